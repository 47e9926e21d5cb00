"""The replica role: DiLoCo data parallelism across the swarm.

Each replica holds the whole model. A round: H inner AdamW steps on its own data shard, then
the pseudo-gradient θ_outer − θ_local is averaged with every replica at the same state
(compressed, error feedback at the sender), and an outer Nesterov step applies it. All
replicas that took part hold bitwise-identical outer state afterwards; each logs and reports
its short hash.

The round key carries the round number and the hash of the outer state it starts from, so
replicas whose states differ never average together: a replica that fell behind (straggler,
restart, a round that failed only for it) ends up alone, and then catches up by downloading the
outer state the other replicas hold, exactly as a joiner does (`SlotState`, `choose_state`).
Where the state comes from, in order: a replica peer that has it; the coordinator's latest
checkpoint; for a brand-new run, the first replica's seeded initialisation, uploaded as
checkpoint 0 so everyone starts from the same bits (seeded init differs between CPU kinds, so it
is never re-created per node). Every `checkpoint_every` rounds, and at the run's last round, the
round's leader uploads the state to the coordinator, which keeps it once enough replicas
reported the same hash.

With `fragments` > 1 the outer step is streamed (streaming.py, decisions in fragments.py): the
parameters are cut into F fragments, each averaged in its own round while the inner steps go on
and applied one fragment period later; the key of a fragment's round carries the outer step, the
fragment and the hash of its outer state. After a cycle (H inner steps, every fragment stepped)
the state is whole: saved, hashed (the hash of the whole outer state, as above), checked against
the others' when a fragment's round failed, checkpointed. A failed fragment round leaves that
fragment's outer state as it was.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import time
from pathlib import Path

import torch

from protocol import RoleAssignment

from ..averaging import AverageReport, Averager, AveragingFailed, NamespaceTaken
from ..averaging.faults import Faults
from ..config import averager_config
from ..models.data import EVAL_SEED, Batches, DataError, evaluate, shard_of
from ..models.diloco import InnerTrainer, OuterOptimizer, copy_into, state_hash
from ..net.host import DHTError
from ..net.transport import NETWORK_ERRORS, HandlerTaken, RemoteError
from ..runconfig import RunConfig
from ..state.checkpoint_client import fetch_manifest, upload_checkpoint
from ..state.checkpoint_dir import CheckpointDirError
from .attacks import replica_attack
from .budget import MedianWatch, keep_stepping
from .pause import PauseWatch
from .role import Role, RoleContext, RoleError
from .run_model import RunModel, model_meta, run_model
from .fragments import after_cycle, split
from .replica_peers import ReplicaPeers
from .slot_state import Offer, SlotState, State, choose_state
from .stats import StatsFile
from .streaming import Streaming
from .view import READ_TIMEOUT_S, SwarmView
from .weights import ComputeThread

log = logging.getLogger(__name__)

COORDINATOR_S = 5.0  # ... the coordinator
FINISH_LOOK_S = 10.0  # a replica that reached the last outer step by a failed round looks this long at a time for the others' final state
WATCH_S = 2.0  # how often a replica that may have fallen behind looks at the others' states while it matchmakes
_PEER_ERRORS = (*NETWORK_ERRORS, CheckpointDirError, ValueError)


def replica_hash(state: State) -> str:
    """The hash of a replica's outer state: parameters and momentum (zeros where it has none)."""
    model, momentum = state["model"], state.get("outer") or {}
    return state_hash({**{f"param/{n}": t for n, t in model.items()}, **{f"momentum/{n}": momentum.get(n, torch.zeros_like(t)) for n, t in model.items()}})


def lone_replica(me: str, recorded: set[str], answered: set[str], min_replicas: int) -> tuple[bool, str]:
    """Whether a replica applies its own outer step, its pseudo-gradient as the average, and why.
    Pure. Only the swarm's only replica does: no other replica in the member records (`recorded`,
    DHT records that live a record TTL, so a replica that is merely late, or slow, or that died
    a moment ago, is still in them) and none of the replicas of our last round answering a
    question about its state (`answered`: a peer our DHT lost sight of, but still there). A
    replica left alone because the others were late or cut off waits and catches up instead
    (`Replica._round_failed`): a step of its own would diverge from theirs. A run that asked for
    `min_replicas` >= 2 never trains on one replica."""
    others, alive = sorted(recorded - {me}), sorted(answered - {me})
    if others:
        return False, f"{len(others)} other replica(s) in the member records: averaging with them"
    if alive:
        return False, f"no other replica in the member records, but {len(alive)} of the last round answer: averaging with them"
    if min_replicas > 1:
        return False, f"the only replica, and the run needs {min_replicas} to train: waiting for others"
    return True, "the swarm's only replica: it applies its own outer step (its checkpoints are verified by one replica) until another joins"


async def _finish(task: asyncio.Task | None) -> bool:
    """Stop a task; whether it had finished by itself with a true result."""
    if task is None:
        return False
    done = task.done() and not task.cancelled() and task.exception() is None and bool(task.result())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return done


