"""What every trainer shares (the pipeline's and the experts'): its data, and the micro-batch loop.

The pipeline trainer and the expert trainer differ only in how one micro-batch travels (its
`send`), how many are in flight, and what a step's boundary means to them; the loop, the data
shard and the loss reporting (stats.LossLog) are the same.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from ..models.data import Batches, DataError, load_corpus, shard_of
from ..runconfig import RunConfig
from .role import RoleContext
from .stats import LossLog

log = logging.getLogger(__name__)

Send = Callable[[str, torch.Tensor, torch.Tensor], Awaitable["float | None"]]


async def trainer_batches(ctx: RoleContext, run: RunConfig, context: int, tokenizer=None) -> tuple[Batches, int, int]:
    """A trainer's micro-batches: its shard of the corpus (--shard-index, else from its peer id;
    read with the model's `tokenizer`, None: bytes), and (shard, number of shards). DataError when
    the corpus cannot be read."""
    c = ctx.node_config
    try:
        corpus = await asyncio.to_thread(load_corpus, c.data or None, tokenizer, c.text_field)
    except DataError as e:
        log.error("cannot train: %s", e)
        raise
    shard = c.shard_index if c.shard_index >= 0 else shard_of(ctx.host.peer_id, c.num_shards)
    return Batches(corpus.train, shard, c.num_shards, run.batch_size, context, run.seed + shard), shard, c.num_shards


async def micro_batch_loop(name: str, batches: Batches, send: Send, losses: LossLog, in_flight: int, window: int = 0,
                           on_window: Callable[[], None] | None = None) -> None:  # fmt: skip
    """Micro-batches from `batches`, `in_flight` at a time, each `send(name, x, y)` until it comes
    back with its loss (None: given up), recorded in `losses`. `window` > 0: a window's
    micro-batches (a synchronous step's) go out only once the previous window's all came back,
    and `on_window()` runs at each boundary, after the window's micro-batches went out. The
    micro-batches in flight are a queue of the node's activity."""
    tasks: set[asyncio.Task] = set()
    n = 0

    async def timed(key: str, x: torch.Tensor, y: torch.Tensor) -> tuple[float | None, int, float]:
        t0 = time.monotonic()
        return await send(key, x, y), x.numel(), time.monotonic() - t0

    losses.activity.queues["micro_batches_in_flight"] = lambda: len(tasks)
    try:
        while True:
            boundary = bool(window and n and n % window == 0 and not tasks)  # the last window's micro-batches all came back
            while len(tasks) < in_flight and not (window and n % window == 0 and tasks):
                x, y = batches.next()
                tasks.add(asyncio.create_task(timed(f"{name}-{n}", x, y)))
                n += 1
            if boundary and on_window is not None:  # (after the window's micro-batches: theirs are the calls the first stage waits for)
                on_window()
            done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                losses.record(*t.result())
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
