"""A parser built in a loop: static analysis cannot know it."""

import argparse

OPTIONS = {"alpha": int, "beta": float}
parser = argparse.ArgumentParser(description="dynamic options")
for name, kind in OPTIONS.items():
    parser.add_argument(f"--{name}", type=kind, help=f"the {name} value")
with open("/tmp/cacherouter-dynamic-was-executed", "w") as fh:
    fh.write("ran")
args = parser.parse_args()
print(vars(args))
