"""List a directory."""

import argparse
import os

parser = argparse.ArgumentParser(description="List the entries of a directory.")
parser.add_argument("path", nargs="?", default=".", help="directory to list")
parser.add_argument("--all", action="store_true", help="include hidden entries")
args = parser.parse_args()
for name in sorted(os.listdir(args.path)):
    if args.all or not name.startswith("."):
        print(name)
