"""A stranger on the swarm's DHT (a plain hivemind DHT peer, no checks of its own) stores forged,
unsigned and replayed values under the swarm's coordinator and members keys: honest nodes keep
none of them, a node that joins afterwards finds the real coordinator, and nobody is listed as a
member but the members. Real console scripts, real p2pd."""

import asyncio
import dataclasses
import time

import pytest
from hivemind.dht import DHT

from node.net.membership import read_members
from node.net.host import Host, HostConfig
from protocol import SigningKey
from protocol.records import CoordinatorRecord, MemberRecord, coordinator_key, members_key
from protocol.signatures import peer_id_from_public_key
from tests.swarm import node_peer_id, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

FAST = ["--heartbeat-interval-s", "0.5", "--bandwidth-mbps", "100"]
IDLE = ["--min-replicas", "99"]  # replicas wait for a quorum that never comes: membership only, no training load


def _forge(dht: DHT, swarm_id: str, real: CoordinatorRecord, member: MemberRecord) -> dict[str, bool]:
    """What a stranger stores, each with an expiry far later than the real records'."""
    mine = SigningKey.generate()
    now = time.time()
    later = now + 1800
    ck, mk = coordinator_key(swarm_id), members_key(swarm_id)
    fake_coord = CoordinatorRecord(swarm_id, "", ("/ip4/127.0.0.1/tcp/9",), "", now, later).sign(mine)  # well signed, by the wrong key
    someone = MemberRecord(swarm_id, "", ("/ip4/127.0.0.1/tcp/9",), "stage:0", 0, now, expires_at=later).sign(mine)
    stores = {
        "coordinator: junk": (ck, b"\x92junk", None),
        "coordinator: signed by a stranger": (ck, fake_coord.to_bytes(), None),
        "coordinator: the real one, kept longer": (ck, real.to_bytes(), None),
        "coordinator: the real one, its expiry changed": (ck, dataclasses.replace(real, expires_at=later).to_bytes(), None),
        "members: junk under a made-up subkey": (mk, b"junk", "12D3KooWmadeup"),
        "members: a stranger's record under a member's subkey": (mk, someone.to_bytes(), member.peer_id),
        "members: a member's record, kept longer": (mk, member.to_bytes(), member.peer_id),
        "members: a stranger's record, kept longer than it signed": (mk, someone.to_bytes(), someone.peer_id, later + 600),
    }
    return {what: bool(dht.store(key, value, (rest or (later,))[0], subkey=subkey)) for what, (key, value, subkey, *rest) in stores.items()}


def _read_plain(maddr: str, swarm_id: str) -> tuple[bytes | None, dict]:
    """What the swarm's DHT holds, read by a peer that checks nothing itself."""
    dht = DHT(initial_peers=[maddr], start=True)
    try:
        found = dht.get(coordinator_key(swarm_id), latest=True)
        members = dht.get(members_key(swarm_id), latest=True)
        return (found.value if found else None), ({k: v.value for k, v in members.value.items()} if members else {})
    finally:
        dht.shutdown()


def test_a_stranger_storing_forged_records_keeps_no_node_out_and_lists_nobody(swarm, tmp_path):
    owner = SigningKey.generate()
    owner.save(tmp_path / "owner.pem")
    swarm_id = f"records@{peer_id_from_public_key(owner.public_key)}"  # the owner's key signs the coordinator record
    coord = swarm.coordinator("coordinator", None, None, "--swarm-id", swarm_id, "--identity", str(tmp_path / "owner.pem"), *IDLE)
    coord.wait_ready()
    maddr = coord.maddr()
    a = swarm.node("a", [maddr], "--swarm-id", swarm_id, *FAST)
    ids = {"a": node_peer_id(a)}
    wait_for(lambda: ids["a"] in coord.members(), 60, "a registered")

    async def records():
        host = await Host.start(SigningKey.generate(), HostConfig(initial_peers=(maddr,), swarm_id=swarm_id))
        try:
            for _ in range(100):
                raw, members = await host.dht_get(coordinator_key(swarm_id)), await read_members(host, swarm_id)
                if raw and ids["a"] in members:
                    return CoordinatorRecord.from_bytes(raw, swarm_id), members[ids["a"]]
                await asyncio.sleep(0.2)
            raise AssertionError("the real records never showed up in the DHT")
        finally:
            await host.shutdown()

    real, member = asyncio.run(records())
    stranger = DHT(initial_peers=[maddr], start=True)
    try:
        _forge(stranger, swarm_id, real, member)
        # a node that joins now finds the coordinator through the DHT and gets a role
        b = swarm.node("b", [maddr], "--swarm-id", swarm_id, *FAST)
        ids["b"] = node_peer_id(b)
        wait_for(lambda: ids["b"] in coord.members(), 60, "b registered while the stranger serves its forgeries")
        assert "coordinator unreachable" not in b.log()
    finally:
        stranger.shutdown()
    # the honest nodes kept none of it: a reader that checks nothing finds the real records only
    wait_for(lambda: ids["b"] in _read_plain(maddr, swarm_id)[1], 60, "b's record in the DHT")
    raw, members = _read_plain(maddr, swarm_id)
    got = CoordinatorRecord.from_bytes(raw, swarm_id)
    assert got.peer_id == real.peer_id and got.expires_at <= time.time() + 3 * 10.0 + 1, got  # the owner's, refreshed: not one kept longer
    assert set(members) == {ids["a"], ids["b"]}, members
    for peer, value in members.items():
        assert MemberRecord.from_bytes(value, swarm_id).peer_id == peer
    assert set(coord.members()) == {ids["a"], ids["b"]}
