"""HTTP status for people and monitoring: GET / (the dashboard, coordinator/dashboard/: a page
that polls /status), GET /status (JSON), GET /metrics (Prometheus).

An owned swarm's dashboard and status (its members, their addresses) answer loopback only, unless
the operator passes --http-public: an operator reaches them through an SSH tunnel, say."""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from node.net.http import HttpServer, serve_http

log = logging.getLogger(__name__)


DASHBOARD = Path(__file__).resolve().parent / "dashboard"
ASSETS = {"app.js": "text/javascript", "charts.js": "text/javascript", "sections.js": "text/javascript", "style.css": "text/css"}  # served under /dashboard/
# the page runs our own files only: no inline script, nothing from elsewhere (a member's strings
# are text; should one ever reach the DOM as markup, its handlers would not run)
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def is_loopback(remote: str | None) -> bool:
    """Whether a request's peer address is this machine's loopback (an IPv4 one mapped into IPv6 too)."""
    try:
        ip = ipaddress.ip_address((remote or "").split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def loopback_only(coordinator) -> bool:
    """Whether / and /status answer loopback only: an owned swarm, unless the operator said --http-public."""
    return coordinator.owned and not coordinator.config.http_public


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


def _guard(coordinator):
    """Middleware: in an owned swarm (see loopback_only) everything but /metrics answers loopback
    only; a request from elsewhere gets 403 and one line saying why."""

    @web.middleware
    async def guard(request: web.Request, handler):
        if request.path != "/metrics" and loopback_only(coordinator) and not is_loopback(request.remote):
            return web.Response(status=403, text="this swarm is owned: its dashboard and /status answer loopback only (the coordinator's --http-public serves them to every address)\n")
        return await handler(request)

    return guard


async def _asset(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name not in ASSETS:
        raise web.HTTPNotFound()
    return web.FileResponse(DASHBOARD / name, headers={**PAGE_HEADERS, "Content-Type": ASSETS[name]})


async def _page(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(DASHBOARD / "index.html", headers={**PAGE_HEADERS, "Content-Type": "text/html; charset=utf-8"})


async def start_http(coordinator, address: str) -> HttpServer:
    async def status(request: web.Request) -> web.Response:
        return web.json_response(await coordinator.status(), headers={"Cache-Control": "no-store"})

    async def metrics(request: web.Request) -> web.Response:
        body = _metrics(coordinator, await coordinator.status())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[_guard(coordinator)])
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", _page)
    app.router.add_get("/dashboard/{name}", _asset)
    return await serve_http(app, address)
