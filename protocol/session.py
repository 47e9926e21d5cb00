"""Session and membership messages: a connection's hello, errors, pings, acks and membership
proofs; a node's registration, heartbeats and role assignments from the coordinator."""

from __future__ import annotations

import dataclasses

from .schema import MAX_ID_LEN, Message, Params, _finite, _require, message

# ---------------------------------------------------------------------------------------------
# Session


@message(1)
class Hello(Message):
    """First message on a connection, both ways: who I am and what I want to do."""

    peer_id: str
    swarm_id: str
    software: str = ""
    roles: tuple[str, ...] = ()
    token: bytes | None = None  # a signed join token, for private swarms

    def validate(self) -> None:
        _require(0 < len(self.peer_id) <= MAX_ID_LEN, "peer_id", "must be 1..256 characters")
        _require(len(self.swarm_id) <= MAX_ID_LEN, "swarm_id", "must be at most 256 characters")


ERROR_CODES = ("bad_request", "unauthorized", "overloaded", "not_found", "timeout", "internal", "unsupported")


@message(2)
class Error(Message):
    """A refusal or failure; `request_id` is the request it answers."""

    code: str
    message: str = ""

    def validate(self) -> None:
        _require(self.code in ERROR_CODES, "code", f"must be one of {', '.join(ERROR_CODES)}")


@message(3)
class Ping(Message):
    nonce: int = 0
    sent_at: float = 0.0  # sender's clock, seconds since the epoch


@message(4)
class Pong(Message):
    nonce: int = 0
    sent_at: float = 0.0  # echoed from the ping


@message(5)
class Ack(Message):
    """A generic positive reply; `info` carries small optional details."""

    info: Params = dataclasses.field(default_factory=dict)


@message(9)
class MemberProof(Message):
    """In an owned swarm, a caller's first message to a peer (and after each renewal): its
    membership certificate, signed by the swarm's owner. The peer serves nothing else of the
    caller's before one checks out; answered with Ack, or `unauthorized` and why."""

    certificate: bytes

    def validate(self) -> None:
        _require(0 < len(self.certificate) <= 2048, "certificate", "1..2048 bytes")


# ---------------------------------------------------------------------------------------------
# Membership


@message(10)
class Register(Message):
    """A node asks the coordinator for membership and a role."""

    peer_id: str
    maddrs: tuple[str, ...] = ()
    capabilities: Params = dataclasses.field(default_factory=dict)  # device, memory_gb, tflops, up/down mbps
    token: bytes | None = None
    wanted_role: str | None = None

    def validate(self) -> None:
        _require(0 < len(self.peer_id) <= MAX_ID_LEN, "peer_id", "must be 1..256 characters")
        _require(len(self.maddrs) <= 64, "maddrs", "at most 64 addresses")


MAX_NOTES = 16  # per heartbeat: a node keeps the newest
MAX_NOTE_LEN = 512


@message(11)
class Heartbeat(Message):
    """Periodic liveness report; the reply is a RoleAssignment (the current one, or a new one)."""

    peer_id: str
    step: int = 0
    loss: float | None = None
    samples_per_second: float | None = None
    state_hash: str | None = None
    # the work samples_per_second was measured at ("stage:2"); "": the current assignment's.
    # A rate reported for other work than the coordinator now assigns is not stored
    measured_as: str = ""
    # bytes this node sent and received since it started, every plane together (libp2p, direct,
    # relayed): the coordinator's bytes/s over time are the differences
    bytes_sent: int = 0
    bytes_received: int = 0
    # "": the role runs; else why it failed (the node takes no other role until restarted)
    failure: str = ""
    # what happened since the last heartbeat that the operator should see (a failed round and
    # its reason, say), oldest first
    notes: tuple[str, ...] = ()
    # the peers this node banned since the last heartbeat, oldest first: each "<peer id> <for how
    # long, and why>"
    bans: tuple[str, ...] = ()

    def validate(self) -> None:
        _require(0 < len(self.peer_id) <= MAX_ID_LEN, "peer_id", "must be 1..256 characters")
        _require(len(self.bans) <= MAX_NOTES, "bans", f"at most {MAX_NOTES} per heartbeat")
        _require(all(0 < len(b) <= MAX_NOTE_LEN and " " in b.strip() for b in self.bans), "bans", f"each '<peer id> <why>', 1..{MAX_NOTE_LEN} characters")
        _require(len(self.measured_as) <= MAX_ID_LEN, "measured_as", "at most 256 characters")
        _require(self.bytes_sent >= 0 and self.bytes_received >= 0, "bytes_sent", "byte counts must be >= 0")
        _require(len(self.failure) <= MAX_NOTE_LEN, "failure", f"at most {MAX_NOTE_LEN} characters")
        _require(len(self.notes) <= MAX_NOTES, "notes", f"at most {MAX_NOTES} per heartbeat")
        _require(all(0 < len(n) <= MAX_NOTE_LEN for n in self.notes), "notes", f"each 1..{MAX_NOTE_LEN} characters")
        _require(self.step >= 0, "step", "must be >= 0")
        _require(_finite(self.loss), "loss", "must be finite")
        _require(_finite(self.samples_per_second), "samples_per_second", "must be finite")


@message(12)
class Deregister(Message):
    peer_id: str
    reason: str = ""


ROLES = ("replica", "stage", "expert", "trainer", "idle")


@message(13)
class RoleAssignment(Message):
    """The coordinator's answer to Register / Heartbeat: what this peer should do, and why."""

    peer_id: str
    role: str
    stage: int | None = None
    expert: str | None = None
    epoch: int = 0  # bumps whenever the plan changes
    reason: str = ""
    config: bytes = b""  # the run's training configuration (JSON), the same for every member
    certificate: bytes = b""  # an owned swarm's: this peer's membership certificate (protocol/tokens.py), new or renewed

    @property
    def label(self) -> str:
        """How member records name this work (protocol/records.py `role_label`)."""
        from .records import role_label

        return role_label(self.role, self.stage if self.stage is not None else self.expert)

    def validate(self) -> None:
        _require(self.role in ROLES, "role", f"must be one of {', '.join(ROLES)}")
        _require(len(self.config) <= 65536, "config", "at most 64 KiB")
        _require(len(self.certificate) <= 2048, "certificate", "at most 2048 bytes")
        _require(self.stage is None or self.stage >= 0, "stage", "must be >= 0")
