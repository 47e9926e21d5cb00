"""Pipeline roles (SWARM-style): stage servers hold one slice of the model, trainers push data through.

    StageServer   the "stage" role: one stage's layers and optimizer; serves StageCall
    Trainer       the "trainer" role: holds the data; sends micro-batches through one peer per stage
    StagePeers    a trainer's view of the peers serving each stage: who to call next, how long to wait

How a micro-batch travels is the run's `stage_routing`:
- "through" (the default): the trainer picks one peer per stage and makes one call, to the first
  stage's peer, naming the rest of the way (op `through`). Each stage runs its forward, calls the
  next one itself, runs its backward with the gradient that comes back and answers the loss, its
  input's gradient and every stage's own time (which the trainer's peer picks and deadlines
  use). Activations cross the network once, stage to stage; a stage sends them only to a peer the
  member records name a peer of the next stage. A call that fails on the way (a dead, frozen or
  garbling peer) comes back naming that peer: the trainer leaves it alone for its backoff and
  sends the micro-batch again another way; the stages before it drop its graphs, nothing of it
  was accumulated. Behind 100 Mbit/s links (bench/pipeline.py arm f) this trained 1.84x the
  samples/s of relaying, which sends every activation over the trainer's link twice; on one
  2-core machine the two are within noise (the trainer's relaying cost about 15 % of a core,
  the pipeline there is bound by compute and how many micro-batches are in flight).
- "relay": stage by stage through the trainer, which keeps each stage's input: forward on
  stages 0..S-2, `train` on the last (forward, loss and backward in one call), then backward on
  S-2..0. The backward goes to the peer that ran the forward, with only the gradient; where
  that peer is gone or no longer has the graph, the trainer sends the backward with the
  stage's input again to any peer of the stage, which recomputes the forward: a peer that dies
  or stalls loses nothing but the call in progress. (Recomputing every backward, as SWARM does,
  measured 0.73x the samples/s of torch.distributed.pipelining on this machine: a fourth more
  compute on every stage but the last; see bench/pipeline.py.)

Either way the peer that ran a forward keeps its autograd graph (at most `MAX_SAVED`, for
`SAVED_S`) for the backward. Optimizer steps do not wait for the graphs kept: a kept graph
saves a copy of the weights it used (one copy per parameter between two steps, PipeDream's
weight stashing), so its backward computes the gradient of the forward it ran.

A stage server takes the calls queued at the moment it is free as one batch (forwards that keep
no graph, recomputing backwards and train calls of the same shape, up to `MAX_BATCH_SAMPLES`),
so several trainers share one forward; it adds no waiting of its own. Gradients of every
backward accumulate; after `stage_step_samples` samples the server takes an AdamW step (the
run's learning rate schedule).

Steps clip gradients by one global norm, as one process clips the whole model's (what
Megatron-style pipelines do with an all-reduce of the norms; torch.distributed.pipelining leaves
each rank to clip its own). With no barrier between stages, the norms travel with the calls:
when a stage's step falls due it puts its gradient's squared norm in every answer from then on
(`norms2`, with a count of its steps so an older answer cannot bring an older norm back), the
trainer hands the latest of every stage on in each call, and the stage takes the step when the
next call arrives (or after `PENDING_S` without one), clipped by the norm of its own gradient and
the others' from that call. With synchronous steps and one peer per stage the next step's first
call carries exactly this step's norms: the stages clip as one process does (tests/
test_pipeline.py checks the weights against one process's). Asynchronous, or with several peers
per stage, the others' norms may be a step old. (Per stage, the loss at 6144 samples was 2.476
against one process's 2.622, a different algorithm: bench/pipeline.py arm a-stage-clip. Clipped
globally, the swarm's runs gave 2.558 to 2.593; the same global clip in one process with the
norm only summed in another order gave 2.552: at this setting rounding alone moves the loss by
that much, arm a-rounding.)

The peers of a stage stay in step: every `stage_sync_every_s` seconds of wall-clock time (the
same boundaries everywhere, so they arrive together and nobody waits) each averages its
pseudo-gradient (outer state minus its parameters) with the others of its stage, in the averager
namespace "stage-<i>", compressed with the run's codec, and applies an outer step of lr 1 and
momentum `stage_outer_momentum`. The default 0 is plain parameter averaging: with 2 peers per
stage and syncs every 10 s, loss 2.69 and 2.70 at 12288 samples against 2.88 and 2.90 with
Nesterov momentum 0.9 (bench/pipeline.py arm (d)). Afterwards they hold bitwise-identical
parameters: the steps a peer took while the round ran (calls are served meanwhile) are dropped.
Their AdamW state stays their own. A round's key carries the outer state's hash: peers whose
outer states differ never mix; after a failed round a peer takes a newer state its peers hold.
A stage's only peer (or one whose round found nobody) takes its parameters as its outer state.

Everything a peer sends is checked before any compute: tensors' headers and payloads (codecs),
shapes, dtypes, NaN/Inf, token ranges, the batch size. Bad input is refused with `bad_request`
naming the problem and scores the sender down; the server keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from protocol import RemoteProtocolError, StageCall, StageResult, decode_tensor, make_codec, pack_tensors, unpack_tensors
from protocol.manifest import step_dir_name
from protocol.tensors import EncodedTensor

from ..averaging import Averager, AveragingFailed, NamespaceTaken
from ..config import averager_config
from ..state.checkpoint_client import download_checkpoint, fetch_manifest, upload_checkpoint
from ..state.checkpoint_dir import CheckpointDirError, load_checkpoint_dir, read_manifest, write_checkpoint_dir
from ..models.data import Batches, DataError, load_corpus
from ..models.diloco import OuterOptimizer, adamw, copy_into, lr_at, state_hash
from ..net.membership import read_members
from ..osutil import woken, write_json
from protocol.records import parse_role_label, role_label

from .runner import Role, RoleError
from ..runconfig import RunConfig, RunConfigError
from .replica import choose_state
from ..models.stages import Stage, StageInputError, init_stage
from ..state.state_server import CheckpointServer, DirectorySource
from ..net.transport import NETWORK_ERRORS, HandlerTaken, RemoteError, RPCError

log = logging.getLogger(__name__)

MAX_BATCH_SAMPLES = 256  # sequences one call, or one batch of queued calls, may carry
MAX_ABS = 1e6  # |activation| or |gradient| beyond this is refused as garbage
PEERS_REFRESH_S = 2.0  # how often a trainer reads the stages' member records from the DHT
REPORT_EVERY = 8  # micro-batches per entry of a trainer's loss history
MAX_SAVED = 32  # forward graphs a stage server keeps for their backward (oldest dropped first)
SAVED_S = 60.0  # seconds a kept forward graph waits for its backward
KEEP_STATES = 2  # states a stage server keeps on disk (the latest is served)
MIN_RATE_BATCHES = 16  # batches a stage server computes before it reports how fast it is
HANDOVER_S = 60.0  # longest the last peer of a stage waits on SIGTERM for a peer to take its state
REPORT_S = 0.5  # a stage server's stats after its steps: written at most this often (syncs and the like at once)
PENDING_S = 1.0  # longest a due step waits for the next call (which brings the other stages' norms)


def activation_codec(run: RunConfig, n_embd: int):
    """The codec activations and their gradients travel with. int8 gets one scale per token's
    vector (a block of n_embd values): the residual stream's magnitude varies by token."""
    if run.activation_codec == "int8":
        return make_codec("int8", block_size=max(16, n_embd))
    return make_codec(run.activation_codec)


_TOKENS = make_codec("none")


def sync_averager(host, transport, node_config, run: RunConfig, namespace: str) -> Averager:
    """The averager of peers that synchronise every `stage_sync_every_s` (a stage's, an expert
    shard's, the trainers' dense parts): the run's codec, a join window of half the period."""
    codec_params = {"block_size": run.block_size} if run.codec == "int8" else {}
    config = averager_config(
        node_config, swarm_id=node_config.swarm_id, namespace=namespace, codec=run.codec, codec_params=codec_params,
        join_timeout_s=min(run.join_timeout_s, run.stage_sync_every_s / 2), bandwidth=node_config.bandwidth_mbps * 1e6 / 8,
    )  # fmt: skip
    return Averager(host, transport, config)


async def trainer_batches(host, node_config, run: RunConfig, context: int) -> tuple[Batches, int, int]:
    """A trainer's micro-batches: its shard of the corpus (--shard-index, else from its peer id),
    and (shard, number of shards). DataError when the corpus cannot be read."""
    from .replica import shard_of

    try:
        corpus = await asyncio.to_thread(load_corpus, node_config.data or None)
    except DataError as e:
        log.error("cannot train: %s", e)
        raise
    nshards = node_config.num_shards
    shard = node_config.shard_index if node_config.shard_index >= 0 else shard_of(host.peer_id, nshards)
    return Batches(corpus.train, shard, nshards, run.batch_size, context, run.seed + shard), shard, nshards


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def encode_floats(codec, t: torch.Tensor) -> EncodedTensor:
    return codec.encode(t.detach().to(torch.float32))


def decode_checked(enc: EncodedTensor, max_numel: int, what: str) -> torch.Tensor:
    """A tensor a peer sent, decoded; RemoteProtocolError naming `what` if it is malformed or
    holds NaN, Inf or absurd values."""
    try:
        t = decode_tensor(enc, max_numel=max_numel, max_abs=MAX_ABS)
    except RemoteProtocolError as e:
        raise RemoteProtocolError(f"{what}: {e}") from None
    return t


# ---- the stage server ------------------------------------------------------------------------


