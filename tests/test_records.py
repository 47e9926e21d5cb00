"""Signed DHT member records: what a node announces (role, step, throughput, load) round-trips,
and a record changed by anyone but its signer, or malformed, is refused with the reason."""

import dataclasses
import math

import msgpack
import pytest

from protocol import RemoteProtocolError, SigningKey
from protocol.records import MemberRecord


def record(**kw) -> MemberRecord:
    fields = dict(swarm_id="s", peer_id="", maddrs=("/ip4/127.0.0.1/tcp/1",), role="expert:shard1", step=7, issued_at=1e9, throughput=51275.1, load=3.0)
    return MemberRecord(**{**fields, **kw}).sign(SigningKey.generate())


def test_a_member_record_carries_its_hosts_throughput_and_load():
    rec = record()
    back = MemberRecord.from_bytes(rec.to_bytes(), "s")
    assert back == rec and (back.role, back.throughput, back.load) == ("expert:shard1", 51275.1, 3.0)
    assert MemberRecord.from_bytes(record(throughput=0.0, load=0.0).to_bytes(), "s").throughput == 0.0  # not measured yet


@pytest.mark.parametrize(
    "change,why",
    [
        (lambda r: dataclasses.replace(r, load=0.0), "forged: bad signature"),  # a peer that makes a busy host look idle
        (lambda r: dataclasses.replace(r, throughput=1e12), "forged: bad signature"),
        (lambda r: dataclasses.replace(r, throughput=math.nan), "field throughput has the wrong type"),
        (lambda r: dataclasses.replace(r, load="busy"), "field load has the wrong type"),
    ],
)
def test_a_changed_or_malformed_member_record_is_refused(change, why):
    with pytest.raises(RemoteProtocolError, match=why):
        MemberRecord.from_bytes(change(record()).to_bytes(), "s")


def test_a_record_of_the_older_layout_is_refused_by_its_length():
    old = msgpack.unpackb(record().to_bytes())
    del old[6:8]  # no throughput, no load
    with pytest.raises(RemoteProtocolError, match="must be a list of 10 fields"):
        MemberRecord.from_bytes(msgpack.packb(old, use_bin_type=True), "s")
