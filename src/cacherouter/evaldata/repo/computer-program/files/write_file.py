"""Write a text file."""

import argparse
import os
import sys

parser = argparse.ArgumentParser(description="Create or overwrite a text file with the given content.")
parser.add_argument("path", help="file to write (under /tmp)")
parser.add_argument("content", help="text to write")
parser.add_argument("--append", action="store_true", help="append instead of overwriting")
args = parser.parse_args()
if not os.path.abspath(args.path).startswith("/tmp/"):
    sys.exit(f"error: permission denied: writes are restricted to /tmp ({args.path})")
with open(args.path, "a" if args.append else "w") as fh:
    fh.write(args.content)
print(f"wrote {len(args.content)} characters to {args.path}")
