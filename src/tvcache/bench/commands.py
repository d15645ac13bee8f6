"""``tvcache bench NAME``: one subcommand per benchmark, each offering only the options it reads.

``BENCHMARKS`` is the one table: a benchmark's name, its one-line description, the shared option groups it takes
(``--json`` for all, the load options for ``server`` and ``ray``) and a function declaring its own options and one
running it. An option a benchmark does not read is an argparse error naming the option and the benchmarks that do
read it. Benchmark modules are imported only when their benchmark runs."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def _json_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON to PATH")
    return options


def _load_options() -> argparse.ArgumentParser:
    """The open-loop lookup load ``server`` and ``ray`` put on their shards."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--rates",
        default="128,256,512,1024,2048,4096,8192",
        help="request rates in req/s (default 128,256,512,1024,2048,4096,8192)",
    )
    options.add_argument("--duration", type=float, default=3.0, help="seconds of load per rate (default 3)")
    options.add_argument("--keys", type=int, default=8192, help="keys populated before the load (8192)")
    options.add_argument("--shards", type=int, default=1, help="shard processes behind the load (default 1)")
    return options


SHARED_OPTIONS: dict[str, Callable[[], argparse.ArgumentParser]] = {"json": _json_options, "load": _load_options}


def _lookup_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=100_000, help="graph size (default 100000)")
    parser.add_argument("--repeats", type=int, default=2000, help="lookups timed per depth (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random graph and lookups (default 0)")


def _run_lookup(args: argparse.Namespace) -> int:
    from . import lookup

    lookup.run(nodes=args.nodes, repeats=args.repeats, seed=args.seed, json_path=args.json)
    return 0


def _server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", metavar="SRC", default=None, help="also load another checkout's server, "
                        "run from its src directory with this venv, rate by rate beside ours")  # fmt: skip


def _rates(args: argparse.Namespace) -> list[int]:
    return [int(rate) for rate in args.rates.split(",")]


def _run_server(args: argparse.Namespace) -> int:
    try:
        from . import server
    except ImportError as error:
        print(f"tvcache bench server: {error}", file=sys.stderr)
        return 2
    return server.run(
        rates=_rates(args), duration=args.duration, keys=args.keys, shards=args.shards, json_path=args.json,
        baseline=args.baseline,
    )  # fmt: skip


def _run_ray(args: argparse.Namespace) -> int:
    # The benchmark starts its own one-machine Ray cluster: keep it on loopback (Ray reads this on import).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        from ..integrations.ray import bench as ray_bench
    except ImportError as error:
        print(f"tvcache bench ray: {error}", file=sys.stderr)
        return 2
    return ray_bench.run(rates=_rates(args), duration=args.duration, keys=args.keys, shards=args.shards,
                         json_path=args.json)  # fmt: skip


def _fork_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="10,1024", help="base tree sizes in MB (default 10,1024)")
    parser.add_argument("--fork-repeats", type=int, default=200, help="overlay forks timed per size (200)")
    parser.add_argument(
        "--docker", action="store_true", help="image-overlay fork vs docker commit+run, checkpoint restore"
    )
    parser.add_argument("--docker-image", default="tvcache-base:bookworm", help="with --docker: the image (local)")


def _run_fork(args: argparse.Namespace) -> int:
    from . import fork

    if args.docker:
        fork.run_docker(image=args.docker_image, repeats=args.fork_repeats, json_path=args.json)
        return 0
    sizes = tuple(int(size) for size in args.sizes.split(","))
    fork.run(sizes_mb=sizes, repeats=args.fork_repeats, json_path=args.json)
    return 0


def _shell_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=200, help="calls timed per command and backend (200)")
    parser.add_argument("--gaps", default="0,20", help="think times between calls in ms (default 0,20)")


def _run_shell(args: argparse.Namespace) -> int:
    from . import shell

    gaps = tuple(float(gap) for gap in args.gaps.split(","))
    shell.run(repeats=args.calls, gaps_ms=gaps, json_path=args.json)
    return 0


def _reopen_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=1_000_000, help="recorded calls in the journal (1000000)")
    parser.add_argument("--tasks", type=int, default=64, help="tasks the calls are spread over (64)")
    parser.add_argument("--tail", type=int, default=None, help="calls after the checkpoint (1%% of --calls)")


