"""A test peer for averaging swarm tests: one Averager in its own process, driven by JSON lines
on stdin, reporting JSON lines on stdout. Also computes, from the seeds of every participant,
the reference result the codec pipeline must produce, so the test can compare bits."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import time

import torch

from node.averaging import Averager, AveragerConfig, AveragingFailed
from node.averaging.faults import Faults
from node.net.host import Host, HostConfig
from node.net.transport import Transport
from protocol import SigningKey, decode_tensor, make_codec


def make_tensors(seed: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel - 63, generator=g), torch.randn(7, 9, generator=g) * 3]


def flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def reference(cfg: AveragerConfig, seeds: list[int], numel: int, bounds, survivors_idx, slice_owners=()) -> torch.Tensor:
    """The first round's result, computed locally from every member's seed (in member order):
    per slice, the mean over the surviving members of their decoded parts (its owner's own part
    exact: it never travels; a slice re-owned after a failure gets the new owner's part as
    encoded for the old one), then through the gather codec. Equal weights. `slice_owners`:
    the member index owning each slice (empty: slice j is member j's)."""
    xs = [flat(make_tensors(s, numel)) for s in seeds]
    codec = make_codec(cfg.codec, **cfg.codec_params)
    gather = make_codec(cfg.resolved_gather_codec, **cfg.gather_codec_params)
    out = torch.empty(numel)
    for j in range(len(bounds) - 1):
        a, b = bounds[j], bounds[j + 1]
        owner = slice_owners[j] if slice_owners else j
        parts = [xs[i][a:b] if i == owner else decode_tensor(codec.encode(xs[i][a:b], {})).reshape(-1) for i in survivors_idx]
        acc = torch.zeros(b - a)
        for p in parts:
            acc.add_(p, alpha=1.0 / len(parts))
        out[a:b] = decode_tensor(gather.encode(acc)).reshape(-1)
    return out


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def watch(avg: Averager, key: str) -> None:
    """While `key` is averaged here, report what only the inside shows, whenever it changes:
    "joined", the peers whose join waits in our group (as its leader); "parts_from", the peers
    whose scatter parts reached us. Tests wait on these instead of sleeping."""
    me, seen = avg.peer_id, {}
    while True:
        lobby = avg.matchmaker.lobbies.get(key)
        rounds = [r for a, r in avg.service.rounds.values() if a is avg and r.report.key == key] if avg.service else []
        now = {
            "joined": sorted(lobby.pending) if lobby else [],
            "parts_from": sorted({s for r in rounds for (phase, _), got in r.received.items() if phase == "scatter" for s in got} - {me}),
        }
        for kind, peers in now.items():
            if seen.get(kind) != peers:
                emit(event=kind, key=key, peers=peers)
        seen = now
        await asyncio.sleep(0.01)  # the poll interval


async def repeat(avg: Averager, me: str, cmd: dict) -> None:
    seeds, numel = cmd["seeds"], cmd["numel"]
    mine = make_tensors(seeds[me], numel)
    exact = torch.stack([flat(make_tensors(s, numel)) for s in seeds.values()]).mean(dim=0)
    total, errors = torch.zeros(numel), []
    for t in range(cmd["rounds"]):
        try:
            result, _ = await avg.average(f"{cmd['key']}-{t}", mine, expected_peers=len(seeds))
        except AveragingFailed as e:
            emit(event="result", key=cmd["key"], ok=False, reason=e.report.reason)
            return
        total += flat(result)
        errors.append(float((total / (t + 1) - exact).abs().max()))
    emit(event="result", key=cmd["key"], ok=True, errors=errors, sha=hashlib.sha256(total.numpy().tobytes()).hexdigest())


async def average(avg: Averager, cfg: AveragerConfig, me: str, cmd: dict) -> list[torch.Tensor] | None:
    """One round; emits its result (checked against the exact mean and the codec's reference);
    the averaged tensors, None if it failed."""
    seeds: dict[str, int] = cmd["seeds"]
    numel = cmd["numel"]
    mine = make_tensors(seeds[me], numel)
    watcher = asyncio.create_task(watch(avg, cmd["key"])) if cmd.get("watch") else None
    try:
        result, report = await avg.average(cmd["key"], mine, expected_peers=cmd.get("expected"))
    except AveragingFailed as e:
        emit(event="result", key=cmd["key"], ok=False, reason=e.report.reason, failed=e.report.failed, silent=e.report.silent,
             unchanged=bool(torch.equal(flat(mine), flat(make_tensors(seeds[me], numel)))))
        return None
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    out = flat(result)
    survivors = [p for p in report.members if p in report.survivors]
    idx_seeds = [seeds[p] for p in survivors]
    exact = torch.stack([flat(make_tensors(s, numel)) for s in idx_seeds]).mean(dim=0)
    ref = reference(cfg, [seeds[p] for p in report.members], numel, report.bounds,
                    [i for i, p in enumerate(report.members) if p in report.survivors], report.slice_owners)
    emit(
        event="result", key=cmd["key"], ok=True, sha=hashlib.sha256(out.numpy().tobytes()).hexdigest(),
        max_err=float((out - exact).abs().max()), rel_err=float((out - exact).norm() / exact.norm()),
        max_abs=float(max(flat(make_tensors(s, numel)).abs().max() for s in idx_seeds)),
        equals_reference=bool(torch.equal(out, ref)), members=report.members, survivors=report.survivors,
        failed=report.failed, silent=report.silent, leader=report.leader, seconds=report.seconds, bytes_sent=report.bytes_sent,
        early_used=report.early_used, early_discarded=report.early_discarded, schedule=report.schedule, pace=report.pace,
        slice_owners=list(report.slice_owners),
        shapes_kept=[list(t.shape) for t in result] == [list(t.shape) for t in mine],
    )
    return result  # the caller's tensors: nothing may write into them after the round


async def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("node.averaging").setLevel(logging.DEBUG)  # the test keeps this log for diagnosis
    initial = sys.argv[1:]
    host = await Host.start(SigningKey.generate(), HostConfig(initial_peers=tuple(initial)))
    transport = Transport(host)
    await transport.start()
    cfg = AveragerConfig()
    avg = Averager(host, transport, cfg)
    await avg.start()
    emit(event="ready", peer_id=host.peer_id, maddr=(await host.visible_maddrs())[0])
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    last: list[torch.Tensor] = []  # the last round's result
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "config":
                cfg = AveragerConfig(**cmd["config"])
                await avg.close()  # one averager per namespace: the old one leaves first
                avg = Averager(host, transport, cfg, Faults(**cmd.get("faults", {})))
                await avg.start()
                avg.on_phase = lambda key, phase: emit(event="phase", key=key, phase=phase)
                emit(event="configured")
            elif cmd["op"] == "repeat":  # K rounds of the same inputs: how close the running mean gets
                await repeat(avg, host.peer_id, cmd)
            elif cmd["op"] == "forget":  # a new test: no reputation carried over from the last one
                transport.scores.peers.clear()
                emit(event="forgot")
            elif cmd["op"] == "banned":  # the peers this one refuses now
                now = time.monotonic()
                emit(event="banned", peers=[p for p in transport.scores.peers if transport.scores.banned(p, now)])
            elif cmd["op"] == "recheck":  # the sha of the last result's tensors, as they are now
                emit(event="recheck", sha=hashlib.sha256(flat(last).numpy().tobytes()).hexdigest())
            elif cmd["op"] == "average":  # "watch": true adds the round's "joined" and "parts_from" events
                last = await average(avg, cfg, host.peer_id, cmd) or last
    finally:
        await avg.close()
        await transport.close()
        await host.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
