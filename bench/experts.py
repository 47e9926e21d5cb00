"""Expert-parallel (MoE) layers side by side: one process, hivemind.moe, and the swarm.

    python -m bench.experts --json [--model tiny-moe] [--tokens 128] [--steps 30] [--arms a,b,c,d,b-kill]

Every layer arm runs the same MoE layer: the E experts of layer 0 of `model` (tiny-moe: 4
experts of width 64, top-2), each an MLP Linear(d, 4d) GELU Linear(4d, d) (node/models/gpt.py), the
experts split over `hosts` host processes (expert e on host e mod hosts, as the swarm's shards
are), on the same token batches: `steps` batches of `tokens` random vectors of width d (one
seeded sequence, the same in every arm), called in order after `warmup` calls, and again in the
same order until the arm has run `min_seconds` (the fast arms' statistics need more than a few
calls; each row says how many it made). A call is a forward and a backward (loss: the output's
mean square; the input's gradient is computed too: a layer inside a model hands it on) and the
experts' optimizer step where the arm's system takes one:

  (a) the MoE layer in one process (router + experts, node/models/moe.py MoELayer), AdamW on the
      experts every call;
  (b) hivemind.moe: `hosts` hivemind Servers (real processes, `Server.create`, each with its own
      DHT, a DHT bootstrap process as the swarm has its coordinator), the client a
      `RemoteMixtureOfExperts(grid_size=(E,), k_best=k)` in its own process: its own gating (a
      Linear, top-k by beam search over the experts declared in the DHT, no capacity limit), one
      RPC per (token, expert) pair each way. Its experts are ours, with (a)'s initial weights,
      registered with hivemind (`--hm-expert mlp`; `ffn`: hivemind's own FeedforwardBlock, the
      same two Linears with a tanh-GELU plus a residual and a LayerNorm). Adam on the servers at
      every backward batch (hivemind's default optimizer); hivemind's defaults otherwise (k_min 1,
      8 connection handler processes per expert) but for the deadlines, which hivemind leaves
      unbounded: forward/backward timeout `hm_timeout_s`, `hm_after_k_min_s` for the stragglers
      once every token has one answer (ours: 10 s for a host never measured, 8 x its call time
      and at least 2 s after);
  (c) the swarm: a coordinator (--mode experts, --expert-shards `hosts`), `hosts` expert hosts
      (`swarmtrain-node`), the client an ExpertClient on its own libp2p host in its own process,
      calling `remote_moe` with the router of (a), then committing the experts' gradients
      clipped by their global norm as (a) clips them; the hosts take an AdamW step every call
      (--stage-step-samples = --batch-size, each call its own micro-batch);
  (d) (c) for `kill_run_s` seconds with one expert host (its whole session: node, DHT, p2pd)
      SIGKILLed every `kill_every_s` seconds, in turn, and started again at once (same data dir);
      with one host per shard, no replica holds the shard's state: the host comes back with the
      run's initial experts (each kill's `state_from`);
  (b-kill) (b) under the same schedule (the server restarted with the same expert uids; its
      experts' training is lost too). hivemind gives a token whose chosen experts all failed a
      NaN output, without an exception: those calls count as `nonfinite_calls`, their tokens not
      as samples.

A "sample" is a token (a vector of width d) through the layer, forward and backward. Reported
per layer arm: samples/s (tokens of the calls that returned finite values / wall time of the
measured calls), token-expert pairs/s (the work behind them), p50/p99 of one call's latency
(forward + backward + optimizer step of the layer, wall clock), token-expert pairs per call,
tokens sent to no expert (ours: the router's capacity, 1.25 x a fair share of the E experts,
drops tokens when fewer experts take them, e.g. while a shard's host is down), exceptions that
reached the loop (the loop catches, counts and goes on), calls whose output or input gradient
was not finite, experts skipped (ours) or expert calls failed (hivemind's log), the machine's
1-minute load average before and after. The kill arms add samples/s per kill period and when
each restarted host served again.

Training loss at equal tokens, (a) and (c): the whole tiny-moe model trained on the same
micro-batches of the built-in corpus (`train_micro_batches` of `batch_size` sequences, data
shard 0 of 1, the run's seed) from the same initial weights with AdamW, the run's lr schedule
(node/models/diloco.py TrainConfig, lr_at) and a step every micro-batch: (a) in one process, (c) a
trainer (`--wanted-role trainer --shard-index 0 --num-shards 1`) with the experts on the hosts of
(c) (trained before (c)'s layer calls). final_loss: the mean cross-entropy of the last WINDOW
micro-batches (without the balance loss, which the trainer does not report).

Every process gets one torch thread. Prints one JSON object (settings, arms, ratios c/b, d/c,
c's loss over a's); exits 1 if an arm failed. Beside this file: experts_layer.py (the settings and
the timed loop every layer arm runs), experts_procs.py (the processes the arms start).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.experts_layer import (
    REPORT,
    WINDOW,
    LayerLoop,
    Settings,
    _env,
    _finite,
    _presets,
    _routed,
)
from bench.experts_procs import client_main, hm_dht_main, hm_server_main

# ---- (a) one process -----------------------------------------------------------------------------


def run_single_layer(s: Settings) -> dict:
    import torch

    from node.models.moe import combine, init_moe_model

    torch.set_num_threads(1)
    gpt, moe = _presets(s)
    layer = init_moe_model(gpt, moe, s.seed).blocks[0].moe
    opt = torch.optim.AdamW(layer.experts.parameters(), lr=s.lr)

    def call(tag, x):
        x = x.clone().requires_grad_(True)
        routing = layer.router(x)
        outs = [layer.experts[e](x[idx]) if idx.numel() else None for e, idx in enumerate(routing.tokens)]
        y = combine(outs, routing, x)
        y.pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(layer.experts.parameters(), 1.0)  # (c)'s client commits the same global clip
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"finite": _finite(y, x.grad), **_routed(routing, x.size(0))}

    return LayerLoop(s, call).run()


def _train_config(s: Settings):
    from node.runconfig import RunConfig

    return RunConfig(model=s.model, batch_size=s.batch_size, inner_lr=s.lr, warmup_steps=s.warmup_steps, seed=s.seed).train_config()


def run_single_train(s: Settings) -> dict:
    """(a)'s training: the whole MoE model, AdamW every micro-batch (node/roles/expert_trainer.py
    ExpertTrainer's settings), the trainer's micro-batches (data shard 0 of 1, seed + 0)."""
    import torch

    from node.models.data import Batches, load_corpus
    from node.models.diloco import adamw, lr_at
    from node.models.moe import init_moe_model

    torch.set_num_threads(1)
    gpt, moe = _presets(s)
    model = init_moe_model(gpt, moe, s.seed)
    tc = _train_config(s)
    opt = adamw(model.parameters(), tc)
    batches = Batches(load_corpus().train, 0, 1, s.batch_size, gpt.context, s.seed)
    losses = []
    t0 = time.perf_counter()
    for step in range(s.train_micro_batches):
        x, y = batches.next()
        _, loss, aux = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        opt.step()
        losses.append(loss.item() - moe.aux_loss_weight * aux.item())  # the cross-entropy, as the trainer reports it
    seconds = time.perf_counter() - t0
    return {"final_loss": sum(losses[-WINDOW:]) / WINDOW, "train_samples_per_s": s.train_micro_batches * s.batch_size / seconds, "train_micro_batches": s.train_micro_batches}


# ---- the arms that start processes -----------------------------------------------------------------


class _Arms:
    """Starts and stops the processes of (b)/(b-kill) and (c)/(d) (tests/swarm.py Swarm: every
    process in its own session, all of each session killed on close)."""

    def __init__(self, s: Settings, work: Path, timeout: float):
        from tests.swarm import Swarm

        self.s, self.work, self.timeout = s, work, timeout
        work.mkdir(parents=True, exist_ok=True)
        self.sw = Swarm(work)

    def close(self) -> None:
        self.sw.close()

    def py(self, name: str, *args: str):
        return self.sw.start(name, "python", "-m", "bench.experts", *args, env=_env())

    def client(self, kind: str, name: str, where: dict, kill=None) -> dict:
        """Runs a client process to its end; `kill(i)` the i-th kill, every kill_every_s once it
        measures. Returns its row (with `kills`)."""
        from bench.workers import kill_session

        out = self.work / f"{name}.json"
        started = self.work / f"{name}.started"
        out.unlink(missing_ok=True)
        started.unlink(missing_ok=True)
        where = {**where, "started": str(started)}
        proc = self.py(name, "--client", kind, "--settings", json.dumps(asdict(self.s)), "--where", json.dumps(where), "--out", str(out))
        deadline = time.monotonic() + self.timeout
        kills, next_kill, kill_log = 0, None, []
        try:
            while proc.alive():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"client {name} did not finish in {self.timeout:.0f} s:\n{_tail(proc.log_path)}")
                if kill is not None and started.exists():
                    if next_kill is None:
                        first = time.monotonic()
                        next_kill = first + self.s.kill_every_s
                    elif time.monotonic() >= next_kill:
                        kill_log.append({"at_s": round(time.monotonic() - first, 1), **kill(kills)})
                        kills += 1
                        next_kill += self.s.kill_every_s
                time.sleep(0.2)
        finally:
            kill_session(proc.sid)
        if proc.wait(10) != 0 or not out.exists():
            raise RuntimeError(f"client {name} failed ({proc.popen.returncode}):\n{_tail(proc.log_path)}")
        row = json.loads(out.read_text())
        row["wall_s"] = time.monotonic() - (deadline - self.timeout)
        if kill is not None:
            row["kills"] = kills
            row["kill_log"] = kill_log
        return row

    # -- (b), (b-kill)

    def hivemind(self, which: list[str]) -> dict[str, dict]:
        from tests.swarm import wait_for

        s = self.s
        dht_out = self.work / "hm-dht.json"
        self.py("hm-dht", "--hm-dht", "--out", str(dht_out))
        boot = wait_for(lambda: json.loads(dht_out.read_text()), 60, "hivemind's DHT bootstrap")
        servers = {}

        def start(i: int):
            out = self.work / f"hm{i}.json"
            out.unlink(missing_ok=True)
            servers[i] = self.py(f"hm{i}", "--hm-server", str(i), "--settings", json.dumps(asdict(s)), "--where", json.dumps({"initial_peers": boot}), "--out", str(out))
            return out

        outs = [start(i) for i in range(s.hosts)]
        for i, out in enumerate(outs):
            wait_for(lambda out=out, i=i: out.exists() or (not servers[i].alive() and _raise(f"hivemind server {i} exited:\n{_tail(servers[i].log_path)}")), 120, f"hivemind server {i}")

        def kill(k: int) -> dict:
            from bench.workers import kill_session

            i = k % s.hosts
            kill_session(servers[i].sid)
            servers[i].wait(10)
            t = time.monotonic()
            out = start(i)
            wait_for(lambda: out.exists(), 120, f"hivemind server {i} back")
            return {"host": i, "up_after_s": round(time.monotonic() - t, 2)}

        rows = {}
        where = {"initial_peers": boot}
        for key in which:
            if key == "b":
                rows[key] = self.client("b", "client-b", where)
            elif key == "b-kill":
                rows[key] = self.client("b", "client-b-kill", {**where, "seconds": s.kill_run_s}, kill)
        return rows

    # -- (c), (d)

    def swarm(self, which: list[str]) -> dict[str, dict]:
        from tests.swarm import wait_for

        s = self.s
        run = [
            "--mode", "experts", "--model", s.model, "--expert-shards", str(s.hosts), "--batch-size", str(s.batch_size),
            "--stage-step-samples", str(s.batch_size), "--inner-lr", str(s.lr), "--warmup-steps", str(s.warmup_steps), "--seed", str(s.seed),
            "--heartbeat-timeout-s", "10", "--stage-sync-every-s", "3600",  # one host per shard: nothing to sync
        ]  # fmt: skip
        node = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "1", "--log-level", "WARNING"]
        coord = self.sw.coordinator("coordinator", None, None, *run)
        maddr = coord.wait_ready()["maddrs"][0]
        hosts = {f"h{i}": self.sw.node(f"h{i}", [maddr], *node) for i in range(s.hosts)}

        def stats(name: str, kind: str) -> dict:
            try:
                return json.loads((self.work / name / f"{kind}-stats.json").read_text())
            except (OSError, ValueError):
                return {}

        def shards() -> dict:
            return {k: v["peers"] for k, v in coord.status()["expert_shards"].items()}

        wait_for(lambda: all(len(p) >= 1 for p in shards().values()) and all(stats(n, "expert") for n in hosts), 120, "every shard served")
        rows: dict[str, dict] = {}
        if "c" in which and s.train_micro_batches > 0:
            t = self.sw.node("t0", [maddr], *node, "--wanted-role", "trainer", "--shard-index", "0", "--num-shards", "1")
            deadline = time.monotonic() + self.timeout
            while stats("t0", "trainer").get("micro_batches", 0) < s.train_micro_batches:
                if time.monotonic() > deadline or not t.alive():
                    raise RuntimeError(f"the trainer did not reach {s.train_micro_batches} micro-batches in {self.timeout:.0f} s: {stats('t0', 'trainer').get('micro_batches')}\n{_tail(t.log_path)}")
                time.sleep(0.5)
            t.kill()
            st = stats("t0", "trainer")
            h = [e for e in st["history"] if e["micro_batches"] <= s.train_micro_batches]
            tail = h[-(WINDOW // REPORT) :]
            first, end = h[0], h[-1]
            span = end["time"] - first["time"]
            rows["c-train"] = {
                "train_wall_s": time.monotonic() - (deadline - self.timeout),
                "final_loss": sum(e["loss"] for e in tail) / len(tail),
                "train_samples_per_s": (end["micro_batches"] - first["micro_batches"]) * s.batch_size / span if span > 0 else 0.0,
                "train_micro_batches": end["micro_batches"], "train_skipped_experts": end["skipped_experts"],
                "trainer_layer_latency_p50_s": st.get("layer_latency_p50_s"), "trainer_layer_latency_p99_s": st.get("layer_latency_p99_s"),
                "trainer_micro_batches_at_stop": st["micro_batches"],  # its last report before it was stopped
                "host_optimizer_steps": {n: stats(n, "expert").get("steps") for n in hosts},  # at stop: one per micro-batch expected
            }  # fmt: skip

        def kill(k: int) -> dict:
            from bench.workers import kill_session

            name = f"h{k % s.hosts}"
            kill_session(hosts[name].sid)  # the node, its DHT child and p2pd at once: the machine is gone
            hosts[name].wait(10)
            t, wall = time.monotonic(), time.time()
            hosts[name] = self.sw.node(name, [maddr], *node)  # the same data dir, the same identity

            def back():  # its new process reported its start (its experts loaded, serving)
                h = stats(name, "expert").get("history") or [{}]
                return h[0] if h[0].get("start") and h[0].get("time", 0) > wall else None

            entry = wait_for(back, 120, f"{name} back")
            return {"host": name, "up_after_s": round(time.monotonic() - t, 2), "state_from": entry.get("state_from")}

        where = {"maddr": maddr, "http": f"127.0.0.1:{coord.http_port}"}
        for key in which:
            if key == "c":
                rows["c"] = self.client("c", "client-c", where)
            elif key == "d":
                rows["d"] = self.client("c", "client-d", {**where, "seconds": s.kill_run_s}, kill)
        return rows


def _timed(fn, s: Settings, field: str = "wall_s") -> dict:
    t0 = time.monotonic()
    row = fn(s)
    row[field] = time.monotonic() - t0
    return row


def _raise(msg: str):
    raise RuntimeError(msg)


# ---- main ---------------------------------------------------------------------------------------


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


ARM_NAMES = {
    "a": "the MoE layer in one process (and the MoE model trained in one process)",
    "b": "hivemind.moe: RemoteMixtureOfExperts, hivemind Servers in {hosts} processes",
    "c": "swarm: remote_moe over an ExpertClient, {hosts} expert hosts (swarmtrain-node) (and a trainer on them)",
    "d": "(c), one host SIGKILLed and restarted every {kill_every_s:g} s",
    "b-kill": "(b), one server SIGKILLed and restarted every {kill_every_s:g} s",
}


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (the default output)")
    p.add_argument("--arms", default="a,b,c,d,b-kill", help="which arms to run: a,b,c,d,b-kill")
    p.add_argument("--work-dir", default="", help="where the arms' logs go (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each client or trainer may take")
    for f in Settings.__dataclass_fields__.values():
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--hm-server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hm-dht", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--where", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _problems(s: Settings, wanted: list[str]) -> list[str]:
    """What is wrong with the settings and the arms asked for, each named."""
    from node.models.moe import MOE_PRESETS

    problems = []
    if s.model not in MOE_PRESETS:
        problems.append(f"--model must be one of {', '.join(MOE_PRESETS)}")
    elif not 1 <= s.hosts <= MOE_PRESETS[s.model][1].num_experts:
        problems.append(f"--hosts must be in 1..{MOE_PRESETS[s.model][1].num_experts} (the experts per layer)")
    if s.train_micro_batches and (s.train_micro_batches % REPORT or s.train_micro_batches < WINDOW):
        problems.append(f"--train-micro-batches must be 0 or a multiple of {REPORT} of at least {WINDOW}")
    if s.hm_expert not in ("mlp", "ffn"):
        problems.append("--hm-expert must be mlp or ffn")
    if s.tokens < 1 or s.steps < 1:
        problems.append("--tokens and --steps must be positive")
    if unknown := [a for a in wanted if a not in ARM_NAMES]:
        problems.append(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARM_NAMES)}")
    return problems


def _ratios(out: list[dict]) -> tuple[dict, dict]:
    """The arms side by side (ratios) and the issue's targets, met or not."""
    by = {r["arm"]: r for r in out if r["status"] == "ok"}
    ratios = {}

    def ratio(name, num, den, field="samples_per_s", digits=3):
        if num in by and den in by and by[den].get(field):
            ratios[name] = round(by[num][field] / by[den][field], digits)

    ratio("c_over_b_samples_per_s", "c", "b")
    ratio("d_over_c_samples_per_s", "d", "c")
    ratio("b_kill_over_b_samples_per_s", "b-kill", "b")
    ratio("d_over_c_token_expert_pairs_per_s", "d", "c", "token_expert_pairs_per_s")
    ratio("c_over_a_samples_per_s", "c", "a")
    ratio("c_loss_over_a", "c", "a", "final_loss", 4)
    targets = {}
    if "c_over_b_samples_per_s" in ratios:
        targets["c_at_least_5x_b"] = ratios["c_over_b_samples_per_s"] >= 5
    if "d_over_c_samples_per_s" in ratios:
        targets["d_at_least_0.7x_c_no_exception"] = ratios["d_over_c_samples_per_s"] >= 0.7 and by["d"]["exceptions"] == 0
    if "c_loss_over_a" in ratios:
        targets["c_loss_within_2pct_of_a"] = abs(ratios["c_loss_over_a"] - 1) <= 0.02
    return ratios, targets


