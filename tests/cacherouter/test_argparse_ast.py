import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cacherouter.argparse_ast import extract_static
from cacherouter.errors import ArgumentError, SchemaError
from cacherouter.executor import build_argv, run_script
from cacherouter.reflection import reflect_schema
from cacherouter.registry import script_schema

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
