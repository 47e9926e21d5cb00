"""What the peers of a slot (a pipeline stage, an expert shard) hold and keep in step.

`SlotWeights` holds the slot's module and its AdamW (this peer's own), the outer state of the
last sync (parameters and momentum, the same on every peer of the slot after a sync), a version
that moves with every change of the parameters, and the lock that work on them holds. What may
take long (building the module, loading a state, a sync's arithmetic) runs on the slot's one
compute thread; batches and optimizer steps run on the event loop's thread (stage_server.py).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..models.diloco import OuterOptimizer, copy_into, state_hash
from ..state.checkpoint_dir import CheckpointDirError
from .slot_state import State


class ComputeThread:
    """A role's one compute thread, for what may take long (training, building or loading a model,
    a sync's arithmetic). A thread of our own, made with the node's torch thread count: one of
    asyncio's shared pool may have computed before the count was set and kept torch's default (on
    a 2-core machine shared by three replicas: two threads each, inner steps ten times slower)."""

    def __init__(self, threads: int, name: str):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=torch.set_num_threads, initargs=(threads,))

    async def __call__(self, fn, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False)  # a thread still computing returns when its work does


class SlotWeights:
    def __init__(self, threads: int, outer_momentum: float, name: str):
        self.module: torch.nn.Module | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.outer: OuterOptimizer | None = None
        self.outer_momentum = outer_momentum
        self.version = 0  # moves with every change of the parameters (steps, syncs, states taken)
        self.busy = asyncio.Lock()  # held while the parameters are used: a batch's compute, a step, a sync
        self._hash, self._hash_version = "", -1
        self.compute = ComputeThread(threads, name)  # `await compute(fn, *args)`: fn on the slot's compute thread

    def hold(self, module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.module, self.opt = module, opt
        self.outer = OuterOptimizer(module.parameters(), 1.0, self.outer_momentum)

    def changed(self) -> None:
        self.version += 1

    def answered_from(self, before: int) -> int:
        """The version an answer computed since `before` was read names (StageResult, ExpertResult
        `weights`): before + 1 (versions named start at 1) if the parameters did not change
        meanwhile, else 0: which ones it used is not known."""
        return before + 1 if before == self.version else 0

    def names(self) -> list[str]:
        return [n for n, _ in self.module.named_parameters()]

    @property
    def hash(self) -> str:
        """The hash of the parameters, computed when read after they changed, not at every step
        (most steps' hashes are never read). Read on the event loop's thread, where steps run;
        what changes the parameters on the compute thread holds `busy`."""
        if self._hash_version != self.version:
            self._hash, self._hash_version = self.params_hash(), self.version
        return self._hash

    def params_hash(self) -> str:
        return state_hash(dict(self.module.named_parameters()))

    def outer_hash(self) -> str:
        return state_hash(dict(zip(self.names(), self.outer.params)))

    def state(self, params: list[torch.Tensor] | None = None) -> State:
        """The outer state to save (or `params`, a leaving peer's latest parameters, with it)."""
        names = self.names()
        model = {n: t.detach().clone() for n, t in zip(names, params if params is not None else self.outer.params)}
        return {"model": model, "outer": {n: b.clone() for n, b in zip(names, self.outer.buffers)}}

    def adopt(self, state: State) -> None:
        """Take a state (its hash checked by SlotState): parameters = outer parameters; momentum.
        The AdamW state stays ours. On the compute thread, under `busy`."""
        model, momentum = state["model"], state.get("outer")
        if momentum is None:
            raise CheckpointDirError("the state has no outer.safetensors")
        self.module.load_state_dict(model)  # strict: the same parameter names and shapes, or RuntimeError
        self.outer = OuterOptimizer(self.module.parameters(), 1.0, self.outer_momentum)
        self.outer.load_state_dict({"params": self.outer.params, "momentum": [momentum[n] for n in self.names()], "step": 0})
        self.changed()

    def pseudo_gradient(self) -> list[torch.Tensor]:
        return self.outer.pseudo_gradient(list(self.module.parameters()))

    def apply_outer(self, avg: list[torch.Tensor]) -> None:
        copy_into(self.module.parameters(), self.outer.apply(avg))
        self.changed()

    def take_as_outer(self) -> str:
        """The parameters as they are become the outer state (a slot's only peer); their hash."""
        params = [p.detach().clone() for p in self.module.parameters()]
        self.outer.load_state_dict({"params": params, "momentum": self.outer.buffers, "step": self.outer.step_count})
        return self.params_hash()

    def latest(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.module.parameters()]

    def close(self) -> None:
        self.compute.close()
