"""Headless Chromium (Debian's package) over the DevTools protocol: a page, its console errors, JavaScript, screenshots."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest

# Without these a headless Chromium here phones home (updates, sync, field trials) and those calls
# fail loudly; a fresh profile keeps one test's state out of the next.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000")


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def need_chromium() -> str:
    """The browser, or a skip on a developer machine without it; CI installs it (.ci/run), so
    there a missing browser fails."""
    path = chromium_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium not installed (apt-get install -y chromium chromium-driver)")
    return path


class Page:
    """One browser with one page; `errors` holds every console error and uncaught exception."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.profile = tempfile.mkdtemp(prefix="tuner-chromium-")
        self.proc = subprocess.Popen(
            [need_chromium(), *FLAGS, f"--user-data-dir={self.profile}",
             "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.loop = asyncio.new_event_loop()
        self.errors: list[str] = []
        self.events: list[dict] = []
        self._id = 0
        self._pending: dict[int, asyncio.Future] = {}
        try:
            self.loop.run_until_complete(self._connect())
        except BaseException:
            self.close()
            raise

    # -- protocol

    async def _connect(self) -> None:
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout_s
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not open its DevTools port")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().splitlines()[0])
        self.session = aiohttp.ClientSession()
        while True:
            async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
                pages = [t for t in await r.json() if t.get("type") == "page"]
            if pages:
                break
            await asyncio.sleep(0.1)
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self.reader = self.loop.create_task(self._read())
        for domain in ("Page", "Runtime", "Log"):
            await self._send(f"{domain}.enable")

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
                continue
            self.events.append(data)
            method, params = data.get("method"), data.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = params["exceptionDetails"]
                self.errors.append("exception: " + d.get("exception", {}).get("description", d.get("text", "")))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                self.errors.append("console: " + " ".join(str(a.get("value", a.get("description")))
                                                          for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                e = params["entry"]
                self.errors.append(f"log: {e.get('text')} {e.get('url', '')}")

    async def _send(self, method: str, **params) -> dict:
        self._id += 1
        fut = self.loop.create_future()
        self._pending[self._id] = fut
        await self.ws.send_str(json.dumps({"id": self._id, "method": method, "params": params}))
        answer = await asyncio.wait_for(fut, self.timeout_s)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def send(self, method: str, **params) -> dict:
        return self.loop.run_until_complete(self._send(method, **params))

    # -- what a test does

    def open(self, url: str) -> None:
        """Navigate and wait for the load event, then a moment for scripts run at load."""
        start = len(self.events)
        self.send("Page.navigate", url=url)

        async def loaded():
            while not any(e.get("method") == "Page.loadEventFired" for e in self.events[start:]):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)

        self.loop.run_until_complete(asyncio.wait_for(loaded(), self.timeout_s))

    def eval(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able results only)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """The whole page as PNG (full height, not just the window)."""
        height = int(self.eval("document.documentElement.scrollHeight"))
        self.send("Emulation.setDeviceMetricsOverride", width=1400, height=min(height, 16000),
                  deviceScaleFactor=1, mobile=False)
        data = self.send("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if getattr(self, "session", None) is not None:
                if getattr(self, "ws", None) is not None:
                    self.loop.run_until_complete(self.ws.close())
                    self.reader.cancel()
                    self.loop.run_until_complete(asyncio.gather(self.reader, return_exceptions=True))
                self.loop.run_until_complete(self.session.close())
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.loop.close()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Page":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
