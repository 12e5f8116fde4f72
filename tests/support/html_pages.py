"""Checking the project's HTML pages (the preview gallery, benchmarks/quality.py's comparison): what a parser sees
of a page, and what headless chromium renders of it (skipped where chromium is missing, except under CI)."""

from __future__ import annotations

import html.parser
import os
import shutil
import subprocess

import pytest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=2000"]


class Links(html.parser.HTMLParser):
    """Every href/src of the page, the tags seen, the text, and any on* handler attribute."""

    def __init__(self):
        super().__init__()
        self.refs, self.tags, self.text, self.handlers = [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("href", "src"):
                self.refs.append(value)
            if name.startswith("on"):
                self.handlers.append((tag, name, value))

    def handle_data(self, data):
        self.text.append(data)


def parse(page: str) -> Links:
    parsed = Links()
    parsed.feed(page)
    return parsed


def chromium() -> str:
    """The chromium binary; the test is skipped where it is missing, and fails under CI (which installs it)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed on this CI machine (Debian: apt-get install chromium)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium); the HTML parser test still runs")
    return browser


def rendered_dom(path) -> str:
    """The DOM headless chromium builds from the page at `path` (a pathlib.Path), scripts run if any."""
    return subprocess.run([chromium(), *CHROMIUM_FLAGS, "--dump-dom", path.as_uri()], capture_output=True,
                          text=True, timeout=120).stdout


def screenshot(path, out, size=(1100, 900)) -> None:
    """Headless chromium's screenshot of the page at `path` into `out` (PNG)."""
    subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--window-size={size[0]},{size[1]}", f"--screenshot={out}",
                    path.as_uri()], capture_output=True, timeout=120, check=True)
