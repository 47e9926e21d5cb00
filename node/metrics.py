"""A node's `--http HOST:PORT`: GET /metrics (Prometheus text) and GET /status (the node's own JSON),
both read from what the node keeps anyway at the moment they are asked: its activity (node/activity.py:
steps, rounds, queues, rates), its transport's traffic (node/net/traffic.py) and counters, and its
membership's role and progress (what its heartbeats report). Nothing is counted twice: the
collector turns those into metric families on each scrape.

Counters are typed as counters (`..._total`); the node's resident memory and CPU time are
prometheus_client's ProcessCollector's `process_*`. The coordinator's metrics (coordinator/http.py)
describe the swarm; these, one node: `swarmtrain_node_*`.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class NodeCollector:
    """Metric families of one node, made at each scrape (see the module). `node`: the daemon
    (node/daemon.py `Node`): its transport, membership, activity, config, started_at."""

    def __init__(self, node: Any):
        self.node = node

    def collect(self):
        node = self.node
        activity, transport, membership = node.activity, node.transport, node.membership
        info = GaugeMetricFamily("swarmtrain_node_info", "This node: its peer id, swarm, role and software (always 1)", labels=["peer_id", "swarm", "role", "software"])
        info.add_metric([transport.peer_id, node.config.swarm_id, activity.role or "none", node.software], 1)
        yield info
        traffic = CounterMetricFamily("swarmtrain_node_bytes", "Bytes of calls this node sent to and received from each peer, by plane (libp2p, direct, relayed)", labels=["plane", "peer", "direction"])
        for (plane, peer, direction), n in list(transport.traffic.bytes.items()):
            traffic.add_metric([plane, peer, direction], n)
        yield traffic
        rounds = CounterMetricFamily("swarmtrain_node_rounds", "Averaging rounds this node took part in, by kind (outer: a replica's; sync: a stage's, expert shard's or trainers' dense parts) and outcome", labels=["kind", "outcome"])
        for (kind, outcome), n in sorted(activity.rounds.items()):
            rounds.add_metric([kind, outcome], n)
        yield rounds
        yield CounterMetricFamily("swarmtrain_node_steps", "Steps trained: inner steps (replica), micro-batches (trainer), batches of calls (stage or expert server)", value=activity.steps)
        yield CounterMetricFamily("swarmtrain_node_samples", "Samples trained", value=activity.samples)
        yield CounterMetricFamily("swarmtrain_node_tokens", "Tokens trained (replicas and trainers)", value=activity.tokens)
        yield SummaryMetricFamily("swarmtrain_node_step_seconds", "Time of a step (see swarmtrain_node_steps_total): an inner step, a micro-batch's round trip, a batch of calls", count_value=activity.steps, sum_value=activity.step_seconds)
        samples_per_s, tokens_per_s = activity.rates()
        for name, value, text in (
            ("swarmtrain_node_samples_per_second", samples_per_s, "Samples trained per second over the latest steps"),
            ("swarmtrain_node_tokens_per_second", tokens_per_s, "Tokens trained per second over the latest steps"),
            ("swarmtrain_node_train_loss", activity.loss, "The latest step's training loss"),
            ("swarmtrain_node_loss", membership.progress.loss if membership else None, "The loss this node reports to the coordinator (a replica's: validation loss after its latest outer step)"),
            ("swarmtrain_node_step", membership.progress.step if membership else None, "The step this node reports to the coordinator (a replica's: its outer step)"),
        ):
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)
        failed = bool(membership and membership.progress.failure)
        yield GaugeMetricFamily("swarmtrain_node_role_failed", "1 while this node's role has failed (it takes no role until restarted)", value=int(failed))
        queues = GaugeMetricFamily("swarmtrain_node_queue_length", "Work waiting or in flight: a server's queued calls, a trainer's micro-batches in flight, the streams peers have open with us (a call, or a pipe between calls)", labels=["queue"])
        for name, n in sorted({**activity.queue_lengths(), "served_streams": len(transport.server.tasks)}.items()):
            queues.add_metric([name], n)
        yield queues
        rpc = CounterMetricFamily("swarmtrain_node_rpc", "The transport's counters, as the coordinator's swarmtrain_rpc (calls made and served, pipes, direct connections, relay hops and relayed_bytes carried as a relay...)", labels=["counter"])
        for name, n in sorted(transport.stats.items()):
            rpc.add_metric([name], n)
        yield rpc


def registry(node: Any) -> CollectorRegistry:
    """The node's own registry: its collector and its process's (resident memory, CPU time, files)."""
    reg = CollectorRegistry()
    reg.register(NodeCollector(node))
    ProcessCollector(registry=reg)
    return reg


async def status(node: Any) -> dict[str, Any]:
    """GET /status: the node as it sees itself."""
    transport, membership, activity = node.transport, node.membership, node.activity
    assignment = membership.assignment if membership else None
    progress = membership.progress if membership else None
    samples_per_s, tokens_per_s = activity.rates()
    sent, received = transport.traffic.totals()
    now = time.time()
    phase = activity.phase
    return {
        "peer_id": transport.peer_id,
        "swarm_id": node.config.swarm_id,
        "software": node.software,
        "maddrs": await node.host.visible_maddrs(),
        "coordinator": membership.coordinator if membership else None,
        "role": assignment.role if assignment else None,
        "stage": assignment.stage if assignment else None,
        "expert": assignment.expert if assignment else None,
        "reason": assignment.reason if assignment else "",
        "epoch": assignment.epoch if assignment else None,
        "progress": {
            "step": progress.step if progress else 0,
            "loss": progress.loss if progress else None,
            "samples_per_second": progress.samples_per_second if progress else None,
            "state_hash": progress.state_hash if progress else None,
            "failure": progress.failure if progress else "",
        },
        "activity": {
            "role": activity.role, "steps": activity.steps, "samples": activity.samples, "tokens": activity.tokens, "train_loss": activity.loss,
            "samples_per_second": samples_per_s, "tokens_per_second": tokens_per_s,
            "rounds": {f"{kind}/{outcome}": n for (kind, outcome), n in sorted(activity.rounds.items())},
            "queues": activity.queue_lengths(),
            "phase": None if phase is None else {"outer_step": phase.outer, "done": phase.done, "total": phase.total, "eta_s": phase.eta(activity.clock())},
        },  # fmt: skip
        "traffic": {**transport.traffic.by_plane(), "sent": sent, "received": received},
        "bans": transport.scores.bans(time.monotonic()),  # peers refused for what they sent, each with why
        "capabilities": membership.capabilities if membership else {},
        "started_at": node.started_at,
        "uptime_s": now - node.started_at,
        "now": now,
    }


def http_app(node: Any) -> web.Application:
    """GET /metrics and GET /status of `node`."""
    reg = registry(node)

    async def get_metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(reg), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_status(request: web.Request) -> web.Response:
        return web.json_response(await status(node))

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/status", get_status)
    return app

