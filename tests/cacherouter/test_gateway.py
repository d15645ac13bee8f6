import json
import logging
import shutil
import threading
import time
from pathlib import Path

from support import add_tool, make_repo

from cacherouter.prompts import PLACEHOLDER_TOOL, ROUTER_TOOL
from cacherouter.tools.gateway import Gateway, GatewayConfig
from cacherouter.tools.registry import Limits, build_registry


def test_registry_layout_and_package_index(tmp_path):
    registry = build_registry(make_repo(tmp_path / "repo"))
    assert [t.name for t in registry] == ["city_weather", "echo_text", "show_time", "stock_price"]
    assert dict(registry.packages) == {"base": ("echo_text", "show_time"), "tail": ("city_weather", "stock_price")}
    spec = registry.get("city_weather")
    assert spec is not None
    assert spec.skill == "weather"
    assert "Skill weather" in spec.skill_text
    assert spec.definition()["function"]["parameters"]["properties"]["text"]["default"] == "hi"


def test_name_and_description_limits(tmp_path):
    root = make_repo(tmp_path / "repo")
    add_tool(root, "tail", "long", "x" * 70)
    add_tool(root, "other", "dup", "echo_text")
    add_tool(root, "tail", "wordy", "wordy", "word " * 100)
    registry = build_registry(root, limits=Limits(max_name_length=64, max_description_length=50))
    messages = {p.path: p.message for p in registry.problems}
    assert any("naming limits" in m for m in messages.values())
    assert any("already taken" in m for m in messages.values())
    wordy = registry.get("wordy")
    assert wordy is not None
    assert len(wordy.description) == 50
    assert wordy.description.endswith("...")


def test_hot_reload_swaps_atomically_and_keeps_serving(tmp_path):
    root = make_repo(tmp_path / "repo")
    seen = []
    with Gateway(GatewayConfig(root=root, index_dir=tmp_path / "index")) as gateway:
        gateway.subscribe(lambda registry: seen.append(registry.generation))
        first = gateway.registry
        assert not gateway.poll().changed  # nothing changed: no rebuild
        add_tool(root, "other", "fresh", "fresh_tool")
        (root / "tail" / "stocks" / "broken_tool.py").write_text("import argparse\nparser = (\n")
        outcome = gateway.poll()
        assert outcome.changed
        assert gateway.registry is outcome.registry
        assert "fresh_tool" in gateway.registry.tools
        assert "broken_tool" not in gateway.registry.tools
        assert [p.path for p in gateway.registry.problems] == ["tail/stocks/broken_tool.py"]
        assert "fresh_tool" not in first.tools  # an old snapshot never changes under its reader
        assert json.loads((tmp_path / "index" / "other.json").read_text())["tools"][0]["name"] == "fresh_tool"
        # the repository vanishes: the previous registry keeps serving
        serving = gateway.registry
        (root).rename(tmp_path / "moved")
        failed = gateway.poll()
        assert failed.error is not None
        assert gateway.registry is serving
        assert seen == [2]


def test_background_polling_picks_up_changes(tmp_path):
    root = make_repo(tmp_path / "repo")
    gateway = Gateway(GatewayConfig(root=root, poll_interval=0.02))
    changed = threading.Event()
    gateway.subscribe(lambda registry: changed.set())
    gateway.start()
    try:
        add_tool(root, "other", "late", "late_tool")
        assert changed.wait(timeout=10)
        assert "late_tool" in gateway.registry.tools
    finally:
        gateway.close()
        gateway.close()  # idempotent


def test_tool_runs_as_subprocess_with_timeout(tmp_path):
    root = make_repo(tmp_path / "repo")
    slow = root / "tail" / "stocks" / "slow_tool.py"
    slow.write_text("import time\ntime.sleep(30)\n")
    gateway = Gateway(GatewayConfig(root=root))
    result = gateway.call("echo_text", {"text": "a b; c"})
    assert result.ok
    assert result.stdout.strip() == "echo_text:a b; c"
    start = time.monotonic()
    timed = gateway.call("slow_tool", {}, timeout=0.5)
    assert timed.timed_out
    assert not timed.ok
    assert time.monotonic() - start < 10
    assert "timed out" in timed.to_json()["error"]


