"""The chat page in headless Chromium (selenium, the system's chromium and chromedriver) against a live
server on tiny models that needs an API key: two streamed turns, coloured tokens, stats, a wrong key.

Skips, saying why, where selenium, chromium or chromedriver is missing (`make browser-deps` installs them).
Screenshots (light and dark) go to test-artifacts/ at the repository root.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from server_util import ServerProcess
from tiny import save_tiny_pair

MODEL, KEY, MAX_TOKENS = "tiny", "browser-key", 24
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def _browser_paths() -> tuple[str, str]:
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (make browser-deps)")
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no chromium or chromedriver on PATH (make browser-deps)")
    return browser, driver


@pytest.fixture(scope="module")
def driver():
    browser, chromedriver = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,1000"):
        options.add_argument(arg)
    try:
        drv = webdriver.Chrome(service=Service(chromedriver), options=options)
    except Exception as exc:  # a browser that cannot start here (no display libraries, ...)
        pytest.skip(f"headless chromium did not start: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("browser"))
    srv = ServerProcess(["--target", target, "--draft", draft, "--dtype", "fp32", "--served-model-name", MODEL,
                         "--api-key", KEY, "-k", "3"])
    yield srv
    srv.stop()


def _api(server, messages: list[dict]) -> str:
    """The API's greedy reply to `messages` (non-streamed)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "top_p": 1}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=60).json()["choices"][0]["message"]["content"]


# keeps a copy of each chat completion's response body the page reads, so a test compares the page with what the
# server sent for that same request (a re-run may colour tokens differently: drafts depend on the draft's cache)
_RECORD_STREAMS = """
    window.streams = [];
    const fetchOriginal = window.fetch;
    window.fetch = async (...args) => {
      const response = await fetchOriginal(...args);
      if (String(args[0]).endsWith("/v1/chat/completions")) {
        const record = {body: null};
        window.streams.push(record);
        response.clone().text().then((body) => { record.body = body; });
      }
      return response;
    };"""


def _streamed(driver, index: int) -> tuple[int, int]:
    """The accepted / target counts the chunks of the page's `index`-th chat completion stream carried."""
    body = _wait(driver, lambda d: d.execute_script("return window.streams[arguments[0]].body", index))
    accepted = target = 0
    for line in body.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            if chunk["choices"] and not chunk["choices"][0]["finish_reason"] and "verispec" in chunk:
                accepted += chunk["verispec"]["accepted"]
                target += chunk["verispec"]["target"]
    return accepted, target


def _wait(driver, condition, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: condition(d))


def _by_id(driver, name: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, name)


def _set(driver, name: str, value: str) -> None:
    from selenium.webdriver.common.keys import Keys

    field = _by_id(driver, name)
    field.clear()
    field.send_keys(value, Keys.TAB)  # the change event


def _send(driver, message: str, turns: int) -> None:
    _by_id(driver, "prompt").send_keys(message)
    _by_id(driver, "send").click()
    _wait(driver, lambda d: d.execute_script(
        "return document.querySelectorAll('.turn').length") == turns and _by_id(d, "send").is_enabled())


def _reply(driver, turn: int, kind: str = "speculative") -> dict:
    """What the page shows for one turn's column: its text and how many tokens of each colour class."""
    return driver.execute_script("""
        const col = document.querySelectorAll('.turn')[arguments[0]].querySelector('.column.' + arguments[1]);
        const text = col.querySelector('.text');
        return {text: text.textContent, draft: text.querySelectorAll('.tok.draft').length,
                target: text.querySelectorAll('.tok.target').length};""", turn, kind)


def test_chat_page_two_turns_coloured_tokens_stats_and_a_wrong_key(driver, server):
    driver.get(server.url + "/")
    driver.execute_script(_RECORD_STREAMS)
    assert _by_id(driver, "stats").text == "no generation yet"
    _set(driver, "api-key", KEY)
    _wait(driver, lambda d: d.execute_script("return document.getElementById('model').value") == MODEL)
    _set(driver, "max-tokens", str(MAX_TOKENS))
    assert _by_id(driver, "temperature").get_attribute("value") == "0"

    _send(driver, "hello there", 1)
    first = _reply(driver, 0)
    text, (accepted, target) = _api(server, [{"role": "user", "content": "hello there"}]), _streamed(driver, 0)
    assert first["text"] == text and text
    assert (first["draft"], first["target"]) == (accepted, target) and accepted > 0 and target > 0
    stats_one = _by_id(driver, "stats").text
    assert "acceptance" in stats_one and "tok/s" in stats_one

    _by_id(driver, "compare").click()
    _send(driver, "and more", 2)
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": text},
                {"role": "user", "content": "and more"}]
    second, plain = _reply(driver, 1), _reply(driver, 1, "plain")
    text2, (accepted2, target2) = _api(server, messages), _streamed(driver, 1)
    assert second["text"] == text2 and (second["draft"], second["target"]) == (accepted2, target2)
    assert plain["text"] == text2 and plain["draft"] == 0 and plain["target"] == accepted2 + target2  # greedy: same
    stats_two = _by_id(driver, "stats").text
    assert stats_two != stats_one and "speedup" in stats_two
    assert not _by_id(driver, "error").is_displayed()

    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "chat-light.png"))
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia",
                           {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    driver.save_screenshot(str(ARTIFACTS / "chat-dark.png"))
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})

    _set(driver, "api-key", "not-the-key")
    _wait(driver, lambda d: _by_id(d, "error").is_displayed())
    assert "invalid or missing API key" in _by_id(driver, "error").text
    _by_id(driver, "compare").click()
    _send(driver, "third", 3)
    assert "401" in _by_id(driver, "error").text and _reply(driver, 2)["text"] == ""
    driver.save_screenshot(str(ARTIFACTS / "chat-wrong-key.png"))
