"""Skill bootstrapping: the check run stays out of the repository, the body cannot change the parser, package names
are single directory names, concurrent builders never publish one name twice, descriptions keep SKILL.md intact."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import make_repo

import cacherouter
from cacherouter.errors import SchemaError
from cacherouter.tools.gateway import Gateway, GatewayConfig
from cacherouter.tools.registry import build_registry, read_skill_file
from cacherouter.tools.skills import SkillParam, build_skill

SKILL_BUILDER = Path(cacherouter.__file__).parent / "evaldata" / "repo" / "computer-program" / "skills"


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_the_check_run_reaches_neither_the_repository_nor_its_variable(tmp_path):
    root = make_repo(tmp_path / "repo")
    shutil.copytree(SKILL_BUILDER, root / "computer-program" / "skills")
    before = _digests(root)
    body = (
        "import os\n"
        "repo = os.environ.get('CACHEROUTER_REPO')\n"
        "if repo:\n"
        "    open(os.path.join(repo, 'base/echo/echo_text.py'), 'a').write('# tampered through the variable')\n"
        "try:\n"
        "    open('../../base/echo/echo_text.py', 'a').write('# tampered through a relative path')\n"
        "except OSError:\n"
        "    pass\n"
        "print('checked', repo)\n"
    )
    gateway = Gateway(GatewayConfig(root=root))
    result = gateway.call("skill_builder", {"name": "escaper", "description": "Writes around.", "body": body})
    assert result.ok, result.stderr
    assert json.loads(result.stdout)["check_output"] == "checked None"
    after = _digests(root)
    assert {path: after[path] for path in before} == before  # no file of the repository changed
    assert sorted(set(after) - set(before)) == [
        ".skill-builder.lock",
        "other/escaper/SKILL.md",
        "other/escaper/escaper.py",
    ]


@pytest.mark.parametrize(
    "body",
    [
        "parser.add_argument('--ghost', help='added after parse_args')\nprint(args)",
        "parser.add_argument('--ghost')\nargs = parser.parse_args()\nprint(args.ghost)",
    ],
)
def test_a_body_that_changes_the_parser_is_refused(tmp_path, body):
    root = make_repo(tmp_path / "repo")
    before = _digests(root)
    with pytest.raises(SchemaError, match="changes the parser"):
        build_skill(
            root, name="late_arg", description="d", params=[SkillParam(name="who")], body=body, check_arguments={}
        )
    assert _digests(root) == before


def test_a_body_may_read_the_parser(tmp_path):
    root = make_repo(tmp_path / "repo")
    built = build_skill(
        root,
        name="describe",
        description="Describe me.",
        params=[],
        body="print(parser.description)",
        check_arguments={},
    )
    assert built.check_output == "Describe me.\n"
    assert build_registry(root).problems == ()


@pytest.mark.parametrize("package", ["../outside_pkg", "a/b", ".hidden", "", "{tmp}/abs_pkg", "other\n", "-x"])
def test_the_package_is_one_directory_name(tmp_path, package):
    root = make_repo(tmp_path / "repo")
    package = package.format(tmp=tmp_path)  # an absolute path, kept inside the test's directory
    before = _digests(tmp_path)
    with pytest.raises(SchemaError, match="package"):
        build_skill(root, name="trav", description="d", params=[], body="print(1)", check_arguments={}, package=package)
    assert _digests(tmp_path) == before
    assert not (tmp_path / "outside_pkg").exists()
    assert not (tmp_path / "abs_pkg").exists()


@pytest.mark.parametrize("param", ["a b", "help", "Who", "x-y", "1st", "dup"])
def test_parameter_names_are_unique_lowercase_identifiers(tmp_path, param):
    root = make_repo(tmp_path / "repo")
    params = [SkillParam(name=param)] + ([SkillParam(name="dup")] if param == "dup" else [])
    before = _digests(root)
    with pytest.raises(SchemaError, match="parameter"):
        build_skill(root, name="named", description="d", params=params, body="print(1)", check_arguments={})
    assert _digests(root) == before


def test_a_skill_name_with_a_trailing_newline_is_refused(tmp_path):
    root = make_repo(tmp_path / "repo")
    with pytest.raises(SchemaError, match="lower_snake_case"):
        build_skill(root, name="evil\n", description="d", params=[], body="print(1)", check_arguments={})


# Each builder's check run waits (bounded) until both are checking, so both pass the first name check before either
# publishes: the race the repository lock must settle.
_RACER = '''
import sys
from pathlib import Path
from cacherouter.errors import CacheRouterError
from cacherouter.tools.skills import build_skill
body = """import os, pathlib, time
gate = pathlib.Path(os.environ["RACE_GATE"])
(gate / str(os.getpid())).touch()
deadline = time.monotonic() + 20
while len(list(gate.iterdir())) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
print("checked")"""
root = Path(sys.argv[1])
try:
    built = build_skill(root, name="twin", description="A twin.", params=[], body=body, check_arguments={},
                        package=sys.argv[2])
except CacheRouterError as e:
    print("refused:", e)
else:
    print("published:", built.script.relative_to(root))
'''


@pytest.mark.parametrize("packages", [("other", "other"), ("pkg_a", "pkg_b")])
def test_concurrent_builders_publish_a_name_once(tmp_path, packages):
    root = make_repo(tmp_path / "repo")
    gate = tmp_path / "gate"
    gate.mkdir()
    env = {"RACE_GATE": str(gate), "PATH": "/usr/bin:/bin"}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(root), package],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for package in packages
    ]
    outcomes = [racer.communicate(timeout=60) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], outcomes
    assert all(stderr == "" for _, stderr in outcomes), outcomes
    lines = sorted(stdout.strip() for stdout, _ in outcomes)
    assert lines[0].startswith("published: ")
    assert lines[1].startswith("refused: ")
    assert "already taken by" in lines[1] or "already exists" in lines[1]
    registry = build_registry(root)
    assert registry.problems == ()
    assert "twin" in registry.tools
    assert len(list(root.rglob("twin.py"))) == 1
    assert [p for p in root.rglob(".*") if p.is_dir()] == []  # no staging directory left behind


def test_the_description_is_one_quoted_line_of_front_matter(tmp_path):
    root = make_repo(tmp_path / "repo")
    for name, description, expected in (
        ("desc_inj", "Line one\n---\nname: other_name", "Line one --- name: other_name"),
        ("say_quoted", 'Say "hi" \\ and """ quotes: \'x\'', 'Say "hi" \\ and """ quotes: \'x\''),
    ):
        build_skill(root, name=name, description=description, params=[], body="print(1)", check_arguments={})
        meta, text = read_skill_file(root / "other" / name)
        assert meta == {"name": name, "description": expected}
        assert text == f"Bootstrapped skill. {expected}"
    registry = build_registry(root)
    assert registry.tools["desc_inj"].description == "Line one --- name: other_name"
    assert registry.problems == ()
