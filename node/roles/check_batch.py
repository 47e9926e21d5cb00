"""A replica's check batches: the judge by harm of the parts it aggregates.

The owner of a slice holds every member's part of it, and every member holds the same outer
parameters θ. Each member trains on its own data shard, the one its peer id picks
(models/data.shard_of), so the owner can draw a batch of that shard too. For each slice it
owns, the judge puts θ into a copy of the model kept for this, and takes the loss of each
member's batch three times: at θ, with the slice moved by -outer_lr x the aggregate, and with it
moved by -outer_lr x the member's part (node/averaging/round.py `Judge`). An honest part lowers
the loss of its own sender's data, whatever that data is; a part that raises it where the
aggregate lowers it points the wrong way, however near the others it lies
(aggregators.harm_ratios, HarmRuns). A batch of data common to all (the validation set) would
not do: an honest replica whose shard is unlike it raises its loss, round after round.

The judge needs shards from peer ids (node setting shard_index -1, the default): a replica told
its shard (tests, benches) cannot know the others'.

Not yet a replica's. Each owner judges only its own slices, so owners reach a run of harm at
different rounds; in a swarm test of five (three honest, a sign-flipper, an IPM liar), two honest
replicas banned the IPM liar while the third went on averaging with it: the swarm split in two,
the third alone with the liars, and the coordinator banned an honest replica of the group that
fell behind for uploading an older checkpoint. Distance evidence does not split (every owner sees
a loud liar far at once). The judge waits for bans that the honest members agree on (e.g. a
round's leader leaving out a peer that a majority of owners accused). bench/byzantine_judge.py
measures it meanwhile.

The copy costs the model's memory once; each slice judged costs three forwards per member's
shard (one batch per shard and round), on the averaging's worker thread, one slice at a time.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence

import torch
from torch import nn

from ..models.data import Batches, shard_of


class CheckBatch:
    def __init__(self, model: nn.Module, train: torch.Tensor, num_shards: int, batch_size: int, context: int, lr: float, seed: int):
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.train, self.num_shards, self.batch_size, self.context, self.lr, self.seed = train, num_shards, batch_size, context, lr, seed
        self.shards: dict[int, Batches] = {}  # shard -> its check batches (drawn apart from its trainer's)
        self._lock = threading.Lock()  # the copy is one: slices are judged one at a time

    def judge(self, outer: Sequence[torch.Tensor], part: range):
        """The judge of one round over `outer[part]` (θ of the averaged tensors, flattened in
        order), `outer` every tensor's θ: averaging.round.Judge."""
        batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this round's, per shard
        loaded: list[bool] = []

        def judge(a: int, b: int, parts: Sequence[torch.Tensor], aggregate: torch.Tensor, members: Sequence[str]) -> list[tuple[float, float, float]]:
            with self._lock, torch.no_grad():
                params = list(self.model.parameters())
                if not loaded:  # θ once per round (it does not move while the round runs)
                    for p, o in zip(params, outer):
                        p.copy_(o)
                    loaded.append(True)
                segments = _segments([params[i] for i in part], [outer[i] for i in part], a, b)
                shards = [shard_of(m, self.num_shards) for m in members]
                for s in shards:
                    if s not in batches:
                        batches[s] = self._batches(s).next()
                at_theta = {s: self._loss(batches[s]) for s in set(shards)}
                self._move(segments, aggregate)
                with_aggregate = {s: self._loss(batches[s]) for s in set(shards)}
                out = []
                for s, v in zip(shards, parts):
                    self._move(segments, v)
                    out.append((at_theta[s], with_aggregate[s], self._loss(batches[s])))
                for p, o, lo, hi, _ in segments:  # back to θ for the next slice
                    p.view(-1)[lo:hi].copy_(o.reshape(-1)[lo:hi])
            return out

        return judge

    def _batches(self, shard: int) -> Batches:
        if shard not in self.shards:
            self.shards[shard] = Batches(self.train, shard, self.num_shards, self.batch_size, self.context, self.seed * 1_000_003 + shard)
        return self.shards[shard]

    def _move(self, segments, v: torch.Tensor) -> None:
        for p, o, lo, hi, at in segments:
            p.view(-1)[lo:hi].copy_(o.reshape(-1)[lo:hi] - self.lr * v[at : at + hi - lo])

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        device = next(self.model.parameters()).device
        _, loss = self.model(batch[0].to(device), batch[1].to(device))
        return float(loss)


def _segments(params: list[torch.Tensor], outer: list[torch.Tensor], a: int, b: int) -> list[tuple]:
    """The pieces of flat range [a, b) over `params` laid end to end: (param, its θ, start and
    end within it, where the piece starts in the slice)."""
    out, offset = [], 0
    for p, o in zip(params, outer):
        n = p.numel()
        lo, hi = max(a, offset), min(b, offset + n)
        if lo < hi:
            out.append((p, o, lo - offset, hi - offset, lo - a))
        offset += n
    return out
