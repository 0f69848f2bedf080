"""The built-in page at / (server/ui/) in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by scripts/browser_env.sh when missing) driven by Selenium, against a
real ``tpuserve serve`` of the default model.

It streams a greedy chat answer that must equal the API's, stops a long answer mid-stream (the server
must abort it: /metrics), shows the live metrics, and under ``--api-key`` asks for the key and works
with it. A screenshot of the page is saved as a test artifact; its path is printed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait
from server_fixtures import openai_client, running_server  # tests/server/server_fixtures.py

from tpuserve.server.api_server import build_app
from tpuserve.server.async_engine import EngineSnapshot
from tpuserve.server.ui import UI_FILES, UI_PATHS

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
SERVE_ARGS = (
    "--no-warmup",
    "--max-model-len",
    "1024",
    "--max-num-batched-tokens",
    "128",
    "--max-num-seqs",
    "8",
)
API_KEY = "ui-test-key"
SYSTEM = "You are a concise assistant."
# Generous: the first request of a server compiles its programs, on a shared 2-core machine.
WAIT_S = 150.0


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """(browser, driver) paths; installs them once per session, skips only where that fails."""
    script = REPO / "scripts" / "browser_env.sh"
    try:
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("no headless Chromium: scripts/browser_env.sh did not finish installing it in 900 s")
    if r.returncode != 0:
        pytest.skip(
            "no headless Chromium: scripts/browser_env.sh could not install Debian's chromium and "
            f"chromium-driver:\n{r.stderr.strip()[-800:]}"
        )
    browser, driver = r.stdout.split()[-2:]
    return browser, driver


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(tmp_path_factory, "ui-server", *SERVE_ARGS)


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    yield from running_server(tmp_path_factory, "ui-keyed-server", *SERVE_ARGS, "--api-key", API_KEY)


@pytest.fixture
def page(chromium, tmp_path):
    browser, driver_path = chromium
    options = Options()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in containers, and no user namespaces in many CI runners
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(arg)
    service = Service(executable_path=driver_path, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


# ---- helpers ----


def metrics(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """/metrics as {name: value summed over label sets}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=60).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            values[name] = values.get(name, 0.0) + value
    return values


def wait(driver: WebDriver, condition, timeout: float = WAIT_S, message: str = ""):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), message)


def by_id(driver: WebDriver, element_id: str):
    return driver.find_element(By.ID, element_id)


def set_value(driver: WebDriver, element_id: str, value: str) -> None:
    el = by_id(driver, element_id)
    el.clear()
    el.send_keys(value)


def wait_connected(driver: WebDriver) -> None:
    wait(
        driver,
        lambda d: by_id(d, "model").get_attribute("value") == MODEL and by_id(d, "send").is_enabled(),
        message="the page never listed the model",
    )


# Records (time, length) of the last answer's text at every change the page makes to it.
WATCH_ANSWER = """
if (window.answerWatch) window.answerWatch.disconnect();
window.answerLengths = [];
window.answerWatch = new MutationObserver(() => {
  const answers = document.querySelectorAll('#conversation .msg.assistant .text');
  const last = answers[answers.length - 1];
  if (last) window.answerLengths.push([performance.now(), last.textContent.length]);
});
window.answerWatch.observe(document.getElementById('conversation'),
                           {subtree: true, childList: true, characterData: true});
"""

LAST_ANSWER = """
const answers = document.querySelectorAll('#conversation .msg.assistant');
const a = answers[answers.length - 1];
if (!a) return null;
const stats = a.querySelector('.stats');
return {state: a.dataset.state, text: a.querySelector('.text').textContent,
        stats: stats ? stats.textContent : '', data: stats ? {...stats.dataset} : {}};
"""


def last_answer(driver: WebDriver) -> dict | None:
    return driver.execute_script(LAST_ANSWER)


def ask(driver: WebDriver, question: str, max_tokens: int) -> None:
    """Set greedy sampling and ``max_tokens``, then send ``question`` (watching the answer grow)."""
    set_value(driver, "temperature", "0")
    set_value(driver, "top-p", "1")
    set_value(driver, "max-tokens", str(max_tokens))
    set_value(driver, "prompt", question)
    driver.execute_script(WATCH_ANSWER)
    by_id(driver, "send").click()


