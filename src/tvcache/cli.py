"""The ``tvcache`` command: ``demo``, ``bench NAME`` and ``inspect DIR``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import __version__


def _bench(args: argparse.Namespace) -> int:
    if args.name == "lookup":
        from .bench import lookup

        lookup.run(nodes=args.nodes, repeats=args.repeats, seed=args.seed, json_path=args.json)
        return 0
    raise AssertionError(args.name)


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args)


def _inspect(args: argparse.Namespace) -> int:
    from .cache import Cache
    from .errors import TVCacheError

    try:
        cache = Cache(args.path, compact_on_open=False)
    except TVCacheError as error:
        print(f"tvcache inspect: {error}", file=sys.stderr)
        return 2
    with cache:
        tasks = {task: cache.graph(task).stats() for task in cache.tasks()}
        report = {"path": str(cache.root), "tasks": tasks, "nondeterministic_tools": cache.nondeterministic_tools}
        print(json.dumps(report, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tvcache",
        description="A stateful tool-value cache for post-training tool-using LLM agents.",
    )
    parser.add_argument("--version", action="version", version=f"tvcache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="run a small real RL loop through the cache, side by side with no cache",
        description="Runs rollout groups of a small learnable policy over real SQLite tools, once without a "
        "cache, once with a naive call-keyed cache and once with tvcache, and checks that tvcache returned "
        "exactly what uncached execution returned.",
    )
    demo.add_argument("--quick", action="store_true", help="fewer tasks and epochs (well under a minute)")
    demo.add_argument("--epochs", type=int, default=None, help="training epochs (default 6, quick 3)")
    demo.add_argument("--rollouts", type=int, default=8, help="rollouts per task group (default 8)")
    demo.add_argument("--seed", type=int, default=0, help="seed for the policy and task order")
    demo.add_argument("--delay", type=float, default=0.0, help="seconds added per SQL query to emulate a remote DB")
    demo.add_argument("--out", default=None, help="directory to write report.json into")
    demo.set_defaults(handler=_demo)

    bench = commands.add_parser(
        "bench", help="run a benchmark", description="Benchmarks print ratios measured in one run."
    )
    bench.add_argument("name", choices=["lookup"], help="lookup: prefix-match latency and bytes per node")
    bench.add_argument("--nodes", type=int, default=100_000, help="graph size for lookup (default 100000)")
    bench.add_argument("--repeats", type=int, default=2000, help="lookups timed per depth (default 2000)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON to PATH")
    bench.set_defaults(handler=_bench)

    inspect = commands.add_parser("inspect", help="summarise a durable cache directory")
    inspect.add_argument("path", help="a directory created by Cache(path=...)")
    inspect.set_defaults(handler=_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    raise SystemExit(main())
