"""The coordinator's dashboard: its page in a real headless browser (Debian's chromium, driven by
Selenium through chromium-driver; nothing is downloaded) over a real swarm, and who may read it
(an owned swarm's page and /status answer loopback only) over a real HTTP server."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.service import Coordinator
from protocol.signatures import SigningKey, peer_id_from_public_key
from tests.swarm import ProcessExited, node_peer_id, wait_for

RUN = ["--model", "tiny", "--inner-steps", "5", "--warmup-steps", "5", "--eval-batches", "1", "--checkpoint-every", "1",
       "--join-timeout-s", "5", "--min-replicas", "2"]  # fmt: skip
HEARTBEAT_TIMEOUT_S = 4
NODE = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "0.5", "--num-shards", "2"]
# what a member reports about itself, as markup: the page must show it as text
HTML_DEVICE = '<img src=x onerror="window.pwned=1">'
HTML_FAILURE = '<img src=y onerror="window.pwned=2"> loss is nan'


def _browser():
    """A headless chromium through Selenium; skips the test, naming what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    binary = next((shutil.which(b) for b in ("chromium", "chromium-browser") if shutil.which(b)), None)
    driver = shutil.which("chromedriver") or next((p for p in ("/usr/lib/chromium/chromedriver",) if os.path.exists(p)), None)
    missing = [what for what, found in (("chromium", binary), ("chromedriver", driver)) if not found]
    if missing:
        pytest.skip(f"no {' and no '.join(missing)} (Debian: apt-get install chromium chromium-driver; .ci/run installs them)")
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900",
                "--no-first-run", "--disable-extensions", "--disable-background-networking"):  # fmt: skip
        options.add_argument(arg)
    # a driver given by path: Selenium asks its manager for nothing (no download)
    browser = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    # the page itself 1280x900 (the window's frame around it varies)
    frame = browser.execute_script("return [window.outerWidth - window.innerWidth, window.outerHeight - window.innerHeight]")
    browser.set_window_size(1280 + frame[0], 900 + frame[1])
    return browser