def _run_reopen(args: argparse.Namespace) -> int:
    from . import reopen

    return reopen.run(calls=args.calls, tasks=args.tasks, tail=args.tail, json_path=args.json)


def _published_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layers", default="10x0,1000x1,2000x32", help="FILESxMIB written per layer (10x0,1000x1,2000x32)"
    )
    parser.add_argument("--publish-repeats", type=int, default=5, help="runs per layer, median (5)")


def _run_published(args: argparse.Namespace) -> int:
    from . import published

    profiles = tuple(_layer_profile(text) for text in args.layers.split(","))
    published.run(profiles=profiles, repeats=args.publish_repeats, json_path=args.json)
    return 0


def _layer_profile(text: str) -> tuple[int, int]:
    """``FILESxMIB`` (e.g. ``1000x1``): what one rollout step writes into the layer."""
    files, _, mib = text.partition("x")
    try:
        return int(files), int(mib or 0)
    except ValueError:
        raise SystemExit(
            f"tvcache bench published: --layers takes FILESxMIB items such as 1000x1, got {text!r}"
        ) from None


def _no_options(parser: argparse.ArgumentParser) -> None:
    pass


@dataclass(frozen=True, kw_only=True)
class Benchmark:
    name: str
    description: str
    shared: tuple[str, ...]  # keys of SHARED_OPTIONS
    options: Callable[[argparse.ArgumentParser], None]  # declares the benchmark's own options
    run: Callable[[argparse.Namespace], int]


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(name="lookup", description="prefix-match latency and bytes per node", shared=("json",),
              options=_lookup_options, run=_run_lookup),
    Benchmark(name="server", description="open-loop HTTP load on `tvcache serve`", shared=("load", "json"),
              options=_server_options, run=_run_server),
    Benchmark(name="fork", description="overlay fork and snapshot latency next to copying the tree (root)",
              shared=("json",), options=_fork_options, run=_run_fork),
    Benchmark(name="shell", description="per-command latency of confined shell sandboxes next to folder "
              "sandboxes, and where the time goes (root)", shared=("json",), options=_shell_options,
              run=_run_shell),
    Benchmark(name="published", description="forking a shell snapshot another process published through a shared "
              "store, next to rebuilding it by replay (root, GNU tar)", shared=("json",),
              options=_published_options, run=_run_published),
    Benchmark(name="ray", description="Ray shard actors vs HTTP shards under the same lookup load",
              shared=("load", "json"), options=_no_options, run=_run_ray),
    Benchmark(name="reopen", description="Cache(dir) and its first lookup on a large journal, from its checkpoint "
              "next to the journal alone", shared=("json",), options=_reopen_options, run=_run_reopen),
)  # fmt: skip


class _BenchmarkParser(argparse.ArgumentParser):
    """Rejects what its benchmark does not read with this benchmark's usage and the benchmarks that do read it
    (left to the top-level parser, the error would show the usage of ``tvcache``)."""

    readers: dict[str, list[str]] = {}  # option -> benchmarks reading it; set on each instance by add_bench_parser

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            known = [f"{option} is read by {', '.join(self.readers[option])}" for option in _options(extras)
                     if option in self.readers]  # fmt: skip
            self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(known)})" if known else ""))
        return parsed, extras


def _options(arguments: Sequence[str]) -> list[str]:
    """The options among unrecognised arguments, without their ``=VALUE``."""
    return [argument.partition("=")[0] for argument in arguments if argument.startswith("--")]


def add_bench_parser(commands: Any) -> None:
    """Adds ``bench`` and one subcommand per row of ``BENCHMARKS`` to ``commands`` (an ``add_subparsers()``)."""
    bench = commands.add_parser(
        "bench", help="run a benchmark", description="Benchmarks print ratios measured in one run."
    )
    names = bench.add_subparsers(dest="name", metavar="NAME", required=True, parser_class=_BenchmarkParser)
    shared = {key: build() for key, build in SHARED_OPTIONS.items()}
    readers: dict[str, list[str]] = {}
    for benchmark in BENCHMARKS:
        parser = names.add_parser(
            benchmark.name,
            help=benchmark.description,
            description=f"{benchmark.description[0].upper()}{benchmark.description[1:]}.",
            parents=[shared[key] for key in benchmark.shared],
        )
        benchmark.options(parser)
        parser.set_defaults(handler=benchmark.run)
        parser.readers = readers
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    readers.setdefault(option, []).append(benchmark.name)
