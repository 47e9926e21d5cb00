"""Serving checkpoints over RPC: CheckpointQuery -> CheckpointManifest, StateRequest ->
streamed StateChunks. The coordinator serves its checkpoint store with it; a replica serves
its own latest outer state, so joiners and stragglers download from peers first.

A `source` is anything with the four methods of `CheckpointSource`; `DirectorySource` serves a
directory of `step-XXXXXXXX/` checkpoints (the format of node/state/checkpoint_dir.py). Where
given a `ModelFilesSource`, it also serves the run's model files (node/state/model_files.py).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

from protocol import CheckpointManifest, CheckpointQuery, RemoteProtocolError, StateChunk, StateRequest
from protocol.manifest import step_dir_name, step_of_dir_name

from .checkpoint_dir import CheckpointDirError, file_list, read_manifest, read_range
from .model_files import PREFIX as MODEL_PREFIX
from .model_files import ModelFilesSource
from ..net.transport import CallContext, Registration, RPCError, Transport

CHUNK = 4 << 20  # bytes per StateChunk
PREFIX = "checkpoint/"  # StateRequest names: checkpoint/<step>/<file>, or stage-<i>/checkpoint/<step>/<file> (model/<pin>/<file>: model files)


class CheckpointSource(Protocol):
    def latest_step(self) -> int | None: ...
    def manifest(self, step: int) -> dict[str, Any] | None: ...
    def files(self, step: int) -> dict[str, tuple[int, str]]: ...  # name -> (size, sha256), manifest included
    def read_chunk(self, step: int, name: str, offset: int, length: int) -> bytes: ...


class DirectorySource:
    """Complete checkpoints under `root` (a manifest that reads back; hashes are the
    downloader's to check)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(s for s in (step_of_dir_name(n) for n in names) if s is not None)

    def _dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def manifest(self, step: int) -> dict[str, Any] | None:
        try:
            return read_manifest(self._dir(step))
        except CheckpointDirError:
            return None

    def latest_step(self) -> int | None:
        for step in reversed(self._steps()):
            if self.manifest(step) is not None:
                return step
        return None

    def files(self, step: int) -> dict[str, tuple[int, str]]:
        m = self.manifest(step)
        if m is None:
            raise KeyError(step)
        return {name: (size, sha) for name, size, sha in file_list(self._dir(step), m)}

    def read_chunk(self, step: int, name: str, offset: int, length: int) -> bytes:
        if name not in self.files(step):  # only files the manifest names: no path tricks
            raise KeyError(name)
        return read_range(self._dir(step) / name, offset, length)


class CheckpointServer:
    """The checkpoint service of one source on a transport: `start()` registers its handlers
    (one group; a second checkpoint service on the same transport is refused), `close()`
    unregisters them."""

    def __init__(
        self,
        transport: Transport,
        source: CheckpointSource,
        on_served: Callable[[str, int, str], None] | None = None,
        stage_source: Callable[[int], CheckpointSource | None] | None = None,
        model_source: ModelFilesSource | None = None,
    ):
        self.transport, self.source = transport, source
        self.model_source = model_source  # the run's model files (node/state/model_files.py), where kept (the coordinator)
        self.stage_source = stage_source  # a pipeline stage's checkpoints, where kept per stage (None: not here)
        self.on_served = on_served  # (peer, step, file name): that peer read the file to its end
        self._registration: Registration | None = None

    def start(self) -> CheckpointServer:
        if self._registration is None:
            self._registration = self.transport.serve({CheckpointQuery: self.on_query, StateRequest: self.on_state_request}, owner="checkpoints")
        return self

    def close(self) -> None:
        if self._registration is not None:
            self._registration.close()
            self._registration = None

    def _source(self, stage: int | None) -> CheckpointSource:
        if stage is None:
            return self.source
        source = self.stage_source(stage) if self.stage_source is not None else None
        if source is None:
            raise RPCError("not_found", f"no checkpoints of stage {stage} here")
        return source

    async def on_query(self, ctx: CallContext) -> CheckpointManifest:
        step = ctx.request.step
        source = self._source(ctx.request.stage)
        loop = asyncio.get_running_loop()
        if step is None:
            step = await loop.run_in_executor(None, source.latest_step)
            if step is None:
                raise RPCError("not_found", "no checkpoint yet")
        manifest = await loop.run_in_executor(None, source.manifest, step)
        if manifest is None:
            raise RPCError("not_found", f"no checkpoint for step {step}")
        return CheckpointManifest(step=step, manifest=json.dumps(manifest, sort_keys=True).encode())

    async def on_state_request(self, ctx: CallContext) -> AsyncIterator[StateChunk]:
        req: StateRequest = ctx.request
        name, stage = req.name, None
        if name.startswith(MODEL_PREFIX):
            return await self._model_file(req, ctx.peer_id)
        if name.startswith("stage-"):
            head, _, name = name.partition("/")
            if not head[6:].isdigit():
                raise RemoteProtocolError("expected stage-<i>/checkpoint/<step>/<file>", "name")
            stage = int(head[6:])
        if not name.startswith(PREFIX):
            raise RPCError("not_found", f"no state named {req.name!r} here")
        try:
            step_text, filename = name[len(PREFIX) :].split("/", 1)
            step = int(step_text)
        except ValueError:
            raise RemoteProtocolError("expected checkpoint/<step>/<file>", "name") from None
        source = self._source(stage)
        loop = asyncio.get_running_loop()
        try:
            files = await loop.run_in_executor(None, source.files, step)
        except (KeyError, OSError, ValueError) as e:
            raise RPCError("not_found", f"no checkpoint {step} here ({e})") from None
        if filename not in files:
            raise RPCError("not_found", f"checkpoint {step} has no file {filename!r}")
        size, sha = files[filename]
        if req.offset > size:
            raise RemoteProtocolError(f"offset {req.offset} is past the end ({size})", "offset")
        end = size if req.length == 0 else min(size, req.offset + req.length)
        return self._chunks(source, step, filename, req.name, req.offset, end, size, sha, ctx.peer_id)

    async def _model_file(self, req: StateRequest, peer: str) -> AsyncIterator[StateChunk]:
        pin, _, filename = req.name[len(MODEL_PREFIX) :].partition("/")
        if self.model_source is None:
            raise RPCError("not_found", "no model files here")
        try:
            size, sha = (await asyncio.to_thread(self.model_source.files, pin))[filename]
        except (KeyError, OSError, ValueError):
            raise RPCError("not_found", f"no model file {req.name!r} here") from None
        if req.offset > size:
            raise RemoteProtocolError(f"offset {req.offset} is past the end ({size})", "offset")
        end = size if req.length == 0 else min(size, req.offset + req.length)
        return self._chunks(self.model_source, pin, filename, req.name, req.offset, end, size, sha, peer, served=False)

    async def _chunks(self, source, step, filename, name, start, end, size, sha, peer, served=True) -> AsyncIterator[StateChunk]:
        loop = asyncio.get_running_loop()
        offset = start
        while True:
            n = min(CHUNK, end - offset)
            try:
                data = await loop.run_in_executor(None, source.read_chunk, step, filename, offset, n) if n else b""
            except (KeyError, OSError) as e:  # gone since the call began (a replica drops its initial state once it is uploaded)
                raise RPCError("not_found", f"{name} is no longer here ({e!r})") from None
            yield StateChunk(name=name, offset=offset, total_size=size, sha256=sha, data=data)
            offset += n
            if offset >= end:
                if served and end == size and self.on_served is not None:
                    self.on_served(peer, step, filename)
                return
