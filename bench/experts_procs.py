"""The processes bench/experts.py starts for its arms: the layer arms' clients (hivemind's
RemoteMixtureOfExperts, the swarm's ExpertClient) and hivemind's expert servers and DHT bootstrap.
Each is started as `python -m bench.experts --client KIND | --hm-dht | --hm-server I`."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from bench.experts_layer import (
    HM_PREFIX,
    LayerLoop,
    Settings,
    _finite,
    _pct,
    _presets,
    _routed,
)

# ---- clients in their own processes ---------------------------------------------------------------


def client_main(kind: str, s: Settings, out: Path, where: dict) -> int:
    """One layer arm's client: `kind` "b" (hivemind) or "c" (the swarm). `where`: how to reach the
    hosts; seconds (run for that long, cycling the batches) or none (`steps` calls)."""
    import torch

    torch.set_num_threads(1)
    started = Path(where["started"]) if where.get("started") else None
    if kind == "b":
        row = _hivemind_client(s, where, started)
    else:
        import asyncio

        row = asyncio.run(_swarm_client(s, where, started))
    out.write_text(json.dumps(row))
    return 0


def _hivemind_client(s: Settings, where: dict, started: Path | None) -> dict:
    import logging
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import hivemind
        from hivemind.moe import RemoteMixtureOfExperts

    gpt, moe = _presets(s)
    failed = {"n": 0}

    class Count(logging.Handler):  # hivemind logs each expert call that failed ("Task ... failed: ...")
        def emit(self, record):
            if "failed" in record.getMessage():
                failed["n"] += 1

    logging.getLogger("hivemind.moe.client.moe").addHandler(Count())
    dht = hivemind.DHT(initial_peers=where["initial_peers"], host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=False, start=True)
    try:
        torch.manual_seed(s.seed)
        dmoe = RemoteMixtureOfExperts(
            in_features=gpt.n_embd, grid_size=(moe.num_experts,), dht=dht, uid_prefix=HM_PREFIX, k_best=moe.top_k,
            forward_timeout=s.hm_timeout_s, backward_timeout=s.hm_timeout_s, timeout_after_k_min=s.hm_after_k_min_s,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:  # every expert declared in the DHT
            found = hivemind.moe.get_experts(dht, [f"{HM_PREFIX}{e}" for e in range(moe.num_experts)])
            if all(found) or time.monotonic() > deadline:
                break
            time.sleep(0.5)

        def call(tag, x):
            x = x.clone().requires_grad_(True)
            before = failed["n"]
            y = dmoe(x)
            y.pow(2).mean().backward()
            return {"finite": _finite(y, x.grad), "pairs": x.size(0) * moe.top_k, "skipped": failed["n"] - before}

        row = LayerLoop(s, call, where.get("seconds"), started, log=True).run()
        row["failed_expert_calls"] = row.pop("skipped_experts")
        return row
    finally:
        dht.shutdown()


async def _swarm_client(s: Settings, where: dict, started: Path | None) -> dict:
    import asyncio

    import torch

    from node.config import NodeConfig
    from node.models.moe import init_moe_model
    from node.net.host import Host, HostConfig
    from node.net.transport import Transport
    from node.roles.activations import activation_codec
    from node.roles.expert_client import ExpertClient, remote_moe
    from node.roles.expert_host import MAX_CALL_TOKENS
    from node.roles.view import SwarmView
    from node.runconfig import RunConfig
    from protocol import SigningKey

    gpt, moe = _presets(s)
    run = RunConfig(model=s.model, expert_shards=s.hosts, batch_size=s.batch_size, stage_step_samples=s.batch_size, seed=s.seed)
    node = NodeConfig()
    host = await Host.start(SigningKey.generate(), HostConfig(initial_peers=(where["maddr"],)))
    transport = Transport(host)
    await transport.start()
    client = ExpertClient(transport, asyncio.get_running_loop(), run, activation_codec(run, gpt.n_embd), MAX_CALL_TOKENS * gpt.n_embd)

    fallback: dict = {}  # shard -> times its hosts came from the coordinator
    known = asyncio.Event()
    view = SwarmView(host, node.swarm_id, node.record_ttl_s)
    task = asyncio.create_task(_follow_hosts(s, view, client, known, fallback, where["http"]))
    try:
        await asyncio.wait_for(known.wait(), 60)
        router = _Capturing(init_moe_model(gpt, moe, s.seed).blocks[0].moe.router)  # (a)'s

        def call(tag, x):
            x = x.clone().requires_grad_(True)
            y, _, skipped = remote_moe(x, router, client, tag, 0)
            y.pow(2).mean().backward()
            client.commit(tag, 0.0, 1.0)  # the experts' gradients clipped by their global norm, as (a)'s
            return {"finite": _finite(y, x.grad), **_routed(router.last, x.size(0)), "skipped": skipped}

        torch.set_num_threads(1)
        row = await asyncio.to_thread(LayerLoop(s, call, where.get("seconds"), started, log=True).run)
        row["expert_rpcs"] = client.calls
        if fallback:
            row["hosts_from_coordinator"] = f"the DHT's member records named no host of shard(s) {sorted(fallback)} for 20 s or more: their hosts were taken from the coordinator's /status ({sum(fallback.values())} times)"
        row["rpc_latency_p50_s"] = _pct(list(client.latencies), 0.5)  # one layer's forward (or backward) calls, together
        row["rpc_latency_p99_s"] = _pct(list(client.latencies), 0.99)
        return row
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await transport.close()
        await host.shutdown()


def _hosts_from_coordinator(http: str) -> dict[int, list[str]]:
    import urllib.request

    with urllib.request.urlopen(f"http://{http}/status", timeout=5) as r:
        status = json.loads(r.read())
    return {int(k.removeprefix("shard")): v["peers"] for k, v in status["expert_shards"].items() if v["peers"]}


async def _follow_hosts(s: Settings, view, client, known, fallback: dict, http: str) -> None:
    """As the expert trainer follows them: the hosts of each shard from their member records
    (`known` set once every shard has one); where the DHT names no host of a shard for 20 s,
    the coordinator's /status is asked (counted in `fallback`, said in the row)."""
    import asyncio

    t_start = time.monotonic()
    while True:
        members = await view.read()
        if not members.ok:
            print("the member records could not be read", file=sys.stderr, flush=True)
        shards = members.numbered("expert", "shard", below=s.hosts)
        if len(shards) < s.hosts and (fallback or time.monotonic() - t_start > 20):
            try:
                told = await asyncio.to_thread(_hosts_from_coordinator, http)
                if not fallback:
                    seen = [(p[-6:], r.role, round(time.time() - r.issued_at, 1)) for p, r in members.records.items()] + [(p[-6:], why) for p, why in members.skipped.items()]
                    print(f"member records after 20 s (peer, role, age s): {seen}; the coordinator: { {k: [p[-6:] for p in v] for k, v in told.items()} }", file=sys.stderr, flush=True)
                for sh, peers in told.items():
                    shards.setdefault(sh, peers)
                    fallback[sh] = fallback.get(sh, 0) + 1
            except OSError as e:
                print(f"coordinator /status: {e}", file=sys.stderr, flush=True)
        if shards:
            client.peers.update(shards)
        if len(shards) == s.hosts:
            known.set()
        await asyncio.sleep(2.0 if known.is_set() else 0.5)


