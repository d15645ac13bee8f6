"""Create a new skill in the 'other' package and validate it."""

import argparse
import json
import os
import sys
from pathlib import Path

from cacherouter.errors import CacheRouterError
from cacherouter.tools.skills import build_skill, params_from_json

parser = argparse.ArgumentParser(
    description="Write a new skill (script + SKILL.md) into the 'other' package, check it runs, and publish it."
)
parser.add_argument("--name", required=True, help="skill name, lower_snake_case")
parser.add_argument("--description", required=True, help="one-line description")
parser.add_argument("--params", default="[]", help="JSON list of {name, type, help, default, required}")
parser.add_argument("--body", required=True, help="Python code using 'args'; print the result")
parser.add_argument("--check-args", default="{}", help="JSON object of arguments for the validation run")
args = parser.parse_args()
root = Path(os.environ.get("CACHEROUTER_REPO", "."))
try:
    check_arguments = json.loads(args.check_args)
    if not isinstance(check_arguments, dict):
        sys.exit("error: --check-args must be a JSON object of arguments")
    # build_skill runs the check on a copy outside the repository, without CACHEROUTER_REPO (validation only,
    # not a sandbox), and publishes under the repository's skill-builder lock.
    built = build_skill(
        root,
        name=args.name,
        description=args.description,
        params=params_from_json(args.params),
        body=args.body,
        check_arguments=check_arguments,
    )
except (CacheRouterError, json.JSONDecodeError) as e:
    sys.exit(f"error: {e}")
print(json.dumps({"skill": built.name, "package": built.package, "check_output": built.check_output.strip()}))