class Replica(Role):
    """The replica role (see the module's docstring). `start` takes the "replicas" averaging
    namespace and serves its states; `run` trains until cancelled; `stop` gives both back.
    Nothing to hand over on a planned stop: every replica holds the whole state."""

    name = "replica"

    def __init__(self, ctx: RoleContext, run: RunConfig, assignment: RoleAssignment | None = None):
        c, data = ctx.node_config, Path(ctx.node_config.data_dir)
        self.ctx, self.run_config = ctx, run
        self.train_config = run.train_config()
        self.spec: RunModel | None = None  # the model and its data (a Hugging Face model's files are fetched first)
        codec_params = run.codec_params()
        config = averager_config(  # the [averager] settings; the run's codec and join window win
            c, swarm_id=c.swarm_id, namespace="replicas", codec=run.codec, codec_params=codec_params, join_timeout_s=run.join_timeout_s,
            bandwidth=c.bandwidth_mbps * 1e6 / 8,  # declared: slices sized by it, sends paced to it
        )  # fmt: skip
        self.averager = Averager(ctx.host, ctx.transport, config, Faults(delay_parts_s=c.fault_delay_parts_s))
        self.threads = c.torch_threads()
        self._compute = ComputeThread(self.threads, "train")  # everything that trains, evaluates or loads a model's state
        self.state = SlotState(ctx.transport, data / "state", data / "downloads", "replica", model_meta(run), replica_hash, self._compute, unhashed_ok=True)
        self.view = SwarmView(ctx.host, c.swarm_id, c.record_ttl_s)
        self.peers = ReplicaPeers(ctx.host.peer_id, self.view, self.averager, self.state)
        self.median = MedianWatch(READ_TIMEOUT_S, (DHTError,))  # inner_phase "time": when the median replica waits to average
        self.stats = StatsFile(data, "replica", keep=1000)
        self.model: torch.nn.Module | None = None
        self.outer: OuterOptimizer | None = None
        self.inner: InnerTrainer | None = None
        self.round = 0
        self.hash = ""
        self.bytes_sent = 0
        self._stop = False
        self.pauses = PauseWatch()
        self._inner_threads = self.threads
        self.slowdown = c.fault_slowdown
        self.attack = replica_attack(c)  # a Byzantine replica (tests, drills, benches)
        self._out_of_step = False  # the last round failed: we may have been left behind
        self._lone = False  # the last round found us the swarm's only replica (logged when that changes)
        self.streaming: Streaming | None = None  # the outer step in fragments (run.fragments > 1), made with the model
        self.inner_s = 0.0  # seconds spent in inner steps (this process)
        self.wait_s = 0.0  # seconds training waited on fragments' rounds (over their period)
        self.eval_s = 0.0  # seconds spent evaluating after outer steps
        self.sync_bytes = 0  # bytes the last outer step's largest round sent
        self._cycle_inner_s = 0.0  # the last cycle's inner steps' time: the join window of the next one's rounds

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self.averager.start()
            self.state.start()
        except (NamespaceTaken, HandlerTaken) as e:
            raise RoleError(str(e)) from None

    async def run(self) -> None:
        watch = asyncio.create_task(self.pauses.run(), name="pause-watch")
        try:
            await self._train()
        except asyncio.CancelledError:
            self._stop = True  # the training thread returns between inner steps
            raise
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def stop(self, planned: bool = True) -> None:
        self._stop = True
        await self.state.close()
        await self.averager.close()
        self.view.close()
        self._compute.close()  # its thread returns between inner steps

    async def _train(self) -> None:
        c = self.ctx.node_config
        try:
            self.spec = await run_model(self.ctx, self.run_config, lambda: self._stop)
            self.corpus = await asyncio.to_thread(self.spec.corpus, c.data, c.text_field)
        except DataError as e:  # the daemon checked it at start: it changed since
            log.error("cannot train: %s", e)
            raise
        shard = c.shard_index if c.shard_index >= 0 else shard_of(self.ctx.host.peer_id, c.num_shards)
        self.model = await asyncio.to_thread(self.spec.make, None)
        if self.run_config.fragments > 1:
            try:
                parts = split([p.numel() for p in self.model.parameters()], self.run_config.fragments)
            except ValueError as e:
                raise RoleError(f"the run's fragments do not fit the model: {e}") from None
            self.streaming = Streaming(parts, self.run_config.inner_steps, self._compute, self._inner_steps, self._average)
        while not self._stop and self.run_config.min_replicas > 1 and len(await self.peers.ids()) < self.run_config.min_replicas:
            await asyncio.sleep(1.0)
        await self._obtain_state()
        batches = Batches(self.corpus.train, shard, c.num_shards, self.train_config.batch_size, self.spec.context, self.train_config.seed + shard)
        if self.attack is not None:  # (other-data trains on data of its own)
            batches = self.attack.data(batches, self.corpus.vocab_size)
        # in a thread: the first AdamW of a process imports torch._dynamo, seconds of work
        self.inner = await self._compute(InnerTrainer, self.model, self.train_config, batches)
        self.inner.step_count = self.round * self.run_config.inner_steps
        log.info("replica: %s model (%d params), data %s shard %d/%d, %d threads, starting at outer step %d (hash %s)", self.spec.source,
                 sum(p.numel() for p in self.model.parameters()), self.corpus.source, shard, c.num_shards, self.threads, self.round, self.hash)  # fmt: skip
        val = await self._compute(self._evaluate)
        log.info("outer %d | val %.4f | hash %s (starting point)", self.round, val, self.hash)
        self.stats.remember({"outer_step": self.round, "val_loss": val, "state_hash": self.hash, "start": True, "time": time.time()})
        self._publish_progress(val)
        while not self._stop:
            if self.run_config.max_outer_steps and self.round >= self.run_config.max_outer_steps:
                # reached by a failed round (our state is not the swarm's): the others' final state first
                while self._out_of_step and not self._stop and await self._catch_up(FINISH_LOOK_S, ours_ends_it=True) == "unseen":
                    pass
                losses = [e["val_loss"] for e in self.stats.history if "val_loss" in e]
                log.info("replica: finished %d outer steps (val loss %.4f, hash %s)", self.round, losses[-1] if losses else float("nan"), self.hash)
                await self.state.uploads_done()
                await asyncio.Event().wait()  # keep serving our state and reporting until stopped
            await self._one_round()

    # ---- one outer round -------------------------------------------------------------------------

    async def _one_round(self) -> None:
        if self.streaming is not None:
            return await self._one_cycle()
        key = f"outer-{self.round}-{self.hash[:8]}"
        self.median.stop = False
        if self.run_config.inner_phase == "time":  # stop early once the median replica waits to average
            watch = asyncio.create_task(self.median.run(self.round, lambda: self.peers.waiting(key), len(await self.peers.ids())))
        else:
            watch = None
        t0 = time.monotonic()
        try:
            losses = await self._compute(self._inner_steps, self.run_config.inner_steps)
        finally:
            await _finish(watch)
        if self._stop:
            return
        t_inner = time.monotonic() - t0
        self.inner_s += t_inner
        if await self._woke_up(t0):
            return
        pseudo = self.outer.pseudo_gradient(self.model.parameters())
        t1 = time.monotonic()
        # wait for slower replicas up to one inner phase: replicas differ in speed, and a
        # window shorter than that difference would leave the fast and the slow ones alone
        window = max(self.run_config.join_timeout_s, t_inner)
        # weighed by the samples behind it (inner_phase "time": a slower replica's fewer steps count for less)
        avg, report, moved_on = await self._average(key, pseudo, "outer", window, float(len(losses) * self.train_config.batch_size))
        if avg is None:
            self.ctx.activity.round("outer", "failed")
            await self._round_failed(report, moved_on, wait_s=window + t_inner + 5)
            return
        self.ctx.activity.round("outer", "ok")
        self._out_of_step = False
        copy_into(self.model.parameters(), self.outer.apply(avg))
        self.round += 1
        self.hash = self._hash()
        await self._save()
        self.bytes_sent += report.bytes_sent
        self.sync_bytes = report.bytes_sent
        await self._outer_step_done(losses, t_inner, len(report.survivors), time.monotonic() - t1, report.leader, {})

    async def _one_cycle(self) -> None:
        """An outer step of every fragment, each fragment's round overlapped with inner steps
        (streaming.py); at its end the state is whole again: saved, checked against the others'
        where a round failed, evaluated, checkpointed."""
        t0 = time.monotonic()
        window = max(self.run_config.join_timeout_s, self._cycle_inner_s)
        cycle = await self.streaming.cycle(self.model, self.outer, self.round, window, lambda: self._stop)
        if self._stop:
            return
        self._cycle_inner_s = cycle.inner_s
        self.inner_s += cycle.inner_s
        self.wait_s += cycle.wait_s
        for o in cycle.outcomes:
            self.ctx.activity.round("outer", "ok" if o.ok else "failed")
        if await self._woke_up(t0):
            return
        if any(o.moved_on for o in cycle.outcomes) and await self._catch_up(wait_s=window + 5) == "taken":
            return  # the others were ahead: theirs, not the half-averaged state of our cycle
        self.round += 1
        self.hash = self._hash()
        await self._save()
        look_s, decision = after_cycle(cycle.outcomes, wait_s=window + cycle.inner_s + 5)
        self._out_of_step = False
        if look_s:
            log.warning("outer step %d: %s", self.round, decision.reason)
            self.ctx.membership.progress.note(f"outer step {self.round}: {decision.reason}")  # for the coordinator's events
            settled = await self._catch_up(look_s, ours_ends_it=True)
            if settled == "taken":
                return
            self._out_of_step = settled != "in step"  # nobody seen holding ours: we may be the one behind
        if not cycle.applied:  # nothing averaged: the state is the one we started the cycle from
            self._publish_progress(None)
            return
        self.bytes_sent += cycle.bytes_sent
        self.sync_bytes = max(r.bytes_sent for r in cycle.reports)
        extra = {"fragments": len(cycle.outcomes), "failed_fragments": [o.fragment for o in cycle.outcomes if not o.ok], "wait_s": round(self.wait_s, 3)}
        # what the outer step cost training: the cycle's time outside inner steps (sends, applies, waits)
        await self._outer_step_done(cycle.losses, cycle.inner_s, cycle.members, time.monotonic() - t0 - cycle.inner_s, cycle.leader, extra)

    async def _outer_step_done(self, losses: list[float], t_inner: float, members: int, round_s: float, leader: str, extra: dict) -> None:
        """After an outer step (the state saved): evaluate, record, report; the round's leader
        hands the state to the coordinator every `checkpoint_every` steps and at the last."""
        t0 = time.monotonic()
        val = await self._compute(self._evaluate)
        self.eval_s += time.monotonic() - t0
        tokens = len(losses) * self.train_config.batch_size * self.spec.context
        entry = {
            "outer_step": self.round, "val_loss": val, "train_loss": sum(losses) / len(losses), "state_hash": self.hash, "inner_steps": len(losses),
            "bytes_sent": self.bytes_sent, "sync_bytes": self.sync_bytes, "members": members, "round_s": round(round_s, 3),
            "tokens_per_s": round(tokens / t_inner, 1), "threads": self._inner_threads, "inner_s": round(self.inner_s, 3), "eval_s": round(self.eval_s, 3), "time": time.time(), **extra,
        }  # fmt: skip
        self.stats.remember(entry)
        log.info("outer %d | train %.3f | val %.4f | %d replicas | %.0f tok/s | round %.2f s | %.1f KB sent | hash %s", self.round, entry["train_loss"], val,
                 members, entry["tokens_per_s"], entry["round_s"], self.sync_bytes / 1e3, self.hash)  # fmt: skip
        self._publish_progress(val, tokens / t_inner / self.spec.context)
        final = bool(self.run_config.max_outer_steps) and self.round >= self.run_config.max_outer_steps
        if (final or self.round % self.run_config.checkpoint_every == 0) and leader == self.ctx.host.peer_id:
            self.state.upload(self.ctx.membership.coordinator, self.round, self.hash, final)

    async def _woke_up(self, t0: float) -> bool:
        """Whether we were frozen since `t0` (SIGSTOP, a suspended machine) and took the swarm's
        state since: it has most likely moved on, so its state, hash-verified, instead of a round
        nobody else is in. Not reachable yet, maybe: then we look again while we matchmake."""
        paused = self.pauses.paused_since(t0)
        if not paused:
            return False
        log.warning("outer step %d: woke up after a pause of %.0f s; looking for the swarm's state", self.round, paused)
        if await self._adopt_from_peers(mine=(self.round, self.hash)):
            return True
        self._out_of_step = True
        return False

    async def _average(self, key: str, pseudo: list[torch.Tensor], state_key: str, window: float, weight: float = 1.0) -> tuple[list[torch.Tensor] | None, AverageReport, bool]:
        """One averaging round of `key` with the other replicas: (the average, or None when the
        round failed; its report; whether we gave it up because the others are ahead). The
        swarm's only replica takes its own pseudo-gradient as the average."""
        expected = await self.peers.ids()
        if await self._alone(expected):  # nobody to wait for
            me = self.ctx.host.peer_id
            return pseudo, AverageReport(key=key, ok=True, reason="alone", leader=me, members=[me], survivors=[me]), False
        # after a failed round we may be the one left behind (cut off, or back from a pause the
        # clocks did not show): while we wait alone for others, look whether the swarm moved on
        watch = asyncio.create_task(self._watch_swarm(key)) if self._out_of_step else None
        if self.attack is not None:
            pseudo = self.attack.apply(pseudo)
        try:
            avg, report = await self.averager.average(key, pseudo, weight=weight, expected_peers=expected, state_key=state_key, join_timeout_s=window)
        except AveragingFailed as e:
            avg, report = None, e.report
        finally:
            moved_on = await _finish(watch)
        if self.attack is not None and avg is not None:
            self.attack.observe(avg)
        return avg, report, moved_on

    async def _round_failed(self, report: AverageReport, moved_on: bool, wait_s: float) -> None:
        self._out_of_step = True
        log.warning("outer step %d: averaging failed (%s)", self.round, report.reason)
        self.ctx.membership.progress.note(f"outer step {self.round}: averaging failed ({report.reason})")  # for the coordinator's events
        # late: the others may be averaging without us right now; wait for their result.
        # Otherwise the round failed for everyone: a quick look, then move on together.
        if await self._catch_up(wait_s=wait_s if report.late or moved_on else 3.0) != "taken":
            # nobody got further: the round failed for everyone; keep our local progress and
            # move on together (the next pseudo-gradient covers both rounds' steps)
            self.round += 1
            self._publish_progress(None)

    def _inner_steps(self, n: int) -> list[float]:
        self._inner_threads = torch.get_num_threads()  # this thread's: what the steps ran with
        losses: list[float] = []
        activity, samples = self.ctx.activity, self.train_config.batch_size
        activity.inner_phase(self.round + 1, n)
        while keep_stepping(len(losses), n, self.median.stop):  # (inner_phase "time": MedianWatch may stop them early)
            if self._stop:
                break
            t0 = time.monotonic()
            losses.append(self.inner.step())
            if self.slowdown > 1.0:  # fault injection: a slower machine
                time.sleep((self.slowdown - 1.0) * (time.monotonic() - t0))
            activity.trained(samples, samples * self.spec.context, time.monotonic() - t0, losses[-1])
        activity.phase_done()
        return losses or [math.nan]

    def _evaluate(self) -> float:
        return evaluate(self.model, self.corpus.val, self.train_config.batch_size, self.spec.context, self.run_config.eval_batches, EVAL_SEED)

    def _hash(self) -> str:
        return replica_hash(self._state_tensors(copy=False))

    def _publish_progress(self, val: float | None, samples_per_s: float | None = None) -> None:
        p = self.ctx.membership.progress
        p.step, p.state_hash = self.round, self.hash
        if val is not None:
            p.loss = val
        if samples_per_s is not None:
            p.samples_per_second = samples_per_s
        self.ctx.membership.heartbeat_soon()
        self.stats.write({"outer_step": self.round, "state_hash": self.hash, "bytes_sent": self.bytes_sent, "val_loss": p.loss})

    # ---- state: save, take, catch up -------------------------------------------------------------

    def _state_tensors(self, copy: bool = True) -> State:
        names = [n for n, _ in self.model.named_parameters()]
        params, momentum = (self.outer.params, self.outer.buffers) if not copy else ([p.clone() for p in self.outer.params], [b.clone() for b in self.outer.buffers])
        return {"model": dict(zip(names, params)), "outer": dict(zip(names, momentum))}

    async def _save(self) -> Path:
        return await self.state.save(self.round, self._state_tensors(), self.hash)

    def _adopt(self, state: State, step: int) -> None:
        """Take a verified state (on the compute thread, between inner steps)."""
        self.model.load_state_dict(state["model"])
        self.outer = OuterOptimizer(self.model.parameters(), self.train_config.outer_lr, self.train_config.outer_momentum)
        momentum = state.get("outer")
        if momentum is not None:
            names = [n for n, _ in self.model.named_parameters()]
            self.outer.load_state_dict({"params": self.outer.params, "momentum": [momentum[n] for n in names], "step": step})
        self.round, self.hash = step, self._hash()
        if self.inner is not None:
            self.inner.step_count = step * self.run_config.inner_steps

    async def _take(self, offer: Offer) -> bool:
        state = await self.state.fetch(offer)
        if state is None:
            return False
        await self._compute(self._adopt, state, offer.step)
        await self.state.drop(offer.step)  # ours of that step, if any: the others' replaces it
        await self._save()
        if self.streaming is not None and offer.from_peer:
            self._out_of_step = True  # the others are somewhere in their cycle: our first rounds may find nobody
        if self.stats.history:  # a catch-up mid-run (the starting point is recorded by _train)
            self.stats.remember({"outer_step": self.round, "state_hash": self.hash, "caught_up_from": offer.peer, "time": time.time()})
        self._publish_progress(None)
        log.info("replica: took outer step %d (hash %s) from %s", self.round, self.hash, offer.peer[-8:])
        return True

    async def _obtain_state(self) -> None:
        """Peers first, then the coordinator's checkpoint, then (a new run) the seeded init."""
        while not self._stop:
            if await self._adopt_from_peers(mine=None):
                return
            coord = self.ctx.membership.coordinator
            if coord is not None:
                try:
                    step, manifest = await fetch_manifest(self.ctx.transport, coord, timeout=COORDINATOR_S)
                except RemoteError as e:
                    if e.code == "not_found":
                        await self._offer_initial_state(coord)
                        continue
                    log.warning("coordinator has no usable checkpoint: %s", e)
                except _PEER_ERRORS as e:
                    log.warning("cannot reach the coordinator for a checkpoint: %s", e)
                else:
                    offer = self.state.offer(coord, step, manifest, from_peer=False)
                    if offer is not None and await self._take(offer):
                        return
            await asyncio.sleep(2.0)

    async def _offer_initial_state(self, coord: str) -> None:
        """A brand-new run: offer our seeded initialisation as checkpoint 0. The coordinator keeps
        the first one it gets; everyone (us included) then downloads that one."""
        self.model.load_state_dict(self.spec.make(self.train_config.seed).state_dict())
        self.outer = OuterOptimizer(self.model.parameters(), self.train_config.outer_lr, self.train_config.outer_momentum)
        self.round, self.hash = 0, self._hash()
        path = await self._save()
        try:
            await upload_checkpoint(self.ctx.transport, coord, path)
            log.info("replica: offered the initial state (hash %s) as checkpoint 0", self.hash)
        except _PEER_ERRORS as e:
            log.info("the initial state came from another replica (%s)", e)
        shutil.rmtree(path, ignore_errors=True)

    async def _watch_swarm(self, key: str) -> bool:
        """While the round of `key` matchmakes: once the other replicas are ahead of us, give
        the round up (we would wait alone for the whole join window) and catch up instead."""
        while True:
            await asyncio.sleep(WATCH_S)
            best = choose_state((self.round, self.hash), {p: o.held for p, o in (await self.peers.states()).items()})
            if best is not None and best[0] > self.round and self.averager.abandon(key, f"the others are at outer step {best[0]}"):
                return True

    async def _catch_up(self, wait_s: float, ours_ends_it: bool = False) -> str:
        """After failed rounds: take the other replicas' state when they hold another at our
        outer step or a later one (`choose_state`), looking for up to `wait_s`: "taken". With
        `ours_ends_it` (our state of the step saved: a cycle's end), stop looking once one of
        them holds ours: "in step". Else "unseen"."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self._stop:
            offers = await self.peers.states()
            mine = (self.round, self.hash)
            if ours_ends_it and choose_state(mine, {p: o.held for p, o in offers.items()}) is None and any(o.held == mine for o in offers.values()):
                return "in step"
            if await self._adopt_from_peers(mine, offers):
                return "taken"
            await asyncio.sleep(1.0)
        return "unseen"

    async def _adopt_from_peers(self, mine: tuple[int, str] | None, offers: dict[str, Offer] | None = None) -> bool:
        """Take the state `choose_state` picks among the other replicas' (`mine` None: we hold
        none); `offers`: what they said they hold, if just asked."""
        offers = await self.peers.states() if offers is None else offers
        best = choose_state(mine, {p: o.held for p, o in offers.items()})
        for offer in offers.values():
            if offer.held == best and await self._take(offer):
                return True
        return False

    async def _alone(self, recorded: set[str]) -> bool:
        """Whether this is the swarm's only replica (`lone_replica`): `recorded`, the replicas of
        the member records, are only us, and no replica of our last round answers either."""
        me = self.ctx.host.peer_id
        if recorded - {me}:  # (the common case: no question to ask anyone)
            return False
        lone, why = lone_replica(me, recorded, await self.peers.last_round_answering(), self.run_config.min_replicas)
        if lone != self._lone:
            log.info("outer step %d: %s", self.round, why)
            self._lone = lone
        return lone
