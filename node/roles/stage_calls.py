"""The checks on a stage call and on the answers a stage server gets, before any compute.

Everything a peer sends is checked: tensors' headers and payloads (codecs), shapes, dtypes,
NaN/Inf, token ranges, the batch size. A problem raises RemoteProtocolError or StageInputError
naming it: the server refuses the call with `bad_request` and scores the sender down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from protocol import RemoteProtocolError, StageCall, StageResult, unpack_tensors

from ..models.stages import Stage, StageInputError
from .activations import decode_checked

MAX_BATCH_SAMPLES = 256  # sequences one call, or one batch of queued calls, may carry
WANT = {"forward": {"x"}, "backward": {"x", "grad"}, "train": {"x", "targets"}, "through": {"x", "targets"}}


@dataclass(frozen=True)
class StageCut:
    """Where this stage sits in the run's cut, and the shapes its calls carry."""

    index: int
    stages: int
    dims: Any  # n_layer, n_embd, vocab_size, context: a GPTConfig or hf_stages.CutDims

    @property
    def max_numel(self) -> int:
        return MAX_BATCH_SAMPLES * self.dims.context * self.dims.n_embd

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1


def check_call(req: StageCall, cut: StageCut, stage: Stage) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(input, gradient or targets) of a call; input None for a backward through the graph this
    peer kept. Raises RemoteProtocolError or StageInputError naming the problem."""
    encoded = unpack_tensors(req, cut.max_numel)
    n_embd = cut.dims.n_embd
    if req.op == "through" and len(req.route) != cut.stages - 1 - cut.index:
        raise StageInputError(f"a through call to stage {cut.index} names a peer for each of the {cut.stages - 1 - cut.index} stages after it, got {len(req.route)}")
    if req.op == "train" and not cut.last:
        raise StageInputError(f"train goes to the last stage ({cut.stages - 1}), not to stage {cut.index}")
    if req.op in ("forward", "backward") and cut.last:
        raise StageInputError(f"the last stage takes train calls (forward, loss and backward at once), not {req.op}")
    if req.op == "backward" and set(encoded) == {"grad"}:  # from the graph its forward kept here
        if not req.micro_batch:
            raise StageInputError("a backward without the stage's input must name its micro-batch")
        grad = decode_checked(encoded["grad"], cut.max_numel, "grad")
        if grad.dtype != torch.float32 or grad.dim() != 3 or grad.size(2) != n_embd:
            raise StageInputError(f"grad must be float32 (batch, time, {n_embd}), got {grad.dtype} {tuple(grad.shape)}")
        return None, grad
    if set(encoded) != WANT[req.op]:
        raise StageInputError(f"{req.op} carries tensors {sorted(WANT[req.op])}, got {sorted(encoded)}")
    if cut.first and encoded["x"].codec != "none":
        raise StageInputError(f"token ids travel uncompressed, got codec {encoded['x'].codec}")
    x = decode_checked(encoded["x"], cut.max_numel, "x")  # (refuses NaN, Inf and values past MAX_ABS)
    stage.check_input(x, finite=False)
    if x.size(0) > MAX_BATCH_SAMPLES:
        raise StageInputError(f"{x.size(0)} sequences in one call, at most {MAX_BATCH_SAMPLES}")
    if req.op == "backward":
        grad = decode_checked(encoded["grad"], cut.max_numel, "grad")
        want_shape = (*x.shape[:2], n_embd)
        if tuple(grad.shape) != want_shape or grad.dtype != torch.float32:
            raise StageInputError(f"grad must be float32 {want_shape} (the stage's output), got {grad.dtype} {tuple(grad.shape)}")
        return x, grad
    if req.op in ("train", "through"):
        targets = decode_checked(encoded["targets"], cut.max_numel, "targets")
        if targets.dtype != torch.int64 or tuple(targets.shape) != tuple(x.shape[:2]):
            raise StageInputError(f"targets must be int64 {tuple(x.shape[:2])}, got {targets.dtype} {tuple(targets.shape)}")
        vocab = cut.dims.vocab_size
        if int(targets.min()) < 0 or int(targets.max()) >= vocab:
            raise StageInputError(f"targets must be token ids in [0, {vocab}), got {int(targets.min())}..{int(targets.max())}")
        return x, targets
    return x, None


def check_through_answer(reply, cut: StageCut, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The gradient of our output from the next stage's answer to a through call (None when it
    reports a failure further on); RemoteProtocolError names what is wrong with it."""
    later = cut.stages - 1 - cut.index
    if not isinstance(reply, StageResult):
        raise RemoteProtocolError(f"answered a StageCall with {type(reply).__name__}")
    if reply.failed:
        if not cut.index + 1 < reply.failed_stage < cut.stages:
            raise RemoteProtocolError(f"reports a failure at stage {reply.failed_stage}, not a stage after it")
        return None
    if reply.loss is None or len(reply.times) != later or len(reply.norms2) != later:
        raise RemoteProtocolError(f"a through answer needs a loss, {later} stage times and {later} norms, got {reply.loss}, {len(reply.times)} and {len(reply.norms2)}")
    encoded = unpack_tensors(reply, cut.max_numel)
    if set(encoded) != {"grad"}:
        raise RemoteProtocolError(f"a through answer carries {sorted(encoded)}, expected ['grad']")
    grad = decode_checked(encoded["grad"], cut.max_numel, "grad")
    if tuple(grad.shape) != shape or grad.dtype != torch.float32:
        raise RemoteProtocolError(f"a through answer's grad is {grad.dtype} {tuple(grad.shape)}, expected float32 {shape}")
    return grad