class _Capturing:
    """A router that keeps its last routing (to count the token-expert pairs it sent)."""

    def __init__(self, router):
        self.router, self.last = router, None

    def __call__(self, x, alive=None):
        self.last = self.router(x, alive)
        return self.last


# ---- hivemind's server and DHT bootstrap, in their own processes -----------------------------------


def _register_mlp(s: Settings, experts: list[int]) -> str:
    """Our expert (node/models/gpt.py MLP) as a hivemind expert class, "swarm_mlp": the i-th one built
    holds the initial weights of layer 0's expert experts[i] of (a)'s model."""
    import torch
    from hivemind.moe.server.layers import name_to_block, register_expert_class

    from node.models.gpt import MLP
    from node.models.moe import init_moe_model

    gpt, moe = _presets(s)
    layer = init_moe_model(gpt, moe, s.seed).blocks[0].moe
    order = iter(experts)

    if "swarm_mlp" not in name_to_block:

        @register_expert_class("swarm_mlp", lambda batch_size, hid_dim: torch.empty((batch_size, hid_dim)))
        class SwarmMLP(MLP):
            def __init__(self, hid_dim):
                assert hid_dim == gpt.n_embd
                super().__init__(gpt)
                self.load_state_dict(layer.experts[next(order)].state_dict())

    return "swarm_mlp"


def _wait_for_sigterm() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


def hm_dht_main(out: Path) -> int:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import hivemind

    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    out.write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
    try:
        _wait_for_sigterm()
    finally:
        dht.shutdown()
    return 0


def hm_server_main(index: int, s: Settings, initial_peers: list[str], out: Path) -> int:
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from hivemind.moe import Server

    torch.set_num_threads(1)
    gpt, moe = _presets(s)
    experts = list(range(index, moe.num_experts, s.hosts))  # as the swarm's shard `index`
    cls = _register_mlp(s, experts) if s.hm_expert == "mlp" else "ffn"
    uids = [f"{HM_PREFIX}{e}" for e in experts]
    torch.manual_seed(s.seed + index)
    kwargs = {"num_handlers": s.hm_handlers} if s.hm_handlers > 0 else {}
    server = Server.create(
        expert_uids=uids, expert_cls=cls, hidden_dim=gpt.n_embd, device="cpu", initial_peers=initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, **kwargs,
    )  # fmt: skip
    out.write_text(json.dumps({"uids": uids, "maddrs": [str(a) for a in server.dht.get_visible_maddrs()]}))
    try:
        _wait_for_sigterm()
    finally:
        server.shutdown()
    return 0
