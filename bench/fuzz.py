"""Fuzzing: every entry where a peer's bytes meet our code, fed generated inputs; a crash is any
exception but the entry's own refusal (RemoteProtocolError, StageInputError), a hang any input
that takes longer than `--hang-s` (the slowest input of each entry is printed, to time it again
alone). Inputs are valid messages mutated (bits flipped, bytes
inserted, deleted, spliced, truncated) and plain random bytes, seeded.

    python -m bench.fuzz --json --inputs 1000000 --seed 0

Entries:
    frames      the wire decoder (prefix, msgpack, every message's fields), fed in random pieces
    tensors     the tensors of mutated calls and answers: unpack_tensors and the checked decode
                (every codec's payload, shapes, NaN/Inf)
    stage_call  a stage server's checks of a mutated StageCall (tensors, shapes, tokens, routes)
    sealed      the direct plane's opener of sealed records (headers, lengths, authentication)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable

ENTRIES = ("frames", "tensors", "stage_call", "sealed")


def mutate(rng: random.Random, data: bytes) -> bytes:
    """`data` with one to eight mutations, or plain random bytes one time in eight."""
    if rng.random() < 0.125 or not data:
        return rng.randbytes(rng.randint(0, 512))
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op, pos = rng.randrange(5), rng.randrange(max(1, len(out)))
        if op == 0 and out:
            out[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            out[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2 and out:
            del out[pos : pos + rng.randint(1, 8)]
        elif op == 3:
            out = out[:pos]
        elif op == 4 and out:  # a run of one byte value: lengths and counts go extreme
            out[pos : pos + 4] = bytes([rng.choice((0x00, 0x7F, 0xFF))]) * 4
    return bytes(out)


def _samples() -> list:
    """Valid frames of every message type, and of calls carrying real tensors of each codec."""
    import torch

    from protocol import encode, make_codec, pack_tensors
    from protocol import messages as m
    from tests.test_framing import SAMPLES

    x = torch.randn(2, 8, 16)
    tensors = [
        m.StageCall(stage=1, op="forward", micro_batch="t-1", **pack_tensors({"x": make_codec(c).encode(x)}))
        for c in ("none", "fp16", "int8")
    ]  # fmt: skip
    tensors.append(m.StageCall(stage=0, op="train", micro_batch="t-2", **pack_tensors({"x": make_codec("none").encode(torch.randint(0, 256, (2, 8))),
                                                                                       "targets": make_codec("none").encode(torch.randint(0, 256, (2, 8)))})))  # fmt: skip
    from node.models.gpt import PRESETS

    h = torch.randn(2, 8, PRESETS["tiny"].n_embd)  # the last stage's train call, as the stage_call entry's check takes it
    tensors.append(m.StageCall(stage=1, op="train", micro_batch="t-3", **pack_tensors({"x": make_codec("none").encode(h),
                                                                                       "targets": make_codec("none").encode(torch.randint(0, 256, (2, 8)))})))  # fmt: skip
    tensors.append(m.ExpertResult(norm2=1.0, **pack_tensors({"y:layer0.expert1": make_codec("int8").encode(torch.randn(5, 16))})))
    return [encode(s) for s in SAMPLES], [encode(s) for s in tensors]


def _entries() -> dict[str, tuple[Callable[[bytes], None], tuple[type[BaseException], ...], list[bytes]]]:
    """entry -> (feed one input, the refusals allowed, the valid inputs mutations start from)."""
    import torch

    from node.models.gpt import PRESETS
    from node.models.stages import StageInputError, init_stage, plan_stages
    from node.roles.activations import decode_checked
    from node.roles.stage_calls import StageCut, check_call
    from protocol import Decoder, RemoteProtocolError, unpack_tensors
    from protocol import messages as m
    from protocol.sealing import Opener, Sealer

    frames, calls = _samples()
    cfg = PRESETS["tiny"]
    plan = plan_stages(cfg, 2)
    stage, cut = init_stage(cfg, 1, plan, 0), StageCut(1, 2, cfg)
    max_numel = 1 << 20

    def decoded(data: bytes) -> list:
        return Decoder(max_frame_size=1 << 20).feed(data)

    def feed_frames(data: bytes) -> None:
        dec, pos = Decoder(max_frame_size=1 << 20), 0
        while pos < len(data):
            step = 1 + (data[pos] % 64)
            dec.feed(data[pos : pos + step])
            pos += step

    def feed_tensors(data: bytes) -> None:
        for msg in decoded(data):
            for name, enc in unpack_tensors(msg, max_numel).items():
                decode_checked(enc, max_numel, name)

    def feed_stage_call(data: bytes) -> None:
        for msg in decoded(data):
            if isinstance(msg, m.StageCall):
                with torch.no_grad():
                    check_call(msg, cut, stage)

    key = bytes(32)
    sealed = b"".join(Sealer(key, 0).seal([f for f in frames]))

    def feed_sealed(data: bytes) -> None:
        Opener(key, 0).feed(data)

    refusals = (RemoteProtocolError,)
    return {
        "frames": (feed_frames, refusals, frames),
        "tensors": (feed_tensors, refusals, calls),
        "stage_call": (feed_stage_call, (RemoteProtocolError, StageInputError), calls),
        "sealed": (feed_sealed, refusals, [sealed]),
    }


def fuzz(name: str, inputs: int, seed: int, hang_s: float) -> dict:
    feed, allowed, valid = _entries()[name]
    rng = random.Random(f"{seed}:{name}")
    crashes: dict[str, int] = {}
    examples: dict[str, str] = {}
    counts = {"inputs": inputs, "refused": 0, "accepted": 0, "crashes": 0, "hangs": 0, "slowest_s": 0.0}
    slowest = b""
    t0 = time.monotonic()
    for _ in range(inputs):
        data = mutate(rng, rng.choice(valid))
        t = time.monotonic()
        try:
            feed(data)
            counts["accepted"] += 1
        except allowed:
            counts["refused"] += 1
        except Exception as e:  # a crash: what the entry lets escape besides its refusals
            kind = f"{type(e).__name__}: {str(e)[:120]}"
            crashes[kind] = crashes.get(kind, 0) + 1
            examples.setdefault(kind, data[:256].hex())
            counts["crashes"] += 1
        took = time.monotonic() - t
        if took > counts["slowest_s"]:
            counts["slowest_s"], slowest = round(took, 4), data
        counts["hangs"] += took > hang_s
    return {"entry": name, **counts, "seconds": round(time.monotonic() - t0, 1), "crash_kinds": crashes, "crash_examples": examples,
            "slowest_input": slowest.hex()}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--inputs", type=int, default=100_000, help="inputs per entry")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang-s", type=float, default=1.0, help="an input that takes longer hangs")
    p.add_argument("--entries", default=",".join(ENTRIES), help=f"comma-separated, of {', '.join(ENTRIES)}")
    args = p.parse_args(argv)
    entries = args.entries.split(",")
    if bad := [e for e in entries if e not in ENTRIES]:
        p.error(f"--entries: unknown {', '.join(bad)}; known: {', '.join(ENTRIES)}")
    if args.inputs < 1:
        p.error("--inputs must be at least 1")
    rows = [fuzz(e, args.inputs, args.seed, args.hang_s) for e in entries]
    result = {"inputs_per_entry": args.inputs, "seed": args.seed, "entries": rows, "crashes": sum(r["crashes"] for r in rows), "hangs": sum(r["hangs"] for r in rows)}
    print(json.dumps(result, indent=1) if args.json else result)
    return 0 if result["crashes"] == result["hangs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
