"""Run Python code in the sandbox."""

import argparse
import subprocess
import sys

parser = argparse.ArgumentParser(
    description="Run a Python snippet (--code) or a script file (--file) and print its output."
)
group = parser.add_mutually_exclusive_group(required=True)
group.add_argument("--code", help="Python source to run")
group.add_argument("--file", help="path of a .py file to run")
parser.add_argument("--timeout", type=float, default=10.0, help="seconds before the run is stopped")
args = parser.parse_args()
cmd = [sys.executable, "-c", args.code] if args.code else [sys.executable, args.file]
proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
sys.stdout.write(proc.stdout)
sys.stderr.write(proc.stderr)
sys.exit(proc.returncode)
