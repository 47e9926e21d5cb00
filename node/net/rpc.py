"""The vocabulary of a call, shared by both sides of the transport (node/net/transport.py): its
protocols, its settings (`TransportConfig`), its two error families (`RPCError` refuses a
request; `RemoteError`, `CallTimeout` and the rest of `NETWORK_ERRORS` say the peer failed us),
what a handler sees of a call (`CallContext`), and the scores that ban peers whose input is bad
(`PeerScores`)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from protocol import Error, Message, RemoteProtocolError
from protocol.framing import DEFAULT_MAX_FRAME_SIZE
from protocol.messages import ERROR_CODES

from .host import PeerUnreachable

log = logging.getLogger(__name__)

RPC_PROTOCOL = "/swarmtrain/rpc/1"
PIPE_PROTOCOL = "/swarmtrain/pipe/1"  # calls one after another on a stream kept open (`send(..., reuse=True)`)


class RPCError(Exception):
    """Raised by a handler to refuse a request with a specific error code."""

    def __init__(self, code: str, message: str):
        if code not in ERROR_CODES:  # an Error frame cannot carry it: the caller would get no reply at all
            raise ValueError(f"RPCError code {code!r} is not one of {', '.join(ERROR_CODES)}")
        super().__init__(message)
        self.code, self.message = code, message


class RemoteError(Exception):
    """The peer answered with an Error frame."""

    def __init__(self, peer_id: str, code: str, message: str):
        super().__init__(f"{peer_id[-8:]} refused: {code}: {message}")
        self.peer_id, self.code, self.message = peer_id, code, message


class CallTimeout(Exception):
    """A call passed its deadline."""


class HandlerTaken(Exception):
    """Our bug: a second service tried to take a message type another one serves."""


# What a call to another peer can raise when the peer, or the way to it, fails: it is dead or
# unreachable, it passed the deadline, it refused, or it sent bytes that broke the protocol.
# One definition for every caller that treats "the peer failed" alike.
NETWORK_ERRORS: tuple[type[BaseException], ...] = (PeerUnreachable, CallTimeout, RemoteError, ConnectionError, RemoteProtocolError, OSError)


def check_reply(peer_id: str, reply: Message | None) -> Message:
    """The reply, or what its absence or its Error frame means at the caller."""
    if reply is None:
        raise ConnectionError(f"{peer_id} closed the stream without a reply")
    if isinstance(reply, Error):
        raise RemoteError(peer_id, reply.code, reply.message)
    return reply


@dataclass(frozen=True)
class TransportConfig:
    call_timeout_s: float = 10.0  # default deadline of an outgoing call
    handler_timeout_s: float = 120.0  # longest a handler may run before the caller is told "timeout"
    request_read_timeout_s: float = 30.0  # a peer must deliver each frame of a request within this
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE  # bytes; larger frames are refused from their prefix
    max_concurrent_per_peer: int = 32  # calls one peer may have open with us at once
    max_bytes_in_flight_per_peer: int = 256 << 20  # request bytes of one peer held in our memory at once (received, not yet handled)
    ban_score: float = -10.0  # a peer at or below this score is refused for `ban_s`
    ban_s: float = 60.0  # first ban; doubles with each further ban
    # a peer's score is minus its penalties of the last `score_window_s`: it recovers with time,
    # never with calls (a peer that sends bad input cannot wash its score with cheap valid calls)
    score_window_s: float = 600.0
    # a served stream stays open after its last reply until the caller hangs up, at most this
    # long. p2pd ends a stream with close-then-reset, and a reset that overtakes the reply
    # between the two daemons throws the reply (or its end) away: on a busy machine, about one
    # call in a thousand; once the caller has hung up, it has read everything
    linger_s: float = 5.0
    pipe_idle_s: float = 300.0  # a pipe with no call for this long is closed (by the server; callers reuse one for half of it)
    pipes_per_peer: int = 4  # idle pipes kept open to one peer
    # pipes go over direct TCP (sealed, see node/net/direct.py) where the peer can be reached, else
    # over libp2p. The listener binds the IPv4 addresses of the host's host_maddrs; behind a
    # port-forwarding NAT, forward `direct_port` too (0: any free port)
    direct: bool = True
    direct_port: int = 0
    direct_connect_s: float = 2.0  # the whole direct attempt: ticket call, connect, confirmation
    direct_retry_s: float = 300.0  # after a failed attempt, that peer's pipes use libp2p this long
    # congestion control of direct connections, where the kernel allows it (else its default):
    # rounds on rate-limited links came closer to the bandwidth bound with CUBIC than with BBR
    direct_congestion: str | None = "cubic"
    # serve relay hops (node/net/relay.py): carry streams to peers that keep a connection to us for
    # callers that cannot dial them (members only, in an owned swarm)
    relay_service: bool = False


@dataclass
class PeerState:
    penalties: deque[tuple[float, float, str]] = field(default_factory=deque)  # (when, amount, offence), within the score window
    active: int = 0
    bytes_in_flight: int = 0
    banned_until: float = 0.0
    bans: int = 0
    ban_reason: str = ""  # what earned the last ban: its offences, the last one named
    last_logged: float = -1e9


class PeerScores:
    """Scores peers by their behaviour; bans the repeat offenders with exponential backoff.
    Every penalty names its offence, and a ban keeps what earned it (logged, in /status, and
    told to the banned peer)."""

    def __init__(self, config: TransportConfig):
        self.config = config
        self.peers: dict[str, PeerState] = defaultdict(PeerState)
        self.on_ban: Callable[[str, str], None] | None = None  # (peer id, "for N s (ban k): why"): the node tells its coordinator

    def penalize(self, peer_id: str, amount: float, now: float, reason: str) -> bool:
        """Score `peer_id` down by `amount` for `reason` (a line naming the offence); whether
        that banned it."""
        st = self.peers[peer_id]
        st.penalties.append((now, amount, reason))
        if self._score(st, now) > self.config.ban_score:
            return False
        ban_s = self.config.ban_s * (2**st.bans)
        st.banned_until = now + ban_s
        st.bans += 1
        n = len(st.penalties)
        st.ban_reason = f"{n} offence{'s' if n > 1 else ''} in {self.config.score_window_s:.0f} s, the last: {reason}"
        st.penalties.clear()
        log.warning("banned %s for %.0f s (ban %d): %s", peer_id, ban_s, st.bans, st.ban_reason)
        if self.on_ban is not None:
            self.on_ban(peer_id, f"for {ban_s:.0f} s (ban {st.bans}): {st.ban_reason}")
        return True

    def _score(self, st: PeerState, now: float) -> float:
        while st.penalties and st.penalties[0][0] <= now - self.config.score_window_s:
            st.penalties.popleft()
        return -sum(amount for _, amount, _ in st.penalties)

    def banned(self, peer_id: str, now: float) -> float:
        """Seconds of ban left (0: not banned)."""
        return max(0.0, self.peers[peer_id].banned_until - now)

    def banned_now(self, now: float) -> set[str]:
        """The peers banned now."""
        return {p for p, st in self.peers.items() if st.banned_until > now}

    def bans(self, now: float) -> list[dict]:
        """The peers banned now: who, for how many more seconds, how many times, and why."""
        return [
            {"peer_id": p, "left_s": round(self.peers[p].banned_until - now, 1), "bans": self.peers[p].bans, "reason": self.peers[p].ban_reason}
            for p in sorted(self.banned_now(now))
        ]

    def score(self, peer_id: str, now: float | None = None) -> float:
        """Minus the peer's penalties within the score window (0: none)."""
        return self._score(self.peers[peer_id], time.monotonic() if now is None else now)


class CallContext:
    """What a handler sees of the call: who, the first frame, and further frames on demand."""

    def __init__(self, peer_id: str, request: Message, receive: Callable[[], Awaitable[Message]]):
        self.peer_id = peer_id
        self.request = request
        self._receive = receive

    async def receive(self) -> Message:
        """The next frame the caller sent (client-streaming calls)."""
        return await self._receive()


Handler = Callable[[CallContext], Awaitable["Message | AsyncIterator[Message]"]]
