"""Validate and pretty-print JSON."""

import argparse
import json
import sys

parser = argparse.ArgumentParser(description="Validate a JSON document and print it indented.")
parser.add_argument("document", help="the JSON text")
parser.add_argument("--indent", type=int, choices=[2, 4], default=2, help="indent width")
parser.add_argument("--sort-keys", action=argparse.BooleanOptionalAction, default=False, help="sort object keys")
args = parser.parse_args()
try:
    print(json.dumps(json.loads(args.document), indent=args.indent, sort_keys=args.sort_keys))
except json.JSONDecodeError as e:
    sys.exit(f"error: invalid JSON: {e}")
