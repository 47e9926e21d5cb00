"""HTTP status for people and monitoring: GET /status (JSON), GET /metrics (Prometheus)."""

from __future__ import annotations

import logging
from collections import Counter

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from node.net.http import HttpServer, serve_http

log = logging.getLogger(__name__)


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
    Gauge("swarmtrain_evictions_total", "Members evicted for missing heartbeats since start", registry=reg).set(status["evictions"])
    Gauge("swarmtrain_plan_epoch", "Role plan version", registry=reg).set(status["epoch"] or 0)
    steps = [m["step"] for m in status["members"] if m["step"] is not None]
    Gauge("swarmtrain_swarm_step", "Highest step reported by a member", registry=reg).set(max(steps, default=0))
    losses = [p["loss"] for p in status["progress"] if p["loss"] is not None]
    if losses:
        Gauge("swarmtrain_last_loss", "Most recent loss reported", registry=reg).set(losses[-1])
    rpc = Gauge("swarmtrain_rpc", "RPC counters of the coordinator", ["counter"], registry=reg)
    for name, value in coordinator.transport.stats.items():
        rpc.labels(counter=name).set(value)
    return generate_latest(reg)


async def start_http(coordinator, address: str) -> HttpServer:
    async def status(request: web.Request) -> web.Response:
        return web.json_response(await coordinator.status())

    async def metrics(request: web.Request) -> web.Response:
        body = _metrics(coordinator, await coordinator.status())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", status)
    return await serve_http(app, address)
