"""Headless Chromium for the browser tests: Debian's chromium driven by Selenium through Debian's chromedriver.

``scripts/install-browser.sh`` installs both (``.ci/run`` calls it); ``missing_browser()`` says why a test must
skip where they are absent.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
# As the machine notes say: as root, without a sandbox, and with Chromium's own network chatter off.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)

try:
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
except ImportError:  # pragma: no cover - depends on the environment
    webdriver = None  # type: ignore[assignment]


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if webdriver is None:
        return "selenium is not installed (pip install -e '.[dev]')"
    if CHROMIUM is None or CHROMEDRIVER is None:
        return (
            "Chromium or ChromeDriver is missing: run scripts/install-browser.sh as root (apt-get install -y "
            "chromium chromium-driver)"
        )
    return None


@contextmanager
def chromium(profile: Path, *, window: str) -> Iterator[Any]:
    """A headless Chromium with a fresh profile in ``profile``, collecting the browser console log."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--window-size={window}", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    try:
        driver = webdriver.Chrome(options=options, service=service)
    except WebDriverException as error:
        pytest.fail(f"Chromium is installed but did not start: {error.msg}")
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()
