"""`perdure web` in a real browser: headless Debian Chromium driven by Selenium through Debian's chromedriver.

Opens the runs page, filters and sorts, selects two runs and checks that both curves are drawn on the loss chart (by
their colours on the canvas), moves a media slider and checks the image changes, follows a run's link to its page,
and reads the browser's console: no errors. Screenshots go to the test's tmp dir (and, when PERDURE_WEB_SCREENSHOTS
names a directory, there too: that is how docs/web-*.png are made). Nothing is downloaded: without a Chromium and a
chromedriver on PATH the test is skipped with the command that installs them (`.ci/run` does).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.web.client import HOSTILE_TAG

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
WIDTH = 1600

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no Chromium found: apt-get install chromium chromium-driver (.ci/run installs them)",
)

# Pixels of each colour drawn on a chart's canvas (channels within a tolerance, for anti-aliasing).
COUNT_COLOUR = """
const [selector, hex] = arguments;
const canvas = document.querySelector(selector);
const rgb = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
let count = 0;
for (let i = 0; i < data.length; i += 4) {
  if (Math.abs(data[i] - rgb[0]) < 30 && Math.abs(data[i + 1] - rgb[1]) < 30 && Math.abs(data[i + 2] - rgb[2]) < 30) {
    count += 1;
  }
}
return count;
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tmp_path_factory.mktemp("chromium-profile")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run"):
        options.add_argument(argument)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={WIDTH},1200")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, condition, what: str, timeout: float = 30):
    # The runs table is drawn again at each poll (every 5 s): an element found just before may be gone; look again.
    waiting = WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,))
    return waiting.until(lambda d: condition(d), message=f"waiting for {what}")


def row(driver, run_id: str):
    return driver.find_element(By.CSS_SELECTOR, f'tr[data-id="{run_id}"]')


