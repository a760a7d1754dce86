"""Drive a headless Chromium with Selenium to use the demo as a person would, and screenshot it.

Selenium (the ``dev`` extra) talks WebDriver to Debian's ``chromium-driver``; both binaries are found on
the PATH (``chromium``, ``chromedriver``) or through ``$FLOWRL_CHROMIUM`` / ``$FLOWRL_CHROMEDRIVER``, and
Selenium Manager is never asked to download anything. ``make install`` installs the two Debian packages
when they are missing. This is what the demo's screenshot test uses, and what makes the README image
(``docs/demo_compare.png``)::

    python app.py --port 7860 &
    python -m flowrl.demo.headless http://127.0.0.1:7860/ docs/demo_compare.png

:func:`capture_compare` opens the app, types prompts and seeds into Compare's form (or keeps its
defaults), clicks Generate, waits until the grid image and the reward tables are rendered, and saves a
screenshot of the whole page together with the grid's position in it, the grid image itself and the
text of the tables a user reads.
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from pathlib import Path

__all__ = ["ChromiumNotFound", "BrowserError", "find_chromium", "find_chromedriver", "open_browser", "open_page",
           "compare_in", "capture_compare", "main"]

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DRIVERS = ("chromedriver", "/usr/lib/chromium/chromedriver")
INSTALL_HINT = ("install Debian's browser and its driver with `apt-get install -y chromium chromium-driver` "
                "(`make install` does this), or set FLOWRL_CHROMIUM and FLOWRL_CHROMEDRIVER")


class ChromiumNotFound(RuntimeError):
    """No Chromium or no chromedriver on this machine (the message says how to install them)."""


class BrowserError(RuntimeError):
    """The browser could not open the page, or the page did not show what was awaited in time."""


def _find(explicit_env: str, candidates: tuple[str, ...]) -> str | None:
    explicit = os.environ.get(explicit_env)
    names = (explicit,) if explicit else candidates
    for name in names:
        found = shutil.which(name) or (name if Path(name).is_file() and os.access(name, os.X_OK) else None)
        if found:
            return found
    return None


def find_chromium() -> str | None:
    """The browser binary: ``$FLOWRL_CHROMIUM``, else the first of :data:`BROWSERS` on the PATH."""
    return _find("FLOWRL_CHROMIUM", BROWSERS)


def find_chromedriver() -> str | None:
    """The WebDriver binary: ``$FLOWRL_CHROMEDRIVER``, else ``chromedriver`` on the PATH."""
    return _find("FLOWRL_CHROMEDRIVER", DRIVERS)


def open_browser(*, width: int = 1280, height: int = 900, binary: str | None = None, driver: str | None = None):
    """A headless Chromium under Selenium with a ``width x height`` CSS-pixel viewport (scale factor 1).

    Raises:
        ChromiumNotFound: the browser or its driver is missing.
        BrowserError: they are there but do not start together (e.g. mismatched versions).
    """
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    binary = binary or find_chromium()
    driver = driver or find_chromedriver()
    if binary is None or driver is None:
        missing = "Chromium" if binary is None else "chromedriver"
        raise ChromiumNotFound(f"{missing} is not installed: {INSTALL_HINT}")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-extensions", "--disable-background-networking", "--disable-component-update",
                 "--hide-scrollbars", "--mute-audio", "--force-device-scale-factor=1",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    try:
        browser = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    except WebDriverException as err:
        raise BrowserError(f"Chromium ({binary}) did not start under {driver}: {' '.join(str(err.msg).split())[:300]}; "
                           "chromium and chromium-driver must be the same version") from None
    browser.set_window_size(width, height)
    return browser


# ---------------------------------------------------------------------------- the Compare tab

_GRID_IMG = "#compare-grid img"
_GRID_READY = """
const i = document.querySelector('#compare-grid img');
const m = document.querySelector('#compare-means');
const h = document.querySelector('#compare-hacking');
return !!(i && i.complete && i.naturalWidth > 0 && m && m.innerText.includes('mean')
          && h && h.innerText.includes('model'));