@dataclass
class _Pending:
    op: str
    x: torch.Tensor | None  # None: a backward from the graph this peer kept (`key`)
    extra: torch.Tensor | None  # grad (backward) or targets (train)
    key: tuple[str, str] | None = None  # (caller, micro-batch): the graph a forward keeps, or a backward uses
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def alone(self) -> bool:
        """Computed on its own: its graph is kept, or was."""
        return self.key is not None

    @property
    def samples(self) -> int:
        return (self.x if self.x is not None else self.extra).size(0)




class StageServer(Role):
    """The stage role: holds stage `index` of the run's cut and serves StageCall for it.

    Its state (the stage's outer parameters and momentum, after the last sync) is kept in
    DATA_DIR/stage-state and served to peers that take the stage later: a peer that joins the
    stage or is moved to it downloads the state from a peer of the stage, hash-verified, before
    it serves calls; the run's seeded initialisation only when no peer of the stage has one.
    A planned stop of the stage's last peer hands its state over (see `stop`)."""

    name = "stage"

    def __init__(self, host, transport, membership, node_config, run: RunConfig, index: int | None):
        try:
            self.plan = run.stage_plan()
        except RunConfigError as e:
            raise RoleError(str(e)) from None
        if index is None or not 0 <= index < len(self.plan):
            raise RoleError(f"stage {index} is not a stage of this run's cut (0..{len(self.plan) - 1})")
        self._setup(host, transport, membership, node_config, run, index, "stage", f"stage {index}", f"stage-{index}", role_label("stage", index))

    def _setup(self, host, transport, membership, node_config, run: RunConfig, index: int, kind: str, what: str, namespace: str, label: str) -> None:
        """What every server of a slot of the model (a stage, a shard of experts) holds: `kind`
        names its files, `what` its log lines, `namespace` its peers' averaging, `label` its
        member records' role."""
        self.host, self.transport, self.membership, self.node_config, self.run_config = host, transport, membership, node_config, run
        self.index, self.what, self.label = index, what, label
        self.model_config = run.model_config()
        self.train_config = run.train_config()
        self.codec = activation_codec(run, self.model_config.n_embd)
        self.clip_across = self.CLIP_ACROSS and run.stage_clip == "global"  # (stage_clip "stage": by our own norm, no waiting)
        self.max_numel = MAX_BATCH_SAMPLES * self.model_config.context * self.model_config.n_embd
        self.stats_path = Path(node_config.data_dir) / f"{kind}-stats.json"
        self.state_dir = Path(node_config.data_dir) / f"{kind}-state"
        self.download_dir = Path(node_config.data_dir) / f"{kind}-downloads"
        self.state_server = CheckpointServer(transport, DirectorySource(self.state_dir), on_served=self._on_served)
        self.state_step = 0  # the sync round of the outer state we hold (0: the run's initial weights)
        self.synced_hash = ""  # the hash of that state
        self._uploads: set[asyncio.Task] = set()
        self._uploading = ""  # the state dir an upload reads
        self.state_from = "init"  # where it came from: "init" or the peer id it was downloaded from
        self._served: dict[int, dict[str, set[str]]] = {}  # state step -> peer -> files it fetched in full
        self._leaving = False
        self._own: tuple[int, Path, dict] | None = None
        self.stage: Stage | None = None
        self.opt: torch.optim.AdamW | None = None
        self.steps = 0  # optimizer steps taken
        self.samples = 0  # samples whose gradients were accumulated (all steps)
        self._acc_samples = 0
        self._acc_calls = 0  # micro-batches in the current accumulation (gradients are averaged over them)
        self._hash, self._hash_version = "", -1  # (see `hash`)
        # kept: backwards through a kept graph (stale: of a forward on older weights than now);
        # failed_after: through calls whose later stage failed
        self.calls = {"forward": 0, "backward": 0, "train": 0, "through": 0, "refused": 0, "batched": 0, "kept": 0, "stale": 0, "failed_after": 0, "norms": 0}
        self.bytes_sent = self.bytes_received = 0  # of through calls to the next stage
        self.due_norm: tuple[int, float] = (0, -1.0)  # (steps due so far, the squared norm of the latest one's gradient); set as batches run
        self._others2: float | None = None  # the other stages' squared norms together, from the latest call that carried them all
        self._next_report, self._unreported = 0.0, False  # when a step may write the stats next; steps since the last
        self._norms_due = False  # _others2 came while our step was due: the step need not wait for the next call
        self.clips = {"global": 0, "alone": 0}  # steps clipped by every stage's norm, by this stage's alone
        self.last_norm = (-1.0, -1.0)  # the last step's gradient norm: this stage's, the other stages' (-1: not known)
        self._stages: dict[int, set[str]] = {}  # the peers of each stage, from the member records (through calls' routes)
        self._stages_read = -math.inf
        self._stages_reading: asyncio.Future | None = None
        self.history: list[dict[str, Any]] = []
        self._queue: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self._registration = None
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)  # (compute seconds, samples) of recent backward work
        self.outer: OuterOptimizer | None = None
        self.syncs = 0  # rounds that committed
        self._busy = asyncio.Lock()  # held while the parameters are used: a batch's compute, a sync
        self._stage_peers: list[str] = []  # the other peers of this stage, from the DHT
        self.averager = sync_averager(host, transport, node_config, run, namespace)
        self._saved: dict[tuple[str, str], tuple[float, torch.Tensor, torch.Tensor, int]] = {}  # key -> (when, input, output, weights_version)
        self.weights_version = 0  # counts changes of the parameters (steps, syncs, states taken)
        self._stash: dict[tuple, torch.Tensor] = {}  # a weight (or view of one) -> its value for the graphs kept since the last step
        self._param_storages: set[int] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stage", initializer=torch.set_num_threads, initargs=(node_config.torch_threads(),))

    async def _compute(self, fn, *args):
        """On the stage's one compute thread (see Replica._compute for why a thread of our own), for
        what may take long: building the stage, loading a state, a sync's arithmetic. Batches and
        optimizer steps run on the event loop's thread (see _serve_forever), both under `_busy`."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- lifecycle

    async def start(self) -> None:
        self._own = await asyncio.to_thread(self._own_state)  # what this node saved of this slot before it restarted
        if self._own is None:
            await asyncio.to_thread(shutil.rmtree, self.state_dir, True)  # another stage's, from an earlier role
        self.membership.progress.samples_per_second, self.membership.progress.measured_as = None, ""  # measured anew at this stage
        self.stage, self.opt = await self._compute(self._build)
        self.outer = OuterOptimizer(self.stage.parameters(), 1.0, self.run_config.stage_outer_momentum)
        try:
            await self.averager.start()
            self.state_server.start()
        except (NamespaceTaken, HandlerTaken) as e:
            raise RoleError(str(e)) from None
        await self._obtain_state()
        self.synced_hash = self.hash
        await self._save_state(self.state_step)
        try:
            self._registration = self.transport.serve({self.CALL: self._on_call}, owner=self.what)
        except HandlerTaken as e:
            raise RoleError(str(e)) from None
        log.info("%s: %s, %d params, activations %s, state of round %d from %s, hash %s",
                 self.what, self._describe(), self.stage.num_params(), self.codec.name, self.state_step, self.state_from[-8:], self.hash)  # fmt: skip
        self._report(start=True, state_from=self.state_from)
        self.membership.publish_soon()  # trainers find stage servers through the DHT

    CALL = StageCall  # the message it serves
    COORDINATOR_KEEPS = True  # the coordinator keeps checkpoints of this kind of state (and offers them)
    CLIP_ACROSS = True  # steps may clip by the norm of every stage's gradient (see `_step`; run setting stage_clip), not this stage's alone

    def _step_due(self) -> bool:
        return self._acc_samples >= self.run_config.stage_step_samples

    def _describe(self) -> str:
        first, last = self.plan[self.index]
        return f"stage {self.index} of {len(self.plan)}: blocks {first}..{last - 1}{' + embeddings' if self.stage.first else ''}{' + head' if self.stage.last else ''}"

    def _same_slot(self, label: str) -> bool:
        """Whether a member record's role label is a peer of this stage."""
        return stage_of_role(label) == self.index

    def _build(self) -> tuple[Stage, torch.optim.AdamW]:
        return self._with_optimizer(init_stage(self.model_config, self.index, self.plan, self.run_config.seed))

    def _with_optimizer(self, stage):
        return stage, adamw(stage.parameters(), self.train_config)

    async def run(self) -> None:
        syncing = asyncio.create_task(self._sync_forever(), name=f"stage-{self.index}-sync")
        try:
            await self._serve_forever()
        finally:
            syncing.cancel()
            await asyncio.gather(syncing, return_exceptions=True)

    async def _serve_forever(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                if self.clip_across and self._step_due():  # the next call brings the other stages' norms of this step
                    if self._norms_due:  # a norms call brought them
                        await self._step_now()
                        continue
                    if not await woken(self._wake, PENDING_S):  # none came: step with the norms heard last
                        await self._step_now()
                elif self._unreported:  # steps since the last report: written once the calls pause
                    if not await woken(self._wake, REPORT_S):
                        self._report()
                else:
                    await self._wake.wait()
            if self.clip_across and self._step_due():  # (due after the last batch: before this one uses the weights)
                await self._step_now()
            await self._busy.acquire()
            if not self._queue:  # refused while we waited (the role is leaving: stop)
                self._busy.release()
                continue
            batch = self._take_batch()
            try:
                # on the event loop's thread, which waits meanwhile: handing each batch to a
                # compute thread and back cost two thread wake-ups and GIL hand-overs (up to the
                # 5-ms switch interval each, while the loop decodes the next call), and each
                # stands on the pipeline's critical path (measured on 2 cores, 3 stages, arm (c)
                # of bench/pipeline.py: 151 -> 165 samples/s, three runs each)
                results = self._run_batch(batch)
            except (RPCError, RemoteProtocolError) as e:  # the call's own problem, found in compute: its caller hears it
                for p in batch:
                    if not p.done.done():
                        p.done.set_exception(e)
                continue
            except Exception as e:  # our bug, or the tensors together broke something: every caller hears it
                log.exception("%s: a %s batch failed", self.what, batch[0].op)
                for p in batch:
                    if not p.done.done():
                        p.done.set_exception(RPCError("internal", f"{self.what} failed on this batch: {type(e).__name__}"))
                continue
            finally:
                self._busy.release()
            for p, r in zip(batch, results):
                if not p.done.done():
                    p.done.set_result(r)
            await asyncio.sleep(0)  # their callers hand the results on (and new calls come in) before the next batch
            if self._step_due() and not self.clip_across:
                await self._step_now()

    async def _step_now(self) -> None:
        async with self._busy:
            self._step(*([self._others2] if self.clip_across else []))  # (on the loop's thread, as batches run)
        if time.monotonic() >= self._next_report:  # (a report hashes the parameters: not at every step)
            self._report()
        else:
            self._unreported = True

    # ---- keeping the stage's peers in step

    # ---- the stage's state: save, serve, obtain

    def _names(self) -> list[str]:
        return [n for n, _ in self.stage.named_parameters()]

    def _params_hash(self) -> str:
        return state_hash({n: p for n, p in self.stage.named_parameters()})

    @property
    def hash(self) -> str:
        """The hash of the parameters, computed when read after they changed (every change moves
        `weights_version`), not at every step: most steps' hashes are never read. Read on the
        event loop's thread, where steps run; what changes the parameters on the compute thread
        (a sync, a state taken) holds `_busy` and is awaited by the task that reads next."""
        if self._hash_version != self.weights_version:
            self._hash, self._hash_version = self._params_hash(), self.weights_version
        return self._hash

    def _meta(self) -> dict[str, Any]:
        """What a state is for: the model and where this stage cuts it (checked on download)."""
        return {**self.model_config.to_dict(), "stage": self.index, "blocks": list(self.plan[self.index]), "num_stages": len(self.plan)}

    async def _save_state(self, step: int, params: list[torch.Tensor] | None = None) -> None:
        """Write our outer state (or `params`, a planned leave's latest parameters) as state `step`."""
        names = self._names()
        model = {n: t.detach().clone() for n, t in zip(names, params if params is not None else self.outer.params)}
        tensors = {"model": model, "outer": {n: b.clone() for n, b in zip(names, self.outer.buffers)}}
        await asyncio.to_thread(write_checkpoint_dir, self.state_dir, step, tensors, self._meta(), state_hash(model))
        for old in sorted(self.state_dir.glob("step-*"))[:-KEEP_STATES]:
            if old.name != self._uploading:  # an upload reads it
                await asyncio.to_thread(shutil.rmtree, old, True)

    def _on_served(self, peer: str, step: int, name: str) -> None:
        self._served.setdefault(step, {}).setdefault(peer, set()).add(name)

    def _own_state(self) -> tuple[int, Path, dict] | None:
        """The newest state of this slot this node saved before (it restarted): (round, dir,
        manifest), None when there is none (or it is of another stage or model)."""
        for d in sorted(self.state_dir.glob("step-*"), reverse=True):
            try:
                manifest = read_manifest(d)
            except (CheckpointDirError, OSError):
                continue
            if manifest.get("model_config") == json.loads(json.dumps(self._meta())) and manifest.get("state_hash"):
                return int(manifest["step"]), d, manifest
        return None

    async def _obtain_state(self) -> None:
        """The newest state of the stage: from a peer of the stage, the coordinator's checkpoint
        of it, or what this node saved before it restarted, whichever is at the later sync round
        (peers first on a tie, our own disk last); else keep the seeded init."""
        offers = await self._offers()
        if self._own is not None:  # a host that was the only one of its slot loses nothing by a restart
            own_step, own_dir, own_manifest = self._own
            if not any(step >= own_step for step, *_ in offers) and await self._take_own(own_step, own_dir, own_manifest):
                return
        for step, _, peer, manifest in sorted(offers, key=lambda o: (o[0], o[1], random.random()), reverse=True):
            if await self._take_state(peer, step, manifest, None if peer != self.membership.coordinator else self.index):
                self.state_step, self.state_from = step, peer
                return

    async def _take_own(self, step: int, path: Path, manifest: dict) -> bool:
        try:
            state = await self._compute(load_checkpoint_dir, path)
            async with self._busy:
                await self._compute(self._adopt, state, manifest.get("state_hash") or "")
        except (CheckpointDirError, ValueError, KeyError, RuntimeError, OSError) as e:
            log.warning("%s: could not take the state it saved before (%s): %s", self.what, path, _short(e))
            return False
        self.state_step, self.state_from = step, "disk"
        return True

    async def _offers(self) -> list[tuple[int, int, str, dict]]:
        """The states of the stage its peers and the coordinator hold: (round, peers first, from, manifest)."""
        offers: list[tuple[int, int, str, dict]] = []  # (round, peers first, from, manifest)
        sources = [(p, None) for p in await self._read_stage_peers()]
        if self.membership.coordinator and self.COORDINATOR_KEEPS:
            sources.append((self.membership.coordinator, self.index))

        async def ask(peer: str, stage: int | None) -> None:
            try:
                step, manifest = await fetch_manifest(self.transport, peer, timeout=5.0, stage=stage)
            except (*NETWORK_ERRORS, ValueError) as e:
                if not (isinstance(e, RemoteError) and e.code == "not_found"):  # not_found: it has none (yet)
                    log.warning("%s: could not ask %s for the stage's state: %s", self.what, peer[-8:], _short(e))
                return
            if manifest.get("model_config") != self._meta():
                log.warning("%s: %s holds a state for %s, not this stage", self.what, peer[-8:], manifest.get("model_config"))
            else:
                offers.append((step, stage is None, peer, manifest))

        await asyncio.gather(*(ask(p, st) for p, st in sources))
        return offers

    async def _take_state(self, peer: str, step: int, manifest: dict, stage: int | None = None) -> bool:
        """Download state `step` from `peer` (of `stage`, from the coordinator) and adopt it;
        False, logged, when that fails."""
        try:
            path = await download_checkpoint(self.transport, peer, self.download_dir, step=step, manifest=manifest, timeout_s=120.0, stage=stage)
            state = await self._compute(load_checkpoint_dir, path)
            async with self._busy:
                await self._compute(self._adopt, state, manifest.get("state_hash") or "")
        except (*NETWORK_ERRORS, CheckpointDirError, ValueError, KeyError, RuntimeError) as e:
            log.warning("%s: could not take the state from %s: %s", self.what, peer[-8:], _short(e))
            return False
        finally:
            await asyncio.to_thread(shutil.rmtree, self.download_dir, True)
        return True

    def _adopt(self, state: dict[str, dict[str, torch.Tensor]], expected_hash: str) -> None:
        """Take a downloaded state: parameters = outer parameters; momentum; hash checked first.
        (The AdamW state stays ours.)"""
        names = self._names()
        model, momentum = state["model"], state["outer"]
        got = state_hash(model)
        if got != expected_hash:
            raise CheckpointDirError(f"the state hashes to {got}, its manifest says {expected_hash}")
        self.stage.load_state_dict(model)  # strict: the same parameter names and shapes, or RuntimeError
        self.outer = OuterOptimizer(self.stage.parameters(), 1.0, self.run_config.stage_outer_momentum)
        self.outer.load_state_dict({"params": self.outer.params, "momentum": [momentum[n] for n in names], "step": 0})
        self._stash = {}
        self.weights_version += 1

    # ---- keeping the stage's peers in step

    async def _sync_forever(self) -> None:
        period = self.run_config.stage_sync_every_s
        while True:
            n = math.floor(time.time() / period) + 1
            await asyncio.sleep(max(0.0, n * period - time.time()))
            self._stage_peers = await self._read_stage_peers()
            if self._stage_peers:
                await self._sync(n)
            else:
                await self._advance_alone(n)

    async def _advance_alone(self, n: int) -> None:
        """The stage's only peer: its parameters become its outer state as they are, so the state
        a peer that joins downloads is what this one trained, not where the last sync left it."""
        async with self._busy:
            params = [p.detach().clone() for p in self.stage.parameters()]
            self.outer.load_state_dict({"params": params, "momentum": self.outer.buffers, "step": self.outer.step_count})
            synced = self._params_hash()
        self.syncs += 1
        await self._save_state(n)
        self.state_step, self.synced_hash = n, synced  # (once on disk: what is offered as our state can be downloaded)
        if self.syncs % self.run_config.checkpoint_every == 0:
            self._upload(n)
        self._report(sync=n, group=1, state_hash=synced)

    def _upload(self, step: int) -> None:
        """State `step` to the coordinator, which keeps it once the stage's peers reported its
        hash: a stage whose every peer is gone starts again from there."""
        coordinator = self.membership.coordinator
        if coordinator is None or self._uploads or not self.COORDINATOR_KEEPS:  # the last upload is still on its way: skip this one
            return

        async def upload() -> None:
            self._uploading = step_dir_name(step)
            try:
                await upload_checkpoint(self.transport, coordinator, self.state_dir / step_dir_name(step))
                log.info("%s: the coordinator keeps state %d (hash %s)", self.what, step, self.synced_hash)
            except (*NETWORK_ERRORS, CheckpointDirError, OSError) as e:
                log.warning("%s: checkpoint %d not kept by the coordinator: %s", self.what, step, _short(e))
            finally:
                self._uploading = ""

        task = asyncio.create_task(upload())
        self._uploads.add(task)
        task.add_done_callback(self._uploads.discard)

    async def _read_stage_peers(self) -> list[str]:
        try:
            members = await asyncio.wait_for(read_members(self.host, self.node_config.swarm_id), 3.0)
        except Exception as e:  # the DHT may be briefly unreachable: no sync this time
            log.debug("%s: could not read member records: %s", self.what, e)
            return []
        fresh = time.time() - self.node_config.record_ttl_s
        return sorted(p for p, rec in members.items() if p != self.host.peer_id and self._same_slot(rec.role) and rec.issued_at > fresh)

    async def _sync(self, n: int) -> None:
        """One round with the stage's other peers. Calls are served while it runs (a dead or
        frozen peer of the stage must not stall the pipeline); the optimizer steps taken
        meanwhile are dropped when the round commits, so every peer leaves it with the same
        parameters (measured on loopback: rounds of 0.05-0.6 s against steps every ~0.3 s)."""
        async with self._busy:
            outer_hash = state_hash(dict(zip(self._names(), self.outer.params)))
            pseudo = await self._compute(self.outer.pseudo_gradient, list(self.stage.parameters()))
            steps_before = self.steps
        key = f"sync-{n}-{outer_hash[:8]}"
        try:
            avg, report = await self.averager.average(key, pseudo, weight=1.0, expected_peers=self._stage_peers, state_key="outer")
        except AveragingFailed as e:
            log.warning("%s: sync %d failed (%s); training on, the next one covers it", self.what, n, e.report.reason)
            if await self._catch_up() is None and e.report.late:
                # nobody else averaged and no peer of the stage answered: the peers the DHT still
                # lists are gone (a killed peer's record outlives it). Our parameters become the
                # stage's state, as for a lone peer: a peer that takes the stage next gets them.
                # A peer that answered with an older state (one that just joined, or lost a
                # round) takes ours now: our state stays as it was, so that both enter the next
                # round from the same hash (advancing alone here kept a joiner a round behind,
                # failing sync after sync, for up to 20 s)
                await self._advance_alone(n)
            return
        async with self._busy:
            await self._compute(self._apply_outer, avg)
            dropped, synced = self.steps - steps_before, self.hash  # (the next step changes self.hash)
        self.syncs += 1
        await self._save_state(n)  # what a peer that takes this stage next downloads
        self.state_step, self.synced_hash = n, synced  # (once on disk)
        if self.syncs % self.run_config.checkpoint_every == 0 and self.host.peer_id == min(report.members):
            self._upload(n)
        log.info("%s: sync %d with %d peers in %.2f s, hash %s (%d steps of the round dropped)", self.what, n, len(report.members), report.seconds, synced, dropped)
        self._report(sync=n, group=len(report.members), dropped_steps=dropped, state_hash=synced)

    async def _catch_up(self) -> bool | None:
        """After a failed sync: if the stage's other peers hold a newer state than ours (or, at
        the same round, the one more of them hold; a tie goes to the smaller hash), take it, so
        peers that drifted apart (a round that failed only for us, two peers that each thought
        they were alone) average together again. Our steps since our last sync are dropped.
        True: taken; False: ours is the one to keep; None: no peer of the stage answered."""
        held: dict[str, tuple[int, str]] = {}
        manifests: dict[str, dict] = {}

        async def ask(peer: str) -> None:
            try:
                step, manifest = await fetch_manifest(self.transport, peer, timeout=3.0)
            except (*NETWORK_ERRORS, ValueError):
                return
            if manifest.get("model_config") == self._meta() and manifest.get("state_hash"):
                held[peer], manifests[peer] = (step, manifest["state_hash"]), manifest

        await asyncio.gather(*(ask(p) for p in self._stage_peers))
        if not held:
            return None
        choice = choose_state((self.state_step, self.synced_hash), held)
        if choice is None:
            return False
        for peer in [p for p, h in held.items() if h == choice]:
            if not await self._take_state(peer, choice[0], manifests[peer]):  # (its manifest's hash is choice[1])
                continue
            self.state_step, self.synced_hash = choice
            await self._save_state(self.state_step)
            log.info("%s: took the stage's state of round %d (hash %s) from %s", self.what, choice[0], choice[1], peer[-8:])
            self._report(caught_up_from=peer, sync=choice[0], state_hash=choice[1])
            return True
        return False

    def _apply_outer(self, avg: list[torch.Tensor]) -> None:
        copy_into(self.stage.parameters(), self.outer.apply(avg))
        self._stash = {}
        self.weights_version += 1

    async def stop(self, planned: bool = True) -> None:
        """Give everything back. Planned (SIGTERM, Ctrl-C, a new assignment): new calls are
        refused (trainers retry them on other peers) after the batch in flight finished, and the
        stage's last peer hands its state over first."""
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        self._refuse_queued()
        if planned and self.stage is not None:
            await self._hand_over()
        for t in [*self._uploads, *([self._stages_reading] if self._stages_reading else [])]:
            t.cancel()
        await asyncio.gather(*self._uploads, *([self._stages_reading] if self._stages_reading else []), return_exceptions=True)
        await self.averager.close()
        self.state_server.close()
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        self._refuse_queued()
        self._pool.shutdown(wait=False)

    def _refuse_queued(self) -> None:
        while self._queue:
            p = self._queue.popleft()
            if not p.done.done():
                p.done.set_exception(RPCError("overloaded", f"{self.what} is leaving this peer"))

    async def _hand_over(self) -> None:
        """The stage's last peer does not take the stage with it: it saves its latest parameters
        (the steps since the last sync included) as a new state, leaves the swarm (the planner
        then moves a peer to the stage and the coordinator names it), and waits until a peer has
        downloaded that state, at most HANDOVER_S; not at all when nobody was named. Peers of the stage that stay keep the stage's state: nothing to hand."""
        if await self._read_stage_peers():
            return
        if self._step_due():  # a step that waited for the next call: nothing trained stays behind
            await self._step_now()
        step = max(self.state_step + 1, math.floor(time.time() / self.run_config.stage_sync_every_s))
        async with self._busy:
            params = [p.detach().clone() for p in self.stage.parameters()]
        await self._save_state(step, params)
        files = set(read_manifest(self.state_dir / step_dir_name(step))["files"])
        answer = await self.membership.leave()  # the coordinator re-plans without us: a peer moves to this stage
        named = [p for p in str((answer or {}).get("stage_peers", "")).split(",") if p and p != self.host.peer_id]
        if not named:  # no coordinator, or no peer it could move: nobody will come for the state
            log.warning("%s: its last peer is leaving and no peer takes the stage; its state (hash %s) stays in %s", self.what, self.hash, self.state_dir)
            return
        log.info("%s: its last peer is leaving; handing over its state (round %d, hash %s) to %s", self.what, step, self.hash, ", ".join(p[-8:] for p in named))
        deadline = time.monotonic() + HANDOVER_S
        while time.monotonic() < deadline:
            taken = sorted(p for p, got in self._served.get(step, {}).items() if got >= files)
            if taken:
                log.info("%s: %s took the stage's state (hash %s); leaving", self.what, taken[0][-8:], self.hash)
                self._report(handed_over_to=taken[0], handover_step=step)
                return
            await asyncio.sleep(0.2)
        log.warning("%s: no peer took the stage's state within %.0f s; it stays in %s", self.what, HANDOVER_S, self.state_dir)

    # ---- serving

    def _take_batch(self) -> list[_Pending]:
        """The first queued call and those queued behind it that can share its compute."""
        first = self._queue.popleft()
        if first.alone:
            return [first]
        batch, n = [first], first.samples
        rest: deque[_Pending] = deque()
        while self._queue:
            p = self._queue.popleft()
            if not p.alone and p.op == first.op and p.x.shape[1:] == first.x.shape[1:] and n + p.samples <= MAX_BATCH_SAMPLES:
                batch.append(p)
                n += p.samples
            else:
                rest.append(p)
        self._queue = rest
        if len(batch) > 1:
            self.calls["batched"] += len(batch)
        return batch

    async def _on_call(self, ctx) -> StageResult:
        req: StageCall = ctx.request
        if req.stage != self.index:
            raise RPCError("not_found", f"this peer serves stage {self.index}, not {req.stage}")
        self._heard(req.norms2)
        if req.op == "norms":
            self.calls["norms"] += 1
            steps, norm2 = self.due_norm
            return StageResult(norms2=(norm2,), norm_steps=(steps,))
        try:
            x, extra = self._inputs(req)
        except (RemoteProtocolError, StageInputError) as e:
            self.calls["refused"] += 1
            raise RemoteProtocolError(f"stage {self.index} {req.op}: {e}") from None  # bad_request; the sender is scored down
        if req.op == "through":
            return await self._through(ctx.peer_id, req, x, extra)
        keep = req.micro_batch and (req.op == "forward" or (req.op == "backward" and x is None))
        p = _Pending(req.op, x, extra, (ctx.peer_id, req.micro_batch) if keep else None)
        loss, out = await self._queued(p)
        self.calls[req.op] += 1
        self.calls["kept"] += p.op == "backward" and p.x is None
        tensors = {} if out is None else {"y" if req.op == "forward" else "grad": encode_floats(self.codec, out)}
        steps, norm2 = self.due_norm
        return StageResult(loss=loss, norms2=(norm2,), norm_steps=(steps,), **pack_tensors(tensors))

    def _heard(self, norms2: tuple[float, ...]) -> None:
        """A call's norms of every stage's latest step: ours clips by them with its own (only
        when it names them all; a caller that has not heard of every stage yet changes nothing).
        Heard while our step is due, they are that step's: it need wait no longer."""
        if len(norms2) == len(self.plan):
            others = [v for i, v in enumerate(norms2) if i != self.index]
            if all(v >= 0 for v in others):
                self._others2 = sum(others)
                if self._step_due():
                    self._norms_due = True
                    self._wake.set()

    async def _through(self, caller: str, req: StageCall, x: torch.Tensor, targets: torch.Tensor) -> StageResult:
        """A micro-batch on its way through this and the later stages (see StageCall): forward
        here, the next stage's call, backward here with the gradient it sends back."""
        t0 = time.monotonic()
        if self.stage.last:
            loss, gx = await self._queued(_Pending("train", x, targets))
            self.calls["through"] += 1
            steps, norm2 = self.due_norm
            return StageResult(loss=loss, times=(time.monotonic() - t0,), norms2=(norm2,), norm_steps=(steps,), **pack_tensors({"grad": encode_floats(self.codec, gx)}))
        nxt = req.route[0]
        if not await self._serves(nxt, self.index + 1):  # (or its record has not reached us yet: not the caller's fault)
            self.calls["failed_after"] += 1
            return StageResult(failed=nxt, failed_stage=self.index + 1, reason=f"{nxt} serves no stage {self.index + 1} in the member records stage {self.index}'s peer {self.host.peer_id} reads")
        key = (caller, f"through:{req.micro_batch}")
        _, y = await self._queued(_Pending("forward", x, None, key))
        own = time.monotonic() - t0
        call = StageCall(stage=self.index + 1, op="through", micro_batch=req.micro_batch, route=req.route[1:], deadlines=req.deadlines[1:], norms2=req.norms2,
                         **pack_tensors({"x": encode_floats(self.codec, y), "targets": _TOKENS.encode(targets)}))  # fmt: skip
        try:
            reply = await self.transport.send(nxt, call, timeout=req.deadlines[0], reuse=True)
            grad = self._through_answer(reply, len(req.route), tuple(y.shape))
        except (*NETWORK_ERRORS, RemoteProtocolError) as e:
            reply = StageResult(failed=nxt, failed_stage=self.index + 1, reason=_short(e))
        self.bytes_sent += len(call.data)
        if reply.failed:  # the trainer sends the micro-batch again another way
            self._saved.pop(key, None)
            self.calls["failed_after"] += 1
            return StageResult(failed=reply.failed, failed_stage=reply.failed_stage, reason=reply.reason)
        self.bytes_received += len(reply.data)
        t1 = time.monotonic()
        _, gx = await self._queued(_Pending("backward", None, grad, key))
        if self.stage.first and self._step_due() and all(n == self.due_norm[0] for n in reply.norm_steps):
            # the answer brought every later stage's norm of the step this backward completed
            # (their counts of steps due are ours): step now, not when the next call brings them
            self._heard((self.due_norm[1], *reply.norms2))
        self.calls["through"] += 1
        self.calls["kept"] += 1
        tensors = {} if gx is None or self.stage.first else {"grad": encode_floats(self.codec, gx)}
        steps, norm2 = self.due_norm
        return StageResult(loss=reply.loss, times=(own + time.monotonic() - t1, *reply.times), norms2=(norm2, *reply.norms2), norm_steps=(steps, *reply.norm_steps),
                           **pack_tensors(tensors))  # fmt: skip

    def _through_answer(self, reply, later: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The gradient of our output from the next stage's answer to a through call, checked (None
        when it reports a failure further on); RemoteProtocolError names what is wrong with it."""
        if not isinstance(reply, StageResult):
            raise RemoteProtocolError(f"answered a StageCall with {type(reply).__name__}")
        if reply.failed:
            if not self.index + 1 < reply.failed_stage < len(self.plan):
                raise RemoteProtocolError(f"reports a failure at stage {reply.failed_stage}, not a stage after it")
            return None
        if reply.loss is None or len(reply.times) != later or len(reply.norms2) != later:
            raise RemoteProtocolError(f"a through answer needs a loss, {later} stage times and {later} norms, got {reply.loss}, {len(reply.times)} and {len(reply.norms2)}")
        encoded = unpack_tensors(reply, self.max_numel)
        if set(encoded) != {"grad"}:
            raise RemoteProtocolError(f"a through answer carries {sorted(encoded)}, expected ['grad']")
        grad = decode_checked(encoded["grad"], self.max_numel, "grad")
        if tuple(grad.shape) != shape or grad.dtype != torch.float32:
            raise RemoteProtocolError(f"a through answer's grad is {grad.dtype} {tuple(grad.shape)}, expected float32 {shape}")
        return grad

    async def _queued(self, p: _Pending):
        self._queue.append(p)
        self._wake.set()
        return await p.done

    async def _serves(self, peer: str, stage: int) -> bool:
        """Whether the member records name `peer` a peer of `stage`: a through call sends our
        activations only to a member of the next stage, not wherever a caller says. A peer not
        in our view makes us read the records again, once for all callers waiting, at most every
        PEERS_REFRESH_S (a peer that just joined is named by a trainer that read them later)."""
        if peer in self._stages.get(stage, ()):
            return True
        if self._stages_reading is None:
            self._stages_reading = asyncio.ensure_future(self._read_stages())
        reading = self._stages_reading
        try:
            await asyncio.shield(reading)
        finally:
            if self._stages_reading is reading and reading.done():
                self._stages_reading = None
        return peer in self._stages.get(stage, ())

    async def _read_stages(self) -> None:
        await asyncio.sleep(max(0.0, self._stages_read + PEERS_REFRESH_S - time.monotonic()))
        self._stages_read = time.monotonic()
        try:
            members = await asyncio.wait_for(read_members(self.host, self.node_config.swarm_id), 3.0)
        except Exception as e:  # the DHT may be briefly unreachable: the view stays as it was
            log.debug("%s: could not read member records: %s", self.what, e)
            return
        self._stages = {s: set(ps) for s, ps in peers_by_stage(members, self.node_config.record_ttl_s).items()}

    def _inputs(self, req: StageCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode and check what a call carries, before any compute; raises RemoteProtocolError
        or StageInputError naming the problem."""
        encoded = unpack_tensors(req, self.max_numel)
        want = {"forward": {"x"}, "backward": {"x", "grad"}, "train": {"x", "targets"}, "through": {"x", "targets"}}[req.op]
        if req.op == "through" and len(req.route) != len(self.plan) - 1 - self.index:
            raise StageInputError(f"a through call to stage {self.index} names a peer for each of the {len(self.plan) - 1 - self.index} stages after it, got {len(req.route)}")
        if req.op == "train" and not self.stage.last:
            raise StageInputError(f"train goes to the last stage ({len(self.plan) - 1}), not to stage {self.index}")
        if req.op in ("forward", "backward") and self.stage.last:
            raise StageInputError(f"the last stage takes train calls (forward, loss and backward at once), not {req.op}")
        if req.op == "backward" and set(encoded) == {"grad"}:  # from the graph its forward kept here
            if not req.micro_batch:
                raise StageInputError("a backward without the stage's input must name its micro-batch")
            grad = decode_checked(encoded["grad"], self.max_numel, "grad")
            if grad.dtype != torch.float32 or grad.dim() != 3 or grad.size(2) != self.model_config.n_embd:
                raise StageInputError(f"grad must be float32 (batch, time, {self.model_config.n_embd}), got {grad.dtype} {tuple(grad.shape)}")
            return None, grad
        if set(encoded) != want:
            raise StageInputError(f"{req.op} carries tensors {sorted(want)}, got {sorted(encoded)}")
        if self.stage.first and encoded["x"].codec != "none":
            raise StageInputError(f"token ids travel uncompressed, got codec {encoded['x'].codec}")
        x = decode_checked(encoded["x"], self.max_numel, "x")  # (refuses NaN, Inf and values past MAX_ABS)
        self.stage.check_input(x, finite=False)
        if x.size(0) > MAX_BATCH_SAMPLES:
            raise StageInputError(f"{x.size(0)} sequences in one call, at most {MAX_BATCH_SAMPLES}")
        extra = None
        if req.op == "backward":
            extra = decode_checked(encoded["grad"], self.max_numel, "grad")
            want_shape = (*x.shape[:2], self.model_config.n_embd)
            if tuple(extra.shape) != want_shape or extra.dtype != torch.float32:
                raise StageInputError(f"grad must be float32 {want_shape} (the stage's output), got {extra.dtype} {tuple(extra.shape)}")
        elif req.op in ("train", "through"):
            extra = decode_checked(encoded["targets"], self.max_numel, "targets")
            if extra.dtype != torch.int64 or tuple(extra.shape) != tuple(x.shape[:2]):
                raise StageInputError(f"targets must be int64 {tuple(x.shape[:2])}, got {extra.dtype} {tuple(extra.shape)}")
            vocab = self.model_config.vocab_size
            if int(extra.min()) < 0 or int(extra.max()) >= vocab:
                raise StageInputError(f"targets must be token ids in [0, {vocab}), got {int(extra.min())}..{int(extra.max())}")
        return x, extra

    # ---- compute (on the event loop's thread, under _busy)

    def _run_batch(self, batch: list[_Pending]) -> list[tuple[float | None, torch.Tensor | None]]:
        t0 = time.thread_time()  # CPU time of this thread: time others had the core is not our speed
        if batch[0].alone:
            return [self._run_kept(batch[0], t0)]
        op, sizes = batch[0].op, [p.samples for p in batch]
        x = torch.cat([p.x for p in batch]) if len(batch) > 1 else batch[0].x
        stage = self.stage
        if op == "forward":
            with torch.no_grad():
                y = stage(x, checked=True)
            self._rate.append((time.thread_time() - t0, 0))
            return [(None, y_i) for y_i in y.split(sizes)]
        if not stage.first:
            x = x.detach().requires_grad_(True)
        if op == "backward":
            grad = torch.cat([p.extra for p in batch]) if len(batch) > 1 else batch[0].extra
            stage(x, checked=True).backward(grad)
            losses = [None] * len(batch)
        else:  # train: each micro-batch's loss is its own mean, as if it had come alone
            targets = torch.cat([p.extra for p in batch]) if len(batch) > 1 else batch[0].extra
            logits, _ = stage(x, checked=True)
            per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none").view(targets.shape)
            means = [m.mean() for m in per_token.split(sizes)]
            torch.stack(means).sum().backward()
            losses = [m.item() for m in means]
            if not all(math.isfinite(v) for v in losses):  # nothing of it is kept
                self.opt.zero_grad(set_to_none=True)
                self._acc_samples = self._acc_calls = 0
                raise FloatingPointError(f"non-finite loss {losses}")
        self._accumulated(sum(sizes), len(batch), t0)
        grads = x.grad.split(sizes) if x.grad is not None else [None] * len(batch)
        return list(zip(losses, grads))

    def _expire_saved(self, now: float) -> None:
        for key in [k for k, (when, *_) in self._saved.items() if now - when > SAVED_S]:
            del self._saved[key]  # their trainers went elsewhere

    def _make_room(self, limit: int) -> None:
        """Room for one more kept graph: the oldest go past `limit`."""
        while len(self._saved) >= limit:
            del self._saved[next(iter(self._saved))]

    def _stash_weights(self, t: torch.Tensor) -> torch.Tensor:
        """What a kept graph saves of a weight (the parameter, or a view of it such as the
        transpose a linear layer saves): a copy, shared by the graphs kept until the weights
        change, so an optimizer step in between does not touch what their backward uses."""
        if t.untyped_storage().data_ptr() not in self._param_storages:
            return t
        key = (t.untyped_storage().data_ptr(), tuple(t.shape), t.stride(), t.storage_offset())
        kept = self._stash.get(key)
        if kept is None:
            kept = self._stash[key] = t.detach().clone()
        return kept

    def _accumulated(self, samples: int, calls: int, t0: float) -> None:
        due = self._step_due()
        self._acc_samples += samples
        self._acc_calls += calls
        self.samples += samples
        self._rate.append((time.thread_time() - t0, samples))
        if self.clip_across and not due and self._step_due():  # our part of the step's global norm, in the answers from now on
            self.due_norm = (self.due_norm[0] + 1, self._own_norm2())

    def _own_norm2(self) -> float:
        """The squared norm of the gradient accumulated here, averaged per micro-batch as the step takes it."""
        norms = [p.grad.detach().norm() for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        return (torch.stack(norms).norm().item() / max(self._acc_calls, 1)) ** 2 if norms else 0.0

    def _run_kept(self, p: _Pending, t0: float) -> tuple[float | None, torch.Tensor | None]:
        """A forward that keeps its graph, or the backward through a kept graph."""
        if p.op == "forward":
            now = time.monotonic()
            self._expire_saved(now)
            self._make_room(MAX_SAVED)
            x = p.x if self.stage.first else p.x.detach().requires_grad_(True)
            self._param_storages = {q.untyped_storage().data_ptr() for q in self.stage.parameters()}
            with torch.autograd.graph.saved_tensors_hooks(self._stash_weights, _same):
                y = self.stage(x, checked=True)
            self._saved[p.key] = (now, x, y, self.weights_version)
            self._rate.append((time.thread_time() - t0, 0))
            return None, y.detach()
        kept = self._saved.pop(p.key, None)
        if kept is None:
            raise RPCError("not_found", f"no forward of micro-batch {p.key[1]!r} kept here: send the stage's input")
        _, x, y, version = kept
        if p.extra.shape != y.shape:
            raise RemoteProtocolError(f"stage {self.index} backward: grad has shape {tuple(p.extra.shape)}, the forward gave {tuple(y.shape)}")
        y.backward(p.extra)
        self.calls["stale"] += version != self.weights_version  # its forward ran on weights older than these
        self._accumulated(x.size(0), 1, t0)
        return None, x.grad

    def _step(self, others2: float | None = None) -> None:
        """An optimizer step on the gradients accumulated since the last, averaged per micro-batch,
        clipped to the run's max norm: by the norm of every stage's gradient together when
        `others2` (the other stages' squared norms) is known, as one process clips the whole
        model's (torch's clip_grad_norm_), else by this stage's alone."""
        params = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        for p in params:
            p.grad.div_(max(self._acc_calls, 1))
        norm = None
        if self.train_config.grad_clip > 0 and params:
            own = torch.stack([p.grad.detach().norm() for p in params]).norm()
            norm = own if others2 is None else (own.double() ** 2 + others2).sqrt().float()
            coef = torch.clamp(self.train_config.grad_clip / (norm + 1e-6), max=1.0)
            self.last_norm = (float(own), -1.0 if others2 is None else math.sqrt(others2))  # (reported with the step)
            for p in params:
                p.grad.mul_(coef)
            self.clips["alone" if others2 is None else "global"] += 1
        stepped = norm is None or bool(torch.isfinite(norm))
        if not stepped:
            log.warning("%s: non-finite gradient norm; dropping %d samples' gradients", self.what, self._acc_samples)
        else:
            for g in self.opt.param_groups:
                g["lr"] = lr_at(self.steps, self.train_config)
            self.opt.step()
            self._stash = {}
            self.weights_version += 1
        self.opt.zero_grad(set_to_none=True)
        self._acc_samples = self._acc_calls = 0
        self._norms_due = False
        self.steps += stepped

    # ---- reporting

    def samples_per_second(self) -> float | None:
        """What this peer can do: samples trained (forward and backward) per second of its
        compute, over its recent batches. Not what it did: in a pipeline every stage does the
        pipeline's pace; the planner needs each stage's capacity to find the bottleneck."""
        if len(self._rate) < MIN_RATE_BATCHES:  # too few batches at this stage to say
            return None
        busy = sum(s for s, _ in self._rate)
        return sum(n for _, n in self._rate) / busy if busy > 0 else None

    def _slot_stats(self) -> dict[str, Any]:
        return {"stage": self.index, "num_stages": len(self.plan), "blocks": list(self.plan[self.index])}

    def _report(self, **entry: Any) -> None:
        self._next_report, self._unreported = time.monotonic() + REPORT_S, False
        p = self.membership.progress
        p.step, p.state_hash = self.state_step, self.synced_hash  # the same on every peer of the stage after a sync
        rate = self.samples_per_second()
        if rate is not None:
            p.samples_per_second, p.measured_as = rate, self.label
        self.history.append({"step": self.steps, "samples": self.samples, "state_hash": self.hash, "time": time.time(), "norms": self.last_norm, **entry})
        del self.history[:-200]
        stats = {
            **self._slot_stats(),
            "params": sorted(n for n, _ in self.stage.named_parameters()),
            "num_params": self.stage.num_params(),
            "steps": self.steps,
            "syncs": self.syncs,
            "samples": self.samples,
            "state_hash": self.hash,
            "calls": self.calls,
            "clips": self.clips,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "samples_per_second": rate,
            "history": self.history,
        }
        write_json(self.stats_path, stats)


# ---- the trainer ------------------------------------------------------------------------------


class NoStagePeer(Exception):
    """No peer serves a stage (yet)."""


@dataclass
class _PeerStats:
    ema_s: float | None = None  # smoothed seconds per call
    inflight: int = 0
    banned_until: float = 0.0
    backoff_s: float = 0.0
    failures: int = 0
    last_pick: float | None = None  # when it was last chosen (monotonic)


class StagePeers:
    """Which peer to call for a stage, and how long to wait for it. Pure bookkeeping, clock passed in.

    The pick is by expected completion time: a peer's smoothed call time times the calls it
    would then have in flight from us; a peer never measured counts as instant, so new peers are
    tried at once. A measured peer not chosen for `reprobe_s` (its smoothed time, once slow, would
    keep it out for good: it measured slow while it started, say) gets the next call, when none
    is in flight to it: its time stays current, and so does the rate the planner sees for it. A
    failed or timed-out peer is left alone for a backoff (1 s, doubling per failure in a row, at
    most `max_backoff_s`); a success clears it. The deadline of a call is `timeout_factor` times
    the peer's smoothed call time, at least `min_timeout_s`."""

    def __init__(self, min_timeout_s: float = 2.0, first_timeout_s: float = 10.0, timeout_factor: float = 8.0, max_backoff_s: float = 30.0, reprobe_s: float = 5.0):
        self.min_timeout_s, self.first_timeout_s, self.timeout_factor, self.max_backoff_s = min_timeout_s, first_timeout_s, timeout_factor, max_backoff_s
        self.reprobe_s = reprobe_s
        self.stages: dict[int, list[str]] = {}
        self.peers: dict[str, _PeerStats] = {}
        self.announced: dict[str, float] = {}  # the load a peer announced in its record: breaks ties between peers never measured

    def update(self, stages: dict[int, list[str]]) -> None:
        self.stages = {s: sorted(ps) for s, ps in stages.items()}
        for ps in self.stages.values():
            for p in ps:
                self.peers.setdefault(p, _PeerStats())

    def choose(self, stage: int, now: float, avoid: set[str] = frozenset()) -> str:
        """The peer to call; NoStagePeer if none serves the stage or all are banned."""
        candidates = [p for p in self.stages.get(stage, ()) if self.peers[p].banned_until <= now]
        if not candidates:
            raise NoStagePeer(f"no peer serves stage {stage}" if not self.stages.get(stage) else f"every peer of stage {stage} failed lately")
        fresh = [p for p in candidates if p not in avoid] or candidates

        def expected(p: str) -> tuple[float, float, float]:
            st = self.peers[p]
            return ((st.ema_s or 0.0) * (st.inflight + 1), self.announced.get(p, 0.0), random.random())

        def unpicked_for(p: str) -> float:
            st = self.peers[p]
            return -1.0 if st.last_pick is None or st.inflight else now - st.last_pick

        stalest = max(fresh, key=unpicked_for)
        peer = stalest if unpicked_for(stalest) > self.reprobe_s else min(fresh, key=expected)
        self.peers[peer].last_pick = now
        return peer

    def timeout(self, peer: str) -> float:
        st = self.peers[peer]
        if st.ema_s is None:
            return self.first_timeout_s
        return max(self.min_timeout_s, self.timeout_factor * st.ema_s)

    def succeeded(self, peer: str, seconds: float) -> None:
        st = self.peers[peer]
        st.ema_s = seconds if st.ema_s is None else 0.8 * st.ema_s + 0.2 * seconds
        st.backoff_s, st.failures = 0.0, 0

    def failed(self, peer: str, now: float) -> float:
        """Ban the peer for its backoff; returns the ban's length. Calls that were in flight
        together and fail together (a peer that froze) count as one failure."""
        st = self.peers[peer]
        if st.banned_until > now:
            return st.banned_until - now
        st.failures += 1
        st.backoff_s = min(self.max_backoff_s, max(1.0, st.backoff_s * 2))
        st.banned_until = now + st.backoff_s
        return st.backoff_s


def peers_by_stage(members: dict[str, Any], ttl_s: float) -> dict[int, list[str]]:
    """stage -> the peers whose member record (fresher than `ttl_s`) names them a peer of it."""
    stages: dict[int, list[str]] = {}
    for peer, rec in members.items():
        s = stage_of_role(rec.role)
        if s is not None and time.time() - rec.issued_at < ttl_s:
            stages.setdefault(s, []).append(peer)
    return stages


def stage_of_role(label: str) -> int | None:
    """The stage of a member record's role label ("stage:2" -> 2), None for other roles."""
    role, slot = parse_role_label(label)
    return int(slot) if role == "stage" and slot.isdigit() else None


class Trainer(Role):
    """The trainer role: feeds micro-batches of `batch_size` sequences through the stages,
    `micro_batches_in_flight` at a time, and reports the training loss. A micro-batch is retried
    call by call on other peers until it completes: none is dropped for a peer's failure."""

    name = "trainer"

    def __init__(self, host, transport, membership, node_config, run: RunConfig):
        try:
            self.plan = run.stage_plan()
        except RunConfigError as e:
            raise RoleError(str(e)) from None
        self.host, self.transport, self.membership, self.node_config, self.run_config = host, transport, membership, node_config, run
        self.model_config = run.model_config()
        self.codec = activation_codec(run, self.model_config.n_embd)
        self.max_numel = MAX_BATCH_SAMPLES * self.model_config.context * max(self.model_config.n_embd, 1)
        self.peers = StagePeers()
        self.stats_path = Path(node_config.data_dir) / "trainer-stats.json"
        self.micro_batches = 0
        self.lost = 0  # micro-batches given up (only for input a peer refuses as ours to fix)
        self.retries = 0
        self.bytes_sent = self.bytes_received = 0
        self.history: list[dict[str, Any]] = []
        self._losses: list[float] = []
        self.first_loss: float | None = None  # the mean of the first REPORT_EVERY micro-batches
        self._norms: dict[int, tuple[str, int, float]] = {}  # stage -> (peer, its steps due, squared norm of the latest): handed on in every call
        self._step_peers: set[tuple[int, str]] = set()  # (stage, peer) that answered since the last step's norms went out
        self._telling: set[asyncio.Task] = set()
        self._stages_known = asyncio.Event()
        self._t0 = time.monotonic()

    async def start(self) -> None:
        pass

    async def stop(self, planned: bool = True) -> None:
        pass

    async def run(self) -> None:
        batches, shard, nshards = await trainer_batches(self.host, self.node_config, self.run_config, self.model_config.context)
        refresh = asyncio.create_task(self._refresh_peers(), name="stage-peers")
        tasks: set[asyncio.Task] = set()
        try:
            await self._stages_known.wait()
            log.info("trainer: %d stages, micro-batches of %d, %d in flight, activations %s, data shard %d/%d",
                     len(self.plan), self.run_config.batch_size, self.run_config.micro_batches_in_flight, self.codec.name, shard, nshards)  # fmt: skip
            self._t0 = time.monotonic()
            n = 0
            send = self._micro_batch_through if self.run_config.stage_routing == "through" else self._micro_batch
            # synchronous_steps: the micro-batches of one stage step in flight at a time
            window = self.run_config.stage_step_samples // self.run_config.batch_size if self.run_config.synchronous_steps else 0
            while True:
                new_step = bool(window and n and n % window == 0 and not tasks)  # the last step's micro-batches all came back
                while len(tasks) < self.run_config.micro_batches_in_flight and not (window and n % window == 0 and tasks):
                    x, y = batches.next()
                    tasks.add(asyncio.create_task(send(f"{self.host.peer_id[-6:]}-{n}", x, y)))
                    n += 1
                if new_step and self.run_config.stage_clip == "global":  # after the step's micro-batches: theirs are the calls the first stage waits for
                    self._tell_norms()
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    loss = t.result()
                    if loss is None:
                        self.lost += 1
                    else:
                        self._record(loss)
        finally:
            for t in (refresh, *tasks, *self._telling):
                t.cancel()
            await asyncio.gather(refresh, *tasks, *self._telling, return_exceptions=True)

    def _tell_norms(self) -> None:
        """Synchronous steps: a step's micro-batches all came back, and with them every stage's
        norm of the step. The peers of the later stages hear them now (a norms call), not when the
        next micro-batch reaches them: the stages then step side by side instead of one after
        another, each on the way of the next step's first micro-batch (the first stage hears them
        with that micro-batch)."""
        norms2, peers = self._norms2(), sorted(p for p in self._step_peers if p[0] > 0)
        self._step_peers.clear()
        if min(norms2, default=-1.0) < 0:
            return
        for stage, peer in peers:
            task = asyncio.create_task(self._send_norms(stage, peer, norms2))
            self._telling.add(task)
            task.add_done_callback(self._telling.discard)

    async def _send_norms(self, stage: int, peer: str, norms2: tuple[float, ...]) -> None:
        try:
            await self.transport.send(peer, StageCall(stage=stage, op="norms", norms2=norms2), timeout=self.peers.timeout(peer), reuse=True)
        except (*NETWORK_ERRORS, RemoteProtocolError) as e:  # only a hint: the next micro-batch brings the norms too
            log.debug("norms to stage %d peer %s: %s", stage, peer[-8:], _short(e))

    async def _refresh_peers(self) -> None:
        """Who serves which stage, from the DHT's member records, in the background: a step never
        waits on the DHT."""
        while True:
            try:
                members = await read_members(self.host, self.node_config.swarm_id)
            except Exception as e:  # the DHT may be briefly unreachable
                log.debug("could not read member records: %s", e)
                members = {}
            stages = {s: ps for s, ps in peers_by_stage(members, self.node_config.record_ttl_s).items() if s < len(self.plan)}
            if members:
                self.peers.update(stages)
            if all(stages.get(s) for s in range(len(self.plan))):
                self._stages_known.set()
            await asyncio.sleep(PEERS_REFRESH_S if self._stages_known.is_set() else 0.5)

    def _norms2(self) -> tuple[float, ...]:
        """What every call carries: each stage's latest gradient norm we heard (-1: none yet)."""
        return tuple(self._norms[s][2] if s in self._norms else -1.0 for s in range(len(self.plan)))

    def _heard(self, peers: list[str], first: int, reply: StageResult) -> None:
        """The norms an answer carries, of the stages from `first` on (served by `peers`): the
        newest step of each wins, so answers that cross on the way do not bring an older one back."""
        for i, (steps, norm2) in enumerate(zip(reply.norm_steps, reply.norms2)):
            if i >= len(peers) or norm2 < 0:
                continue
            self._step_peers.add((first + i, peers[i]))
            held = self._norms.get(first + i)
            if held is None or held[0] != peers[i] or steps > held[1]:
                self._norms[first + i] = (peers[i], steps, norm2)

    async def _micro_batch(self, name: str, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One micro-batch through every stage and back; its loss, or None if it was given up."""
        last = len(self.plan) - 1
        try:
            inputs, forward_peers = [x], []
            for s in range(last):
                (out,), _, peer = await self._call(s, "forward", name, {"x": inputs[-1]}, ("y",))
                inputs.append(out)
                forward_peers.append(peer)
            outs, loss, _ = await self._call(last, "train", name, {"x": inputs[-1], "targets": y}, ("grad",) if last else ())
            grad = outs[0] if last else None
            for s in range(last - 1, -1, -1):
                want = ("grad",) if s > 0 else ()
                outs = await self._backward_kept(s, forward_peers[s], name, grad, want, inputs[s].shape[:2])
                if outs is None:  # that peer is gone or kept no graph: recompute, on any peer of the stage
                    outs, _, _ = await self._call(s, "backward", name, {"x": inputs[s], "grad": grad}, want)
                grad = outs[0] if want else None
            return loss
        except _GiveUp as e:
            log.error("micro-batch %s given up: %s", name, e)
            return None

    async def _micro_batch_through(self, name: str, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One micro-batch sent through every stage in one call to the first (op `through`): the
        stages hand activations on to each other. The peers are picked here, stage by stage; if a
        call on the way fails, the answer names the peer, which is left alone for its backoff, and
        the micro-batch goes again another way. Its loss, or None if it was given up."""
        stages = len(self.plan)
        encoded = pack_tensors({"x": _TOKENS.encode(x), "targets": _TOKENS.encode(y)})
        tried: set[str] = set()
        refused: list[str] = []
        while True:
            now = time.monotonic()
            try:
                route = [self.peers.choose(s, now, tried) for s in range(stages)]
            except NoStagePeer:
                await asyncio.sleep(0.2)  # a peer comes back from its ban, or the DHT names a new one
                continue
            waits = [self.peers.timeout(p) for p in route]
            deadlines = [sum(waits[i:]) for i in range(stages)]  # each call waits for the stages after it too
            request = StageCall(stage=0, op="through", micro_batch=name, route=tuple(route[1:]), deadlines=tuple(deadlines[1:]), norms2=self._norms2(), **encoded)
            for p in route:
                self.peers.peers[p].inflight += 1
            blame, why = route[0], ""
            try:
                reply = await self.transport.send(route[0], request, timeout=deadlines[0], reuse=True)
                if not isinstance(reply, StageResult):
                    raise RemoteProtocolError(f"answered a StageCall with {type(reply).__name__}")
                if reply.failed:
                    if reply.failed in route[1:] and route.index(reply.failed) == reply.failed_stage:
                        blame, why = reply.failed, reply.reason
                    else:  # it names a peer we did not route through: its own failure
                        why = f"reports a failure of {reply.failed[-8:]} at stage {reply.failed_stage}, not on its route"
                elif reply.loss is None or len(reply.times) != stages or len(reply.norms2) != stages or reply.tensors:
                    why = f"a through answer needs a loss, {stages} stage times and norms and no tensors, got {reply.loss}, {len(reply.times)}, {len(reply.norms2)}, {len(reply.tensors)}"
            except (*NETWORK_ERRORS, RemoteProtocolError) as e:
                why = _short(e)
                if isinstance(e, RemoteError) and e.code == "bad_request":
                    refused.append(e.message)
                    if len(refused) >= 3:  # three peers refuse what we send: it is ours to fix
                        log.error("micro-batch %s given up: refused by 3 peers: %s", name, e.message)
                        return None
            finally:
                for p in route:
                    self.peers.peers[p].inflight -= 1
            if not why:
                for p, seconds in zip(route, reply.times):
                    self.peers.succeeded(p, seconds)
                self._heard(route, 0, reply)
                self.bytes_sent += len(request.data)
                self.bytes_received += len(reply.data)
                return reply.loss
            tried.add(blame)
            ban = self.peers.failed(blame, time.monotonic())
            self.retries += 1
            log.info("micro-batch %s through stage %d on %s failed (%s); sending it again another way, %s left alone for %.0f s",
                     name, route.index(blame), blame[-8:], why, blame[-8:], ban)  # fmt: skip

    async def _backward_kept(self, stage: int, peer: str, name: str, grad: torch.Tensor, want: tuple[str, ...], bt: torch.Size):
        """The backward on the peer that ran the forward, through the graph it kept: only the
        gradient travels. None when that does not work out (the caller recomputes elsewhere)."""
        request = StageCall(stage=stage, op="backward", micro_batch=name, norms2=self._norms2(), **pack_tensors({"grad": encode_floats(self.codec, grad)}))
        st = self.peers.peers.get(peer)
        if st is None or st.banned_until > time.monotonic():
            return None
        st.inflight += 1
        t0 = time.monotonic()
        try:
            reply = await self.transport.send(peer, request, timeout=self.peers.timeout(peer), reuse=True)
            outs = self._outputs(reply, want, bt, "backward")
        except (*NETWORK_ERRORS, RemoteProtocolError) as e:
            if not (isinstance(e, RemoteError) and e.code == "not_found"):  # not_found: it dropped the graph, nothing wrong
                self.peers.failed(peer, time.monotonic())
                self.retries += 1
                log.info("stage %d backward of %s on %s failed (%s); recomputing elsewhere", stage, name, peer[-8:], _short(e))
            return None
        finally:
            st.inflight -= 1
        self.peers.succeeded(peer, time.monotonic() - t0)
        self.bytes_sent += len(request.data)
        self.bytes_received += len(reply.data)
        self._heard([peer], stage, reply)
        return outs

    async def _call(self, stage: int, op: str, name: str, tensors: dict[str, torch.Tensor], want: tuple[str, ...]):
        """One stage call, retried on other peers of the stage until one answers well; (tensors
        wanted, loss, the peer that answered)."""
        encoded = {k: (_TOKENS.encode(t) if not t.is_floating_point() else encode_floats(self.codec, t)) for k, t in tensors.items()}
        request = StageCall(stage=stage, op=op, micro_batch=name, norms2=self._norms2(), **pack_tensors(encoded))
        refused: list[str] = []
        tried: set[str] = set()
        while True:
            try:
                peer = self.peers.choose(stage, time.monotonic(), tried)
            except NoStagePeer:
                await asyncio.sleep(0.2)  # a peer comes back from its ban, or the DHT names a new one
                continue
            st = self.peers.peers[peer]
            timeout = self.peers.timeout(peer)
            st.inflight += 1
            t0 = time.monotonic()
            try:
                reply = await self.transport.send(peer, request, timeout=timeout, reuse=True)
                outs = self._outputs(reply, want, tensors["x"].shape[:2], op)
            except (*NETWORK_ERRORS, RemoteProtocolError) as e:
                tried.add(peer)
                ban = self.peers.failed(peer, time.monotonic())
                self.retries += 1
                log.info("stage %d %s of %s on %s failed (%s); retrying elsewhere, %s left alone for %.0f s", stage, op, name, peer[-8:], _short(e), peer[-8:], ban)
                if isinstance(e, RemoteError) and e.code == "bad_request":
                    refused.append(e.message)
                    if len(refused) >= 3:  # three peers refuse what we send: it is ours to fix
                        raise _GiveUp(f"stage {stage} {op} refused by 3 peers: {refused[-1]}") from None
                continue
            finally:
                st.inflight -= 1
            self.peers.succeeded(peer, time.monotonic() - t0)
            self.bytes_sent += len(request.data)
            self.bytes_received += len(reply.data)
            self._heard([peer], stage, reply)
            return outs, reply.loss, peer

    def _outputs(self, reply, want: tuple[str, ...], bt: torch.Size, op: str) -> list[torch.Tensor]:
        """The tensors of a stage's reply, checked: a peer that sends garbage is treated as failed."""
        if not isinstance(reply, StageResult):
            raise RemoteProtocolError(f"answered a StageCall with {type(reply).__name__}")
        encoded = unpack_tensors(reply, self.max_numel)
        if set(encoded) != set(want):
            raise RemoteProtocolError(f"{op} reply carries {sorted(encoded)}, expected {sorted(want)}")
        outs = [decode_checked(encoded[k], self.max_numel, k) for k in want]
        shape = (*bt, self.model_config.n_embd)
        for k, t in zip(want, outs):
            if tuple(t.shape) != shape or t.dtype != torch.float32:
                raise RemoteProtocolError(f"{op} reply's {k} is {t.dtype} {tuple(t.shape)}, expected float32 {shape}")
        if op == "train" and (reply.loss is None or not math.isfinite(reply.loss)):
            raise RemoteProtocolError("train reply without a finite loss")
        return outs

    def _record(self, loss: float) -> None:
        self.micro_batches += 1
        self._losses.append(loss)
        if len(self._losses) < REPORT_EVERY:
            return
        mean = sum(self._losses) / len(self._losses)
        self._losses.clear()
        elapsed = time.monotonic() - self._t0
        rate = self.micro_batches * self.run_config.batch_size / elapsed if elapsed > 0 else None
        self.history.append({"micro_batches": self.micro_batches, "loss": mean, "time": time.time()})
        if self.first_loss is None:
            self.first_loss = mean  # (the history keeps only its latest entries)
        del self.history[:-500]
        log.info("trainer | %d micro-batches | loss %.4f | %.1f samples/s | %d retries, %d lost", self.micro_batches, mean, rate or 0, self.retries, self.lost)
        p = self.membership.progress
        p.step, p.loss, p.samples_per_second = self.micro_batches, mean, rate
        stats = {
            "micro_batches": self.micro_batches, "samples": self.micro_batches * self.run_config.batch_size, "lost": self.lost,
            "retries": self.retries, "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "loss": mean, "first_loss": self.first_loss,
            "samples_per_second": rate, "history": self.history,
        }  # fmt: skip
        write_json(self.stats_path, stats)


class _GiveUp(Exception):
    pass


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 160 else text[:157] + "..."
