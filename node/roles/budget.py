"""How long a replica's inner phase lasts when replicas differ in speed.

With `inner_phase = "steps"` every replica takes H inner steps per outer step, and a round
waits for its slowest member: a replica at half speed makes every round twice as long. With
`inner_phase = "time"` a replica takes at most H steps, and stops early once the swarm's median
replica has finished its H: once half of the replicas (rounded up) wait in the round's
matchmaking (their signed records under the round's key say so). A faster replica finishes its
H steps and waits as before; a slower one joins with the steps it took by then, and the average
weighs each pseudo-gradient by the samples behind it, so a slow replica contributes what it
trained and nobody waits for it. Nothing depends on clocks or on speeds measured rounds ago:
the others' arrival is the signal.

Pure decisions, each with its reason, and `MedianWatch`, which asks the DHT who waits while the
replica's inner steps run (replica.py starts it and reads `stop`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

READY_POLL_S = 0.5  # how often a replica still in its inner phase looks who waits to average


def median_ready(waiting: int, replicas: int) -> tuple[bool, str]:
    """Whether the swarm's median replica has finished its inner steps: `waiting` other replicas
    are in the round's matchmaking, of `replicas` in the swarm (this one included)."""
    need = max(1, math.ceil(replicas / 2))
    if waiting >= need:
        return True, f"{waiting} of the {replicas} replicas wait to average (half of them: the median replica finished)"
    return False, f"{waiting} of the {replicas} replicas wait to average (stopping early needs {need})"


def keep_stepping(done: int, h: int, told_to_stop: bool) -> bool:
    """Whether to take another inner step: at most H, and at least one (a pseudo-gradient needs
    a step behind it) even once told to stop."""
    return done < h and (done == 0 or not told_to_stop)


class MedianWatch:
    """One replica's watch over its inner phases (inner_phase "time"): `run` polls who waits to
    average the coming round and sets `stop` once `median_ready`; the inner steps read `stop`
    (`keep_stepping`) from their thread."""

    def __init__(self, read_timeout_s: float, errors: tuple[type[BaseException], ...]):
        self.read_timeout_s, self.errors = read_timeout_s, errors
        self.stop = False
        self._said = False  # logged once at INFO: every round of a slow replica says the same

    async def run(self, step: int, waiting: Callable[[], Awaitable[set[str]]], replicas: int) -> None:
        """Until cancelled (the inner phase over) or the median replica waits: `waiting()`, the
        other replicas in the round's matchmaking; `replicas`, the swarm's, this one included."""
        self.stop = False
        while True:
            await asyncio.sleep(READY_POLL_S)
            try:
                others = len(await asyncio.wait_for(waiting(), self.read_timeout_s))
            except (*self.errors, TimeoutError):  # a DHT read that failed or hung: look again
                continue
            done, why = median_ready(others, replicas)
            if done:
                log.log(logging.DEBUG if self._said else logging.INFO, "outer step %d: %s: this replica joins with the steps it took", step, why)
                self.stop = self._said = True
                return
