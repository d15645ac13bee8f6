import ast
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from cacherouter.errors import ArgumentError, SchemaError
from cacherouter.tools.argparse_ast import extract_static
from cacherouter.tools.executor import MAX_OUTPUT_CHARS, build_argv, run_script
from cacherouter.tools.reflection import reflect_schema
from cacherouter.tools.registry import script_schema

CORPUS = Path(__file__).parent / "corpus"


def schema_of(name: str):
    return script_schema(CORPUS / name)


def test_every_feature_is_extracted_statically():
    schema = schema_of("every_feature.py")
    js = schema.json_schema()
    props = js["properties"]
    assert schema.source == "static"
    assert schema.description == "Every feature, statically."
    assert set(js["required"]) == {"source", "ratio"}
    assert props["source"] == {"type": "string", "format": "path", "description": "input file"}
    assert props["extra"]["type"] == "array"
    assert props["count"] == {"type": "integer", "default": 3, "description": "how many (default 3)"}
    assert props["ratio"]["type"] == "number"
    assert props["mode"]["enum"] == ["fast", "slow"]
    assert props["level"] == {"type": "integer", "enum": [1, 2, 3], "description": "level"}
    assert props["verbose"] == {"type": "boolean", "default": False, "description": "talk more"}
    assert props["color"]["default"] is True
    assert props["tag"]["type"] == "array"
    assert props["pair"]["minItems"] == props["pair"]["maxItems"] == 2
    assert props["items"]["minItems"] == 1
    assert props["maybe"]["default"] == "x"
    assert props["q"]["type"] == "integer"
    assert props["cache"]["type"] == "boolean"
    assert "hidden" not in props
    assert "version" not in props
    assert "help" not in props
    assert schema.exclusive_groups == ((("json", "csv"), False),)


def test_static_and_reflection_agree_on_every_feature():
    static = schema_of("every_feature.py")
    reflected = reflect_schema(CORPUS / "every_feature.py")
    assert reflected.source == "reflection"
    assert static.json_schema()["properties"].keys() == reflected.json_schema()["properties"].keys()
    for dest in static.json_schema()["properties"]:
        s, r = static.argument(dest), reflected.argument(dest)
        assert (s.action, s.json_type, s.required, s.option_strings) == (
            r.action,
            r.json_type,
            r.required,
            r.option_strings,
        ), dest


def test_argv_round_trip_through_the_real_script():
    schema = schema_of("every_feature.py")
    arguments = {
        "source": "-odd name.txt",
        "extra": ["a", "b"],
        "count": 7,
        "ratio": -0.5,
        "mode": "slow",
        "level": 2,
        "verbose": True,
        "color": False,
        "tag": ["x", "-y"],
        "pair": [1, 2],
        "items": ["i"],
        "q": 2,
        "cache": False,
        "csv": True,
    }
    argv = build_argv(schema, arguments)
    result = run_script(CORPUS / "every_feature.py", argv, tool="every_feature", timeout=20)
    assert result.ok, result.stderr
    parsed = ast.literal_eval(
        result.stdout.strip().replace("PosixPath(", "(").replace("('-odd name.txt')", "'-odd name.txt'")
    )
    assert parsed["source"] == "-odd name.txt"
    assert parsed["count"] == 7
    assert parsed["ratio"] == -0.5
    assert parsed["mode"] == "slow"
    assert parsed["level"] == 2
    assert parsed["verbose"] is True
    assert parsed["color"] is False
    assert parsed["cache"] is False
    assert parsed["tag"] == ["x", "-y"]
    assert parsed["pair"] == [1, 2]
    assert parsed["q"] == 2
    assert parsed["csv"]
    assert parsed["extra"] == ["a", "b"]


def test_shell_metacharacters_reach_the_script_literally(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('text')\n" "print(p.parse_args().text)\n"
    )
    value = "$(touch pwned); rm -rf / `id` | cat"
    result = run_script(script, build_argv(script_schema(script), {"text": value}), tool="echo", timeout=20)
    assert result.stdout.strip() == value
    assert not (tmp_path / "pwned").exists()


def test_bad_arguments_are_rejected_before_running():
    schema = schema_of("every_feature.py")
    with pytest.raises(ArgumentError, match="missing required"):
        build_argv(schema, {"source": "a"})
    with pytest.raises(ArgumentError, match="not one of"):
        build_argv(schema, {"source": "a", "ratio": 1, "mode": "medium"})
    with pytest.raises(ArgumentError, match="unknown"):
        build_argv(schema, {"source": "a", "ratio": 1, "nope": 1})
    with pytest.raises(ArgumentError, match="mutually exclusive"):
        build_argv(schema, {"source": "a", "ratio": 1, "json": True, "csv": True})