def wait_finished(driver: WebDriver) -> dict:
    wait(
        driver,
        lambda d: (last_answer(d) or {}).get("state") in ("done", "stopped", "error"),
        message="the answer never finished",
    )
    return last_answer(driver)


def answer_sizes(driver: WebDriver) -> list[int]:
    """The distinct non-empty lengths the last answer's text has had on screen."""
    lengths = [n for _, n in driver.execute_script("return window.answerLengths")]
    return sorted(set(lengths) - {0})


def artifact_dir() -> Path:
    out = Path(
        os.environ.get("TPUSERVE_TEST_ARTIFACTS", Path(tempfile.gettempdir()) / "tpuserve-test-artifacts")
    )
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextmanager
def explained_failures(driver: WebDriver, server, name: str):
    """On any failure (a pytest-timeout too) keep a screenshot and add the page's and the server's
    state to the error."""
    try:
        yield
    except BaseException as e:
        shot = artifact_dir() / f"{name}-failure.png"
        try:
            driver.save_screenshot(str(shot))
            answer = last_answer(driver)
            status = by_id(driver, "server-state").text
        except Exception as why:  # the browser itself may be what failed
            answer = status = f"(no answer from the browser: {why!r})"
        e.add_note(
            f"screenshot: {shot}\nlast answer on the page: {answer}\npage status: {status}\n"
            f"server log ({server.log_path}), last lines:\n{server.log_tail(25)}"
        )
        raise


def save_screenshot(driver: WebDriver, tmp_path: Path, name: str, capsys) -> Path:
    """Save a screenshot under the test's tmp dir and copy it where it survives the run (printed)."""
    shot = tmp_path / name
    assert driver.save_screenshot(str(shot)), "the browser gave no screenshot"
    assert shot.stat().st_size > 10_000  # a rendered page, not an empty image
    kept = artifact_dir() / name
    shutil.copyfile(shot, kept)
    with capsys.disabled():
        print(f"\n[tpuserve] screenshot of the built-in page: {kept}")
    return kept


def greedy_api_answer(server, question: str, max_tokens: int, api_key: str | None = None):
    client = openai_client(server)
    if api_key:
        client = client.with_options(api_key=api_key)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        top_p=1,
    )


# ---- tests ----


@pytest.mark.parametrize("api_key", [None, API_KEY])
def test_page_files_are_public_and_no_ui_removes_them(api_key):
    """In process, no browser: with the page on, its files load without the key (and name no other
    origin: nothing from a CDN) while /metrics keeps needing it; ``ui=False`` (``--no-ui``) drops them."""
    engine = SimpleNamespace(max_model_len=64, tokenizer=None, snapshot=EngineSnapshot())
    with_ui = TestClient(build_app(engine, MODEL, api_key=api_key))
    for f in UI_FILES:
        r = with_ui.get(f.path)
        assert r.status_code == 200 and r.headers["content-type"] == f.media_type, f
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert not re.search(r"(src|href)=\"(https?:)?//", r.text), f  # only this server's files
    page_links = re.findall(r'(?:src|href)="([^"]+)"', with_ui.get("/").text)
    assert {u for u in page_links if not u.startswith("data:")} == UI_PATHS - {"/"}
    assert with_ui.get("/metrics").status_code == (401 if api_key else 200)
    without_ui = TestClient(build_app(engine, MODEL, api_key=api_key, ui=False))
    for path in UI_PATHS:
        assert without_ui.get(path).status_code == (401 if api_key else 404), path


def test_page_streams_greedy_answer_and_stop_aborts_on_server(server, page, tmp_path, capsys):
    with explained_failures(page, server, "ui-playground"):
        check_stop_then_greedy_chat(server, page)
    save_screenshot(page, tmp_path, "ui-playground.png", capsys)


