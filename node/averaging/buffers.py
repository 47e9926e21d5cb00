"""The averager's memory across rounds: error feedback (what lossy compression lost, carried
into the next round) and the buffers it reuses. A round writes only into spares; what it
wrote becomes the state on commit (`commit`), and a failed round leaves everything as it was.

Also the round's input preparation (`prepare`: flatten, check, encode early) and the
per-part encodings that feed or read the error feedback (`encode_part`, `own_part`,
`aggregate_encode`'s carry)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from protocol import EncodedTensor
from protocol.codecs import finite_max_abs

log = logging.getLogger(__name__)


def viewable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `flatten` can view the input instead of copying it."""
    return len(tensors) == 1 and tensors[0].dtype == torch.float32 and tensors[0].device.type == "cpu" and tensors[0].is_contiguous()


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """One flat fp32 CPU vector (read-only use: a single fp32 CPU tensor is viewed, not copied),
    written into `out` if given and a copy is needed."""
    if viewable(tensors):
        return tensors[0].detach().reshape(-1)
    return torch.cat([t.detach().reshape(-1).to(torch.float32).cpu() for t in tensors], out=out)


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, pos = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[pos : pos + n].view(t.shape).to(t.dtype))
        pos += n
    return out


@dataclass
class Prepared:
    """A round's input, ready before its group is known (see `Buffers.prepare`)."""

    flat: torch.Tensor
    residual: torch.Tensor | None = None  # error feedback of earlier rounds (lossy codecs)
    new_residual: torch.Tensor | None = None  # where this round's goes
    encoded: list[tuple[int, int, EncodedTensor]] = field(default_factory=list)  # (a, b, flat[a:b] + residual encoded): cut into parts