"""


def _wait(browser, condition, timeout: float, what: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(browser, timeout, poll_frequency=0.25).until(condition)
    except TimeoutException:
        raise BrowserError(f"timed out after {timeout:.0f} s waiting for {what}") from None


def _type_into(browser, selector: str, value: str) -> None:
    """Replace the text of the textbox in ``selector`` by typing, as a user would (Enter between lines: in
    Gradio's multi-line boxes Enter is a newline and Shift+Enter submits)."""
    from selenium.common.exceptions import NoSuchElementException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    try:
        box = browser.find_element(By.CSS_SELECTOR, f"{selector} textarea, {selector} input")
    except NoSuchElementException:
        raise BrowserError(f"no text box {selector} in the page") from None
    box.click()
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    for k, line in enumerate(value.split("\n")):
        if k:
            box.send_keys(Keys.ENTER)
        box.send_keys(line)


def _click(browser, element, timeout: float, what: str) -> None:
    """Click ``element`` once nothing covers it (Gradio lays a translucent status overlay over components while
    the page settles)."""
    from selenium.common.exceptions import ElementClickInterceptedException

    def attempt(_):
        try:
            element.click()
        except ElementClickInterceptedException:
            return False
        return True

    _wait(browser, attempt, timeout, f"{what} to be clickable")


def _set_models(browser, names, timeout: float = 60.0) -> None:
    """Tick exactly ``names`` in the Compare tab's model checkboxes (clicking their labels, as a user would)."""
    from selenium.webdriver.common.by import By

    labels = browser.find_elements(By.CSS_SELECTOR, "#compare-models label")
    offered = {label.text.strip(): label for label in labels}
    unknown = [n for n in names if n not in offered]
    if unknown:
        raise BrowserError(f"no model checkbox {', '.join(unknown)} in the page (offered: {', '.join(offered)})")
    for text, label in offered.items():
        box = label.find_element(By.CSS_SELECTOR, "input[type=checkbox]")
        if box.is_selected() != (text in names):
            _click(browser, label, timeout, f"the model checkbox {text!r}")


_CLIPS_READY = """
const imgs = Array.from(document.querySelectorAll('#compare-clips img'));
return imgs.length >= arguments[0] && imgs.every(i => i.complete && i.naturalWidth > 0);
"""
_FETCH_SRC = """
const done = arguments[arguments.length - 1];
fetch(arguments[0])
  .then(r => r.arrayBuffer())
  .then(b => { let s = ''; const a = new Uint8Array(b);
               for (let k = 0; k < a.length; k += 8192) s += String.fromCharCode.apply(null, a.subarray(k, k + 8192));
               done(btoa(s)); })
  .catch(e => done('error: ' + e));
"""


def _fetch(browser, src: str, what: str) -> bytes:
    data = browser.execute_async_script(_FETCH_SRC, src)
    if data.startswith("error:"):
        raise BrowserError(f"cannot read {what} back from the page ({data})")
    return base64.b64decode(data)


def compare_in(browser, *, prompts: str | None = None, seeds: str | None = None, models: list[str] | None = None,
               source: str | Path | None = None, steps: int | None = None, clips: int = 0, timeout: float = 180.0,
               screenshot: bool = True) -> dict:
    """One generation in the Compare tab of the page ``browser`` shows (:func:`open_browser`, then ``get(url)``).

    Args:
        prompts / seeds: typed into the form first (None: leave them).
        models: the models to tick, exactly (None: leave the selection).
        source: an image file to upload as the source of editing models (None: leave the upload box).
        steps: typed into the steps slider's number box (None: leave it).
        clips: wait for at least this many clips (GIFs of a video model) under the grid too.
        screenshot: grow the window to the page's height and screenshot it (``png`` in the result).

    Returns:
        ``{"png", "grid_rect", "grid_natural", "grid_png", "means_text", "table_text", "status_text", "hacking_text",
        "clips": [{"gif": bytes, "rect": (x, y, w, h), "natural": (w, h), "caption": text}], "source_shown": whether
        the source upload box shows an image}`` (see :func:`capture_compare`).

    Raises:
        BrowserError: a widget is missing, or the page did not render the results in time (with its messages).
    """
    from selenium.webdriver.common.by import By

    run = _wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#compare-run"), timeout,
                "the Compare tab's Generate button")[0]
    if models is not None:
        _set_models(browser, list(models), timeout)
    for selector, value in (("#compare-prompts", prompts), ("#compare-seeds", seeds)):
        if value is not None:
            _type_into(browser, selector, value)
    if steps is not None:
        from selenium.webdriver.common.keys import Keys

        boxes = browser.find_elements(By.CSS_SELECTOR, "#compare-steps input[type=number]")
        if not boxes:
            raise BrowserError("no steps box (#compare-steps) in the page")
        boxes[0].send_keys(Keys.CONTROL, "a")
        boxes[0].send_keys(str(steps), Keys.TAB)  # the slider takes the number when the box loses focus
    if source is not None:
        inputs = browser.find_elements(By.CSS_SELECTOR, "#compare-source input[type=file]")
        if not inputs:
            raise BrowserError("no source upload box (#compare-source) in the page: is an editing model offered?")
        inputs[0].send_keys(str(Path(source).resolve()))
        _wait(browser, lambda b: b.execute_script(
            "const i = document.querySelector('#compare-source img'); return !!(i && i.complete && i.naturalWidth);"),
            timeout, "the uploaded source image's preview")
    # A fresh result replaces the grid: remember the old one so that it is not mistaken for the new.
    before = browser.execute_script("const i = document.querySelector('#compare-grid img'); return i ? i.src : '';")
    time.sleep(0.3)  # the UI registers the last keystrokes before the click
    run.click()
    ready = lambda b: b.execute_script(_GRID_READY) and b.execute_script(  # noqa: E731
        "const i = document.querySelector('#compare-grid img'); return i.src !== arguments[0];", before) and (
        not clips or b.execute_script(_CLIPS_READY, clips))
    try:
        _wait(browser, ready, timeout, "the Compare grid and its reward table" + (" and clips" if clips else ""))
    except BrowserError as err:
        toast = browser.execute_script("return Array.from(document.querySelectorAll('.toast-body, "
                                       "[data-testid=\"toast-body\"]')).map(e => e.innerText).join(' | ')")
        raise BrowserError(f"{err}; messages in the page: {toast or 'none'}") from None
    grid = browser.find_element(By.CSS_SELECTOR, _GRID_IMG)
    png = None
    if screenshot:
        width = browser.get_window_size()["width"]
        page_height = int(browser.execute_script("return Math.ceil(document.documentElement.scrollHeight)"))
        browser.set_window_size(width, max(browser.get_window_size()["height"], min(page_height, 4000)))
        time.sleep(0.3)  # one layout pass at the new size
        browser.execute_script("window.scrollTo(0, 0)")
        png = browser.get_screenshot_as_png()
    rect_of = lambda e: tuple(round(v) for v in browser.execute_script(  # noqa: E731
        "const r = arguments[0].getBoundingClientRect(); "
        "return [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height];", e))
    natural_of = lambda e: tuple(browser.execute_script(  # noqa: E731
        "return [arguments[0].naturalWidth, arguments[0].naturalHeight];", e))
    text = lambda selector: browser.execute_script(  # noqa: E731
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : '';", selector)
    shown = []
    for img in browser.find_elements(By.CSS_SELECTOR, "#compare-clips img"):
        caption = browser.execute_script(
            "const b = arguments[0].closest('button, .thumbnail-item, .gallery-item'); "
            "return b ? b.innerText : '';", img)
        shown.append({"gif": _fetch(browser, img.get_attribute("src"), "a clip"), "rect": rect_of(img),
                      "natural": natural_of(img), "caption": caption})
    return {"png": png, "grid_rect": rect_of(grid), "grid_natural": natural_of(grid),
            "grid_png": _fetch(browser, grid.get_attribute("src"), "the grid image"),
            "means_text": text("#compare-means"), "table_text": text("#compare-table"),
            "status_text": text("#compare-status"), "hacking_text": text("#compare-hacking"), "clips": shown,
            "source_shown": bool(browser.execute_script(
                "const i = document.querySelector('#compare-source img'); return !!(i && i.naturalWidth);"))}


def open_page(url: str, *, timeout: float = 180.0, width: int = 1280, height: int = 900, binary: str | None = None,
              driver: str | None = None):
    """A headless browser (:func:`open_browser`) showing the app at ``url``; the caller quits it."""
    browser = open_browser(width=width, height=height, binary=binary, driver=driver)
    try:
        browser.set_page_load_timeout(timeout)
        browser.set_script_timeout(60)
        try:
            browser.get(url)
        except Exception as err:  # noqa: BLE001 - WebDriver wraps connection failures in several types
            raise BrowserError(f"cannot open {url}: "
                               f"{' '.join(str(getattr(err, 'msg', None) or err).split())[:200]}") from None
    except BaseException:
        browser.quit()
        raise
    return browser


def capture_compare(url: str, out: str | Path | None = None, *, prompts: str | None = None,
                    seeds: str | None = None, timeout: float = 180.0, width: int = 1280, height: int = 900,
                    binary: str | None = None, driver: str | None = None) -> dict:
    """Run one generation in the Compare tab of the app at ``url`` and screenshot the page.

    Args:
        url: the app's address.
        out: where to write the PNG (None: do not write).
        prompts / seeds: typed into the form first (None: the form's defaults).
        timeout: seconds for the page to load and for the generation to finish.
        width / height: the viewport (the screenshot grows to the page's height, up to 4000 px).

    Returns:
        ``{"png": screenshot bytes, "grid_rect": (x, y, w, h) of the grid image in the screenshot's pixels,
        "grid_natural": (w, h) of the grid image, "grid_png": the grid image's own bytes, "means_text": the
        mean-reward table's text, "table_text": the per-image table's text, "status_text": the status line,
        "hacking_text": the reward-hacking panel's text, "clips": the video clips shown under the grid}``
        (:func:`compare_in`).

    Raises:
        ChromiumNotFound: no browser; BrowserError: the page did not render the grid in time.
    """
    browser = open_page(url, timeout=timeout, width=width, height=height, binary=binary, driver=driver)
    try:
        info = compare_in(browser, prompts=prompts, seeds=seeds, timeout=timeout)
    finally:
        browser.quit()
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_bytes(info["png"])
    return info


def main(argv: list[str] | None = None) -> int:
    """``python -m flowrl.demo.headless URL OUT.png [--prompts TEXT] [--seeds S]``."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m flowrl.demo.headless",
                                     description="Screenshot the demo's Compare tab after one generation.")
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--prompts", default=None, help="prompts typed in first (use \\n between lines)")
    parser.add_argument("--seeds", default=None)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    prompts = args.prompts.replace("\\n", "\n") if args.prompts else None
    try:
        info = capture_compare(args.url, args.out, prompts=prompts, seeds=args.seeds, timeout=args.timeout,
                               width=args.width)
    except (ChromiumNotFound, BrowserError) as err:
        print(f"headless: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (grid at {info['grid_rect']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
