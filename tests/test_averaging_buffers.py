"""Buffers an Averager reuses across rounds must never carry one round's data into the next.
Two real hosts (p2pd) in one process, so the test can look at what each round allocated."""

import asyncio

import pytest
import torch

from tests.swarm import averagers

pytestmark = pytest.mark.timeout(120)


def test_rounds_of_a_lossy_codec_reuse_the_flat_copy_and_average_their_own_inputs():
    async def main():
        async with averagers(2, codec="int8", join_timeout_s=10) as avgs:
            gen = torch.Generator().manual_seed(3)
            flats = []
            for rnd in range(3):
                # several tensors: the averager must copy them into one flat vector
                inputs = [[torch.randn(300, 40, generator=gen), torch.randn(5000, generator=gen)] for _ in avgs]
                out = await asyncio.gather(*(a.average(f"reuse-{rnd}", x, expected_peers=2, state_key="k") for a, x in zip(avgs, inputs)))
                exact = [(x0 + x1) / 2 for x0, x1 in zip(*inputs)]
                for result, _ in out:
                    for r, e in zip(result, exact):
                        # int8 error of one scatter and one gather step: far below the gap
                        # between two rounds' inputs (~1.4 on average per element)
                        assert (r - e).abs().max() < 0.1
                    assert [r.shape for r in result] == [x.shape for x in inputs[0]]
                assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0]))
                flats.append([a.buffers.spare_flats[17000][-1].data_ptr() for a in avgs])
            # from the second round on, each averager flattens into the buffer of the round before
            assert flats[0] == flats[1] == flats[2]

    asyncio.run(main())


def test_a_wrongly_predicted_own_slice_changes_no_bit_of_any_round():
    """Encoding starts before the group is known, skipping the slice we owned last time. When
    that guess is wrong the part is encoded after all: two pairs fed the same inputs, one of
    them misled about its slice every round, end every round with the same bits."""

    async def main():
        async with averagers(4, codec="int8", join_timeout_s=10, slice_align=1024) as avgs:
            pairs = [sorted(avgs[:2], key=lambda a: a.peer_id), sorted(avgs[2:], key=lambda a: a.peer_id)]
            numel = 10_000
            gen = torch.Generator().manual_seed(5)
            for rnd in range(3):
                inputs = [[torch.randn(numel, generator=gen)] for _ in range(2)]  # by position in the pair
                if rnd:  # the misled pair expects to own the other member's slice
                    lo, hi = pairs[1]
                    lo.buffers.last_own[numel], hi.buffers.last_own[numel] = hi.buffers.last_own[numel], lo.buffers.last_own[numel]
                outs = []
                for pair in pairs:
                    got = await asyncio.gather(*(a.average(f"{id(pair)}-{rnd}", x, expected_peers=2, state_key="k") for a, x in zip(pair, inputs)))
                    outs.append([r[0][0] for r in got])
                assert torch.equal(outs[0][0], outs[0][1]) and torch.equal(outs[1][0], outs[1][1])
                assert torch.equal(outs[0][0], outs[1][0]), f"round {rnd}: a wrong guess changed the result"
                assert (outs[0][0] - (inputs[0][0] + inputs[1][0]) / 2).abs().max() < 0.2
                for a, b in zip(*pairs):  # and the error feedback carried into the next round
                    assert torch.equal(a.buffers.residuals["k"], b.buffers.residuals["k"])

    asyncio.run(main())
