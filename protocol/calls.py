"""Compute calls: a trainer's calls to a pipeline stage server and to an expert host, and their
answers, each carrying a few encoded tensors in one bundle."""

from __future__ import annotations

import math

from .bulk import MAX_TENSOR_NDIM, TENSOR_DTYPES
from .schema import MAX_ID_LEN, Message, Params, _finite, _require, message

# ---------------------------------------------------------------------------------------------
# Pipeline stages (a trainer's calls to a stage server)

STAGE_OPS = ("forward", "backward", "train", "through", "norms")
MAX_ROUTE = 64  # stages after the called one a `through` call may name


def _norms2_ok(norms2: tuple[float, ...]) -> bool:
    return len(norms2) <= MAX_ROUTE + 1 and all(v == -1 or (math.isfinite(v) and v >= 0) for v in norms2)
MAX_DEADLINE_S = 3600.0
MAX_BUNDLE_TENSORS = 4


def _check_bundle(msg: Message, max_tensors: int = MAX_BUNDLE_TENSORS) -> None:
    """A few encoded tensors in one message: a header per tensor (name, dtype, codec, nbytes, and
    the codec's params as `p.<name>`), its shape, and the payloads one after another in `data`."""
    n = len(msg.tensors)
    _require(n <= max_tensors, "tensors", f"at most {max_tensors}")
    _require(len(msg.shapes) == n, "shapes", "one per tensor")
    total, names = 0, set()
    for i, (head, shape) in enumerate(zip(msg.tensors, msg.shapes)):
        name, dtype, codec, nbytes = head.get("name"), head.get("dtype"), head.get("codec"), head.get("nbytes")
        _require(isinstance(name, str) and 0 < len(name) <= 64 and name not in names, f"tensors[{i}].name", "must be a distinct name of 1..64 characters")
        names.add(name)
        _require(dtype in TENSOR_DTYPES, f"tensors[{i}].dtype", f"unknown dtype {dtype!r}")
        _require(isinstance(codec, str) and 0 < len(codec) <= 32, f"tensors[{i}].codec", "must be a codec name")
        _require(isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 0, f"tensors[{i}].nbytes", "must be an int >= 0")
        _require(len(shape) <= MAX_TENSOR_NDIM and all(d >= 0 for d in shape), f"shapes[{i}]", f"at most {MAX_TENSOR_NDIM} dimensions, each >= 0")
        total += nbytes
    _require(total == len(msg.data), "data", f"carries {len(msg.data)} bytes, the headers declare {total}")