def check_stop_then_greedy_chat(server, page: WebDriver) -> None:
    base = server.base_url
    page.get(base + "/")
    wait_connected(page)
    set_value(page, "system", SYSTEM)

    # Stop mid-stream: a long answer (900 tokens would take many seconds here), stopped once it
    # is visibly streaming and the server shows it running.
    before = metrics(base)
    long_max = 900
    ask(page, "Write a very long story about a dragon who learns to cook.", long_max)
    wait(
        page,
        lambda d: len(answer_sizes(d)) >= 4 and metrics(base)["vllm:num_requests_running"] == 1,
        message="the long answer never streamed",
    )
    by_id(page, "stop").click()
    stopped = wait_finished(page)
    assert stopped["state"] == "stopped", stopped
    assert stopped["text"] and "stopped" in stopped["stats"], stopped
    assert by_id(page, "send").is_enabled() and not by_id(page, "stop").is_enabled()
    # The server aborted it: nothing runs, every KV page is free again, far fewer than max_tokens
    # were generated, and it never finished (an aborted request does not count as a success).
    deadline = time.monotonic() + 30
    while True:
        after = metrics(base)
        idle = after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
        free = after["tpuserve:kv_cache_free_blocks"] == after["tpuserve:kv_cache_total_blocks"]
        if (idle and free) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle and free, after
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < long_max / 2, (
        after
    )
    assert after.get("vllm:request_success_total", 0) == before.get("vllm:request_success_total", 0), after

    # A greedy answer streams in and equals the API's for the same messages.
    by_id(page, "clear").click()
    # 40 tokens of a longer answer: a second or more of streaming, whatever the machine.
    question, max_tokens = "Explain in three sentences why the sky is blue.", 40
    ask(page, question, max_tokens)
    answer = wait_finished(page)
    assert answer["state"] == "done", answer
    sizes = answer_sizes(page)
    assert len(sizes) >= 3 and sizes[-1] == len(answer["text"]), sizes  # it grew, chunk by chunk
    expected = greedy_api_answer(server, question, max_tokens)
    assert answer["text"] == expected.choices[0].message.content
    assert answer["data"]["completionTokens"] == str(expected.usage.completion_tokens), answer
    assert answer["data"]["promptTokens"] == str(expected.usage.prompt_tokens), answer
    assert float(answer["data"]["ttftMs"]) > 0 and "time to first token" in answer["stats"], answer

    # The live view reads /metrics (once a second): the finished requests show up, then an idle server.
    wait(
        page,
        lambda d: by_id(d, "stat-done").text == "2" and by_id(d, "stat-running").text == "0",
        30,
        "the live view never showed the idle server",
    )
    assert by_id(page, "stat-kv").text.endswith("%")
    assert by_id(page, "stat-spec").text == "off"  # no speculative decoding on this server
    assert float(by_id(page, "stat-tps").text) >= 0


def test_page_asks_for_the_api_key_and_works_with_it(keyed_server, page, tmp_path, capsys):
    with explained_failures(page, keyed_server, "ui-api-key"):
        check_api_key_flow(keyed_server, page)
    save_screenshot(page, tmp_path, "ui-api-key.png", capsys)


def check_api_key_flow(keyed_server, page: WebDriver) -> None:
    base = keyed_server.base_url
    # The page's files load without the key; everything with data needs it.
    assert httpx.get(base + "/", timeout=30).status_code == 200
    assert httpx.get(base + "/ui/app.js", timeout=30).status_code == 200
    for path in ("/metrics", "/v1/models"):
        assert httpx.get(base + path, timeout=30).status_code == 401, path

    page.get(base + "/")
    dialog = by_id(page, "key-dialog")
    wait(page, lambda d: dialog.get_attribute("open") is not None, 30, "the page never asked for a key")
    set_value(page, "api-key", "wrong-key")
    by_id(page, "key-submit").click()
    wait(page, lambda d: by_id(d, "key-error").is_displayed(), 30, "a wrong key was not refused")
    assert "rejected" in by_id(page, "key-error").text
    assert dialog.get_attribute("open") is not None
    set_value(page, "api-key", API_KEY)
    by_id(page, "key-submit").click()
    wait_connected(page)
    assert dialog.get_attribute("open") is None
    assert "API key" in by_id(page, "server-state").text

    set_value(page, "system", SYSTEM)
    question, max_tokens = "Name three colors.", 16
    ask(page, question, max_tokens)
    answer = wait_finished(page)
    assert answer["state"] == "done", answer
    assert (
        answer["text"]
        == greedy_api_answer(keyed_server, question, max_tokens, API_KEY).choices[0].message.content
    )
    # /metrics with the key, too.
    wait(page, lambda d: "updated" in by_id(d, "metrics-age").text, 30, "the live view never read /metrics")
    wait(page, lambda d: by_id(d, "stat-done").text not in ("–", "0"), 30, "the live view never updated")
    assert metrics(base, API_KEY)["vllm:request_success_total"] >= 1
