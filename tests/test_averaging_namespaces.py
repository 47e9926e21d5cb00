"""Several averagers in one process, one per namespace, on shared hosts and transports (real
p2pd): their rounds never mix, even under the same round key at the same moment."""

import asyncio

import pytest
import torch

from node.averaging import Averager, AveragerConfig, AveragingService, NamespaceTaken
from protocol import AvgJoin, TensorPart
from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(120)


def test_two_namespaces_average_concurrently_with_their_own_groups_and_codecs():
    async def main():
        from node.net.transport import Transport

        hosts = await start_hosts(3)
        transports = [Transport(h) for h in hosts]
        # "stage-0": every host, int8; "stage-1": the first two hosts only, fp16
        stage0 = [Averager(h, t, AveragerConfig(namespace="stage-0", codec="int8", join_timeout_s=10)) for h, t in zip(hosts, transports)]
        stage1 = [Averager(h, t, AveragerConfig(namespace="stage-1", codec="fp16", join_timeout_s=10)) for h, t in zip(hosts[:2], transports[:2])]
        try:
            for t in transports:
                await t.start()
            for a in stage0 + stage1:
                await a.start()
            gen = torch.Generator().manual_seed(11)
            for rnd in range(2):
                x0 = [torch.randn(5000, generator=gen) for _ in stage0]
                x1 = [torch.randn(3000, generator=gen) * 10 for _ in stage1]
                key = f"round-{rnd}"  # the same key in both namespaces
                out0, out1 = await asyncio.gather(
                    asyncio.gather(*(a.average(key, [x], expected_peers=3) for a, x in zip(stage0, x0))),
                    asyncio.gather(*(a.average(key, [x], expected_peers=2) for a, x in zip(stage1, x1))),
                )
                for outs, xs, n in ((out0, x0, 3), (out1, x1, 2)):
                    results = [r[0][0] for r in outs]
                    reports = [r[1] for r in outs]
                    assert all(len(rep.members) == n for rep in reports), [rep.members for rep in reports]
                    assert len({rep.group_id for rep in reports}) == 1
                    assert all(torch.equal(results[0], r) for r in results[1:]), "members of one group differ"
                    exact = torch.stack(xs).mean(0)
                    assert (results[0] - exact).abs().max() < 0.05 * exact.abs().max()
                assert out0[0][1].group_id != out1[0][1].group_id
                assert sorted(out1[0][1].members) == sorted(h.peer_id for h in hosts[:2])
        finally:
            for a in stage0 + stage1:
                await a.close()
            for t in transports:
                await t.close()
            for h in hosts:
                await h.shutdown()

    asyncio.run(main())


def test_one_averager_per_namespace_and_the_message_types_are_freed_by_the_last():
    async def main():
        from node.net.transport import HandlerTaken, Transport

        (host,) = await start_hosts(1)
        transport = Transport(host)
        try:
            await transport.start()
            first = Averager(host, transport, AveragerConfig(namespace="replicas"))
            other = Averager(host, transport, AveragerConfig(namespace="stage-1"))
            await first.start()
            await other.start()
            with pytest.raises(NamespaceTaken, match="replicas"):
                await Averager(host, transport, AveragerConfig(namespace="replicas")).start()
            # the averaging service owns the message types: nothing else can take them
            with pytest.raises(HandlerTaken, match="TensorPart"):
                transport.on(TensorPart, lambda ctx: None)
            await first.close()
            again = Averager(host, transport, AveragerConfig(namespace="replicas"))
            await again.start()  # the namespace is free once its averager closed
            await again.close()
            assert AvgJoin in transport.handlers  # "stage-1" still serves
            await other.close()
            assert AvgJoin not in transport.handlers and TensorPart not in transport.handlers
            assert AveragingService.of(transport).averagers == {}
        finally:
            await transport.close()
            await host.shutdown()

    asyncio.run(main())


def test_bad_namespaces_are_refused_by_the_config():
    for bad in ("", "a/b", "x" * 65, "two words"):
        with pytest.raises(ValueError, match="namespace"):
            AveragerConfig(namespace=bad)


def test_a_peer_that_went_silent_is_not_waited_for_until_it_joins_again():
    async def main():
        from node.net.transport import Transport

        (host,) = await start_hosts(1)
        transport = Transport(host)
        avg = Averager(host, transport, AveragerConfig())
        mm = avg.matchmaker
        mm.silent = {"gone": 100.0, "old": 10.0}
        assert mm.recently_silent(now=110.0) == {"gone"}  # "old" went silent long ago
        assert "old" not in mm.silent
        await transport.close()
        await host.shutdown()

    asyncio.run(main())