class HtmlMember:
    """A member registered from this test over real libp2p, heartbeating every 0.5 s on a loop of
    its own until closed, whose device name and role failure hold markup."""

    def __init__(self, coordinator_maddr: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.coordinator = coordinator_maddr.rsplit("/p2p/", 1)[1]
        self.host = self.transport = self.beat = None
        self.peer_id = self._run(self._start(coordinator_maddr), 60)

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, maddr: str) -> str:
        from node.net.host import Host, HostConfig
        from node.net.transport import Transport
        from protocol import Register

        self.host = await Host.start(SigningKey.generate(), HostConfig(initial_peers=(maddr,)))
        self.transport = Transport(self.host)
        await self.transport.start()
        caps = {"device": "cpu", "device_name": HTML_DEVICE, "software": "<b>swarmtrain</b>/0.1", "up_mbps": 10.0, "down_mbps": 20.0}
        await self.transport.call(self.coordinator, Register(peer_id=self.host.peer_id, capabilities=caps), timeout=20)
        self.beat = asyncio.create_task(self._heartbeats())
        return self.host.peer_id

    async def _heartbeats(self) -> None:
        from node.net.transport import RPCError
        from protocol import Heartbeat

        while True:
            try:
                await self.transport.call(self.coordinator, Heartbeat(peer_id=self.host.peer_id, failure=HTML_FAILURE), timeout=5)
            except RPCError:
                pass  # the next one may get through
            await asyncio.sleep(0.5)

    async def _close(self) -> None:
        if self.beat is not None:
            self.beat.cancel()
            await asyncio.gather(self.beat, return_exceptions=True)
        if self.transport is not None:
            await self.transport.close()
        if self.host is not None:
            await self.host.shutdown()

    def close(self) -> None:
        try:
            self._run(self._close(), 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def _page_members(browser) -> list[str]:
    return browser.execute_script("return [...document.querySelectorAll('#members-body tr[data-peer-id]')].map(r => r.dataset.peerId)")


def _renders(browser) -> int:
    return int(browser.execute_script("return document.body.dataset.renders || 0"))


def _points(browser) -> int:
    return int(browser.execute_script("return document.getElementById('chart-loss-steps').dataset.points"))


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_the_page_shows_the_swarm_live_and_members_strings_as_text(swarm, tmp_path):
    browser = _browser()  # (skips before anything starts where there is none)
    member = None
    try:
        coord = swarm.coordinator("coordinator", None, None, *RUN, "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S))
        maddr = coord.wait_ready()["maddrs"][0]
        nodes = {n: swarm.node(n, [maddr], *NODE, "--shard-index", str(i)) for i, n in enumerate(["a", "b"])}
        member = HtmlMember(maddr)
        ids = {n: node_peer_id(p) for n, p in nodes.items()}
        browser.get(f"http://127.0.0.1:{coord.http_port}/")

        def alive(value):
            for n, p in nodes.items():
                if not p.alive():
                    raise ProcessExited(f"node {n} exited:\n{p.log()}")
            return value

        # every member is on the page, the coordinator's /status read by the page itself
        wanted = {*ids.values(), member.peer_id}
        wait_for(lambda: alive(wanted <= set(_page_members(browser))), 60, "every member on the page")
        assert browser.find_element("css selector", f'tr[data-peer-id="{ids["a"]}"] .peer').get_attribute("title") == ids["a"]

        # the member's strings are text: shown literally, no element made of them, no script run
        text = browser.execute_script("return document.body.textContent")
        assert HTML_DEVICE in text and "<b>swarmtrain</b>/0.1" in text
        assert browser.execute_script("return document.querySelectorAll('img, b').length") == 0
        assert browser.execute_script("return typeof window.pwned") == "undefined"

        # the loss curve grows as the swarm trains
        first = wait_for(lambda: alive(_points(browser)), 120, "a first point of the loss curve")
        wait_for(lambda: alive(_points(browser) > first), 120, f"the loss curve to grow past {first} points")
        if os.environ.get("SWARMTRAIN_SCREENSHOT"):  # the README's picture: a swarm that has trained a bit
            wait_for(lambda: alive(any(c["step"] >= 30 for c in coord.status()["checkpoints"])), 180, "a checkpoint of step 30")
            renders = _renders(browser)
            wait_for(lambda: _renders(browser) >= renders + 2, 30, "the page to show it")
        shot = Path(os.environ.get("SWARMTRAIN_SCREENSHOT") or tmp_path / "dashboard.png")
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0
        assert browser.execute_script("return typeof window.pwned") == "undefined"
        assert browser.execute_script("return document.querySelectorAll('img, b').length") == 0

        # a killed member leaves the page within the heartbeat timeout (the coordinator checks every
        # second, the page polls every second: a few seconds of slack on a loaded machine)
        nodes["b"].kill()
        wait_for(lambda: ids["b"] not in _page_members(browser), HEARTBEAT_TIMEOUT_S + 8, "b to leave the page")
        assert {ids["a"], member.peer_id} <= set(_page_members(browser))
        assert browser.find_element("id", "live").text == "live"
    finally:
        browser.quit()
        if member is not None:
            member.close()


# ---- who may read it ----------------------------------------------------------------------------


def _outside_address() -> str:
    """One of this machine's addresses that is not loopback; skips the test where there is none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 9))  # no packet is sent: the kernel picks the source address
            ip = s.getsockname()[0]
        if not ip.startswith("127."):
            return ip
    except OSError:
        pass
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        ip = line.split()[3].split("/")[0] if len(line.split()) > 3 else ""
        if ip and not ip.startswith("127."):
            return ip
    pytest.skip("this machine has no IPv4 address but loopback: no request from elsewhere can be made")


def _serve(tmp_path, owned: bool, http_public: bool) -> list[tuple[str, str, int, str]]:
    """A coordinator serving HTTP on 0.0.0.0 (owned swarm or not); (address, path, status, body)
    of GET / and /status and /metrics from loopback and from this machine's outside address."""
    tmp_path.mkdir()
    key = SigningKey.load_or_create(tmp_path / "identity.pem")
    swarm_id = f"lab@{peer_id_from_public_key(key.public_key)}" if owned else "lab"
    coord = Coordinator(CoordinatorConfig(swarm_id=swarm_id, data_dir=str(tmp_path), http="0.0.0.0:0", http_public=http_public))
    outside = _outside_address()

    async def main():
        got = []
        try:
            await coord.start()  # (its libp2p host on loopback, its HTTP server on every address)
            port = coord.http_address.rsplit(":", 1)[1]
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                for ip in ("127.0.0.1", outside):
                    for path in ("/", "/status", "/metrics", "/dashboard/app.js"):
                        async with session.get(f"http://{ip}:{port}{path}") as resp:
                            got.append((ip, path, resp.status, await resp.text()))
        finally:
            await coord.stop()
        return got

    return asyncio.run(main())


@pytest.mark.timeout(60)
def test_an_owned_swarm_answers_loopback_only_unless_the_operator_says_public(tmp_path):
    got = _serve(tmp_path / "owned", owned=True, http_public=False)
    loopback = {path: (status, body) for ip, path, status, body in got if ip == "127.0.0.1"}
    outside = {path: (status, body) for ip, path, status, body in got if ip != "127.0.0.1"}
    assert {p: s for p, (s, _) in loopback.items()} == {"/": 200, "/status": 200, "/metrics": 200, "/dashboard/app.js": 200}
    assert '<script src="/dashboard/app.js"' in loopback["/"][1] and '"swarm_id": "lab@' in loopback["/status"][1]
    assert {p: s for p, (s, _) in outside.items()} == {"/": 403, "/status": 403, "/metrics": 200, "/dashboard/app.js": 403}
    reason = outside["/status"][1]
    assert reason.count("\n") == 1 and "loopback only" in reason and "--http-public" in reason and "lab@" not in reason

    for name, owned, public in (("public", True, True), ("open", False, False)):
        assert all(status == 200 for _, _, status, _ in _serve(tmp_path / name, owned=owned, http_public=public)), name


@pytest.mark.timeout(60)
def test_http_public_without_an_owned_swarm_is_refused_in_one_line(tmp_path):
    script = Path(sys.executable).parent / "swarmtrain-coordinator"
    run = subprocess.run([str(script), "--data-dir", str(tmp_path), "--http", "127.0.0.1:0", "--http-public"], capture_output=True, text=True, timeout=50)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: --http-public is for an owned swarm") and "'swarmtrain' is not owned" in run.stderr
