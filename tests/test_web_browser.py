"""The web review and the search page in a real browser: headless Chromium from the distribution's packages
(``apt-get install chromium chromium-driver``; .ci/run installs them) driven by Selenium, typing keys and
checking the sheet on disk. Skipped, with the reason, when no browser or no selenium is installed.

``ENCODERKIT_SCREENSHOTS=docs/img`` saves the pages' screenshots there (audit-web.png, search-web.png) for
the docs; otherwise they go to the test's temporary folder (and are checked to be PNGs all the same).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from test_search_page import TOKEN, search_app

from encoderkit.label.sheet import read_sheet, write_sheet
from encoderkit.label.web import ReviewDesk, create_review_app

CHROMIUM = os.environ.get("ENCODERKIT_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("ENCODERKIT_CHROMEDRIVER", "/usr/bin/chromedriver")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                  "--window-size=1000,720")
REVIEWS = [("an engrossing, beautifully acted drama that stays with you", "positive", 0.58, 0.91),
           ("the plot is thin and the jokes never land", "positive", 0.61, 0.84),
           ("a tedious two hours; I checked my watch twice", "negative", 0.97, 0.12),
           ("witty, warm and <i>surprisingly</i> moving", "positive", 0.93, 0.05)]


@pytest.fixture
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        pytest.skip(f"no browser: {', '.join(missing)} not installed (apt-get install chromium chromium-driver; "
                    ".ci/run tries)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(check, what: str, timeout: float = 15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = check()
        except Exception:  # noqa: BLE001 - an element not there yet
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def screenshot(driver, tmp_path: Path, name: str) -> Path:
    folder = Path(os.environ.get("ENCODERKIT_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path


def press(driver, key: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).send_keys(key).perform()


def gold(sheet: Path) -> list[str]:
    return [r["gold"] for r in read_sheet(sheet)]


def test_review_page_keys_write_the_sheet_and_refusals_are_shown(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from encoderkit.deploy.serve import BackgroundServer

    sheet = tmp_path / "sheet.csv"
    write_sheet(sheet, [{"row": 40 + i, "text": t, "label": lab, "confidence": c, "suspicion": s,
                         "suspect": str(s > 0.5), "gold": ""} for i, (t, lab, c, s) in enumerate(REVIEWS)])
    app = create_review_app(ReviewDesk(sheet, ["negative", "positive"]), TOKEN)
    text = lambda: browser.find_element(By.ID, "text").text
    with BackgroundServer(app) as url:
        browser.get(url + "/")
        token = wait_for(lambda: browser.find_element(By.ID, "token").is_displayed()
                         and browser.find_element(By.ID, "token"),
                         "the token box")
        assert "type the token" in browser.find_element(By.ID, "msg").text
        assert "engrossing" not in browser.page_source  # no data before the token
        token.send_keys(TOKEN + Keys.ENTER)
        wait_for(lambda: "engrossing" in text(), "the first row")
        assert "suspicion 0.910" in browser.find_element(By.ID, "view").text

        press(browser, Keys.ENTER)                                          # accept
        wait_for(lambda: gold(sheet) == ["positive", "", "", ""], "Enter written to the sheet")
        wait_for(lambda: "plot is thin" in text(), "the second row")
        press(browser, "1")                                                  # correct to negative
        wait_for(lambda: gold(sheet) == ["positive", "negative", "", ""], "1 written to the sheet")
        wait_for(lambda: "tedious" in text(), "the third row")
        press(browser, "s")                                                  # skip
        wait_for(lambda: "surprisingly" in text(), "the fourth row")
        assert "<i>surprisingly</i>" in text()                               # shown as text, not markup
        press(browser, "u")                                                  # undo the correction
        wait_for(lambda: "plot is thin" in text(), "the undone row again")
        wait_for(lambda: gold(sheet) == ["positive", "", "", ""], "the undo written to the sheet")
        press(browser, "a")
        wait_for(lambda: gold(sheet) == ["positive", "positive", "", ""], "a written to the sheet")
        wait_for(lambda: "surprisingly" in text(), "the fourth row again (the third stays skipped)")
        assert "answered 2 of 4" in browser.find_element(By.ID, "progress").text
        assert "accuracy so far 1.000" in browser.find_element(By.ID, "progress").text
        screenshot(browser, tmp_path, "audit-web.png")

        # a second tab is a second reviewer: it gets the skipped row, never the one the first tab holds
        first = browser.current_window_handle
        browser.switch_to.new_window("tab")
        browser.get(url + "/")
        wait_for(lambda: browser.find_element(By.ID, "token").is_displayed(), "the token box in tab 2")
        browser.find_element(By.ID, "token").send_keys(TOKEN + Keys.ENTER)
        wait_for(lambda: "tedious" in text(), "tab 2 gets the row tab 1 does not hold")
        browser.switch_to.window(first)

        # the sheet edited by hand while the page shows row 43: the answer is refused and named, nothing written
        rows = read_sheet(sheet)
        rows[3]["text"] = "witty and warm (edited)"
        write_sheet(sheet, rows)
        press(browser, Keys.ENTER)
        msg = wait_for(lambda: browser.find_element(By.ID, "msg"), "the message")
        wait_for(lambda: "the text of row 43 is not the text shown" in msg.text, "the refusal on the page")
        assert msg.get_attribute("class") == "err" and "sheet.csv:5" in msg.text
        wait_for(lambda: "(edited)" in text(), "the row as it is now")
        assert gold(sheet) == ["positive", "positive", "", ""]


def test_search_page_asks_for_the_token_and_marks_the_query_terms(browser, tmp_path, tiny_tokenizer_dir,
                                                                  tmp_path_factory):
    from deploy_models import make_task_model, tiny_root
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from encoderkit.deploy.serve import BackgroundServer

    docs = {"py-intro": "Python is a programming language that lets you work quickly with data.",
            "py-data": "Load the data with Python, clean it, then plot it: a short tutorial.",
            "html": "Escaping matters: <script>alert(1)</script> must show as text, with python data.",
            "film": "A film about a man who loves his dog; the best story of the year.",
            "pasta": "Boil the pasta for nine minutes, then add the sauce."}
    embed_dir = make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")
    app, _ = search_app(tmp_path, embed_dir, docs=docs)
    with BackgroundServer(app) as url:
        browser.get(url + "/search")
        box = wait_for(lambda: browser.find_element(By.ID, "q"), "the search box")
        box.send_keys("python data")
        browser.find_element(By.ID, "bm25").click()
        box.send_keys(Keys.ENTER)
        token = wait_for(lambda: browser.find_element(By.ID, "token").is_displayed()
                         and browser.find_element(By.ID, "token"),
                         "the token box after a 401")
        token.send_keys(TOKEN + Keys.ENTER)
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#results .hit")) == 5, "five hits")
        marks = [m.text.lower() for m in browser.find_elements(By.CSS_SELECTOR, "#results mark")]
        assert set(marks) == {"python", "data"}
        texts = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#results .hit .text")]
        assert any("<script>alert(1)</script>" in t for t in texts)  # shown as text
        assert not browser.find_elements(By.CSS_SELECTOR, "#results script")
        assert browser.find_elements(By.CSS_SELECTOR, "#results .score")[0].text.replace(".", "").isdigit()
        screenshot(browser, tmp_path, "search-web.png")