@message(50)
class StageCall(Message):
    """A trainer's call to a stage server, for one micro-batch.
    - forward: tensor `x` (the stage's input) in; the stage's output `y` back.
    - backward: `x` again and `grad` (of the stage's output) in; the server recomputes forward from
      `x`, accumulates its parameters' gradients and sends back `grad` of `x` (none for the first
      stage, whose input is token ids).
    - train (the last stage): `x` and `targets` (token ids) in; forward, loss and backward in one
      call: the `loss` and `grad` of `x` back.
    - through: `x` and `targets` in, and the rest of the micro-batch's way: `route`, the peer
      to call for each later stage, and `deadlines`, how long each of those calls may take. The
      server runs its forward, calls `route[0]` with the rest of the way, runs its backward with
      the gradient that comes back and answers the `loss`, `grad` of `x` and every stage's
      `times`; the last stage does what `train` does. Activations go stage to stage, not through
      the trainer.
    - norms: no tensors, only `norms2`: a synchronous trainer's word, once a step's micro-batches
      all came back, of every stage's norm of that step; a stage whose step is due takes it
      then, rather than when the next micro-batch reaches it (so stages step side by side).
    Every call may carry `norms2`: for each stage of the cut, the squared norm of its gradient
    at its latest step as the caller last heard it (-1: not heard). A stage clips its next step
    by the norm of all of them together (one global clip, as one process clips the model's);
    a through call hands them on."""

    BULK_FIELDS = ("data",)

    stage: int
    op: str
    micro_batch: str = ""  # the trainer's name for the micro-batch (logs)
    tensors: tuple[Params, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    data: bytes = b""
    route: tuple[str, ...] = ()
    deadlines: tuple[float, ...] = ()
    norms2: tuple[float, ...] = ()

    def validate(self) -> None:
        _require(self.stage >= 0, "stage", "must be >= 0")
        _require(_norms2_ok(self.norms2), "norms2", f"at most {MAX_ROUTE + 1}, each -1 or a finite value >= 0")
        _require(self.op in STAGE_OPS, "op", f"must be one of {', '.join(STAGE_OPS)}")
        _require(len(self.micro_batch) <= MAX_ID_LEN, "micro_batch", "at most 256 characters")
        _require(len(self.route) <= MAX_ROUTE, "route", f"at most {MAX_ROUTE} peers")
        _require(self.op == "through" or not self.route, "route", f"only a through call names a route, not {self.op}")
        _require(self.op != "norms" or (self.norms2 and not self.tensors), "norms2", "a norms call carries norms2 and no tensors")
        _require(all(0 < len(p) <= MAX_ID_LEN for p in self.route), "route", "peer ids of 1..256 characters")
        _require(len(self.deadlines) == len(self.route), "deadlines", "one per peer of the route")
        _require(all(0 < d <= MAX_DEADLINE_S for d in self.deadlines), "deadlines", f"seconds in (0, {MAX_DEADLINE_S:.0f}]")
        _check_bundle(self)


@message(51)
class StageResult(Message):
    """A stage server's answer to a StageCall: tensors (`y` or `grad`), and the loss of a train
    call. A through call's answer also carries `times`: the seconds each stage from the called
    one on spent on the micro-batch itself (queue and compute, not the calls after it). Where a
    later stage's call failed, the answer names that stage and peer (`failed_stage`, `failed`)
    and why, and carries nothing else: the trainer sends the micro-batch again another way.
    `norms2` and `norm_steps` (like `times`, one per stage from the called one on): the squared
    norm of the stage's gradient at its latest step that was due, and how many steps were due
    there until then (0 and -1: none yet); callers hand the norms on in their next calls.
    `weights`: the version of the stage's weights the answer came from, from 1 (it moves with
    every step and sync; 0: not known): a trainer's check compares two answers of one peer only
    at one known version."""

    BULK_FIELDS = ("data",)

    loss: float | None = None
    tensors: tuple[Params, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    data: bytes = b""
    times: tuple[float, ...] = ()
    failed: str = ""
    failed_stage: int = 0
    reason: str = ""
    norms2: tuple[float, ...] = ()
    norm_steps: tuple[int, ...] = ()
    weights: int = 0

    def validate(self) -> None:
        _require(_finite(self.loss), "loss", "must be finite")
        _require(self.weights >= 0, "weights", "a version >= 0")
        _require(_norms2_ok(self.norms2), "norms2", f"at most {MAX_ROUTE + 1}, each -1 or a finite value >= 0")
        _require(len(self.norm_steps) == len(self.norms2) and all(n >= 0 for n in self.norm_steps), "norm_steps", "one count >= 0 per value of norms2")
        _require(len(self.times) <= MAX_ROUTE + 1 and all(0 <= t <= MAX_DEADLINE_S for t in self.times), "times", f"at most {MAX_ROUTE + 1}, each in [0, {MAX_DEADLINE_S:.0f}] seconds")
        _require(len(self.failed) <= MAX_ID_LEN, "failed", "at most 256 characters")
        _require(len(self.reason) <= 1024, "reason", "at most 1024 characters")
        _require(self.failed_stage >= 0, "failed_stage", "must be >= 0")
        _require(not self.failed or not self.tensors, "tensors", "a failed through call carries none")
        _check_bundle(self)


# ---------------------------------------------------------------------------------------------
# Experts (a trainer's calls to an expert host)

EXPERT_OPS = ("forward", "backward", "commit")
MAX_CALL_EXPERTS = 64  # experts one call may address (tensors: two per expert at most)


@message(52)
class ExpertCall(Message):
    """A trainer's call to an expert host for one micro-batch of one MoE layer: every expert of
    the host that tokens were routed to, in one call. Tensors are named by expert:
    - forward: `x:<expert>` (its tokens, (n, C)) in; `y:<expert>` back. The host keeps the graph.
    - backward: `grad:<expert>` (of its output) in, and `x:<expert>` again when the host may not
      hold the forward's graph (it recomputes); `grad:<expert>` of the input back, and `norm2`,
      the squared norm of the gradient of the experts' parameters. The host holds that gradient
      until the commit.
    - commit: after the micro-batch's whole backward, its global gradient clip (`scale`: the
      trainer's clip coefficient over every part of the model, 0: drop the gradients, e.g. a
      non-finite norm). `micro_batch` names the micro-batch (no layer); no tensors. The host adds
      the held gradients times `scale` and steps its optimizer when a step is due."""

    BULK_FIELDS = ("data",)

    op: str
    micro_batch: str = ""  # the trainer's name for the micro-batch and layer (keys a kept graph)
    tensors: tuple[Params, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    data: bytes = b""
    scale: float | None = None  # commit only

    def validate(self) -> None:
        _require(self.op in EXPERT_OPS, "op", f"must be one of {', '.join(EXPERT_OPS)}")
        _require(0 < len(self.micro_batch) <= MAX_ID_LEN, "micro_batch", "1..256 characters")
        if self.op == "commit":
            _require(self.scale is not None and math.isfinite(self.scale) and 0.0 <= self.scale <= 1.0, "scale", "a commit's scale must be in [0, 1]")
            _require(not self.tensors, "tensors", "a commit carries none")
        else:
            _require(self.scale is None, "scale", f"only a commit carries one, not a {self.op}")
        _check_bundle(self, 2 * MAX_CALL_EXPERTS)


@message(53)
class ExpertResult(Message):
    """An expert host's answer to an ExpertCall: `y:<expert>` or `grad:<expert>` per expert;
    a backward's answer has `norm2` too (see ExpertCall), a commit's nothing. `weights`: the
    version of the shard's weights the answer came from (as StageResult's)."""

    BULK_FIELDS = ("data",)

    tensors: tuple[Params, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    data: bytes = b""
    norm2: float | None = None
    weights: int = 0

    def validate(self) -> None:
        _require(self.norm2 is None or (math.isfinite(self.norm2) and self.norm2 >= 0.0), "norm2", "must be finite and >= 0")
        _require(self.weights >= 0, "weights", "a version >= 0")
        _check_bundle(self, 2 * MAX_CALL_EXPERTS)
