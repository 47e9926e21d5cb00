"""HTTP status for people and monitoring: GET /status (JSON), GET /metrics (Prometheus)."""

from __future__ import annotations

import logging
from collections import Counter

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)


class HttpServer:
    def __init__(self, runner: web.AppRunner, site: web.TCPSite, address: str):
        self.runner, self.site, self.address = runner, site, address

    async def stop(self) -> None:
        await self.runner.cleanup()


def parse_http(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--http must be HOST:PORT, got {text!r}")
    return host, int(port)


class _Counters:
    """What only grows since the coordinator started, typed as counters (values from its state)."""

    def __init__(self, evictions: int, rpc: dict[str, int]):
        self.evictions, self.rpc = evictions, rpc

    def collect(self):
        evictions = CounterMetricFamily("swarmtrain_evictions", "Members evicted for missing heartbeats since start")
        evictions.add_metric([], self.evictions)
        rpc = CounterMetricFamily("swarmtrain_rpc", "RPC counters of the coordinator since start", labels=["counter"])
        for name, value in sorted(self.rpc.items()):
            rpc.add_metric([name], value)
        return [evictions, rpc]


def _metrics(coordinator, status: dict) -> bytes:
    reg = CollectorRegistry()
    by_role = Counter(m["role"] or "unassigned" for m in status["members"])
    members = Gauge("swarmtrain_members", "Registered members by role", ["role"], registry=reg)
    for role, n in by_role.items():
        members.labels(role=role).set(n)
    Gauge("swarmtrain_members_total", "Registered members", registry=reg).set(len(status["members"]))
    Gauge("swarmtrain_checkpoints", "Checkpoints on disk", registry=reg).set(len(status["checkpoints"]))
    latest = max((c["step"] for c in status["checkpoints"]), default=-1)
    Gauge("swarmtrain_latest_checkpoint_step", "Step of the newest checkpoint (-1: none)", registry=reg).set(latest)
    Gauge("swarmtrain_failed_members", "Members whose role failed (they take no role until restarted)", registry=reg).set(
        sum(1 for m in status["members"] if m.get("failed"))
    )
    Gauge("swarmtrain_plan_epoch", "Role plan version", registry=reg).set(status["epoch"] or 0)
    steps = [m["step"] for m in status["members"] if m["step"] is not None]
    Gauge("swarmtrain_swarm_step", "Highest step reported by a member", registry=reg).set(max(steps, default=0))
    losses = [p["loss"] for p in status["progress"] if p["loss"] is not None]
    if losses:
        Gauge("swarmtrain_last_loss", "Most recent loss reported", registry=reg).set(losses[-1])
    reg.register(_Counters(status["evictions"], dict(coordinator.transport.stats) if coordinator.transport else {}))
    return generate_latest(reg)


async def start_http(coordinator, address: str) -> HttpServer:
    host, port = parse_http(address)

    async def status(request: web.Request) -> web.Response:
        return web.json_response(await coordinator.status())

    async def metrics(request: web.Request) -> web.Response:
        body = _metrics(coordinator, await coordinator.status())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", status)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        from node.config import ConfigError

        raise ConfigError(f"--http {address}: cannot listen: {e.strerror}") from None
    bound = runner.addresses[0][1] if port == 0 else port  # the sockets' (host, port, ...) names
    return HttpServer(runner, site, f"{host}:{bound}")
