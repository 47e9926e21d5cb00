"""A slot's state on disk and between its peers: what a stage server, an expert host or a replica
holds of the model and hands to the peer that takes the same slot.

A state is a checkpoint directory (node/state/checkpoint_dir.py) per sync round: the model's
parameters and the outer optimizer's momentum, a manifest naming the model (and the cut) it is
for and its hash. `SlotState` keeps the newest few on disk and serves them (a peer that joins the
slot downloads from one that holds it), reads the ones its peers and the coordinator offer,
downloads and verifies one, uploads one to the coordinator, and tells who took a state (a hand-over).
Which state to take is `choose_state`'s decision.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protocol.manifest import step_dir_name, step_of_dir_name

from ..net.transport import NETWORK_ERRORS, CallTimeout, RemoteError
from ..state.checkpoint_client import download_checkpoint, fetch_manifest, upload_checkpoint
from ..state.checkpoint_dir import CheckpointDirError, load_checkpoint_dir, read_manifest, write_checkpoint_dir
from ..state.state_server import CheckpointServer, DirectorySource
from .caller import short

log = logging.getLogger(__name__)

KEEP_STATES = 2  # states kept on disk (the newest is served)
DOWNLOAD_S = 120.0  # longest a state's download may take
HANDOVER_POLL_S = 0.2

State = dict[str, dict[str, torch.Tensor]]  # {"model": {name: tensor}, "outer": {name: momentum}}


def choose_state(mine: tuple[int, str] | None, peers: dict[str, tuple[int, str]]) -> tuple[int, str] | None:
    """The (round, hash) to adopt from peers, or None to keep ours. Pure.

    Adopt the state most peers hold among those at the highest round when it is ahead of ours.
    At our own round, states vote (ours counts for us); the larger vote wins and a tie goes to
    the smaller hash, so two diverged peers always settle on the same one."""
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


@dataclass(frozen=True)
class Offer:
    """A state of the slot someone holds: who, its round, its hash, its manifest."""

    peer: str  # a peer id, the coordinator's, or "disk" (what this node saved before it restarted)
    step: int
    hash: str
    manifest: dict[str, Any]
    from_peer: bool = True  # a peer of the slot (not the coordinator's checkpoint)
    slot: int | None = None  # the coordinator keeps checkpoints per stage: which one this is
    path: Path | None = None  # on our own disk

    @property
    def held(self) -> tuple[int, str]:
        return self.step, self.hash


class SlotState:
    """The states of one slot on this node (see the module's docstring). `meta` is what a state
    is for (the model, where it is cut): a state whose manifest names other meta is not ours.
    `hash_of(state)` is the hash a state's manifest must carry; `compute` runs `fn(*args)` on the
    role's compute thread (loading and hashing may take long)."""

    def __init__(self, transport, directory: Path, downloads: Path, what: str, meta: dict[str, Any],
                 hash_of: Callable[[State], str], compute: Callable[..., Awaitable[Any]], keep: int = KEEP_STATES, unhashed_ok: bool = False):  # fmt: skip
        """`unhashed_ok`: a state whose manifest carries no hash may be taken unchecked (a replica's
        run seeded by its owner with a checkpoint of its own, a warm start, say)."""
        self.transport, self.dir, self.downloads, self.what = transport, Path(directory), Path(downloads), what
        self.meta = json.loads(json.dumps(meta))  # as a manifest carries it
        self.hash_of, self.compute, self.keep, self.unhashed_ok = hash_of, compute, keep, unhashed_ok
        self.step = 0  # the round of the state we hold (0: the run's initial one)
        self.hash = ""
        self.source = "init"  # where it came from: "init", "disk" or the peer id it was downloaded from
        self.server = CheckpointServer(transport, DirectorySource(self.dir), on_served=self._on_served)
        self._served: dict[int, dict[str, set[str]]] = {}  # round -> peer -> files it fetched in full
        self._uploads: set[asyncio.Task] = set()
        self._uploading = ""  # the state dir an upload reads
        self._writes: set[asyncio.Future] = set()  # saves still writing

    def start(self) -> None:
        """Serve our states (HandlerTaken when another service serves checkpoints here)."""
        self.server.start()

    async def close(self) -> None:
        for t in self._uploads:
            t.cancel()
        await asyncio.gather(*self._uploads, return_exceptions=True)
        self.server.close()

    def held(self, step: int, state_hash: str, source: str) -> None:
        self.step, self.hash, self.source = step, state_hash, source

    async def save(self, step: int, state: State, state_hash: str) -> Path:
        """Write `state` as round `step`; the oldest beyond `keep` go (not one an upload reads).
        A save whose caller is cancelled still finishes its write (`writes_done` waits for it):
        its thread would go on writing anyway, unseen."""
        write = asyncio.ensure_future(asyncio.to_thread(write_checkpoint_dir, self.dir, step, state, self.meta, state_hash))
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)
        path = await asyncio.shield(write)
        for old in sorted(self.dir.glob("step-*"))[: -self.keep]:
            if old.name != self._uploading:
                await asyncio.to_thread(shutil.rmtree, old, True)
        return path

    async def writes_done(self) -> None:
        """Until every save begun has written its state (or failed)."""
        await asyncio.gather(*self._writes, return_exceptions=True)

    def newest(self) -> int:
        """The newest round saved here (-1: none)."""
        return max((s for d in self.dir.glob("step-*") if (s := step_of_dir_name(d.name)) is not None), default=-1)

    async def drop(self, step: int) -> None:
        """Remove our state of round `step`, unless an upload reads it: a state taken from a
        peer for the same round replaces it (ours diverged from the others')."""
        if step_dir_name(step) != self._uploading:
            await asyncio.to_thread(shutil.rmtree, self.dir / step_dir_name(step), True)

    def fits(self, manifest: dict[str, Any]) -> bool:
        return manifest.get("model_config") == self.meta

    def own(self) -> Offer | None:
        """The newest state of this slot this node saved before (it restarted); None when there
        is none, or only another slot's or model's (blocking: call it in a thread)."""
        for d in sorted(self.dir.glob("step-*"), reverse=True):
            try:
                manifest = read_manifest(d)
            except (CheckpointDirError, OSError):
                continue
            if self.fits(manifest) and manifest.get("state_hash"):
                return Offer("disk", int(manifest["step"]), manifest["state_hash"], manifest, from_peer=False, path=d)
        return None

    def offer(self, peer: str, step: int, manifest: dict[str, Any], from_peer: bool = True, slot: int | None = None) -> Offer | None:
        """What `peer` says it holds, as an offer of this slot's state (None, logged: another's)."""
        if not self.fits(manifest):
            log.warning("%s: %s holds a state for %s, not this one", self.what, peer[-8:], manifest.get("model_config"))
            return None
        return Offer(peer, step, manifest.get("state_hash") or "", manifest, from_peer=from_peer, slot=slot)

    async def ask(self, peers: Iterable[str], timeout: float, slot: int | None = None) -> dict[str, Offer]:
        """The newest state of this slot each of `peers` holds (of stage `slot` where a peer keeps
        them per stage: the coordinator); peers that hold none, or another slot's, are left out."""
        offers: dict[str, Offer] = {}

        async def one(peer: str) -> None:
            try:
                step, manifest = await fetch_manifest(self.transport, peer, timeout=timeout, stage=slot)
            except CallTimeout:  # silent, or a connection a dead link left stuck: dial afresh next time
                await self.transport.host.disconnect(peer)
                return
            except (*NETWORK_ERRORS, ValueError) as e:
                if not (isinstance(e, RemoteError) and e.code == "not_found"):  # not_found: it has none (yet)
                    log.debug("%s: could not ask %s for its state: %s", self.what, peer[-8:], short(e))
                return
            offer = self.offer(peer, step, manifest, from_peer=slot is None, slot=slot)
            if offer is not None:
                offers[peer] = offer

        await asyncio.gather(*(one(p) for p in peers))
        return offers

    async def fetch(self, offer: Offer) -> State | None:
        """`offer`'s state, downloaded (or read from our disk), loaded and its hash checked; None,
        logged, when that fails."""
        try:
            path = offer.path or await download_checkpoint(self.transport, offer.peer, self.downloads, step=offer.step, manifest=offer.manifest, timeout_s=DOWNLOAD_S, stage=offer.slot)
            return await self.compute(self._load, path, offer.hash)
        except (*NETWORK_ERRORS, CheckpointDirError, ValueError, KeyError, RuntimeError) as e:
            log.warning("%s: could not take the state of round %d from %s: %s", self.what, offer.step, offer.peer[-8:], short(e))
            return None
        finally:
            if offer.path is None:
                await asyncio.to_thread(shutil.rmtree, self.downloads, True)

    def _load(self, path: Path, expected: str) -> State:
        state = load_checkpoint_dir(path)
        if "model" not in state:
            raise CheckpointDirError("the state has no model.safetensors")
        if expected or not self.unhashed_ok:
            got = self.hash_of(state)
            if got != expected:
                raise CheckpointDirError(f"the state hashes to {got}, its manifest says {expected or 'no hash'}")
        return state

    def upload(self, coordinator: str | None, step: int, state_hash: str, final: bool = False) -> None:
        """State `step` (of `state_hash`) to the coordinator, in the background (it keeps it once
        the slot's peers reported that hash). Skipped while the last upload is still on its way,
        but for a run's `final` state, which follows it: a finished run keeps its last state."""
        if coordinator is None or (self._uploads and not final):
            return
        before = list(self._uploads)

        async def upload() -> None:
            await asyncio.gather(*before, return_exceptions=True)
            self._uploading = step_dir_name(step)
            try:
                await upload_checkpoint(self.transport, coordinator, self.dir / step_dir_name(step))
                log.info("%s: the coordinator keeps state %d (hash %s)", self.what, step, state_hash)
            except (*NETWORK_ERRORS, CheckpointDirError, OSError) as e:
                log.warning("%s: state %d not kept by the coordinator: %s", self.what, step, short(e))
            finally:
                self._uploading = ""

        task = asyncio.create_task(upload())
        self._uploads.add(task)
        task.add_done_callback(self._uploads.discard)

    async def uploads_done(self) -> None:
        await asyncio.gather(*self._uploads, return_exceptions=True)

    def _on_served(self, peer: str, step: int, name: str) -> None:
        self._served.setdefault(step, {}).setdefault(peer, set()).add(name)

    async def taken(self, step: int, timeout_s: float) -> str | None:
        """The peer that downloaded every file of state `step` within `timeout_s` (None: nobody)."""
        files = set(read_manifest(self.dir / step_dir_name(step))["files"])
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            taken = sorted(p for p, got in self._served.get(step, {}).items() if got >= files)
            if taken:
                return taken[0]
            await asyncio.sleep(HANDOVER_POLL_S)
        return None