class _Flag(logging.Handler):
    """Sets an event when the gateway logs an error: a bounded wait on the poll thread, without sleeps."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.event.set()


def test_pathological_scripts_are_reported_and_polling_carries_on(tmp_path):
    root = make_repo(tmp_path / "repo")
    (root / "tail" / "stocks" / "deep_sum.py").write_text("x = " + "+".join(["1"] * 3000) + "\n")
    gateway = Gateway(GatewayConfig(root=root, poll_interval=0.02))
    assert gateway.last_error is None
    assert [p.path for p in gateway.registry.problems] == ["tail/stocks/deep_sum.py"]
    assert "stock_price" in gateway.registry.tools
    picked = threading.Event()
    gateway.subscribe(lambda registry: picked.set() if "late_tool" in registry.tools else None)
    gateway.start()
    try:
        (root / "tail" / "stocks" / "deep_minus.py").write_text("x = " + "-" * 10_000 + "1\n")
        add_tool(root, "other", "late", "late_tool")
        assert picked.wait(timeout=10)
        assert {p.path for p in gateway.registry.problems} == {"tail/stocks/deep_sum.py", "tail/stocks/deep_minus.py"}
    finally:
        gateway.close()


def test_a_failing_listener_neither_breaks_the_poll_nor_starves_the_others(tmp_path, caplog):
    root = make_repo(tmp_path / "repo")
    gateway = Gateway(GatewayConfig(root=root))
    seen = []

    def broken_listener(registry):
        raise RuntimeError("listener bug")

    gateway.subscribe(broken_listener)
    gateway.subscribe(lambda registry: seen.append(registry.generation))
    add_tool(root, "other", "fresh", "fresh_tool")
    assert gateway.poll().changed
    assert seen == [2]
    assert "listener bug" in caplog.text


def test_polling_survives_an_unexpected_error(tmp_path):
    root = make_repo(tmp_path / "repo")
    index = tmp_path / "index"
    gateway = Gateway(GatewayConfig(root=root, index_dir=index, poll_interval=0.02))
    shutil.rmtree(index)
    index.write_text("a file where the index directory should be")  # the next index write raises OSError
    flag = _Flag()
    logger = logging.getLogger("cacherouter.tools.gateway")
    logger.addHandler(flag)
    picked = threading.Event()
    gateway.subscribe(lambda registry: picked.set() if "later_tool" in registry.tools else None)
    gateway.start()
    try:
        add_tool(root, "other", "first", "first_tool")
        assert flag.event.wait(timeout=10)
        assert gateway.last_error is not None
        index.unlink()
        add_tool(root, "other", "later", "later_tool")
        assert picked.wait(timeout=10)
        assert (index / "other.json").is_file()
    finally:
        logger.removeHandler(flag)
        gateway.close()


def test_relative_repository_root_runs_tools(tmp_path, monkeypatch):
    make_repo(tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    gateway = Gateway(GatewayConfig(root=Path("repo")))
    assert gateway.config.root == tmp_path / "repo"
    result = gateway.call("echo_text", {"text": "hi"})
    assert result.ok, result.stderr
    assert result.stdout.strip() == "echo_text:hi"
    spec = build_registry(Path("repo")).get("echo_text")
    assert spec is not None
    assert spec.script == tmp_path / "repo" / "base" / "echo" / "echo_text.py"


def test_a_script_broken_while_serving_keeps_its_last_good_schema(tmp_path, caplog):
    root = make_repo(tmp_path / "repo")
    gateway = Gateway(GatewayConfig(root=root))
    good = gateway.registry.get("echo_text")
    assert good is not None
    good.script.write_text(good.script.read_text() + "\ndef broken(:\n")
    with caplog.at_level(logging.WARNING, logger="cacherouter.tools.gateway"):
        assert gateway.poll().changed
        add_tool(root, "other", "fresh", "fresh_tool")
        assert gateway.poll().changed  # the problem is not new this time: logged once only
    kept = gateway.registry.get("echo_text")
    assert kept is not None
    assert kept.schema == good.schema
    [problem] = gateway.registry.problems
    assert problem.path == "base/echo/echo_text.py"
    assert "not valid Python" in problem.message
    assert "last good schema" in problem.message
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(logged) == 1
    assert "base/echo/echo_text.py" in logged[0]
    assert "not valid Python" in logged[0]
    # the call runs the current file and reports its error honestly
    result = gateway.call("echo_text", {"text": "hi"})
    assert not result.ok
    assert "SyntaxError" in result.stderr
    # a script deleted on purpose disappears
    good.script.unlink()
    assert gateway.poll().changed
    assert "echo_text" not in gateway.registry.tools
    assert gateway.registry.problems == ()


def test_tools_do_not_see_model_api_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEROUTER_MAIN_API_KEY", "sk-secret-123")
    monkeypatch.setenv("CACHEROUTER_ROUTER_API_KEY", "sk-secret-456")
    root = make_repo(tmp_path / "repo")
    (root / "base" / "echo" / "show_env.py").write_text(
        '"""Print the environment."""\nimport os\nfor k, v in sorted(os.environ.items()):\n    print(f"{k}={v}")\n'
    )
    gateway = Gateway(GatewayConfig(root=root))
    result = gateway.call("show_env", {})
    assert result.ok, result.stderr
    assert "sk-secret" not in result.stdout
    assert f"CACHEROUTER_REPO={root}" in result.stdout.splitlines()


def test_reserved_tool_names_are_refused(tmp_path):
    root = make_repo(tmp_path / "repo")
    add_tool(root, "base", "echo", ROUTER_TOOL)
    add_tool(root, "tail", "stocks", PLACEHOLDER_TOOL)
    registry = build_registry(root)
    assert ROUTER_TOOL not in registry.tools
    assert PLACEHOLDER_TOOL not in registry.tools
    messages = {p.path: p.message for p in registry.problems}
    assert "reserved" in messages[f"base/echo/{ROUTER_TOOL}.py"]
    assert "reserved" in messages[f"tail/stocks/{PLACEHOLDER_TOOL}.py"]


def test_a_new_script_never_takes_over_a_registered_tool_name(tmp_path):
    root = make_repo(tmp_path / "repo")
    gateway = Gateway(GatewayConfig(root=root))
    home = gateway.registry.tools["echo_text"].script
    intruder = add_tool(root, "aaa", "x", "echo_text", "Echo some text back.")  # scans before base/
    intruder.write_text(intruder.read_text().replace('print("echo_text:"', 'print("HIJACKED:"'))
    assert gateway.poll().changed
    assert gateway.registry.tools["echo_text"].script == home
    [problem] = gateway.registry.problems
    assert problem.path == "aaa/x/echo_text.py"
    assert "already taken by base/echo/echo_text.py" in problem.message
    result = gateway.call("echo_text", {"text": "hi"})
    assert result.ok, result.stderr
    assert result.stdout.strip() == "echo_text:hi"
    # the holder keeps its name while it is broken, too (it serves its last good schema)
    home.write_text(home.read_text() + "\ndef broken(:\n")
    assert gateway.poll().changed
    assert gateway.registry.tools["echo_text"].script == home
    # with no previous holder (a fresh start), the first script in scan order gets the name, as before
    assert build_registry(root).tools["echo_text"].script == intruder
