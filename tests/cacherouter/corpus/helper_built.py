"""Arguments added by a helper that receives the parser."""

import argparse


def add_common(p):
    p.add_argument("--name", default="world", help="who to greet")


parser = argparse.ArgumentParser(description="helper-built parser")
add_common(parser)
print(parser.parse_args())
