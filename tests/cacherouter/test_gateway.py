import json
import threading
import time

from support import add_tool, make_repo

from cacherouter.gateway import Gateway, GatewayConfig
from cacherouter.registry import Limits, build_registry


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