def visible_ids(driver) -> list[str]:
    return [tr.get_attribute("data-id") for tr in driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr[data-id]")]


def select_run(driver, run_id: str) -> None:
    wait(driver, lambda d: row(d, run_id).find_element(By.CSS_SELECTOR, "input.select").click() or True, "a click")
    wait(driver, lambda d: "selected" in row(d, run_id).get_attribute("class"), f"{run_id} selected")


def screenshot(driver, tmp_path: Path, name: str) -> Path:
    """A full-page screenshot: the window is grown to the page's height first."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(WIDTH, min(max(height + 140, 800), 4000))
    time.sleep(0.5)  # let the charts follow the resize
    path = tmp_path / name
    driver.save_screenshot(str(path))
    if os.environ.get("PERDURE_WEB_SCREENSHOTS"):
        shutil.copy(path, Path(os.environ["PERDURE_WEB_SCREENSHOTS"]) / name)
    driver.set_window_size(WIDTH, 1200)
    return path


def shows(driver, selector: str, name: str) -> bool:
    return driver.find_element(By.CSS_SELECTOR, selector).get_attribute("src").endswith("/" + name)


def console_errors(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_browse_compare_step_through_images_and_open_a_run(web_workspace, browser, tmp_path):
    ids, d = web_workspace.ids, browser
    d.get(web_workspace.url + "/")
    wait(d, lambda d: len(visible_ids(d)) == 6, "six runs in the table")

    # A hostile tag is shown as text, not parsed as HTML.
    tags = [span.text for span in row(d, ids["baseline"]).find_elements(By.CSS_SELECTOR, ".tag")]
    assert tags == [HOSTILE_TAG, "sweep"]
    assert d.execute_script("return document.querySelectorAll('img[src=\"x\"]').length + (window.__pwned || 0)") == 0

    # Filter by text, status and tag; sort by a column.
    d.find_element(By.ID, "filter-text").send_keys("wide")
    wait(d, lambda d: visible_ids(d) == [ids["wide"]], "the text filter")
    d.find_element(By.ID, "filter-text").send_keys(Keys.BACKSPACE * len("wide"))
    Select(d.find_element(By.ID, "filter-status")).select_by_value("failed")
    wait(d, lambda d: visible_ids(d) == [ids["crash"]], "the status filter")
    Select(d.find_element(By.ID, "filter-status")).select_by_value("")
    Select(d.find_element(By.ID, "filter-tag")).select_by_value("sweep")
    wait(d, lambda d: sorted(visible_ids(d)) == sorted([ids["baseline"], ids["wide"]]), "the tag filter")
    Select(d.find_element(By.ID, "filter-tag")).select_by_value("")
    d.find_element(By.CSS_SELECTOR, 'th[data-key="lineage"]').click()
    expected = [ids[lineage] for lineage in sorted(ids)]
    wait(d, lambda d: visible_ids(d) == expected, "rows sorted by lineage")

    # Two runs selected: two curves on the loss chart, each drawn in its own colour.
    select_run(d, ids["baseline"])
    select_run(d, ids["wide"])
    loss_chart = '.chart[data-metric="train/loss"] canvas'
    series = (
        "return (window.perdureCharts['train/loss'] || {series: []}).series"
        ".map((s) => [s.label, typeof s.stroke === 'function' ? s.stroke() : s.stroke])"
    )
    wait(d, lambda d: len(d.execute_script(series)) == 3, "a loss chart with two runs")
    (_, first), (_, second) = [pair for pair in d.execute_script(series)[1:]]
    labels = [label for label, _ in d.execute_script(series)[1:]]
    assert labels == [ids["baseline"], ids["wide"]]
    for colour in (first, second):
        assert d.execute_script(COUNT_COLOUR, loss_chart, colour) > 100, f"no curve drawn in {colour}"
    legend = d.find_element(By.CSS_SELECTOR, '.chart[data-metric="train/loss"] .u-legend').text
    assert ids["baseline"] in legend and ids["wide"] in legend
    for metric in ("val/loss", "train/lr", "train/steps_per_s"):
        assert d.find_elements(By.CSS_SELECTOR, f'.chart[data-metric="{metric}"]'), metric

    # The run with images: a panel per tag, a slider per panel; moving it changes the image.
    select_run(d, ids["images"])
    panel = '.media-panel[data-tag="samples/pattern"]'
    image = f'{panel} .media-row[data-run="{ids["images"]}"] img'
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, image), "the image panel")
    assert d.find_elements(By.CSS_SELECTOR, '.media-panel[data-tag="weights/layer0"]')
    loaded = "const img = document.querySelector(arguments[0]); return img.complete && img.naturalWidth"
    wait(d, lambda d: d.execute_script(loaded, image) == 24, "the newest image")
    before = d.find_element(By.CSS_SELECTOR, image)
    assert before.get_attribute("src").endswith("/00000025_0.png")
    pixels_before = before.screenshot_as_png
    slider = d.find_element(By.CSS_SELECTOR, f"{panel} input[type=range]")
    slider.click()
    slider.send_keys(Keys.HOME)
    wait(d, lambda d: shows(d, image, "00000000_0.png"), "step 0")
    wait(d, lambda d: d.execute_script(loaded, image) == 24, "the step-0 image")
    assert d.find_element(By.CSS_SELECTOR, f"{panel} .step-label").text.startswith("step 0")
    assert d.find_element(By.CSS_SELECTOR, image).screenshot_as_png != pixels_before
    slider.send_keys(Keys.ARROW_RIGHT)
    wait(d, lambda d: shows(d, image, "00000005_0.png"), "step 5")
    slider.send_keys(Keys.END)
    wait(d, lambda d: shows(d, image, "00000025_0.png"), "step 25")
    screenshot(d, tmp_path, "web-runs.png")

    # A running run's curve grows while the page is open (the page polls every 5 s).
    select_run(d, ids["live"])
    points = (
        "const u = window.perdureCharts['train/loss']; const i = u.series.findIndex((s) => s.label === arguments[0]);"
        "return i < 0 ? 0 : u.data[i].filter((v) => v !== null).length"
    )
    wait(d, lambda d: d.execute_script(points, ids["live"]) > 0, "the live run's curve")
    first_count = d.execute_script(points, ids["live"])
    wait(d, lambda d: d.execute_script(points, ids["live"]) > first_count, "the live curve to grow", timeout=40)

    # The run page: facts, checkpoints verified, attempts, config diff, git, log tail.
    row(d, ids["baseline"]).find_element(By.CSS_SELECTOR, "td.id a").click()
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#checkpoint-list tbody tr"), "the run page")
    assert ids["baseline"] in d.find_element(By.ID, "title").text
    rows = "return [...document.querySelectorAll('#checkpoint-list tbody tr')].map((tr) => tr.textContent)"
    # Sizes are compared at once, checksums in the background: the page refreshes until they are through.
    wait(d, lambda d: all("\u2713 checksums" in row for row in d.execute_script(rows)), "checksums verified")
    assert len(d.execute_script(rows)) == 3
    assert "budget reached" in d.find_element(By.ID, "attempt-list").text
    goodput = d.find_element(By.ID, "goodput-list").text
    assert "of the run's wall time trained the model" in goodput and "checkpoint_stall" in goodput
    assert "steps" in d.find_element(By.ID, "config-body").text
    assert "commit" in d.find_element(By.ID, "git-body").text
    wait(d, lambda d: "finished at step 30" in d.find_element(By.ID, "log-text").text, "the log tail")
    wait(d, lambda d: len(d.execute_script(series)) == 2, "the run's own loss curve")
    screenshot(d, tmp_path, "web-run.png")

    assert console_errors(d) == []
    assert (tmp_path / "web-runs.png").stat().st_size > 10_000 and (tmp_path / "web-run.png").stat().st_size > 10_000
