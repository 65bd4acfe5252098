"""`reinforge ui` in a real browser: headless Chromium (Debian's package, installed by
`scripts/setup_browser.sh`, which `make test` runs) driven through chromedriver's W3C
WebDriver API. A reviewer opens the run, filters the rollouts, opens one, marks its reward
wrong, and the mark arrives in the run's stream on the nats-server; a completion of HTML and
script shows as text and runs nothing."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import httpx
import pytest
from ui_runs import EVIL, stored_marks

from reinforge.core import messages as m

pytestmark = [pytest.mark.nats, pytest.mark.slow]

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--disable-background-networking", "--disable-sync",
                 "--disable-component-update", "--window-size=1200,900"]
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference


class Browser:
    """The few WebDriver commands a reviewer's clicks need (https://w3c.github.io/webdriver/)."""

    def __init__(self, driver_url: str, profile: Path) -> None:
        self.http = httpx.Client(base_url=driver_url, timeout=60)
        options = {"binary": "/usr/bin/chromium",
                   "args": [*CHROMIUM_ARGS, f"--user-data-dir={profile}"]}
        started = self.http.post("/session", json={"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": options}}})
        assert started.status_code == 200, started.text
        self.session = started.json()["value"]["sessionId"]

    def command(self, method: str, path: str, body: dict | None = None):
        r = self.http.request(method, f"/session/{self.session}{path}", json=body)
        assert r.status_code == 200, f"{method} {path}: {r.text[:500]}"
        return r.json()["value"]

    def go(self, url: str) -> None:
        self.command("POST", "/url", {"url": url})

    def find(self, css: str) -> str:
        return self.command("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def click(self, css: str) -> None:
        self.command("POST", f"/element/{self.find(css)}/click", {})

    def click_to_load(self, css: str, timeout_s: float = 30) -> None:
        """Click a link or a form's button and wait until the page it opens has loaded:
        chromedriver may answer the click while the old page is still shown (CI once read
        the old page's text, once found no body at all)."""
        self.script("window.rfPageBeforeClick = true")
        self.click(css)
        deadline = time.monotonic() + timeout_s
        while not self.script("return document.readyState === 'complete'"
                              " && !window.rfPageBeforeClick"):
            assert time.monotonic() < deadline, f"clicking {css} loaded no page in {timeout_s} s"

    def script(self, source: str):
        r = self.http.post(f"/session/{self.session}/execute/sync",
                           json={"script": source, "args": []})
        return r.status_code == 200 and r.json()["value"]  # mid-navigation: not loaded yet

    def type(self, css: str, text: str) -> None:
        self.command("POST", f"/element/{self.find(css)}/value", {"text": text})

    def text(self, css: str = "body") -> str:
        return self.command("GET", f"/element/{self.find(css)}/text")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.command("GET", "/screenshot"))

    def close(self) -> None:
        self.http.delete(f"/session/{self.session}")
        self.http.close()


def test_a_reviewer_in_chromium_filters_opens_a_rollout_and_marks_its_reward(
        live_ui, chromedriver, creds, run_name, tmp_path):
    browser = Browser(chromedriver, tmp_path / "profile")
    try:
        browser.go(f"{live_ui.url}/?token={live_ui.token}")
        overview = browser.text("table")
        assert "math" in overview and "docqa" in overview
        assert browser.screenshot().startswith(b"\x89PNG")

        browser.go(f"{live_ui.url}/rollouts")  # the cookie from the first page carries on
        browser.type("input[name=outcome]", "pass")
        browser.click_to_load("form button")
        listing = browser.text()
        assert "2 of 3" in listing and "doc:0:1" not in listing

        browser.click_to_load("a[href='/rollout?id=2%2B2%3A0%3A1']")
        assert "what is 2+2?" in browser.text()
        browser.click("select[name=kind] option[value=wrong_reward]")
        browser.type("input[name=corrected_reward]", "0")
        browser.type("input[name=note]", "2+2 is 4")
        browser.click_to_load("form[action='/review'] button")
        assert "mark sent" in browser.text()

        browser.go(f"{live_ui.url}/rollout?id=doc:0:1")  # a completion of HTML and script
        assert EVIL in browser.text("pre:nth-of-type(2)")  # shown as the text it is
        no_dialog = browser.http.get(f"/session/{browser.session}/alert/text")
        assert no_dialog.json()["value"]["error"] == "no such alert"  # and nothing ran
    finally:
        browser.close()
    marks = stored_marks(creds, run_name)
    assert [(k.rollout_id, k.kind, k.corrected_reward, k.note, k.reviewer) for k in marks] == \
        [("2+2:0:1", m.Review.WRONG_REWARD, 0.0, "2+2 is 4", "ann")]
