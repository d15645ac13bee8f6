"""``cacherouter web --scripted`` in a real headless browser: Debian's Chromium driven by Selenium through
Debian's ChromeDriver, against the real Starlette app on a free 127.0.0.1 port, running the real agent, gateway and
tool subprocesses with the scripted models and the offline DeepSeek cache model.

Where the browser or Selenium is missing, the browser test is skipped and says why. The screenshot lands in the
test's tmp dir (its path is printed).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import make_repo, replies_since_query

from cacherouter.channels.agent import Agent
from cacherouter.channels.mainview import MainView
from cacherouter.channels.router import Router
from cacherouter.frontends.chat import MAX_MESSAGE_CHARS, SCRIPTED_LABEL, ChatSetup, build_chat
from cacherouter.frontends.web import MAX_BODY_BYTES, WebChat, create_app
from cacherouter.models.accounting import Ledger, RecordingModel
from cacherouter.models.base import ChatRequest, ChatResponse, ChatToolCall, ScriptedModel, SimulatedProvider
from cacherouter.models.prompt_cache import DeepSeekCacheModel
from cacherouter.prompts import NEED_TOOLS
from cacherouter.tools.gateway import Gateway, GatewayConfig
from tvcache.server.runner import AppThread

from browser_support import chromium, missing_browser

MESSAGES = ("Weather report for a city text=Paris", "Stock price for a ticker symbol text=<b>ACME</b>")

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - the tests are skipped then; missing_browser() says why
    pass

needs_browser = pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser()))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AppThread]:
    root = make_repo(tmp_path / "repo")
    with Gateway(GatewayConfig(root=root)) as gateway:
        view = MainView.from_registry(gateway.registry, ("base",))
        setup = build_chat(gateway, view=view, scripted=True, sessions_dir=None)
        web = WebChat(setup, setup.agent.new_session(view))
        with AppThread(create_app(web)) as thread:
            yield thread


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with chromium(tmp_path / "chromium-profile", window="1400,1500") as driver:
        yield driver


@needs_browser
def test_web_ui_in_chromium(server: AppThread, browser: Any, tmp_path: Path) -> None:
    wait = WebDriverWait(browser, 30, poll_frequency=0.05)
    browser.get(f"{server.url}/")
    wait.until(lambda d: d.find_element(By.ID, "mode").text == "SCRIPTED")
    for count, message in enumerate(MESSAGES, start=1):
        box = browser.find_element(By.ID, "message")
        box.send_keys(message)
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d, n=count: d.find_element(By.TAG_NAME, "body").get_attribute("data-turns") == str(n))
        wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())

    state = httpx.get(f"{server.url}/api/state", timeout=10).json()
    assert state["mode"] == "scripted"
    assert browser.find_element(By.ID, "banner").text == SCRIPTED_LABEL
    assert browser.find_element(By.ID, "cache-label").text == "SCRIPTED"
    assert browser.find_element(By.ID, "session").text == state["session"]
    assert [turn["query"] for turn in state["turns"]] == list(MESSAGES)

    # The transcript: each message and answer as the server recorded it, rendered as text (the <b> stays literal).
    for turn in state["turns"]:
        item = browser.find_element(By.CSS_SELECTOR, f'#transcript li[data-turn="{turn["index"]}"]')
        assert item.find_element(By.CSS_SELECTOR, ".msg.user .text").text == turn["query"]
        assert item.find_element(By.CSS_SELECTOR, ".msg.agent .text").text == turn["answer"]
        assert turn["path"] == "tools"
    assert "city_weather:Paris" in state["turns"][0]["answer"]
    assert "stock_price:<b>ACME</b>" in state["turns"][1]["answer"]
    assert browser.find_elements(By.CSS_SELECTOR, "#transcript b") == []

    def text_at(selector: str) -> str:
        """The text at ``selector``, found anew on each try: the page may render the transcript again meanwhile
        (an element of the last rendering is stale then)."""
        from selenium.common.exceptions import StaleElementReferenceException

        for _ in range(100):
            try:
                return str(browser.find_element(By.CSS_SELECTOR, selector).text)
            except StaleElementReferenceException:
                time.sleep(0.05)
        raise AssertionError(f"{selector} kept being rendered again")

    # Each tool call: name, router target, arguments and result as the server reports them.
    routed = []
    for turn in state["turns"]:
        assert turn["calls"]
        for call in turn["calls"]:
            node = f'#transcript li[data-turn="{turn["index"]}"] [data-call="{call["id"]}"]'
            assert text_at(f"{node} .call-name") == call["name"]
            assert text_at(f"{node} .call-result") == call["result"].strip()
            assert call["ok"] is True
            if call["router"]:
                assert text_at(f"{node} .call-routed") == call["routed_to"]
                assert call["arguments"] == {"task": turn["query"]}
                routed.append(call["routed_to"])
    assert routed == ["city_weather", "stock_price"]  # both outside the core view, reached through the router

    # The per-request cache table: one row per model request, figures equal to the server's.
    requests = [request for turn in state["turns"] for request in turn["requests"]]
    # Read in one script: the page re-renders the table as it polls, so elements found one by one can go stale.
    rows = browser.execute_script(
        """return [...document.querySelectorAll("#requests tbody tr")].map((row) => ({
            request: row.getAttribute("data-request"),
            ...Object.fromEntries([...row.querySelectorAll("[data-field]")].map(
                (cell) => [cell.getAttribute("data-field"), cell.innerText.trim()])),
        }));"""
    )
    assert len(rows) == len(requests) == state["totals"]["requests"]
    for row, request in zip(rows, requests, strict=True):
        assert row["request"] == str(request["index"])
        assert row["channel"] == request["channel"]
        assert int(row["prompt"]) == request["prompt_tokens"]
        assert int(row["cached"]) == request["cached_tokens"]
        assert row["cost"] == f"{request['cost']:.1f}"
    assert {"triage", "main", "router"} <= {request["channel"] for request in requests}
    assert requests[0]["cached_tokens"] == 0  # a fresh offline cache claims no hit on the first request
    assert sum(r["cached_tokens"] for r in state["turns"][1]["requests"]) > 0  # the second turn reuses the prefix
    totals = browser.find_element(By.ID, "totals")
    assert int(totals.find_element(By.CSS_SELECTOR, "[data-field=prompt]").text) == state["totals"]["prompt_tokens"]
    assert int(totals.find_element(By.CSS_SELECTOR, "[data-field=cached]").text) == state["totals"]["cached_tokens"]
    shown = totals.find_element(By.CSS_SELECTOR, "[data-field=hit]").text
    assert shown == f"{100 * state['totals']['hit_rate']:.1f}%"
    assert totals.find_element(By.CSS_SELECTOR, "[data-field=cost]").text == f"{state['totals']['cost']:.1f}"

    screenshot = tmp_path / "cacherouter-web.png"
    assert browser.save_screenshot(str(screenshot))
    print(f"web UI screenshot: {screenshot}")
    # Nothing failed in the page: no script error, no request refused, nothing blocked by the CSP.
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []


def test_chat_endpoint_refuses_cross_site_and_malformed_requests(server: AppThread) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as http:
        page = http.get("/")
        assert page.status_code == 200
        assert "script-src 'self'" in page.headers["content-security-policy"]
        # A cross-site form can only send text/plain or form bodies: refused before any agent turn runs.
        assert http.post("/api/chat", content="message=hi", headers={"Content-Type": "text/plain"}).status_code == 415
        refused = http.post("/api/chat", json={"message": "hi"}, headers={"Origin": "http://evil.example"})
        assert refused.status_code == 403
        assert http.post("/api/chat", json={"message": "  "}).status_code == 400
        assert http.post("/api/chat", json=["not", "an", "object"]).status_code == 400
        assert http.get("/api/state", headers={"Host": "rebound.example"}).status_code == 400  # DNS rebinding
        assert http.get("/api/state").json()["turns"] == []


def test_each_request_reports_its_relative_input_cost(server: AppThread) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        state = http.post("/api/chat", json={"message": MESSAGES[0]}).json()["state"]
    requests = state["turns"][0]["requests"]
    for request in requests:  # DeepSeek's offline cache model: a hit costs 1/30 of an uncached input token
        miss = request["prompt_tokens"] - request["cached_tokens"]
        assert request["cost"] == pytest.approx(miss + request["cached_tokens"] / 30)
    assert state["totals"]["cost"] == pytest.approx(sum(r["cost"] for r in requests))


Respond = Callable[[ChatRequest], ChatResponse]


@contextlib.contextmanager
def scripted_web(tmp_path: Path, main: Respond, *, simulated: bool = True) -> Iterator[AppThread]:
    """The web app over HTTP with a scripted main model of the test's own (the router model calls no tool).

    ``simulated``: usage from the offline DeepSeek cache model; otherwise the usage the main model returns."""
    root = make_repo(tmp_path / "repo")
    ledger = Ledger()
    cache = DeepSeekCacheModel()
    main_model: Any = ScriptedModel(main)
    if simulated:
        main_model = SimulatedProvider(main_model, cache)
    router_model = SimulatedProvider(ScriptedModel(lambda r: ChatResponse(content="none fits")), cache)
    with Gateway(GatewayConfig(root=root)) as gateway:
        view = MainView.from_registry(gateway.registry, ("base",))
        router = Router(
            gateway, RecordingModel(router_model, ledger, provider="deepseek"), core_tools=frozenset(view.core_tools)
        )
        agent = Agent(
            gateway=gateway, main_model=RecordingModel(main_model, ledger, provider="deepseek"), router=router
        )
        web = WebChat(ChatSetup(agent=agent, ledger=ledger, scripted=True), agent.new_session(view))
        with AppThread(create_app(web)) as thread:
            yield thread


def test_the_page_and_state_answer_while_a_turn_runs(tmp_path: Path) -> None:
    entered, release = threading.Event(), threading.Event()

    def main(request: ChatRequest) -> ChatResponse:
        entered.set()
        release.wait(30)  # a slow provider, until the test has looked at the page
        return ChatResponse(content="Four. [STATUS: DIRECT_ANSWER]")

    with scripted_web(tmp_path, main) as server, httpx.Client(base_url=server.url, timeout=5) as http:
        turn: dict[str, Any] = {}
        poster = threading.Thread(
            target=lambda: turn.update(http.post("/api/chat", json={"message": "2+2?"}, timeout=30).json())
        )
        poster.start()
        try:
            assert entered.wait(10)
            state = http.get("/api/state").json()  # before the fix: waited for the turn (ReadTimeout here)
            assert [(t["query"], t["pending"], t["answer"]) for t in state["turns"]] == [("2+2?", True, None)]
            assert http.get("/").status_code == 200
            assert http.get("/static/web.js").status_code == 200
        finally:
            release.set()
            poster.join(30)
        assert turn["turn"]["answer"] == "Four."
        assert [(t["pending"], t["answer"]) for t in http.get("/api/state").json()["turns"]] == [(False, "Four.")]


def test_turns_on_one_session_stay_serialised(tmp_path: Path) -> None:
    active = 0
    overlapped = False
    lock = threading.Lock()

    def main(request: ChatRequest) -> ChatResponse:
        nonlocal active, overlapped
        with lock:
            active += 1
            overlapped |= active > 1
        threading.Event().wait(0.2)  # hold the turn open long enough for the other to try to start
        with lock:
            active -= 1
        return ChatResponse(content="ok [STATUS: DIRECT_ANSWER]")

    with scripted_web(tmp_path, main) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        threads = [
            threading.Thread(target=http.post, args=("/api/chat",), kwargs={"json": {"message": f"q{i}"}})
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        state = http.get("/api/state").json()
    assert not overlapped
    assert sorted(t["query"] for t in state["turns"]) == ["q0", "q1"]
    assert [t["index"] for t in state["turns"]] == [0, 1]


def test_an_unexpected_error_is_an_error_turn_not_a_500(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def main(request: ChatRequest) -> ChatResponse:
        if request.channel == "triage":
            return ChatResponse(content=NEED_TOOLS)
        if replies_since_query(request.messages) == 0:
            return ChatResponse(tool_calls=(ChatToolCall(id="a", name="echo_text", arguments={"text": "ran"}),))
        raise KeyError("choices")  # a bug or an answer nobody expected, not a CacheRouterError

    with (
        caplog.at_level(logging.ERROR, logger="cacherouter.frontends.web"),
        scripted_web(tmp_path, main) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        response = http.post("/api/chat", json={"message": "echo it"})
        state = http.get("/api/state").json()
    assert response.status_code == 200
    assert "Traceback" not in response.text
    turn = response.json()["turn"]
    assert turn["path"] == "error"
    assert "KeyError" in turn["error"]
    assert "server log" in turn["error"]
    assert [(c["name"], "echo_text:ran" in c["result"]) for c in turn["calls"]] == [("echo_text", True)]
    assert [t["path"] for t in state["turns"]] == ["error"]
    assert any(record.exc_info for record in caplog.records)  # the traceback stays on the server


def test_calls_pair_with_their_own_results_when_ids_repeat(tmp_path: Path) -> None:
    """Providers that omit tool-call ids give every round the same ids."""

    def main(request: ChatRequest) -> ChatResponse:
        if request.channel == "triage":
            return ChatResponse(content=NEED_TOOLS)
        done = replies_since_query(request.messages)
        if done < 2:
            return ChatResponse(
                tool_calls=(ChatToolCall(id="call_0", name="echo_text", arguments={"text": f"r{done}"}),)
            )
        return ChatResponse(content="done")

    with scripted_web(tmp_path, main) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        turn = http.post("/api/chat", json={"message": "echo twice"}).json()["turn"]
    calls = turn["calls"]
    assert [c["arguments"]["text"] for c in calls] == ["r0", "r1"]
    assert "echo_text:r0" in calls[0]["result"]  # before: both showed the last round's result
    assert "echo_text:r1" in calls[1]["result"]


def test_web_accepts_what_chat_accepts_and_says_the_limit(tmp_path: Path) -> None:
    def main(request: ChatRequest) -> ChatResponse:
        return ChatResponse(content="long read. [STATUS: DIRECT_ANSWER]")

    with scripted_web(tmp_path, main) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/api/chat", json={"message": "y" * 10_000}).status_code == 200
        refused = http.post("/api/chat", json={"message": "y" * (MAX_MESSAGE_CHARS + 1)})
        assert refused.status_code == 400
        assert f"{MAX_MESSAGE_CHARS:,}" in refused.json()["error"]
        assert len(http.get("/api/state").json()["turns"]) == 1
        assert f'maxlength="{MAX_MESSAGE_CHARS}"' in http.get("/").text  # the page's own limit is the same
        huge = http.post("/api/chat", content=b"x" * (MAX_BODY_BYTES + 1), headers={"Content-Type": "application/json"})
        assert huge.status_code == 413  # read and dropped, never buffered or parsed
        assert f"{MAX_MESSAGE_CHARS:,} characters" in huge.json()["error"]


def test_totals_count_requests_of_unknown_cost(tmp_path: Path) -> None:
    known = {"prompt_tokens": 100, "prompt_cache_hit_tokens": 60, "prompt_cache_miss_tokens": 40}

    def main(request: ChatRequest) -> ChatResponse:
        if request.channel == "triage":
            return ChatResponse(content=NEED_TOOLS, usage=known)
        return ChatResponse(content="done", usage={})  # the provider sent no usage

    with scripted_web(tmp_path, main, simulated=False) as server, httpx.Client(base_url=server.url) as http:
        state = http.post("/api/chat", json={"message": "q"}).json()["state"]
    assert [r["cost"] for r in state["turns"][0]["requests"]] == [pytest.approx(42.0), None]
    totals = state["totals"]
    assert (totals["requests"], totals["cost"], totals["unknown_cost_requests"]) == (2, pytest.approx(42.0), 1)


@needs_browser
def test_the_page_shows_a_running_turn_and_then_its_answer(tmp_path: Path, browser: Any) -> None:
    entered, release = threading.Event(), threading.Event()

    def main(request: ChatRequest) -> ChatResponse:
        entered.set()
        release.wait(30)
        return ChatResponse(content="Four. [STATUS: DIRECT_ANSWER]")

    wait = WebDriverWait(browser, 30, poll_frequency=0.05)
    with scripted_web(tmp_path, main) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        poster = threading.Thread(target=http.post, args=("/api/chat",), kwargs={"json": {"message": "2+2?"}})
        poster.start()  # another tab's turn
        try:
            assert entered.wait(10)
            browser.get(f"{server.url}/")
            pending = '#transcript li[data-turn="0"] .pending .text'
            assert wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, pending))[0].text.startswith("working")
            assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-turns") == "0"
        finally:
            release.set()
            poster.join(30)
        # The page keeps fetching the state while a turn runs, so the answer replaces the pending line.
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-turns") == "1")
        assert browser.find_element(By.CSS_SELECTOR, '#transcript li[data-turn="0"] .msg.agent .text').text == "Four."
        assert browser.find_elements(By.CSS_SELECTOR, "#transcript .pending") == []
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []
