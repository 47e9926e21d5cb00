"""The two exception families of the protocol.

`RemoteProtocolError`: the *peer* broke the protocol (bad bytes, bad field, bad signature).
The caller refuses the input with a clear error reply, scores the peer down, and keeps serving.

`LocalProtocolError`: *we* broke it (misuse of this package by our own code). It is a bug.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of both families; never raised directly."""


class RemoteProtocolError(ProtocolError):
    """Bad input from a remote peer. The message names the field and the problem."""

    def __init__(self, problem: str, field: str | None = None):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}" if field else problem)


class LocalProtocolError(ProtocolError):
    """Our own code misused the protocol (e.g. encoding an invalid message)."""
