"""Signed DHT member records: what a node announces (role, step, throughput, load) round-trips,
and a record changed by anyone but its signer, or malformed, is refused with the reason."""

import dataclasses
import math

import msgpack
import pytest

from protocol import RemoteProtocolError, SigningKey
from protocol.records import MAX_RECORD_TTL_S, CoordinatorRecord, MemberRecord, check_stored, swarm_id_problem
from protocol.signatures import peer_id_from_public_key
from protocol.tokens import issue_certificate


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
    del old[8:10]  # no expiry, no certificate
    with pytest.raises(RemoteProtocolError, match="must be a list of 12 fields"):
        MemberRecord.from_bytes(msgpack.packb(old, use_bin_type=True), "s")


OWNER = SigningKey.generate()
OWNED = f"s@{peer_id_from_public_key(OWNER.public_key)}"


def coordinator(key=OWNER, swarm_id=OWNED, issued=1000.0, expires=1030.0) -> CoordinatorRecord:
    return CoordinatorRecord(swarm_id, "", ("/ip4/127.0.0.1/tcp/1",), "", issued, expires).sign(key)


def member(cert_from=OWNER, cert_swarm=OWNED, cert_for: str | None = None, issued=1000.0, ttl=600.0) -> MemberRecord:
    """A member record of OWNED, issued at 1000 and expiring at 1030, with a certificate."""
    key = SigningKey.generate()
    me = peer_id_from_public_key(key.public_key)
    cert = b"" if cert_from is None else issue_certificate(cert_from, cert_swarm, cert_for or me, "replica", issued, ttl).to_bytes()
    return MemberRecord(OWNED, "", (), "replica", 0, 1000.0, expires_at=1030.0, certificate=cert).sign(key)


@pytest.mark.parametrize(
    "kind,value,subkey,expiration,why",
    [
        ("coordinator", b"junk", None, 1030.0, "not msgpack|must be a list"),
        ("coordinator", coordinator(key=SigningKey.generate()).to_bytes(), None, 1030.0, "not by the swarm's owner"),
        ("coordinator", coordinator().to_bytes(), None, 1031.0, "to be kept 1 s past the expiry its signer signed"),
        ("coordinator", dataclasses.replace(coordinator(), expires_at=5000.0).to_bytes(), None, 5000.0, "forged: bad signature"),
        ("coordinator", coordinator(issued=1200.0, expires=1230.0).to_bytes(), None, 1230.0, "issued 160 s in the future"),
        ("coordinator", coordinator(expires=1000.0 + MAX_RECORD_TTL_S + 1).to_bytes(), None, 1030.0, "expires 3601 s after it was issued"),
        ("coordinator", coordinator().to_bytes(), "12D3KooWx", 1030.0, "one value, not a dictionary"),
        ("coordinator", coordinator(swarm_id="other").to_bytes(), None, 1030.0, "for swarm 'other'"),
        ("members", member().to_bytes(), "12D3KooWsomeoneelse", 1030.0, "under the subkey"),
        ("members", member().to_bytes(), None, 1030.0, "under their peer ids"),
    ],
)
def test_a_value_the_dht_must_not_keep_is_refused_with_the_reason(kind, value, subkey, expiration, why):
    with pytest.raises(RemoteProtocolError, match=why):
        check_stored(OWNED, kind, value, subkey, expiration, now=1040.0)


@pytest.mark.parametrize(
    "rec,why",
    [
        (member(cert_from=None), "no valid membership certificate: none presented"),
        (member(cert_from=SigningKey.generate()), "forged: not signed by the swarm owner's key"),
        (member(cert_swarm="other"), "other swarm"),
        (member(cert_for=peer_id_from_public_key(SigningKey.generate().public_key)), "other peer"),
        (member(issued=0.0, ttl=600.0), "expired 440 s ago"),
    ],
)
def test_an_owned_swarms_member_record_needs_its_owners_certificate(rec, why):
    with pytest.raises(RemoteProtocolError, match=why):
        check_stored(OWNED, "members", rec.to_bytes(), rec.peer_id, 1030.0, now=1040.0)


def test_the_owners_and_the_members_own_records_are_kept():
    assert check_stored(OWNED, "coordinator", coordinator().to_bytes(), None, 1030.0, now=1040.0).peer_id == peer_id_from_public_key(OWNER.public_key)
    rec = member()
    assert check_stored(OWNED, "members", rec.to_bytes(), rec.peer_id, 1030.0, now=1040.0) == rec
    unowned = record(issued_at=1000.0, expires_at=1030.0)  # swarm "s": nobody certifies its members
    assert check_stored("s", "members", unowned.to_bytes(), unowned.peer_id, 1030.0, now=1040.0) == unowned
    # an unowned swarm id: any peer's well-signed coordinator record (nothing names who may sign it)
    assert check_stored("s", "coordinator", coordinator(key=SigningKey.generate(), swarm_id="s").to_bytes(), None, 1030.0, now=1040.0)


@pytest.mark.parametrize("swarm_id,problem", [("", "1..200 characters"), ("a b", "without spaces"), ("a@b@c", "with one '@'"), ("@x", "with one '@'"),
                                               ("a@12D3KooWnotapeerid", "not an Ed25519 libp2p peer id")])  # fmt: skip
def test_malformed_swarm_ids_are_named(swarm_id, problem):
    assert problem in swarm_id_problem(swarm_id)
    assert swarm_id_problem("swarmtrain") is None and swarm_id_problem(OWNED) is None
