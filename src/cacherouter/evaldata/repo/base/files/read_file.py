"""Read a text file."""

import argparse
import sys
from pathlib import Path

parser = argparse.ArgumentParser(description="Print the contents of a text file.")
parser.add_argument("path", type=Path, help="file to read")
parser.add_argument("--max-chars", type=int, default=4000, help="truncate after this many characters")
args = parser.parse_args()
if str(args.path).startswith("/root"):
    sys.exit(f"error: permission denied: {args.path}")
try:
    print(args.path.read_text()[: args.max_chars])
except FileNotFoundError:
    sys.exit(f"error: no such file: {args.path}")
