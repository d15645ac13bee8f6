"""``cacherouter chat --scripted``: the terminal loop, labelled as scripted, with per-request cache figures."""

import io
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from support import make_repo

from cacherouter.channels.conversation import ChatSession
from cacherouter.channels.mainview import MainView
from cacherouter.errors import SessionError
from cacherouter.frontends.chat import MAX_MESSAGE_CHARS, SCRIPTED_LABEL, build_chat, run_chat
from cacherouter.tools.gateway import Gateway, GatewayConfig


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cacherouter.cli", *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def chat(*args: str, stdin: str) -> str:
    proc = run_cli("chat", "--scripted", *args, stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_scripted_chat_routes_reports_cache_and_resumes(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    sessions = tmp_path / "sessions"
    common = ("--repo", str(root), "--packages", "base", "--sessions-dir", str(sessions))
    out = chat(*common, stdin="Weather report for a city text=Paris\n/quit\n")
    assert SCRIPTED_LABEL in out
    assert "router -> city_weather" in out  # a tool outside the core view, reached through the router
    assert "city_weather:Paris" in out
    assert "SCRIPTED router" in out
    assert "cache hit" in out
    session_id = out.split("session ", 1)[1].split(";", 1)[0]
    assert (sessions / f"{session_id}.json").is_file()

    again = chat(*common, "--session", session_id, stdin="Stock price for a ticker symbol text=ACME\n")
    assert f"session {session_id}" in again
    assert "stock_price:ACME" in again
    # a fresh process starts with an empty (offline, simulated) cache: its first request claims no hit
    triage = next(line for line in again.splitlines() if "SCRIPTED triage" in line)
    assert "cache hit 0 tok" in triage
    turns = json.loads((sessions / f"{session_id}.json").read_text())["turns"]
    assert [t["path"] for t in turns] == ["tools", "tools"]


class _Provider(BaseHTTPRequestHandler):
    """A local OpenAI-compatible endpoint with DeepSeek usage fields; it plays main and router models."""

    usage_after_tools = True  # False: the main model's answer after a tool result comes without usage

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        names = [t["function"]["name"] for t in body.get("tools", [])]
        last = body["messages"][-1]
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if body.get("tool_choice") == "none":
            message["content"] = "Needs a tool. [STATUS: NEED_TOOLS]"
        elif last["role"] == "tool":
            message["content"] = "Final: " + last["content"]
        else:
            name, arguments = ("INTERNAL_ROUTER", {"task": last["content"]})
            if "INTERNAL_ROUTER" not in names:  # the router channel: its own, filtered tool list
                name, arguments = "stock_price", {"text": "ACME"}
            message["tool_calls"] = [
                {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            ]
        usage = {"prompt_tokens": 100, "prompt_cache_hit_tokens": 60, "prompt_cache_miss_tokens": 40}
        if last["role"] == "tool" and not self.usage_after_tools:
            usage = {}
        data = json.dumps({"model": body["model"], "choices": [{"message": message}], "usage": usage}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _live_chat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[str], handler: type[_Provider] = _Provider
) -> str:
    """Run ``lines`` through ``run_chat`` against ``handler`` on a local port; returns what the chat printed."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("CACHEROUTER_MAIN_BASE_URL", f"http://127.0.0.1:{httpd.server_address[1]}/v1")
        monkeypatch.setenv("CACHEROUTER_MAIN_MODEL", "local-test")
        monkeypatch.setenv("CACHEROUTER_MAIN_PROVIDER", "deepseek")
        root = make_repo(tmp_path / "repo")
        with Gateway(GatewayConfig(root=root)) as gateway:
            view = MainView.from_registry(gateway.registry, ("base",))
            setup = build_chat(gateway, view=view, scripted=False, sessions_dir=None)
            session = setup.agent.new_session(view)
            out = io.StringIO()
            run_chat(setup, session, lines, out)
    finally:
        httpd.shutdown()
        thread.join(timeout=10)
    return out.getvalue()


def test_live_chat_reads_the_endpoint_from_env_and_reports_provider_usage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _live_chat(tmp_path, monkeypatch, ["price of ACME please\n", "/quit\n"])
    assert "SCRIPTED" not in text
    assert "stock_price:ACME" in text
    assert "router -> stock_price" in text
    # DeepSeek prices a hit at 1/30 of an uncached input token: 40 + 60/30 = 42 uncached-token units.
    assert "provider-reported router   prompt 100 tok, cache hit 60 tok, input cost 42.0" in text
    assert "token-level cache hit rate 60.00%, input cost " in text


def test_chat_and_web_help_name_the_environment_defaults_and_quit() -> None:
    for command in ("chat", "web"):
        text = " ".join(run_cli(command, "--help").stdout.split())  # independent of the terminal's width
        for name in ("BASE_URL", "MODEL", "API_KEY", "PROVIDER", "TIMEOUT"):
            assert f"CACHEROUTER_MAIN_{name}" in text
        assert "CACHEROUTER_ROUTER_BASE_URL" in text
        assert "default: base geography internet" in text
        assert "seconds between repository polls (default: 1.0)" in text
        for option in ("--blacklist", "--whitelist", "--yellowlist", "--top-k", "--tool-timeout"):
            assert option in text
    assert "/quit" in run_cli("chat", "--help").stdout


def test_router_filter_options_reach_the_router(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    common = ("--repo", str(root), "--packages", "base", "--tool-timeout", "30")
    out = chat(*common, stdin="Weather report for a city text=Paris\n")
    assert "router -> city_weather" in out
    blocked = chat(*common, "--blacklist", "city_weather", stdin="Weather report for a city text=Paris\n")
    assert "router -> city_weather" not in blocked
    refused = run_cli("chat", "--scripted", *common, "--top-k", "0", stdin="hello\n")
    assert refused.returncode == 2
    assert "--top-k must be at least 1" in refused.stderr


def test_sessions_dir_that_is_a_file_is_refused_before_any_turn(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    proc = run_cli(
        "chat",
        "--scripted",
        "--repo",
        str(root),
        "--packages",
        "base",
        "--sessions-dir",
        str(afile),
        stdin="Weather report for a city text=Paris\n",
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"cacherouter: --sessions-dir {afile}: cannot use it as a directory")
    assert "Traceback" not in proc.stderr
    assert "agent>" not in proc.stdout  # no turn ran, so none was lost
    with Gateway(GatewayConfig(root=root)) as gateway:
        session = ChatSession(view=MainView.from_registry(gateway.registry, ("base",)))
    with pytest.raises(SessionError, match="cannot save session"):
        session.save(afile)


def test_resumed_session_keeps_its_own_core_tools(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    sessions = tmp_path / "sessions"
    common = ("--repo", str(root), "--sessions-dir", str(sessions))
    out = chat(*common, "--packages", "tail", stdin="Stock price for a ticker symbol text=ACME\n")
    session_id = out.split("session ", 1)[1].split(";", 1)[0]
    # Resumed without --packages: the default packages (geography, internet) do not exist in this repository,
    # and the router must still avoid the session's core tools (city_weather is one), not today's.
    again = chat(*common, "--session", session_id, stdin="Weather report for a city text=Paris\n")
    assert f"session {session_id}; main view: city_weather, stock_price" in again
    assert "router -> city_weather" not in again
    assert "router -> " in again
    # Resumed with other --packages: the session's view still decides what the router avoids.
    other = chat(*common, "--session", session_id, "--packages", "base", stdin="Weather report for a city text=Paris\n")
    assert "router -> city_weather" not in other


class _NoUsageAfterTools(_Provider):
    usage_after_tools = False


def test_totals_say_how_many_requests_have_unknown_cost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = _live_chat(tmp_path, monkeypatch, ["price of ACME please\n"], _NoUsageAfterTools)
    assert "provider-reported main     prompt unknown tok, cache hit unknown tok, input cost unknown" in text
    assert "None" not in text
    # triage, main, router at 42.0 each; the final main request's cost is unknown and is said so, not hidden.
    assert "4 requests, token-level cache hit rate 60.00%" in text
    assert "input cost 126.0 (+1 request of unknown cost)" in text


def test_chat_refuses_a_message_over_the_limit_and_goes_on(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    with Gateway(GatewayConfig(root=root)) as gateway:
        view = MainView.from_registry(gateway.registry, ("base",))
        setup = build_chat(gateway, view=view, scripted=True, sessions_dir=None)
        out = io.StringIO()
        lines = ["x" * (MAX_MESSAGE_CHARS + 1) + "\n", "Weather report for a city text=Paris\n"]
        run_chat(setup, setup.agent.new_session(view), lines, out)
    text = out.getvalue()
    assert f"error: the message has {MAX_MESSAGE_CHARS + 1:,} characters; the limit is {MAX_MESSAGE_CHARS:,}" in text
    assert "city_weather:Paris" in text
    assert setup.ledger.records[0].channel == "triage"
    assert len([r for r in setup.ledger.records if r.channel == "triage"]) == 1  # the long message never went out


def test_ctrl_c_during_a_turn_ends_the_chat_cleanly(tmp_path: Path) -> None:
    arrived, release = threading.Event(), threading.Event()

    class Slow(_Provider):
        def do_POST(self) -> None:
            arrived.set()
            release.wait(60)  # a provider that takes its time: the user presses Ctrl-C meanwhile
            super().do_POST()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEROUTER_")}
    env.update(
        CACHEROUTER_MAIN_BASE_URL=f"http://127.0.0.1:{httpd.server_address[1]}/v1", CACHEROUTER_MAIN_MODEL="local"
    )
    root = make_repo(tmp_path / "repo")
    sessions = tmp_path / "sessions"
    command = [sys.executable, "-m", "cacherouter.cli", "chat", "--repo", str(root), "--packages", "base"]
    command += ["--sessions-dir", str(sessions)]
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdin is not None
        proc.stdin.write("price of ACME please\n")
        proc.stdin.flush()
        assert arrived.wait(60)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        httpd.shutdown()
        thread.join(timeout=10)
    assert "Traceback" not in err, err
    assert "interrupted; the session is saved as of the last finished turn" in out
    assert proc.returncode == 130
