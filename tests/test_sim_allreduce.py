"""The all-reduce as arithmetic (node/models/sim_allreduce.py), which the convergence bench's
sparse arm trains through: exact without compression, lossless over rounds with it."""

import torch

from node.models.sim_allreduce import SimAllReduce, equal_bounds
from protocol import make_codec
from protocol.sparse import payload_bytes


def inputs(n: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(numel, generator=g) + 0.3 for _ in range(n)]


def test_bounds_are_aligned_equal_shares():
    assert equal_bounds(10_000, 4, 1024) == [0, 2048, 5120, 7168, 10_000]
    assert equal_bounds(100, 3, 1024) == [0, 0, 0, 100]


def test_without_compression_every_member_gets_the_mean():
    xs = inputs(3, 5000)
    none = make_codec("none")
    ar = SimAllReduce(3, 5000, none, none, align=64)
    assert torch.allclose(ar(xs), torch.stack(xs).mean(0), atol=1e-6)
    # each member sends its parts of the 2 other slices, and its own slice to the 2 others
    b = ar.bounds
    for j in range(3):
        others = 5000 - (b[j + 1] - b[j])
        assert ar.bytes_sent[j] == 4 * others + 2 * 4 * (b[j + 1] - b[j])


def test_sparse_both_ways_loses_nothing_over_rounds():
    """The same inputs every round: with error feedback at the senders and at the owners, the
    running mean of the results approaches the exact mean; its bytes are the codec's."""
    n, numel = 4, 3 * 4096 + 500
    xs = inputs(n, numel)
    codec = make_codec("sparse", density=0.05, bits=2, chunk=1024)
    ar = SimAllReduce(n, numel, codec, codec, align=1024)
    exact, total, errors = torch.stack(xs).mean(0), torch.zeros(numel), []
    for k in range(1, 61):
        out = ar(xs)
        assert (out != 0).sum() <= 0.06 * numel  # what went back is as sparse as what went out
        total += out
        errors.append(float((total / k - exact).norm() / exact.norm()))
    assert errors[-1] < 0.25 * errors[0] and errors[-1] < 0.7 * errors[29], errors  # measured: 0.91, 0.30, 0.19
    b = ar.bounds
    for j in range(n):
        part = lambda i: payload_bytes(b[i + 1] - b[i], 1024, codec.k, 2)  # noqa: E731
        assert ar.bytes_sent[j] == 60 * (sum(part(i) for i in range(n) if i != j) + (n - 1) * part(j))
