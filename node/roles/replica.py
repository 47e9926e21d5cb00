"""The replica role: DiLoCo data parallelism across the swarm.

Each replica holds the whole model. A round: H inner AdamW steps on its own data shard, then
the pseudo-gradient θ_outer − θ_local is averaged with every replica at the same state
(compressed, error feedback at the sender), and an outer Nesterov step applies it. All
replicas that took part hold bitwise-identical outer state afterwards; each logs and reports
its short hash.

The round key carries the round number and the hash of the outer state it starts from, so
replicas whose states differ never average together: a replica that fell behind (straggler,
restart, a round that failed only for it) ends up alone, and then catches up by downloading the
outer state the other replicas hold, exactly as a joiner does. Where the state comes from, in
order: a replica peer that has it; the coordinator's latest checkpoint; for a brand-new run,
the first replica's seeded initialisation, uploaded as checkpoint 0 so everyone starts from the
same bits (seeded init differs between CPU kinds, so it is never re-created per node).

Every `checkpoint_every` rounds the round's leader uploads the state to the coordinator, which
accepts it once enough replicas reported the same hash.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from protocol.manifest import step_dir_name

from ..averaging import Averager, AveragingFailed, NamespaceTaken
from ..state.checkpoint_client import download_checkpoint, fetch_manifest, upload_checkpoint
from ..state.checkpoint_dir import CheckpointDirError, load_checkpoint_dir, read_manifest, write_checkpoint_dir
from ..models.data import Batches, DataError, evaluate, load_corpus
from ..averaging.faults import Faults
from ..config import averager_config
from ..models.diloco import InnerTrainer, OuterOptimizer, copy_into, state_hash
from ..net.membership import read_members
from ..osutil import write_json
from .pause import PauseWatch
from ..models.gpt import GPT, GPTConfig, init_model
from ..runconfig import RunConfig, RunConfigError, run_config_of  # noqa: F401 (re-exported)
from ..state.state_server import CheckpointServer, DirectorySource
from .runner import Role, RoleError
from ..net.transport import NETWORK_ERRORS, CallTimeout, HandlerTaken, RemoteError

log = logging.getLogger(__name__)

MEMBERS_TIMEOUT_S = 3.0  # longest an outer step waits for the DHT's list of members
EVAL_SEED = 1234  # the same validation windows everywhere, so losses compare across replicas and runs
KEEP_LOCAL_STATES = 2
_PEER_ERRORS = (*NETWORK_ERRORS, CheckpointDirError, ValueError)


def choose_state(mine: tuple[int, str] | None, peers: dict[str, tuple[int, str]]) -> tuple[int, str] | None:
    """The (round, hash) to adopt from peers, or None to keep ours. Pure.

    Adopt the state most peers hold among those at the highest round when it is ahead of ours.
    At our own round, states vote (ours counts for us); the larger vote wins and a tie goes to
    the smaller hash, so two diverged replicas always settle on the same one."""
    if not peers:
        return None
    top = max(step for step, _ in peers.values())
    votes = Counter(s for s in peers.values() if s[0] == top)
    best, n = min(votes.items(), key=lambda kv: (-kv[1], kv[0][1]))
    if mine is None or best[0] > mine[0]:
        return best
    if best[0] == mine[0] and best != mine:
        ours = votes.get(mine, 0) + 1
        if n > ours or (n == ours and best[1] < mine[1]):
            return best
    return None


async def _finish(task: asyncio.Task | None) -> bool:
    """Stop a task; whether it had finished by itself with a true result."""
    if task is None:
        return False
    done = task.done() and not task.cancelled() and task.exception() is None and bool(task.result())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return done


def shard_of(peer_id: str, num_shards: int) -> int:
    return zlib.crc32(peer_id.encode()) % num_shards


class Replica(Role):
    """The replica role (see the module's docstring). `start` takes the "replicas" averaging
    namespace and the checkpoint service; `run` trains until cancelled; `stop` gives both
    back. Nothing to hand over on a planned stop: every replica holds the whole state."""

    name = "replica"

    def __init__(self, host, transport, membership, node_config, run: RunConfig):
        self.host, self.transport, self.membership, self.node_config, self.run_config = host, transport, membership, node_config, run
        self.data_dir = Path(node_config.data_dir)
        self.state_dir = self.data_dir / "state"
        self.download_dir = self.data_dir / "downloads"
        self.stats_path = self.data_dir / "replica-stats.json"
        self.model_config = run.model_config()
        self.train_config = run.train_config()
        codec_params = {"block_size": run.block_size} if run.codec == "int8" else {}
        self.averager = Averager(
            host,
            transport,
            averager_config(  # the [averager] settings; the run's codec and join window win
                node_config,
                swarm_id=node_config.swarm_id,
                namespace="replicas",
                codec=run.codec,
                codec_params=codec_params,
                join_timeout_s=run.join_timeout_s,
                bandwidth=node_config.bandwidth_mbps * 1e6 / 8,  # declared: slices sized by it, sends paced to it
            ),
            Faults(delay_parts_s=node_config.fault_delay_parts_s),
        )
        self.server = CheckpointServer(transport, DirectorySource(self.state_dir))  # serves once started
        self.model: GPT | None = None
        self.outer: OuterOptimizer | None = None
        self.inner: InnerTrainer | None = None
        self.round = 0
        self.hash = ""
        self.bytes_sent = 0
        self.history: list[dict[str, Any]] = []
        self._stop = False
        self._uploads: set[asyncio.Task] = set()
        self.pauses = PauseWatch()
        self.threads = node_config.torch_threads()
        self._inner_threads = self.threads
        self._compute_pool = ThreadPoolExecutor(1, thread_name_prefix="train", initializer=torch.set_num_threads, initargs=(self.threads,))
        self.slowdown = node_config.fault_slowdown
        self._out_of_step = False  # the last round failed: we may have been left behind
        self._last_members: dict = {}  # the member records last read from the DHT

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self.averager.start()
            self.server.start()
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

    async def _compute(self, fn, *args):
        """`fn(*args)` on the training thread: one thread, made at the start with the node's
        torch thread count, for everything that trains, evaluates or loads a model's state. (A
        thread of asyncio's shared pool may have computed before the count was set, and kept
        torch's default: on a 2-core machine shared by three replicas, two threads each and
        inner steps ten times slower.)"""
        return await asyncio.get_running_loop().run_in_executor(self._compute_pool, fn, *args)

    async def _train(self) -> None:
        try:
            corpus = await asyncio.to_thread(load_corpus, self.node_config.data or None)
        except DataError as e:  # the daemon checked it at start: it changed since
            log.error("cannot train: %s", e)
            raise
        nshards = self.node_config.num_shards
        shard = self.node_config.shard_index if self.node_config.shard_index >= 0 else shard_of(self.host.peer_id, nshards)
        self.corpus = corpus
        self.model = GPT(self.model_config)
        await self._wait_for_replicas()
        await self._obtain_state()
        batches = Batches(corpus.train, shard, nshards, self.train_config.batch_size, self.model_config.context, self.train_config.seed + shard)
        # in a thread: the first AdamW of a process imports torch._dynamo, seconds of work
        self.inner = await self._compute(InnerTrainer, self.model, self.train_config, batches)
        self.inner.step_count = self.round * self.run_config.inner_steps
        log.info(
            "replica: %s model (%d params), data %s shard %d/%d, %d threads, starting at outer step %d (hash %s)",
            self.run_config.model, sum(p.numel() for p in self.model.parameters()), corpus.source, shard, nshards, self.threads, self.round, self.hash,
        )
        val = await self._compute(self._evaluate)
        log.info("outer %d | val %.4f | hash %s (starting point)", self.round, val, self.hash)
        self.history.append({"outer_step": self.round, "val_loss": val, "state_hash": self.hash, "start": True, "time": time.time()})
        self._publish_progress(val)
        while not self._stop:
            if self.run_config.max_outer_steps and self.round >= self.run_config.max_outer_steps:
                losses = [e["val_loss"] for e in self.history if "val_loss" in e]
                log.info("replica: finished %d outer steps (val loss %.4f, hash %s)", self.round, losses[-1] if losses else float("nan"), self.hash)
                await asyncio.gather(*self._uploads, return_exceptions=True)
                await asyncio.Event().wait()  # keep serving our state and reporting until stopped
            await self._one_round()

    async def stop(self, planned: bool = True) -> None:
        self._stop = True
        for t in self._uploads:
            t.cancel()
        await asyncio.gather(*self._uploads, return_exceptions=True)
        await self.averager.close()
        self.server.close()
        self._compute_pool.shutdown(wait=False)  # its thread returns between inner steps

    # ---- one outer round -------------------------------------------------------------------------

    async def _one_round(self) -> None:
        t0 = time.monotonic()
        losses = await self._compute(self._inner_steps, self.run_config.inner_steps)
        if self._stop:
            return
        t_inner = time.monotonic() - t0
        paused = self.pauses.paused_since(t0)
        if paused:
            # frozen (SIGSTOP, a suspended machine): the swarm has most likely moved on. Its
            # state, hash-verified, instead of a round nobody else is in; and the pause is no
            # measure of how long our inner phase takes (it sizes the join window below)
            t_inner = max(t_inner - paused, 0.0)
            log.warning("outer step %d: woke up after a pause of %.0f s; looking for the swarm's state", self.round, paused)
            if await self._adopt_if_behind():
                return
            self._out_of_step = True  # not reachable yet, maybe: keep looking while we matchmake
        pseudo = self.outer.pseudo_gradient(self.model.parameters())
        expected = await self._replica_ids()
        key = f"outer-{self.round}-{self.hash[:8]}"
        t1 = time.monotonic()
        # wait for slower replicas up to one inner phase: replicas differ in speed, and a
        # window shorter than that difference would leave the fast and the slow ones alone
        window = max(self.run_config.join_timeout_s, t_inner)
        # after a failed round we may be the one left behind (cut off, or back from a pause the
        # clocks did not show): while we wait alone for others, look whether the swarm moved on
        watch = asyncio.create_task(self._watch_swarm(key)) if self._out_of_step else None
        failed: AveragingFailed | None = None
        try:
            avg, report = await self.averager.average(key, pseudo, weight=1.0, expected_peers=expected, state_key="outer", join_timeout_s=window)
        except AveragingFailed as e:
            failed = e
        finally:
            moved_on = await _finish(watch)
        if failed is not None:
            self._out_of_step = True
            log.warning("outer step %d: averaging failed (%s)", self.round, failed.report.reason)
            # late: the others may be averaging without us right now; wait for their result.
            # Otherwise the round failed for everyone: a quick look, then move on together.
            if not await self._catch_up(wait_s=window + t_inner + 5 if failed.report.late or moved_on else 3.0):
                # nobody got further: the round failed for everyone; keep our local progress
                # and move on together (the next pseudo-gradient covers both rounds' steps)
                self.round += 1
                self._publish_progress(None)
            return
        self._out_of_step = False
        new = self.outer.apply(avg)
        copy_into(self.model.parameters(), new)
        self.round += 1
        self.hash = self._hash()
        self.bytes_sent += report.bytes_sent
        val = await self._compute(self._evaluate)
        tokens = self.run_config.inner_steps * self.train_config.batch_size * self.model_config.context
        entry = {
            "outer_step": self.round, "val_loss": val, "train_loss": sum(losses) / len(losses), "state_hash": self.hash,
            "bytes_sent": self.bytes_sent, "members": len(report.survivors), "round_s": round(time.monotonic() - t1, 3),
            "tokens_per_s": round(tokens / t_inner, 1), "threads": self._inner_threads, "time": time.time(),
        }
        self.history.append(entry)
        log.info(
            "outer %d | train %.3f | val %.4f | %d replicas | %.0f tok/s | round %.2f s | %.1f KB sent | hash %s",
            self.round, entry["train_loss"], val, len(report.survivors), entry["tokens_per_s"], entry["round_s"], report.bytes_sent / 1e3, self.hash,
        )
        await self._save_state()
        self._publish_progress(val, tokens / t_inner / self.model_config.context)
        if self.round % self.run_config.checkpoint_every == 0 and report.leader == self.host.peer_id:
            task = asyncio.create_task(self._upload_checkpoint(self.round))
            self._uploads.add(task)
            task.add_done_callback(self._uploads.discard)

    def _inner_steps(self, n: int) -> list[float]:
        self._inner_threads = torch.get_num_threads()  # this thread's: what the steps ran with
        losses = []
        for _ in range(n):
            if self._stop:
                break
            t0 = time.monotonic()
            losses.append(self.inner.step())
            if self.slowdown > 1.0:  # fault injection: a slower machine
                time.sleep((self.slowdown - 1.0) * (time.monotonic() - t0))
        return losses or [math.nan]

    def _evaluate(self) -> float:
        return evaluate(self.model, self.corpus.val, self.train_config.batch_size, self.model_config.context, self.run_config.eval_batches, EVAL_SEED)

    def _hash(self) -> str:
        names = [n for n, _ in self.model.named_parameters()]
        return state_hash({**{f"param/{n}": p for n, p in zip(names, self.outer.params)}, **{f"momentum/{n}": b for n, b in zip(names, self.outer.buffers)}})

    def _publish_progress(self, val: float | None, samples_per_s: float | None = None) -> None:
        p = self.membership.progress
        p.step, p.state_hash = self.round, self.hash
        if val is not None:
            p.loss = val
        if samples_per_s is not None:
            p.samples_per_second = samples_per_s
        self.membership.heartbeat_soon()
        stats = {"outer_step": self.round, "state_hash": self.hash, "bytes_sent": self.bytes_sent, "val_loss": p.loss, "history": self.history}
        write_json(self.stats_path, stats)

    # ---- state: save, serve, obtain, catch up --------------------------------------------------

    def _state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        names = [n for n, _ in self.model.named_parameters()]
        return {
            "model": {n: p.clone() for n, p in zip(names, self.outer.params)},
            "outer": {n: b.clone() for n, b in zip(names, self.outer.buffers)},
        }

    async def _save_state(self) -> Path:
        path = await asyncio.to_thread(
            write_checkpoint_dir, self.state_dir, self.round, self._state_tensors(), self.model_config.to_dict(), self.hash
        )
        for old in sorted(self.state_dir.glob("step-*"))[:-KEEP_LOCAL_STATES]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def _adopt(self, state: dict[str, dict[str, torch.Tensor]], step: int, expected_hash: str | None) -> None:
        if "model" not in state:
            raise CheckpointDirError("the checkpoint has no model.safetensors")
        self.model.load_state_dict(state["model"])
        self.outer = OuterOptimizer(self.model.parameters(), self.train_config.outer_lr, self.train_config.outer_momentum)
        names = [n for n, _ in self.model.named_parameters()]
        momentum = state.get("outer")
        if momentum is not None:
            self.outer.load_state_dict({"params": self.outer.params, "momentum": [momentum[n] for n in names], "step": step})
        self.round = step
        self.hash = self._hash()
        if expected_hash and self.hash != expected_hash:
            raise CheckpointDirError(f"state of step {step} hashes to {self.hash}, its manifest says {expected_hash}")
        if self.inner is not None:
            self.inner.step_count = step * self.run_config.inner_steps

    async def _download_and_adopt(self, peer: str, step: int | None) -> bool:
        try:
            path = await download_checkpoint(self.transport, peer, self.download_dir, step=step)
            state = await self._compute(load_checkpoint_dir, path)
            manifest = await asyncio.to_thread(read_manifest, path)
            manifest_step = manifest["step"]
            model_cfg = manifest.get("model_config") or {}
            if model_cfg and GPTConfig.from_dict(model_cfg) != self.model_config:
                log.error("checkpoint %d from %s is for another model (%s); the run is %s", manifest_step, peer[-8:], model_cfg, self.run_config.model)
                return False
            self._adopt(state, manifest_step, manifest.get("state_hash") or None)
        except _PEER_ERRORS as e:
            log.warning("could not take the state from %s: %s", peer[-8:], e)
            return False
        finally:
            shutil.rmtree(self.download_dir, ignore_errors=True)
        await self._save_state()
        if self.history:  # a catch-up mid-run (the starting point is recorded by run_forever)
            self.history.append({"outer_step": self.round, "state_hash": self.hash, "caught_up_from": peer, "time": time.time()})
        self._publish_progress(None)
        log.info("replica: took outer step %d (hash %s) from %s", self.round, self.hash, peer[-8:])
        return True

    async def _peer_states(self) -> dict[str, tuple[int, str]]:
        """(round, hash) of the latest state of every other replica that answers."""
        members = await self._members()
        # and the members of our last round: our DHT may have lost its neighbours (a link that
        # was down) while those peers are still where they were
        peers = sorted(({p for p, rec in members.items() if rec.role == "replica"} | set(self.averager.last_members)) - {self.host.peer_id})

        async def one(peer):
            try:
                step, manifest = await fetch_manifest(self.transport, peer, timeout=3.0)
                return peer, (step, manifest.get("state_hash") or "")
            except CallTimeout:  # silent, or a connection a dead link left stuck: dial afresh next time
                await self.host.disconnect(peer)
                return peer, None
            except _PEER_ERRORS:
                return peer, None

        results = await asyncio.gather(*(one(p) for p in peers))
        return {p: s for p, s in results if s is not None}

    async def _obtain_state(self) -> None:
        """Peers first, then the coordinator's checkpoint, then (a new run) the seeded init."""
        while not self._stop:
            if await self._adopt_from_peers(mine=None):
                return
            coord = self.membership.coordinator
            if coord is not None:
                try:
                    await fetch_manifest(self.transport, coord, timeout=5.0)
                    if await self._download_and_adopt(coord, None):
                        return
                except RemoteError as e:
                    if e.code == "not_found":
                        await self._offer_initial_state(coord)
                        continue
                    log.warning("coordinator has no usable checkpoint: %s", e)
                except _PEER_ERRORS as e:
                    log.warning("cannot reach the coordinator for a checkpoint: %s", e)
            await asyncio.sleep(2.0)

    async def _offer_initial_state(self, coord: str) -> None:
        """A brand-new run: offer our seeded initialisation as checkpoint 0. The coordinator keeps
        the first one it gets; everyone (us included) then downloads that one."""
        model = init_model(self.model_config, self.train_config.seed)
        self.model.load_state_dict(model.state_dict())
        self.outer = OuterOptimizer(self.model.parameters(), self.train_config.outer_lr, self.train_config.outer_momentum)
        self.round, self.hash = 0, self._hash()
        path = await self._save_state()
        try:
            await upload_checkpoint(self.transport, coord, path)
            log.info("replica: offered the initial state (hash %s) as checkpoint 0", self.hash)
        except _PEER_ERRORS as e:
            log.info("the initial state came from another replica (%s)", e)
        shutil.rmtree(path, ignore_errors=True)

    async def _watch_swarm(self, key: str, every_s: float = 2.0) -> bool:
        """While the round of `key` matchmakes: once the other replicas are ahead of us, give
        the round up (we would wait alone for the whole join window) and catch up instead."""
        while True:
            await asyncio.sleep(every_s)
            best = choose_state((self.round, self.hash), await self._peer_states())
            if best is not None and best[0] > self.round and self.averager.abandon(key, f"the others are at outer step {best[0]}"):
                return True

    async def _catch_up(self, wait_s: float) -> bool:
        """After a failed round: if the other replicas got further, take their state."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self._stop:
            if await self._adopt_if_behind():
                return True
            await asyncio.sleep(1.0)
        return False

    async def _adopt_if_behind(self) -> bool:
        """One look at the other replicas' states; take theirs if it is ahead of ours."""
        return await self._adopt_from_peers(mine=(self.round, self.hash))

    async def _adopt_from_peers(self, mine: tuple[int, str] | None) -> bool:
        """Take the state `choose_state` picks among the other replicas' (None: we hold none)."""
        states = await self._peer_states()
        best = choose_state(mine, states)
        if best is not None:
            for peer, s in states.items():
                if s == best and await self._download_and_adopt(peer, best[0]):
                    return True
        return False

    async def _members(self) -> dict:
        """The swarm's member records from the DHT, within MEMBERS_TIMEOUT_S; else the last
        ones read. While a peer is cut off or frozen, a DHT look-up can wait on it for tens of
        seconds (measured: 31 s, with 40 inner steps taking 2): an outer step must not."""
        try:
            self._last_members = await asyncio.wait_for(read_members(self.host, self.node_config.swarm_id), MEMBERS_TIMEOUT_S)
        except TimeoutError:
            log.info("the DHT took over %.0f s to list the members: going by the last list", MEMBERS_TIMEOUT_S)
        return self._last_members

    async def _replica_ids(self) -> set[str]:
        """The replicas alive as far as the DHT shows, this one included."""
        members = await self._members()
        # records are re-published every ttl/3 s: an older one is most likely from a dead replica
        max_age = self.membership.config.record_ttl_s / 3 * 1.5
        fresh = [r for r in members.values() if r.role == "replica" and time.time() - r.issued_at < max_age]
        return {r.peer_id for r in fresh} | {self.host.peer_id}

    async def _count_replicas(self) -> int:
        return len(await self._replica_ids())

    async def _wait_for_replicas(self) -> None:
        if self.run_config.min_replicas <= 1:
            return
        while not self._stop and await self._count_replicas() < self.run_config.min_replicas:
            await asyncio.sleep(1.0)

    async def _upload_checkpoint(self, step: int) -> None:
        path = self.state_dir / step_dir_name(step)
        coord = self.membership.coordinator
        if coord is None:
            return
        try:
            await upload_checkpoint(self.transport, coord, path)
            log.info("checkpoint of outer step %d stored by the coordinator", step)
        except _PEER_ERRORS as e:
            log.warning("checkpoint of outer step %d not stored: %s", step, e)
