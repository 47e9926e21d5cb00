"""How a one-process DiLoCo simulation averages its replicas' pseudo-gradients: `SenderMean`
(each sender's error feedback, then the plain mean) or `SimAllReduce`, the averager's all-reduce
(node/averaging/) as plain arithmetic.

What each member ends a round with, when none fails: the flat vector cut into one slice per
member (equal shares, bounds aligned, as `slice_bounds` cuts them); member j owns slice j.

1. Scatter: every member encodes its part of every other member's slice with error feedback
   (x + its residual; what the codec lost is its next residual). Its part of its own slice never
   travels: it counts exactly, residual included (and that residual is spent).
2. The owner takes the mean of the parts, in member order.
3. Gather: the owner encodes the mean with the gather codec and its own error feedback (what the
   gather lost is sent with the next round's); every member, the owner included, keeps what the
   encoding decodes to, so all hold the same bits.

Bytes are payload bytes each member sends: its scatter parts, and its slice's gather encoding to
each other member.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol import Codec, ErrorFeedback, decode_tensor


class SenderMean:
    """Each replica sends its tensors through its own ErrorFeedback(codec), tensor by tensor;
    everyone averages every sender's decoded tensors, in replica order. Bytes: the encodings."""

    def __init__(self, n: int, names: Sequence[str], codec: Codec):
        self.n, self.names = n, list(names)
        self.senders = [ErrorFeedback(codec) for _ in range(n)]
        self.bytes_sent = [0] * n

    def tensors(self, pgs: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """The mean, per tensor, of what every replica's `pgs[r]` decodes to."""
        decoded = []
        for r, pg in enumerate(pgs):
            encoded = [self.senders[r].encode(name, g) for name, g in zip(self.names, pg)]
            self.bytes_sent[r] += sum(e.nbytes for e in encoded)
            decoded.append([decode_tensor(e) for e in encoded])
        return [torch.stack(ts).sum(0) / self.n for ts in zip(*decoded)]


def equal_bounds(numel: int, n: int, align: int) -> list[int]:
    """[0, numel) in n slices of equal share, inner bounds multiples of `align`."""
    inner = [min(numel, int(round(numel * i / n / align)) * align) for i in range(1, n)]
    return [0, *inner, numel]


class SimAllReduce:
    """The all-reduce of n members over flat vectors of `numel` elements; keeps every member's
    scatter residual and every owner's gather residual across rounds."""

    def __init__(self, n: int, numel: int, codec: Codec, gather_codec: Codec, align: int = 1024):
        self.n, self.codec, self.gather_codec = n, codec, gather_codec
        self.bounds = equal_bounds(numel, n, align)
        self.residuals = [torch.zeros(numel) for _ in range(n)]  # per member, its scatter feedback
        self.gather_residual = torch.zeros(numel)  # each owner's, on its slice
        self.bytes_sent = [0] * n

    def tensors(self, pgs: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """`__call__` over lists of tensors (flattened, as the averager flattens them)."""
        flat = self([torch.cat([g.reshape(-1) for g in pg]) for pg in pgs])
        return [t.view(g.shape) for t, g in zip(flat.split([g.numel() for g in pgs[0]]), pgs[0])]

    def __call__(self, flats: Sequence[torch.Tensor]) -> torch.Tensor:
        """The averaged vector every member holds after the round."""
        if len(flats) != self.n:
            raise ValueError(f"expected {self.n} vectors, got {len(flats)}")
        out = torch.empty_like(self.gather_residual)
        for j, (a, b) in enumerate(zip(self.bounds, self.bounds[1:])):
            parts = []
            for i, x in enumerate(flats):
                r = self.residuals[i][a:b]
                if i == j:  # the owner's own part: exact, with what earlier rounds lost
                    parts.append(x[a:b] + r)
                    r.zero_()
                    continue
                enc, _ = self.codec.encode_with_feedback(x[a:b], r, keep_decoded=False)
                self.bytes_sent[i] += enc.nbytes
                parts.append(decode_tensor(enc).reshape(-1))
            avg = torch.mul(parts[0], 1.0 / self.n)
            for p in parts[1:]:
                avg.add_(p, alpha=1.0 / self.n)
            if self.gather_codec.lossy:
                enc, _ = self.gather_codec.encode_with_feedback(avg, self.gather_residual[a:b], decoded=out[a:b])
            else:
                enc = self.gather_codec.encode(avg)
                out[a:b] = avg
            self.bytes_sent[j] += enc.nbytes * (self.n - 1)
        return out
