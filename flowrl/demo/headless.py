"""Drive a headless Chromium over the DevTools protocol with the standard library only.

Chromium's ``--remote-debugging-pipe`` speaks the DevTools protocol (CDP) over two inherited file
descriptors (3: commands in, 4: events and replies out; NUL-terminated JSON), so no websocket client, no
Node and no Playwright are needed. This is what the demo's screenshot test uses, and what makes the README
image (``docs/demo_compare.png``)::

    python app.py --port 7860 &
    python -m flowrl.demo.headless http://127.0.0.1:7860/ docs/demo_compare.png

:func:`capture_compare` opens the app, clicks Compare's Generate button (with the form's defaults, or
prompts and seeds it types in first), waits until the grid image and the reward table are rendered, and
saves a screenshot of the page together with the grid's position in it and the page's text.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["ChromiumNotFound", "CDPError", "find_chromium", "Chromium", "capture_compare", "main"]

CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class ChromiumNotFound(RuntimeError):
    """No Chromium binary: install one (Debian: ``apt-get install -y chromium``) or set FLOWRL_CHROMIUM."""


class CDPError(RuntimeError):
    """A DevTools command failed, timed out, or the browser went away."""


def find_chromium() -> str | None:
    """The Chromium binary: ``$FLOWRL_CHROMIUM``, else the first of :data:`CANDIDATES` that exists."""
    explicit = os.environ.get("FLOWRL_CHROMIUM")
    if explicit:
        return explicit if shutil.which(explicit) or Path(explicit).is_file() else None
    for name in CANDIDATES:
        found = shutil.which(name) or (name if Path(name).is_file() and os.access(name, os.X_OK) else None)
        if found:
            return found
    return None


class Chromium:
    """A headless Chromium with one page, driven over ``--remote-debugging-pipe``.

    Args:
        binary: the executable (default :func:`find_chromium`).
        width / height: the viewport in CSS px (device scale factor 1).
        timeout: default seconds to wait for one command.

    Use as a context manager; :meth:`close` shuts the browser down and removes its profile.
    """

    def __init__(self, binary: str | None = None, *, width: int = 1280, height: int = 900, timeout: float = 60.0):
        binary = binary or find_chromium()
        if binary is None:
            raise ChromiumNotFound("Chromium is not installed: `apt-get install -y chromium` (Debian) or set "
                                   "FLOWRL_CHROMIUM to a Chromium/Chrome binary")
        self.timeout = timeout
        self.width, self.height = width, height
        self._profile = tempfile.mkdtemp(prefix="flowrl-chromium-")
        self._log = open(Path(self._profile) / "stderr.log", "wb")  # noqa: SIM115 (closed in close())
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # The child must find the pipes at fds 3 and 4. Move our ends out of the way (>= 10) so that the
        # redirections cannot clobber one with the other, and let bash (dash takes one-digit fds only) move
        # them into place before it execs Chromium; no preexec_fn (unsafe in a process with threads).
        a = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
        b = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
        os.close(to_child_r)
        os.close(from_child_w)
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--mute-audio",
            "--force-device-scale-factor=1", f"--window-size={width},{height}", "--remote-debugging-pipe",
            f"--user-data-dir={self._profile}", "about:blank",
        ]
        script = 'exec "$0" "$@" 3<&%d 4>&%d %d<&- %d>&-' % (a, b, a, b)
        try:
            self._proc = subprocess.Popen([shutil.which("bash") or "/bin/bash", "-c", script, binary, *flags],
                                          pass_fds=(a, b), stdin=subprocess.DEVNULL, stdout=self._log,
                                          stderr=self._log)
        except OSError:
            for fd in (a, b, to_child_w, from_child_r):
                os.close(fd)
            self._log.close()
            shutil.rmtree(self._profile, ignore_errors=True)
            raise
        os.close(a)
        os.close(b)
        self._out = to_child_w
        self._in = from_child_r
        self._buffer = b""
        self._next_id = 0
        self._session: str | None = None
        try:
            target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
            self._session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                      session=False)["sessionId"]
            self.send("Page.enable")
            self.send("Runtime.enable")
            self.send("Emulation.setDeviceMetricsOverride",
                      {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ protocol

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CDPError("timed out waiting for Chromium")
            ready, _, _ = select.select([self._in], [], [], min(left, 1.0))
            if not ready:
                if self._proc.poll() is not None:
                    raise CDPError(f"Chromium exited with code {self._proc.returncode}: {self.stderr_tail()}")
                continue
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise CDPError(f"Chromium closed the DevTools pipe: {self.stderr_tail()}")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, *, session: bool = True,
             timeout: float | None = None) -> dict:
        """Send one command and return its ``result`` (events in between are dropped)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self._session:
            message["sessionId"] = self._session
        data = json.dumps(message).encode() + b"\0"
        try:
            while data:
                data = data[os.write(self._out, data):]
        except OSError as err:
            raise CDPError(f"cannot talk to Chromium ({err}): {self.stderr_tail()}") from None
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error'].get('message')} {reply['error'].get('data', '')}")
                return reply.get("result", {})

    def stderr_tail(self, chars: int = 600) -> str:
        try:
            self._log.flush()
            text = (Path(self._profile) / "stderr.log").read_text(errors="replace")
        except OSError:
            return ""
        return " ".join(text[-chars:].split())

    # ------------------------------------------------------------------ page helpers

    def navigate(self, url: str) -> None:
        result = self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CDPError(f"cannot open {url}: {result['errorText']}")

    def evaluate(self, expression: str, *, timeout: float | None = None):
        """The value of a JavaScript expression in the page (promises are awaited)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, timeout=timeout)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CDPError(f"JavaScript error: {text}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, *, timeout: float, what: str, poll: float = 0.25):
        """Poll ``expression`` until it is truthy; returns its value.

        Raises:
            CDPError: still falsy after ``timeout`` seconds (the message says what was awaited).
        """
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise CDPError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(poll)

    def screenshot(self, path: str | Path | None = None, *, full_page: bool = True) -> bytes:
        """A PNG of the viewport, or of the whole page (the viewport grows to the page's height)."""
        if full_page:
            height = int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)") or self.height)
            self.send("Emulation.setDeviceMetricsOverride",
                      {"width": self.width, "height": max(self.height, min(height, 4000)), "deviceScaleFactor": 1,
                       "mobile": False})
            time.sleep(0.3)  # one layout pass at the new size
        data = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(data)
        return data

    def close(self) -> None:
        try:
            if self._proc.poll() is None:
                try:
                    self.send("Browser.close", session=False, timeout=5)
                except CDPError:
                    pass
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=10)
        finally:
            for fd in (getattr(self, "_out", None), getattr(self, "_in", None)):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._out = self._in = None
            self._log.close()
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------- the Compare tab

