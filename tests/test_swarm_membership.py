"""Swarm tests for membership: real console scripts, real p2pd, real SQLite, real HTTP."""

import asyncio
import time

import msgpack
import pytest

from node.net.host import Host, HostConfig
from node.net.transport import RPC_PROTOCOL, Transport
from protocol import PROTOCOL_VERSION, Decoder, Error, Ping, Pong, SigningKey
from tests.swarm import node_peer_id, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

FAST = ["--heartbeat-interval-s", "0.5", "--bandwidth-mbps", "100"]
IDLE = ["--min-replicas", "99"]  # replicas wait for a quorum that never comes: membership only, no training load


def _frame(body) -> bytes:
    data = msgpack.packb(body)
    return len(data).to_bytes(4, "big") + data


async def _abuse_and_check(maddr: str, targets: list[str]) -> dict:
    """From a real libp2p peer: send garbage, oversized and unknown frames to every target; then
    check each still answers a well-formed call. Returns the error replies seen."""
    host = await Host.start(SigningKey.generate(), HostConfig(initial_peers=(maddr,)))
    transport = Transport(host)
    replies = {}
    try:
        for peer in targets:
            got = []
            for raw in (
                b"\x00\x00\x00\x07garbage",  # not msgpack
                b"\xff\xff\xff\xf0",  # a 4 GiB frame announced
                _frame([PROTOCOL_VERSION, 99, 0, {}]),  # unknown message type
            ):
                reader, writer = await host.open_stream(peer, RPC_PROTOCOL)
                writer.write(raw)
                await writer.drain()
                data = await asyncio.wait_for(reader.read(1 << 16), 10)
                writer.close()
                got += Decoder().feed(data)
            replies[peer] = got
            assert isinstance(await transport.call(peer, Ping(nonce=7), timeout=10), Pong)
    finally:
        await transport.close()
        await host.shutdown()
    return replies


def test_coordinator_and_three_nodes(swarm):
    coord = swarm.coordinator("coordinator", None, None, "--heartbeat-timeout-s", "4", *IDLE)
    coord.wait_ready()
    maddr = coord.maddr()
    nodes = {name: swarm.node(name, [maddr], *FAST) for name in ("a", "b", "c")}
    ids = {name: node_peer_id(p) for name, p in nodes.items()}

    # all three listed with roles within seconds of starting
    members = wait_for(lambda: len(m := coord.members()) == 3 and all(x["role"] for x in m.values()) and m, 30, "3 members with roles")
    assert set(members) == set(ids.values())
    assert {m["role"] for m in members.values()} == {"replica"}
    for m in members.values():
        assert m["capabilities"]["device"] == "cpu" and m["capabilities"]["tflops"] > 0
    assert "swarmtrain_members_total 3.0" in coord.metrics()

    # garbage, oversized and unknown frames to a node and to the coordinator: refused, both keep answering
    coord_id = coord.status()["peer_id"]
    replies = asyncio.run(_abuse_and_check(maddr, [ids["a"], coord_id]))
    for peer, got in replies.items():
        assert [type(r) for r in got] == [Error, Error, Error], got
        assert [r.code for r in got] == ["bad_request"] * 3
        assert "msgpack" in got[0].message and "exceeds" in got[1].message and "unknown message type" in got[2].message
    assert nodes["a"].alive() and coord.proc.alive()
    assert len(coord.members()) == 3

    # SIGTERM: deregisters at once (not by eviction), exits 0 within a few seconds
    evictions = coord.status()["evictions"]
    t0 = time.monotonic()
    nodes["b"].terminate()
    wait_for(lambda: ids["b"] not in coord.members(), 10, "b to deregister")
    assert coord.status()["evictions"] == evictions
    assert nodes["b"].wait(15) == 0
    assert time.monotonic() - t0 < 15
    assert "deregistered " + ids["b"] in coord.proc.log()

    # SIGKILL: evicted within the heartbeat timeout (4 s, checked every second)
    nodes["c"].kill()
    t0 = time.monotonic()
    wait_for(lambda: ids["c"] not in coord.members(), 4 + 3, "c to be evicted")
    assert coord.status()["evictions"] == evictions + 1
    assert f"evicted {ids['c']}: no heartbeat" in coord.proc.log()
    # its DHT child and p2pd follow it down by themselves
    wait_for(lambda: not nodes["c"].leftovers(), 10, "c's children to exit")
    assert ids["a"] in coord.members()


def test_node_keeps_running_without_coordinator_and_reregisters(swarm):
    coord = swarm.coordinator("coordinator", None, None, "--heartbeat-timeout-s", "5", *IDLE)
    coord_id = coord.wait_ready()["peer_id"]
    node = swarm.node("a", [coord.maddr()], *FAST)
    peer = node_peer_id(node)
    wait_for(lambda: peer in coord.members(), 30, "a to register")
    coord.proc.kill()
    # the node survives and keeps retrying
    wait_for(lambda: "coordinator unreachable" in node.log(), 15, "the node to notice")
    assert node.alive()
    # restart on the same data dir and port: same identity, the member is known, the node re-registers
    again = swarm.restart(coord, "coordinator-again")
    assert again.wait_ready()["peer_id"] == coord_id
    assert peer in again.members()  # known from the registry on disk, before the node is back
    wait_for(lambda: "registered with the coordinator again" in node.log(), 30, "the node to re-register")
    assert time.time() - again.members()[peer]["last_seen"] < 5
