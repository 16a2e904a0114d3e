"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages ended by NUL on file descriptors 3 and 4), for the job view's browser tests.

No Playwright, no WebDriver, no websocket client: the standard library and the system's
``chromium``. :func:`chromium_or_skip` names why a machine cannot run the tests (no
browser installed: ``make browser`` installs the Debian package where apt-get exists).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

__all__ = ["Chromium", "chromium_or_skip"]

#: where the tests look for the browser (the Debian package's path), then $PATH
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


def chromium_or_skip() -> str:
    """The browser's path, or skip the test naming why there is none."""
    for path in CHROMIUM_PATHS:
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    pytest.skip("no headless Chromium: /usr/bin/chromium is missing (`make browser` installs "
                "it with apt-get; CI runs these tests)")


class Chromium:
    """One headless browser with one page. ``evaluate`` runs JavaScript in the page,
    ``wait_for`` polls an expression until it is truthy, ``screenshot`` writes a PNG."""

    def __init__(self, path: str, *, width: int = 1400, height: int = 900) -> None:
        self._profile = tempfile.mkdtemp(prefix="eventbus-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        args = [path, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-extensions",
                "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
                f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
                "--remote-debugging-pipe", "about:blank"]
        # the browser reads commands on fd 3 and answers on fd 4
        shell = f'exec 3<&{to_browser_r} 4>&{from_browser_w}; exec "$@"'
        self.proc = subprocess.Popen(["bash", "-c", shell, "chromium", *args],
                                     pass_fds=(to_browser_r, from_browser_w),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._buffer = b""
        self._lock = threading.Lock()
        self.session = ""
        try:
            self._attach()
        except BaseException:
            self.close()
            raise

    # -- protocol ---------------------------------------------------------------------------
    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer in time")
            import select

            ready, _, _ = select.select([self._from_browser], [], [], 0.5)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe (it exited?)")
                self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        message: dict[str, Any] = json.loads(raw)
        return message

    def send(self, method: str, params: dict[str, Any] | None = None, *,
             session: bool = True, timeout: float = 30.0) -> dict[str, Any]:
        """Send one command and return its result (raises on a protocol error)."""
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
            if session and self.session:
                message["sessionId"] = self.session
            os.write(self._to_browser, json.dumps(message).encode() + b"\0")
            deadline = time.monotonic() + timeout
            while True:
                answer = self._read_message(deadline)
                if answer.get("id") != ident:
                    continue  # an event, or an answer nobody waits for
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                result: dict[str, Any] = answer.get("result", {})
                return result

    def _attach(self) -> None:
        targets = self.send("Target.getTargets", session=False, timeout=60.0)
        pages = [t for t in targets["targetInfos"] if t["type"] == "page"]
        if pages:
            target = pages[0]["targetId"]
        else:
            target = self.send("Target.createTarget", {"url": "about:blank"},
                               session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")

    # -- what the tests use ---------------------------------------------------------------
    def goto(self, url: str) -> None:
        """Navigate (returns once the navigation started; use :meth:`wait_for`)."""
        self.send("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (JSON-able values only)."""
        result = self.send("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, *, timeout: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; its value, or TimeoutError naming it."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError as exc:  # the page is not there yet (still navigating)
                value = exc
            else:
                if value:
                    return value
            time.sleep(0.2)
        raise TimeoutError(f"{expression!r} still {value!r} after {timeout:g} s")

    def screenshot(self, path: Path) -> None:
        """A PNG of the whole page at ``path``."""
        metrics = self.send("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        data = self.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"],
                     "scale": 1}})["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        """End the browser (and its helper processes) and remove its profile."""
        with contextlib.suppress(OSError):
            os.close(self._to_browser)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        # the browser's helpers (renderer, GPU, zygote) may outlive the browser: the whole
        # session goes, whether the browser ended by itself or not
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            os.close(self._from_browser)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
