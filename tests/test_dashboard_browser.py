"""The dashboard in a real headless browser: Debian's Chromium driven by Selenium through Debian's ChromeDriver,
against a real server on 127.0.0.1 holding real rollouts of ``RemoteCache`` sessions.

``scripts/install-browser.sh`` installs the browser (``.ci/run`` calls it before ``make test``); where it is
missing the test is skipped and says why. The screenshot lands in the test's tmp dir (its path is printed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tvcache.server import CacheService, ServerSettings, ServerThread

from browser_support import chromium, missing_browser
from server_support import TASKS, populate_dashboard

TOKEN = "dashboard-test-token"
try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - the tests are skipped then; missing_browser() says why
    pass

if missing_browser() is not None:
    pytestmark = pytest.mark.skip(reason=str(missing_browser()))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, dict[str, Any]]]:
    service = CacheService()
    with ServerThread(service, ServerSettings(token=TOKEN)) as thread:
        # A token-protected server: the clients authenticate like any other.
        counted = populate_dashboard(thread.url, tmp_path_factory.mktemp("snapshots"), token=TOKEN)
        yield thread, counted
    service.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with chromium(tmp_path_factory.mktemp("chromium-profile"), window="1500,1850") as driver:
        yield driver


def percent(text: str) -> float:
    match = re.fullmatch(r"(\d+\.\d)%", text.strip())
    assert match, f"not a percentage: {text!r}"
    return float(match.group(1))


def test_dashboard_in_chromium(server: tuple[ServerThread, Any], browser: Any, tmp_path: Path) -> None:
    thread, counted = server
    http = httpx.Client(base_url=thread.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    activity = http.get("/v1/activity").json()
    stats = http.get("/v1/stats").json()
    # The server's tallies are exactly what the clients' own sessions counted, per task and epoch.
    tallied = {
        (task["task_id"], epoch["epoch"]): (epoch["hits"], epoch["misses"])
        for task in activity["tasks"]
        for epoch in task["epochs"]
    }
    assert tallied == {key: (value.hits, value.misses) for key, value in counted.items()}
    wait = WebDriverWait(browser, 15, poll_frequency=0.05)

    # The page and its assets load without the token; the data does not: the page asks for the token once.
    browser.get(f"{thread.url}/dashboard")
    login = wait.until(
        lambda d: d.find_element(By.ID, "login") if d.find_element(By.ID, "login").is_displayed() else None
    )
    login.find_element(By.ID, "token").send_keys(TOKEN)
    login.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")) == len(TASKS))
    browser.get_log("browser")  # drop the 401s of the page's first, token-less requests
    assert TOKEN not in browser.current_url
    assert browser.execute_script("return sessionStorage.getItem('tvcache.token')") == TOKEN

    # Totals equal the server's /v1/stats.
    def card(key: str) -> str:
        return str(browser.find_element(By.CSS_SELECTOR, f"[data-card={key}] .value").text)

    assert int(card("hits")) == stats["hits"]
    assert int(card("misses")) == stats["misses"]
    assert percent(card("hit-rate")) == pytest.approx(100 * stats["hits"] / (stats["hits"] + stats["misses"]), abs=0.05)

    # Per task, and per task and epoch: the figures shown equal /v1/activity, which equals what the clients'
    # own sessions counted.
    for task in activity["tasks"]:
        row = browser.find_element(By.CSS_SELECTOR, f'#tasks tr[data-task="{task["task_id"]}"]')
        assert int(row.find_element(By.CSS_SELECTOR, "[data-field=hits]").text) == task["total"]["hits"]
        assert int(row.find_element(By.CSS_SELECTOR, "[data-field=misses]").text) == task["total"]["misses"]
        shown = percent(row.find_element(By.CSS_SELECTOR, "[data-field=hit-rate]").text)
        assert shown == pytest.approx(100 * task["total"]["hit_rate"], abs=0.05)
        for epoch in task["epochs"]:
            name = "untagged" if epoch["epoch"] is None else str(epoch["epoch"])
            cell = browser.find_element(
                By.CSS_SELECTOR, f'#epochs td[data-task="{task["task_id"]}"][data-epoch="{name}"]'
            )
            assert percent(cell.find_element(By.CSS_SELECTOR, ".rate").text) == pytest.approx(
                100 * epoch["hit_rate"], abs=0.05
            )
            hits, total = (int(part) for part in cell.find_element(By.CSS_SELECTOR, ".counts").text.split("/"))
            assert (hits, total - hits) == (epoch["hits"], epoch["misses"])
    assert len(browser.find_elements(By.CSS_SELECTOR, "#epochs td[data-epoch]")) == len(counted)

    # The graph of the second task: every node drawn, snapshot markers where the server has snapshots.
    task_id = TASKS[1]
    browser.find_element(By.CSS_SELECTOR, f'#tasks tr[data-task="{task_id}"]').click()
    graph = http.get("/v1/graph", params={"task_id": task_id}).json()["nodes"]
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#graph g.node")) == len(graph))  # the root too
    drawn = {int(g.get_attribute("data-id")) for g in browser.find_elements(By.CSS_SELECTOR, "#graph g.has-snapshot")}
    assert drawn
    assert drawn == {node["id"] for node in graph if node["snapshot"] is not None}

    # Click the most-hit node: its call and result appear in the side panel.
    node = max(graph, key=lambda node: (node["hits"], -node["id"]))
    assert node["hits"] > 0
    browser.find_element(By.CSS_SELECTOR, f'#graph g.node[data-id="{node["id"]}"] .shape').click()
    call = wait.until(lambda d: d.find_element(By.ID, "detail-call"))
    assert f'"name": "{node["name"]}"' in call.text
    for key, value in node["arguments"].items():
        assert f'"{key}": {json.dumps(value)}' in call.text
    assert browser.find_element(By.ID, "detail-output").text == node["output"].strip()
    assert f"node {node['id']}" in browser.find_element(By.CSS_SELECTOR, "#detail h3").text
    selected = browser.find_elements(By.CSS_SELECTOR, "#graph g.node.selected")
    assert [g.get_attribute("data-id") for g in selected] == [str(node["id"])]

    screenshot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(screenshot))
    print(f"dashboard screenshot: {screenshot}")
    # Nothing failed in the page: no script error, no request refused, nothing blocked by the CSP.
    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert severe == []
