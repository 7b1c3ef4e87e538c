"""TensorBoard as a user opens it: a TensorBoard server on 127.0.0.1 and headless Chromium driven through the Chrome
DevTools Protocol (``websocket-client``), reading the rendered page (through the shadow roots TensorBoard's
dashboards draw into) and taking screenshots.

Chromium comes from the distribution's packages (`ensure_chromium` installs it with apt-get where it can, as root);
where it cannot, the caller skips with the reason it returns.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from tests.launcher import free_port

NAMES = ("chromium", "chromium-browser", "google-chrome")
DEEP_TEXT = """(() => { const out = [];
  const walk = (node) => { if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.childNodes) { if (child.nodeType === 3) out.push(child.textContent); else walk(child); } };
  walk(document.body); return out.join(' ').replace(/\\s+/g, ' '); })()"""
DEEP_IMAGES = """(() => { let shown = 0;
  const walk = (node) => { if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.children || []) { if (child.tagName === 'IMG' && child.complete && child.naturalWidth > 0)
      shown += 1; walk(child); } };
  walk(document.body); return shown; })()"""


def ensure_chromium() -> tuple[str | None, str]:
    """The browser's path, or None and why there is none."""
    found = next((shutil.which(name) for name in NAMES if shutil.which(name)), None)
    if found:
        return found, ""
    if not shutil.which("apt-get") or os.geteuid() != 0:
        return None, "no Chromium and no apt-get run as root to install it (`apt-get install chromium`)"
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if done.returncode != 0:
            return None, f"`{' '.join(command)}` failed: {(done.stdout + done.stderr)[-500:]}"
    found = next((shutil.which(name) for name in NAMES if shutil.which(name)), None)
    return found, "" if found else "apt-get installed chromium but no browser binary is on PATH"


def _wait_for(url: str, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return answer.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@contextmanager
def tensorboard(logdir: Path, timeout: float = 90):
    """A TensorBoard server on 127.0.0.1 (never another interface), stopped on leaving; yields its URL."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
                               "--port", str(port), "--reload_interval", "0"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        _wait_for(f"http://127.0.0.1:{port}/data/runs", timeout)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


class Browser:
    """One headless Chromium page, driven over the DevTools Protocol."""

    def __init__(self, binary: str, profile: Path, width: int = 1600, height: int = 1200) -> None:
        import websocket

        port = free_port()
        self.process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--remote-debugging-port={port}", f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            pages = json.loads(_wait_for(f"http://127.0.0.1:{port}/json/list", 60))
            page = next(p for p in pages if p.get("type") == "page")
            self.socket = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        except Exception:
            self.process.kill()
            raise
        self._ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        number = next(self._ids)
        self.socket.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def open(self, url: str, ready, timeout: float = 60) -> str:
        """Go to ``url`` and wait until ``ready(text)`` holds for the rendered text; returns that text."""
        self.call("Page.navigate", url=url)
        deadline, text = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            time.sleep(1)
            text = self.evaluate(DEEP_TEXT) or ""
            if ready(text):
                time.sleep(2)  # let the last charts and images finish drawing
                return self.evaluate(DEEP_TEXT) or ""
        return text

    def images_shown(self) -> int:
        return int(self.evaluate(DEEP_IMAGES) or 0)

    def screenshot(self, path: Path) -> Path:
        height = self.evaluate("Math.max(document.body.scrollHeight, 1200)")
        self.call("Emulation.setDeviceMetricsOverride", width=1600, height=min(int(height), 4000), deviceScaleFactor=1,
                  mobile=False)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        self.socket.close()
        self.process.terminate()
        self.process.wait(timeout=30)
