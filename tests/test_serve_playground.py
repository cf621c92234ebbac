"""The playground page in headless Chromium (Debian's `chromium`, driven over the DevTools protocol): load `/`,
send a prompt, see the output and the stats, run the side-by-side comparison, and keep a screenshot in
a screenshot (see SCREENSHOT). Uses the embedded SmolLM2 with its bundled P-EAGLE head, as `peagle serve` does with no
arguments (real text, real acceptance)."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.serve_util import LiveServer

CHROMIUM = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs a Chromium binary: `apt-get install -y chromium`")
# The run's screenshot; `PEAGLE_SCREENSHOT=docs/playground.png pytest tests/test_serve_playground.py` refreshes
# the one in the docs (a plain run leaves the tree untouched).
SCREENSHOT = Path(os.environ.get("PEAGLE_SCREENSHOT", Path(tempfile.gettempdir()) / "peagle-playground.png"))


class Browser:
    """Headless Chromium and one page, over the DevTools websocket."""

    def __init__(self, profile: Path):
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--window-size=1360,820",
             f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        end = time.time() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert self.proc.poll() is None and time.time() < end, "chromium did not start"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
        from websockets.sync.client import connect

        self._conn = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self.ws = self._conn.__enter__()
        self.n = 0

    def call(self, method: str, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=120))
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr: str, timeout: float = 120):
        end = time.time() + timeout
        while True:
            try:
                value = self.js(expr)
            except RuntimeError:  # the page is still loading (the old document has no such element)
                value = None
            if value:
                return value
            assert time.time() < end, f"timed out waiting for {expr}"
            time.sleep(0.1)

    def close(self):
        try:
            self._conn.__exit__(None, None, None)
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def server():
    from peagle.engine import LLMEngine
    from peagle.model.speculation import resolve_speculation
    from peagle.serve.app import build_app
    from peagle.serve.async_engine import AsyncEngine
    from peagle.serve.metrics import Metrics

    # what `peagle serve` runs with no arguments: the embedded SmolLM2 with its bundled P-EAGLE head
    engine = LLMEngine.from_pretrained(resolve_speculation(None), max_num_seqs=2, device="cpu")
    base = LLMEngine(engine.target, engine.tokenizer, max_num_seqs=1, max_model_len=engine.max_model_len,
                     model_name=engine.model_name)
    aengine = AsyncEngine(engine, base, metrics=Metrics("SmolLM2-135M-Instruct", engine.k))
    srv = LiveServer(build_app(aengine, ["SmolLM2-135M-Instruct"]), aengine)
    with srv as s:
        yield s


def test_playground(server, tmp_path):
    browser = Browser(tmp_path / "profile")
    try:
        browser.call("Page.enable")
        browser.call("Page.navigate", url=server.url + "/")
        info = browser.wait("document.getElementById('model-info').textContent.includes('K=') && "
                            "document.getElementById('model-info').textContent")
        assert "P-EAGLE" in info
        browser.js("document.getElementById('max-tokens').value = '24'")
        # side by side off: the no-speculation panel takes no room at all (not an empty box)
        assert browser.js("getComputedStyle(document.getElementById('pane-base')).display") == "none"

        # one prompt: output streams in, stats fill
        browser.js("document.getElementById('prompt').value = 'What is the capital of France?';"
                   "document.getElementById('send').click()")
        browser.wait("document.body.dataset.done === '1' || document.body.dataset.error")
        assert not browser.js("document.body.dataset.error || ''")
        out = browser.js("document.getElementById('output').textContent")
        assert out.strip()
        tps = browser.js("document.getElementById('stats-tps').textContent")
        accept = browser.js("document.getElementById('stats-accept').textContent")
        assert float(tps) > 0 and float(accept) >= 1.0
        assert browser.js("document.querySelectorAll('#bars .bar').length") >= 1

        # side by side: the same prompt with P-EAGLE and without speculation; greedy outputs match
        browser.js("document.getElementById('compare').click();"
                   "document.getElementById('prompt').value = 'Name three colours of the rainbow.';"
                   "document.getElementById('send').click()")
        browser.wait("document.body.dataset.done === '2' || document.body.dataset.error")
        assert not browser.js("document.body.dataset.error || ''")
        spec_text = browser.js("document.getElementById('output').textContent")
        base_text = browser.js("document.getElementById('output-base').textContent")
        assert spec_text and spec_text == base_text
        assert browser.js("getComputedStyle(document.getElementById('pane-base')).display") != "none"
        assert browser.js("document.getElementById('stats-speedup').textContent").endswith("x")
        assert browser.js("document.getElementById('tps-base').textContent").endswith("tok/s")

        # the schema box: the answer (with and without speculation, side by side) is JSON matching the
        # schema, the same both ways, and forced tokens are counted
        browser.js("document.getElementById('format').value = 'json_schema';"
                   "document.getElementById('max-tokens').value = '40';"
                   "document.getElementById('prompt').value = 'Where is the Eiffel Tower? Answer as JSON.';"
                   "document.getElementById('send').click()")
        browser.wait("document.body.dataset.done === '3' || document.body.dataset.error")
        assert not browser.js("document.body.dataset.error || ''")
        answer = json.loads(browser.js("document.getElementById('output').textContent"))
        assert answer == json.loads(browser.js("document.getElementById('output-base').textContent"))
        assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values())
        assert int(browser.js("document.getElementById('stats-forced').textContent")) > 0

        shot = browser.call("Page.captureScreenshot", format="png")
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        SCREENSHOT.write_bytes(base64.b64decode(shot["data"]))
        assert SCREENSHOT.stat().st_size > 10_000
    finally:
        browser.close()
