"""Fault-tolerant compressed all-reduce among the peers that average the same key.

One round, as each member sees it:

1. **Matchmaking** (matchmaking.py, joins.py, leading.py). Publish a signed record under the
   round's DHT key, then join the group of the smallest peer id that wants the same key (it
   leads; a leader that sees a smaller id later hands its joiners over; a joiner follows such
   redirects). The leader closes the group when `expected_peers` have joined or its join window
   ends, and tells everyone the members, their order, the slices and their owners (sized by
   bandwidth in half-octave steps, so that every link takes as long; on uneven links a link
   too slow for any share owns none, and the others own several slices each, interleaved),
   the codec, and phase deadlines derived from bandwidth. A peer that arrives after the group
   closed is told so and waits for the next round.
2. **Scatter** (round.py, schedule.py). The flat vector is cut into one slice per member. Every
   member sends each owner its part, compressed with error feedback (encoded while matchmaking
   still waits on the network, where the codec allows), streamed in chunks: with a declared
   bandwidth on equal links, all parts at once, each paced to its share of it (`Sender.paced`);
   else one owner at a time starting after its own index, so each link carries one flow at a
   time (`Sender.in_turn`); on uneven links in slice order, so that slices fill up one after
   another. An owner's own part never travels and counts exactly.
3. **Decision** (decisions.py). Every member reports to the leader whose parts it received
   intact and whom it blames (dead, late, NaN, wrong shape). The leader decides who survives
   (an accuser of half the group whom nobody corroborates is the one excluded); a failed
   member's contribution is dropped everywhere and its slice is re-owned by a survivor (its
   part is re-sent there). Fewer survivors than `min_group_size`: the round aborts.
4. **Aggregate + gather**. Owners aggregate their slices over the survivors (mean, or a robust
   aggregator) and send the result to every survivor, as in the scatter; the owner keeps the
   decoded copy of what it sent, so every member holds the same bits. An owner that holds every
   member's part does not wait for the decision: it aggregates over all members and sends at
   once ("early" slices), slice by slice as each fills up. If the decision then excludes nobody, those are the gather; if it
   excludes someone, they are void everywhere and sent again over the survivors (a per-slice
   lock makes the post-decision copy the one that stays in the result).
5. **Commit**. Members report that they hold every slice; the leader commits only if all
   survivors do, else aborts. Only on commit is the result applied (buffers.py).

First error latches: any failure ends the round for a member as `AveragingFailed`; its inputs
and its error-feedback state are left as they were before the round. A member that cannot
reach the leader asks the other members for the leader's decision before giving up.

Files:
    averager.py      `Averager`: the facade (`start`, `average`, `reset_feedback`, `close`);
                     composes the pieces below, keeps measured bandwidth and the last group
    config.py        `AveragerConfig` (every setting, its unit and bounds), `AverageReport`,
                     `AveragingFailed`
    decisions.py     pure decisions, each with its reason: group closing and formation, slice
                     shares, layout and bounds, survivors and re-owned slices, commit, pacing
                     choice, bandwidth and flow-rate learning
    matchmaking.py   `Matchmaker`: the async driver of matchmaking (DHT records, calls to
                     leaders, serving joins); its docstring tells the protocol
    joins.py         `Search` and `Lobby`: the sans-IO follower / leader state machines
    leading.py       `Leading`: one lead of a key, step by step (look for a smaller leader, ask
                     the last group or late peers, hear the answers, form the group)
    probes.py        `Probes`: pings of the peers a leader or a round waits on
    round.py         `Round` (one round's state) and `RoundDriver`: scatter → decide →
                     aggregate + gather → commit, each its own method
    schedule.py      `Sender`: parts in turn or paced, fault hooks, flow measurement; `settle`
    buffers.py       `Buffers`: error feedback and reused memory across rounds (commit or leave
                     as it was), input preparation and per-part encoding
    handlers.py      what members of our rounds call: parts, reports, decision queries
    service.py       `AveragingService`: one per transport, owns the averaging message types
                     and routes each call to the averager of its namespace (joins name it,
                     parts / reports / queries name their round)
    aggregators.py   mean, trimmed mean, CenteredClip: how a slice owner combines contributions;
                     the evidence against a part: far from the robust aggregate, or harmful to
                     its sender's check batch (`average(judge=...)`) where the aggregate helps
    faults.py        typed fault injection (corrupt / delay outgoing parts) for tests and drills

Several averagers run in one process, one per namespace (`AveragerConfig.namespace`, e.g.
"replicas", "stage-2", "expert-l1-e3"), each with its own codec, groups and error feedback.
"""

from .averager import Averager
from .config import AverageReport, AveragerConfig, AveragingFailed
from .decisions import decide_survivors, reassign, slice_bounds, slice_shares
from .service import AveragingService, NamespaceTaken

__all__ = [
    "AverageReport",
    "Averager",
    "AveragerConfig",
    "AveragingFailed",
    "AveragingService",
    "NamespaceTaken",
    "decide_survivors",
    "reassign",
    "slice_bounds",
    "slice_shares",
]
