"""Exercise every argparse feature the extractor supports.

Second paragraph is not part of the description."""

import argparse
from pathlib import Path

MODES = ("fast", "slow")


def build() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Every feature, statically.")
    parser.add_argument("source", help="input file", type=Path)
    parser.add_argument("extra", nargs="*", help="extra words")
    parser.add_argument("-n", "--count", type=int, default=3, help="how many (default %(default)s)")
    parser.add_argument("--ratio", type=float, required=True, help="a ratio")
    parser.add_argument("--mode", choices=MODES, default="fast", help="speed")
    parser.add_argument("--level", type=int, choices=range(1, 4), help="level")
    parser.add_argument("--verbose", action="store_true", help="talk more")
    parser.add_argument("--no-color", dest="color", action="store_false", help="plain output")
    parser.add_argument("--tag", action="append", help="repeatable tag")
    parser.add_argument("--pair", nargs=2, type=int, help="two numbers")
    parser.add_argument("--items", nargs="+", help="one or more")
    parser.add_argument("--maybe", nargs="?", default="x", help="optional value")
    parser.add_argument("-q", action="count", default=0, help="quietness")
    parser.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True, help="use the cache")
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_argument("--version", action="version", version="1.0")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json", action="store_true", help="json output")
    group.add_argument("--csv", action="store_true", help="csv output")
    return parser


if __name__ == "__main__":
    args = build().parse_args()
    print(vars(args))