def outside(ranges: Sequence[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The stretches of [0, numel) that none of `ranges` ([a, b) each) covers, in order."""
    out, pos = [], 0
    for a, b in sorted(ranges):
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < numel:
        out.append((pos, numel))
    return out


def cut_from(pieces: list[tuple[int, int, EncodedTensor]], codec, a: int, b: int) -> EncodedTensor | None:
    """The encoding of elements [a, b), cut from a piece (start, end, encoding) that covers
    them at the codec's alignment; None if none does."""
    for start, end, enc in pieces:
        if start <= a and b <= end and (a - start) % codec.cut_align == 0 and (b == end or (b - start) % codec.cut_align == 0):
            return codec.cut(enc, a - start, b - start)
    return None


class Buffers:
    """Error feedback and reusable buffers of one averager, per `state_key` (a caller's name
    for a series of rounds over the same tensors)."""

    def __init__(self, codec, slice_align: int):
        self.codec, self.slice_align = codec, slice_align
        self.residuals: dict[str, torch.Tensor] = {}  # state_key -> error-feedback residual (flat)
        self.spare_residuals: dict[str, torch.Tensor | None] = {}  # where the next round writes its residual
        self.spare_flats: dict[int, list[torch.Tensor]] = {}  # numel -> flattened-input buffers free for reuse
        self.codec_state: dict[tuple, dict] = {}
        self.gather_residuals: dict[tuple[str, int, int], torch.Tensor] = {}  # (state_key, a, b) -> what the gather lost
        self.last_own: dict[int, tuple[tuple[int, int], ...]] = {}  # vector length -> the slices [a, b) we owned in the last such round

    # ---- spares ----

    def take_flat(self, numel: int, tensors: Sequence[torch.Tensor]) -> tuple[bool, torch.Tensor | None]:
        """(whether the round's flat copy returns to the spares afterwards, a spare to flatten
        into). With a lossy codec nothing refers to the flat copy once the round is over (what
        we send is encoded apart from it), so the next round reuses its memory: fresh memory
        costs a page fault per 4 KiB."""
        reuse = self.codec.lossy and not viewable(tensors)
        spares = self.spare_flats.setdefault(numel, []) if reuse else []
        return reuse, (spares.pop() if spares else None)

    def give_back_flat(self, flat: torch.Tensor) -> None:
        spares = self.spare_flats.setdefault(flat.numel(), [])
        if len(spares) < 2:
            spares.append(flat)

    def feedback(self, state_key: str, numel: int) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """(residual of earlier rounds, spare buffer for this round's), None where there is
        none of the right size yet (`prepare` allocates it); None for a lossless codec."""
        if not self.codec.lossy:
            return None
        residual = self.residuals.get(state_key)
        spare = self.spare_residuals.pop(state_key, None)
        return (
            residual if residual is not None and residual.numel() == numel else None,
            spare if spare is not None and spare.numel() == numel else None,
        )

    # ---- a round's input ----

    def prepare(self, key: str, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None, feedback=None, own=()) -> Prepared:
        """The flat fp32 vector to average (written into `out` when given and a copy is needed)
        and, with a lossy codec, its error-feedback buffers. A codec whose encoding can be cut
        (`Codec.cut`) encodes the vector here, while matchmaking waits on the network: once the
        group is known the first part can leave at once, instead of after the CPU burst of
        every member encoding at the same moment. Except the slices `own` ([a, b) each): the
        ones we owned last round, which never travel if we own them again."""
        t0 = time.monotonic()
        flat = flatten(tensors, out)
        if not math.isfinite(finite_max_abs(flat)):
            raise ValueError(f"averaging {key}: local tensors contain NaN or Inf")
        t1 = time.monotonic()
        prepared = Prepared(flat)
        if feedback is not None:
            residual, new_residual = feedback
            prepared.residual = residual if residual is not None else torch.zeros_like(flat)
            prepared.new_residual = new_residual if new_residual is not None else torch.empty_like(flat)
            if self.codec.cut_align and self.slice_align % self.codec.cut_align == 0:
                for a, b in outside(own, flat.numel()):
                    if b > a:
                        enc = self.codec.encode_with_feedback(flat[a:b], prepared.residual[a:b], out=prepared.new_residual[a:b], keep_decoded=False)[0]
                        prepared.encoded.append((a, b, enc))
        log.debug("prepared in %.3f s (flatten+check %.3f)", time.monotonic() - t0, t1 - t0)
        return prepared

    def encode_part(self, codec, prepared: Prepared, state_key: str, a: int, b: int) -> EncodedTensor:
        """The encoded part; this round's residual goes to `new_residual`. What its owner will
        decode is not kept (needed only if we inherit the slice, and then decoded again)."""
        if prepared.residual is None:  # lossless
            return codec.encode(prepared.flat[a:b])
        state = self.codec_state.setdefault((state_key, a, b), {})
        return codec.encode_with_feedback(prepared.flat[a:b], prepared.residual[a:b], state, out=prepared.new_residual[a:b], keep_decoded=False)[0]

    @staticmethod
    def own_part(prepared: Prepared, a: int, b: int) -> torch.Tensor:
        """Our contribution to the slice we own: exact, with what compression lost in earlier
        rounds (when other members owned these elements) added back, so nothing is lost."""
        if prepared.residual is None:
            return prepared.flat[a:b]
        prepared.new_residual[a:b].zero_()
        return prepared.flat[a:b] + prepared.residual[a:b]

    def gather_carry(self, state_key: str, a: int, b: int, like: torch.Tensor) -> torch.Tensor:
        """What earlier gathers of slice [a, b) lost at its owner (zeros if nothing yet)."""
        carry = self.gather_residuals.get((state_key, a, b))
        if carry is None or carry.numel() != like.numel():
            carry = torch.zeros_like(like)
        return carry

    # ---- after a round ----

    def commit(self, state_key: str, new_residual: torch.Tensor | None, gather: dict[tuple[int, int], torch.Tensor] | None) -> None:
        """The round committed: its error feedback becomes the state (the old residual becomes
        the spare the next round writes into); `gather`: (a, b) -> what this round's gather lost
        per slice we own now (slices we no longer own: dropped)."""
        if gather is not None:
            for k in [k for k in self.gather_residuals if k[0] == state_key]:
                del self.gather_residuals[k]
            for (a, b), r in gather.items():
                self.gather_residuals[(state_key, a, b)] = r
        if new_residual is not None:
            self.spare_residuals[state_key] = self.residuals.get(state_key)
            self.residuals[state_key] = new_residual

    def reset(self, state_key: str | None = None) -> None:
        """Zero the error feedback of `state_key` (None: of every key), in place: its buffers
        are kept for the next round (fresh memory costs a page fault per 4 KiB on first touch)."""
        for k, r in self.residuals.items():
            if state_key is None or k == state_key:
                r.zero_()
        for k, r in self.gather_residuals.items():
            if state_key is None or k[0] == state_key:
                r.zero_()
        for k in [k for k in self.codec_state if state_key is None or k[0] == state_key]:
            del self.codec_state[k]
