"""``tvcache bench NAME`` parses: each benchmark offers exactly the options it reads, rejects the others by name,
and the command lines of the README, docs and Makefile keep parsing. Nothing here runs a benchmark."""

from __future__ import annotations

import argparse

import pytest

from tvcache.bench.commands import BENCHMARKS
from tvcache.cli import build_parser

LOAD = {"--rates", "--duration", "--keys", "--shards"}
OPTIONS = {
    "lookup": {"--json", "--nodes", "--repeats", "--seed"},
    "server": {"--json", "--baseline", *LOAD},
    "ray": {"--json", *LOAD},
    "fork": {"--json", "--sizes", "--fork-repeats", "--docker", "--docker-image"},
    "shell": {"--json", "--calls", "--gaps"},
    "reopen": {"--json", "--calls", "--tasks", "--tail"},
    "published": {"--json", "--layers", "--publish-repeats"},
}
EVERY_OPTION = set().union(*OPTIONS.values())


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return dict(action.choices)


def _benchmark_parsers() -> dict[str, argparse.ArgumentParser]:
    return _subcommands(_subcommands(build_parser())["bench"])


def test_each_benchmark_offers_exactly_the_options_it_reads() -> None:
    parsers = _benchmark_parsers()
    assert set(parsers) == set(OPTIONS) == {benchmark.name for benchmark in BENCHMARKS}
    for name, parser in parsers.items():
        offered = {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}
        assert offered == OPTIONS[name], name


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_an_option_the_benchmark_does_not_read_is_an_error_naming_it(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for option in sorted(EVERY_OPTION - OPTIONS[name]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["bench", name, option, "1"])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert f"tvcache bench {name}: error: unrecognized arguments: {option} 1" in error
        readers = ", ".join(other for other in OPTIONS if option in OPTIONS[other])
        assert f"{option} is read by {readers}" in error


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "lookup"], {"nodes": 100_000, "repeats": 2000, "seed": 0, "json": None}),
        (["bench", "shell"], {"calls": 200, "gaps": "0,20", "json": None}),
        (["bench", "reopen"], {"calls": 1_000_000, "tasks": 64, "tail": None}),
        (["bench", "reopen", "--calls", "1000000"], {"calls": 1_000_000}),
        (
            ["bench", "server", "--rates", "2048,4096", "--duration", "3", "--baseline", "SRC"],
            {"rates": "2048,4096", "duration": 3.0, "keys": 8192, "shards": 1, "baseline": "SRC"},
        ),
        (["bench", "server", "--shards", "2", "--rates", "2048,4096,8192"], {"shards": 2, "baseline": None}),
        (
            ["bench", "ray", "--rates", "256,512", "--duration", "2", "--keys", "4096", "--shards", "1"],
            {"rates": "256,512", "duration": 2.0, "keys": 4096, "shards": 1},
        ),
        (["bench", "ray"], {"rates": "128,256,512,1024,2048,4096,8192", "duration": 3.0}),
        (["bench", "fork"], {"sizes": "10,1024", "fork_repeats": 200, "docker": False}),
        (["bench", "fork", "--docker", "--docker-image", "img"], {"docker": True, "docker_image": "img"}),
        (["bench", "published"], {"layers": "10x0,1000x1,2000x32", "publish_repeats": 5}),
        (["bench", "published", "--layers", "5x0", "--publish-repeats", "1", "--json", "r.json"], {"json": "r.json"}),
    ],
)
def test_the_documented_command_lines_parse(argv: list[str], expected: dict[str, object]) -> None:
    args = build_parser().parse_args(argv)
    assert args.name == argv[1]
    assert {key: getattr(args, key) for key in expected} == expected
    assert args.handler is next(benchmark.run for benchmark in BENCHMARKS if benchmark.name == argv[1])


def test_bench_help_lists_every_benchmark_with_its_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    listing = " ".join(capsys.readouterr().out.split())
    for benchmark in BENCHMARKS:
        assert f"{benchmark.name} {benchmark.description}" in listing


def test_bench_without_a_benchmark_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench"])
    assert "required: NAME" in capsys.readouterr().err