def main(argv=None) -> int:
    args = _parse(argv)
    if args.client:
        return client_main(args.client, Settings(**json.loads(args.settings)), Path(args.out), json.loads(args.where))
    if args.hm_dht:
        return hm_dht_main(Path(args.out))
    if args.hm_server is not None:
        return hm_server_main(args.hm_server, Settings(**json.loads(args.settings)), json.loads(args.where)["initial_peers"], Path(args.out))

    s = Settings(**{k: getattr(args, k) for k in Settings.__dataclass_fields__})
    wanted = [a for a in args.arms.split(",") if a]
    if problems := _problems(s, wanted):
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    import tempfile

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-experts-"))

    def interrupted(*_):
        raise KeyboardInterrupt  # a SIGTERM cleans up as Ctrl-C does: every arm's `finally` closes its processes

    signal.signal(signal.SIGTERM, interrupted)
    rows: dict[str, dict] = {}

    def record(keys: list[str], fn) -> None:
        """Runs `fn` (rows by key; "<arm>-train": more fields of that arm); every arm of `keys`
        is marked failed if it raises."""
        t0 = time.monotonic()
        try:
            got = fn()
        except Exception as e:  # one arm failing must not hide the others' results
            got = {k: {"status": "failed", "error": f"{type(e).__name__}: {e}"[:3000]} for k in keys if k not in rows}
        for k, r in got.items():
            arm = k.removesuffix("-train")
            row = rows.setdefault(arm, {"arm": arm, "name": ARM_NAMES[arm].format(**asdict(s)), "status": "ok"})
            row.update(r)
            print(json.dumps(_rounded({**row, "since_start_s": round(time.monotonic() - t0, 1)})), file=sys.stderr)

    if "a" in wanted:
        record(["a"], lambda: {"a": _timed(run_single_layer, s), **({"a-train": _timed(run_single_train, s, "train_wall_s")} if s.train_micro_batches else {})})
    for group, start in ((["b", "b-kill"], "hivemind"), (["c", "d"], "swarm")):
        keys = [k for k in group if k in wanted]
        if not keys:
            continue
        arms = _Arms(s, work / start, args.timeout)
        try:
            record(keys, lambda arms=arms, keys=keys, start=start: getattr(arms, start)(keys))
        finally:
            arms.close()

    out = [_rounded(rows[k]) for k in ARM_NAMES if k in rows]
    ratios, targets = _ratios(out)
    print(json.dumps({"settings": asdict(s), "arms": out, "ratios": ratios, "targets_met": targets, "work_dir": str(work)}, indent=1))
    return 0 if all(r["status"] == "ok" for r in out) else 1


def _rounded(row: dict) -> dict:
    def r(v):
        if isinstance(v, float):
            return round(v, 4)
        if isinstance(v, dict):
            return {k: r(x) for k, x in v.items()}
        if isinstance(v, list):
            return [r(x) for x in v]
        return v

    return r(row)


if __name__ == "__main__":
    sys.exit(main())