def test_dynamic_parsers_are_reported_not_executed():
    marker = Path("/tmp/cacherouter-dynamic-was-executed")
    marker.unlink(missing_ok=True)
    for name, reason in [
        ("dynamic_loop.py", "loop"),
        ("helper_built.py", "not a parser built here"),
        ("subcommands.py", "sub-commands"),
    ]:
        extraction = extract_static((CORPUS / name).read_text())
        assert extraction.schema is None
        assert reason in (extraction.dynamic_reason or "")
        with pytest.raises(SchemaError, match="built dynamically"):
            script_schema(CORPUS / name)
    assert not marker.exists(), "registration must never run the script"


def test_reflection_is_an_explicit_fallback():
    marker = Path("/tmp/cacherouter-dynamic-was-executed")
    schema = script_schema(CORPUS / "dynamic_loop.py", allow_reflection=True)
    assert schema.source == "reflection"
    props = schema.json_schema()["properties"]
    assert props["alpha"]["type"] == "integer"
    assert props["beta"]["type"] == "number"
    assert marker.exists()  # reflection does run the script: that is why it is opt-in
    marker.unlink()


def test_broken_and_trivial_scripts(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import argparse\nparser = argparse.ArgumentParser(\n")
    with pytest.raises(SchemaError, match="not valid Python"):
        script_schema(broken)
    none = schema_of("no_args.py")
    assert none.source == "none"
    assert none.arguments == ()
    assert none.description.startswith("Print the date")
    aliased = schema_of("from_import.py")
    props = aliased.json_schema()["properties"]
    assert props["flag"]["type"] == "boolean"
    assert props["value"] == {"type": "integer", "default": 5}


def test_cli_prints_schemas(capsys):
    from cacherouter.cli import main

    assert main(["tools", "schema", str(CORPUS / "every_feature.py")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[str(CORPUS / "every_feature.py")]["inputSchema"]["required"] == ["source", "ratio"]
    assert main(["tools", "schema", str(CORPUS / "dynamic_loop.py")]) == 1


def test_cli_entry_point_runs_as_a_process():
    proc = subprocess.run(
        [sys.executable, "-m", "cacherouter.cli", "tools", "schema", str(CORPUS / "no_args.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(proc.stdout)[str(CORPUS / "no_args.py")]["source"] == "none"


PARSER = "import argparse\np = argparse.ArgumentParser()\n"


@pytest.mark.parametrize(
    "source",
    [
        "x = " + "+".join(["1"] * 3000),  # RecursionError while ast.parse builds the tree
        "x = " + "-" * 10_000 + "1",  # MemoryError: the parser's stack overflows
        "x = 1\0\n",  # null bytes: a ValueError in older Pythons, a SyntaxError without a line now
        "x = '\ud800'\n",  # ValueError (UnicodeEncodeError): a lone surrogate
        PARSER + 'p.add_argument("--a", type=' + "+".join(["x"] * 900) + ")\n",  # RecursionError in the analysis
    ],
    ids=["long-binop", "deep-unary", "null-byte", "surrogate", "deep-type"],
)
def test_pathological_sources_are_schema_errors(source):
    with pytest.raises(SchemaError, match="<script>: "):
        extract_static(source)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (PARSER + 'p.add_argument("--a")\np = argparse.ArgumentParser()\np.add_argument("--b")\n', "several"),
        (
            "import argparse\ndef f():\n    p = argparse.ArgumentParser()\n    p.add_argument('--a')\n"
            "def g():\n    p = argparse.ArgumentParser()\n    p.add_argument('--b')\n",
            "several",
        ),
        (PARSER + "import sys\nif sys.platform == 'win32':\n    p.add_argument('--winonly')\n", "condition"),
        (PARSER + "try:\n    p.add_argument('--x')\nexcept Exception:\n    pass\n", "condition"),
        ("import argparse\np = argparse.ArgumentParser(prefix_chars='+')\np.add_argument('+x', type=int)\n", "prefix"),
        (PARSER + "p.add_argument('--a', default='x')\np.set_defaults(a=input())\n", "set_defaults"),
        (PARSER + "p.set_defaults(**{'a': 1})\np.add_argument('--a')\n", "set_defaults"),
        ("import argparse\np = argparse.ArgumentParser(fromfile_prefix_chars='@')\np.add_argument('x')\n", "file"),
        ("import argparse\np = argparse.ArgumentParser(argument_default='')\np.add_argument('--x')\n", "default"),
    ],
    ids=[
        "rebound",
        "two-functions",
        "if",
        "try",
        "prefix-chars",
        "computed-set-defaults",
        "set-defaults-kwargs",
        "fromfile-prefix-chars",
        "argument-default",
    ],
)
def test_parsers_the_text_cannot_pin_down_are_dynamic(source, reason):
    extraction = extract_static(source)
    assert extraction.schema is None
    assert reason in (extraction.dynamic_reason or "")


def test_the_main_guard_is_not_a_condition():
    inside = (
        "import argparse\nif __name__ == '__main__':\n    p = argparse.ArgumentParser()\n    p.add_argument('--a')\n"
    )
    under = PARSER + "if __name__ == '__main__':\n    p.add_argument('--a')\n    p.parse_args()\n"
    for source in (inside, under):
        schema = extract_static(source).schema
        assert schema is not None
        assert [a.dest for a in schema.arguments] == ["a"]
    otherwise = PARSER + "if __name__ == '__main__':\n    pass\nelse:\n    p.add_argument('--a')\n"
    assert "condition" in (extract_static(otherwise).dynamic_reason or "")


def test_literal_remainder_nargs_is_accepted_like_the_argparse_name():
    literal = extract_static(PARSER + 'p.add_argument("rest", nargs="...")\n').schema
    named = extract_static(PARSER + 'p.add_argument("rest", nargs=argparse.REMAINDER)\n').schema
    assert literal is not None
    assert literal == named
    assert literal.arguments[0].nargs == "..."


def test_literal_set_defaults_sets_the_advertised_default(tmp_path):
    source = (
        PARSER + 'p.set_defaults(b="early", func="ignored")\n'
        'p.add_argument("--a", default="x", help="a is %(default)s")\n'
        'p.add_argument("--b", help="b is %(default)s")\n'
        'p.add_argument("--c", default="own")\n'
        'p.add_argument("--flag", action="store_true")\n'
        'p.set_defaults(a="y", flag=True)\n'
        "print(vars(p.parse_args()))\n"
    )
    schema = extract_static(source).schema
    assert schema is not None
    props = schema.json_schema()["properties"]
    # set_defaults before add_argument fills only a missing default; after it, it overrides
    assert props["a"] == {"type": "string", "default": "y", "description": "a is y"}
    assert props["b"] == {"type": "string", "default": "early", "description": "b is early"}
    assert props["c"]["default"] == "own"
    assert props["flag"]["default"] is True
    script = tmp_path / "defaults.py"
    script.write_text(source)
    parsed = ast.literal_eval(run_script(script, [], tool="defaults", timeout=20).stdout)
    assert {k: parsed[k] for k in ("a", "b", "c", "flag")} == {"a": "y", "b": "early", "c": "own", "flag": True}


def test_relative_script_paths_run_and_reflect(monkeypatch):
    marker = Path("/tmp/cacherouter-dynamic-was-executed")
    monkeypatch.chdir(CORPUS.parent)
    result = run_script(Path("corpus/no_args.py"), [], tool="no_args", timeout=20)
    assert result.ok, result.stderr
    schema = script_schema(Path("corpus/dynamic_loop.py"), allow_reflection=True)
    assert schema.source == "reflection"
    assert set(schema.json_schema()["properties"]) == {"alpha", "beta"}
    marker.unlink()


def test_tool_environment_drops_model_api_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEROUTER_MAIN_API_KEY", "sk-secret-main")
    monkeypatch.setenv("CACHEROUTER_ROUTER_API_KEY", "sk-secret-router")
    monkeypatch.setenv("CACHEROUTER_MAIN_MODEL", "visible-model")
    script = tmp_path / "env.py"
    script.write_text("import os\nprint(sorted(os.environ.items()))\n")
    for env in (None, {"CACHEROUTER_MAIN_API_KEY": "sk-secret-main", "KEEP": "1"}):
        result = run_script(script, [], tool="env", timeout=20, env=env)
        assert result.ok, result.stderr
        assert "sk-secret" not in result.stdout
    assert "visible-model" in run_script(script, [], tool="env", timeout=20).stdout
    reflected = tmp_path / "reflected.py"
    reflected.write_text("import argparse, os\nprint(os.environ.get('CACHEROUTER_MAIN_API_KEY'))\n")
    with pytest.raises(SchemaError) as info:
        reflect_schema(reflected)
    assert "sk-secret" not in str(info.value)


def test_timeout_holds_when_a_detached_grandchild_keeps_the_pipes(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(20)'], start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    result = run_script(script, [], tool="hang", timeout=1)
    elapsed = time.monotonic() - start
    grandchild = int(result.stdout.split()[0])
    os.kill(grandchild, signal.SIGKILL)
    assert result.timed_out
    assert elapsed < 5


def test_tool_output_read_into_memory_is_bounded(tmp_path):
    script = tmp_path / "loud.py"
    script.write_text("import sys\nsys.stdout.write('x' * 20_000_000)\nsys.stderr.write('e\\r\\n')\n")
    tracemalloc.start()
    try:
        result = run_script(script, [], tool="loud", timeout=30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.ok
    assert result.stdout == "x" * MAX_OUTPUT_CHARS
    assert result.stderr == "e\n"
    assert peak < 2_000_000
