"""The ``/admin`` dashboard in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by scripts/setup.sh, driven by selenium): the page loads with no
console errors, shows the loaded model, the cache figures and the kernel/BLAS status, and its
unload/load buttons change ``/v1/models/status``; its pull field fetches a repo from the fake hub
of tests/fake_hub.py (the 4-bit SmolLM2) with a progress bar, and the model then shows in its
catalogue; a repo that does not exist shows the server's error. A screenshot is saved as
``artifacts/dashboard.png``."""

from __future__ import annotations

import shutil
import time

import httpx
import openai
import pytest

from tests.fake_hub import FakeHub, Repo
from tests.helpers import MODEL_ID, REPO, ServerProcess, quantized_model_dir

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="Debian's chromium and chromium-driver are not installed (scripts/setup.sh "
                                       "installs them)")


HUB_REPO = "mlx-community/SmolLM2-135M-Instruct-4bit"


@pytest.fixture(scope="module")
def hub():
    with FakeHub([Repo.from_folder(HUB_REPO, quantized_model_dir(4))]) as h:
        yield h


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory):
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path_factory.mktemp("dashboard-hub"))}
    with ServerProcess(["--api-key", KEY, "--block-size", "32", "--no-ssd-cache"], env=env) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        for _ in range(2):  # a cache hit and two recent requests to show
            client.completions.create(model=MODEL_ID, prompt="Rivers and mountains. " * 20, max_tokens=3)
        yield s


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1100", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait_for(fn, timeout_s: float = 60.0, what: str = "condition"):
    """Poll ``fn`` until it returns something truthy. The page re-renders its tables on every
    poll, so an element found a moment ago may be gone: a stale element counts as not yet."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            v = fn()
        except StaleElementReferenceException:
            v = None
        if v:
            return v
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


# One table row read in one script call, so a re-render between reads cannot split it.
_ROW_JS = """
const tr = document.querySelector(arguments[0]);
if (!tr) return null;
const bar = tr.querySelector('.bar > div');
return {text: tr.innerText, cells: Array.from(tr.querySelectorAll('td')).map(td => td.innerText.trim()),
        bar: bar ? bar.getAttribute('style') : null};
"""


def row_now(browser, css: str) -> dict | None:
    """The first row matching ``css`` as ``{"text", "cells", "bar"}`` (``bar`` the style of its
    progress bar's fill, or None), or None when no row matches."""
    return browser.execute_script(_ROW_JS, css)


def click(browser, css: str, what: str) -> None:
    """Click the element matching ``css``, finding it again if a re-render replaced it."""
    from selenium.webdriver.common.by import By

    def attempt():
        found = browser.find_elements(By.CSS_SELECTOR, css)
        if found:
            found[0].click()
            return True
        return False
    wait_for(attempt, what=what)


def model_state(server: ServerProcess) -> str:
    rows = httpx.get(server.url + "/v1/models/status", headers=AUTH, timeout=30).json()["models"]
    return {r["id"]: r["state"] for r in rows}[MODEL_ID]


def test_page_shows_models_cache_and_kernels_and_buttons_work(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/admin?key=" + KEY)
    wait_for(lambda: int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-polls") or 0) >= 2,
             what="two dashboard polls")
    assert "key=" not in browser.current_url  # the key left the address bar for sessionStorage
    assert "loaded" in row_now(browser, f'#models tr[data-model="{MODEL_ID}"]')["text"]
    cells = row_now(browser, f'#cache tr[data-model="{MODEL_ID}"][data-tier="hot"]')["cells"]
    assert cells[2].endswith("%") and cells[2] != "0.0 %", cells  # the second request hit
    assert int(cells[3]) > 0
    assert len(browser.find_elements(By.CSS_SELECTOR, "#recent tbody tr")) >= 2
    heads = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#recent thead th")]
    first = row_now(browser, "#recent tbody tr")["cells"]
    # the newest request (a whole-prompt hit) ran none of its prompt through the model
    assert first[heads.index("prefilled")] == "0", (heads, first)
    assert "BLAS:" in browser.find_element(By.ID, "blas").text
    assert "used" in browser.find_element(By.ID, "memory-text").text
    assert browser.find_elements(By.CSS_SELECTOR, "#plot-memory polyline")
    (REPO / "artifacts").mkdir(exist_ok=True)
    browser.save_screenshot(str(REPO / "artifacts" / "dashboard.png"))

    click(browser, f'#models tr[data-model="{MODEL_ID}"] button.unload', what="the unload button")
    wait_for(lambda: model_state(server) != "loaded", what="the model to unload")
    click(browser, f'#models tr[data-model="{MODEL_ID}"] button.load', what="the load button")
    wait_for(lambda: model_state(server) == "loaded", timeout_s=300, what="the model to load again")

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_the_pull_field_fetches_a_repo_with_a_progress_bar_and_lists_it(server, browser, hub):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/admin?key=" + KEY)
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, f'#catalogue tr[data-model="{MODEL_ID}"]'),
             what="the catalogue")
    assert not browser.find_elements(By.CSS_SELECTOR, f'#catalogue tr[data-model="{HUB_REPO}"]')
    field = browser.find_element(By.ID, "pull-repo")
    field.send_keys("nobody/nothing")
    browser.find_element(By.ID, "pull-button").click()
    wait_for(lambda: "no model nobody/nothing" in browser.find_element(By.ID, "pull-error").text,
             what="the 404's message")
    field.clear()
    hub.slow_file["model.safetensors"] = 0.02  # about 2 s: the bar is seen moving
    try:
        field.send_keys(HUB_REPO)
        browser.find_element(By.ID, "pull-button").click()
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#pulls tr[data-state=running], #pulls tr[data-state=done]"),
                 what="the pull's row")
        done = wait_for(lambda: row_now(browser, "#pulls tr[data-state=done]"), timeout_s=120,
                        what="the pull to finish")
    finally:
        hub.slow_file.clear()
    assert browser.find_element(By.ID, "pull-error").text == ""
    assert (done["bar"] or "").replace(" ", "") == "width:100%;", done
    assert " MB / " in done["text"]
    row = wait_for(lambda: row_now(browser, f'#catalogue tr[data-model="{HUB_REPO}"]'),
                   what="the pulled model in the catalogue")
    assert "hub cache" in row["text"] and "4-bit, group 64" in row["text"]
    (REPO / "artifacts").mkdir(exist_ok=True)
    browser.save_screenshot(str(REPO / "artifacts" / "dashboard-pull.png"))
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not [e for e in errors if "/v1/admin/pulls" not in e["message"]], errors  # the 404 logs its fetch


def test_page_needs_the_key(server):
    r = httpx.get(server.url + "/admin", timeout=30)
    assert r.status_code == 401
    assert httpx.get(server.url + "/admin?key=wrong", timeout=30).status_code == 401
    r = httpx.get(server.url + "/admin", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<script" in r.text and "http://" not in r.text and "https://" not in r.text  # nothing from outside