_BUTTON = "(() => { const e = document.querySelector('#compare-run'); if (!e) return null; " \
          "return e.tagName === 'BUTTON' ? e : e.querySelector('button'); })()"
_GRID_IMG = "document.querySelector('#compare-grid img')"

_SET_TEXT = """
((selector, value) => {
  const root = document.querySelector(selector);
  const box = root && (root.matches('textarea, input') ? root : root.querySelector('textarea, input'));
  if (!box) return false;
  const proto = box.tagName === 'TEXTAREA' ? HTMLTextAreaElement.prototype : HTMLInputElement.prototype;
  Object.getOwnPropertyDescriptor(proto, 'value').set.call(box, value);
  box.dispatchEvent(new Event('input', { bubbles: true }));
  box.dispatchEvent(new Event('change', { bubbles: true }));
  return true;
})(%s, %s)
"""


def capture_compare(url: str, out: str | Path | None = None, *, prompts: str | None = None,
                    seeds: str | None = None, timeout: float = 180.0, width: int = 1280, height: int = 900,
                    binary: str | None = None) -> dict:
    """Run one generation in the Compare tab of the app at ``url`` and screenshot the page.

    Args:
        url: the app's address.
        out: where to write the PNG (None: do not write).
        prompts / seeds: typed into the form first (None: the form's defaults).
        timeout: seconds for the page to load and for the generation to finish.
        width / height: the viewport.

    Returns:
        ``{"png": bytes, "grid_rect": (x, y, w, h) of the grid image in the screenshot's pixels,
        "grid_natural": (w, h) of the grid image itself, "means_text": the mean-reward table's text,
        "status_text": the status line}``.

    Raises:
        ChromiumNotFound: no browser; CDPError: the page did not render the grid in time.
    """
    with Chromium(binary, width=width, height=height, timeout=max(60.0, timeout / 2)) as browser:
        browser.navigate(url)
        browser.wait_for(f"{_BUTTON} !== null", timeout=timeout, what="the Compare tab's Generate button")
        for selector, value in (("#compare-prompts", prompts), ("#compare-seeds", seeds)):
            if value is not None and not browser.evaluate(_SET_TEXT % (json.dumps(selector), json.dumps(value))):
                raise CDPError(f"no text box {selector} in the page")
        time.sleep(0.3)  # let the UI register the edits before the click
        browser.evaluate(f"{_BUTTON}.click()")
        grid_ready = (f"(() => {{ const i = {_GRID_IMG}; const m = document.querySelector('#compare-means'); "
                      "return !!(i && i.complete && i.naturalWidth > 0 && m && m.innerText.includes('mean')); })()")
        try:
            browser.wait_for(grid_ready, timeout=timeout, what="the Compare grid and its reward table")
        except CDPError as err:
            toast = browser.evaluate("Array.from(document.querySelectorAll('.toast-body, [data-testid=\"toast-body\"]'))"
                                     ".map(e => e.innerText).join(' | ')")
            raise CDPError(f"{err}; messages in the page: {toast or 'none'}") from None
        browser.evaluate(f"{_GRID_IMG}.scrollIntoView({{block: 'center'}})")
        png = browser.screenshot(out, full_page=True)
        rect = browser.evaluate(f"(() => {{ const r = {_GRID_IMG}.getBoundingClientRect(); "
                                "return [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height]; })()")
        natural = browser.evaluate(f"[{_GRID_IMG}.naturalWidth, {_GRID_IMG}.naturalHeight]")
        means = browser.evaluate("document.querySelector('#compare-means').innerText")
        status = browser.evaluate("(document.querySelector('#compare-status') || {innerText: ''}).innerText")
    return {"png": png, "grid_rect": tuple(round(v) for v in rect), "grid_natural": tuple(natural),
            "means_text": means, "status_text": status}


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
    except (ChromiumNotFound, CDPError) as err:
        print(f"headless: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (grid at {info['grid_rect']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
