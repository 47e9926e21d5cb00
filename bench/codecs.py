"""Codec benchmark: ours vs hivemind's compression classes on the same tensor, in one run.

    python -m bench.codecs --json            # 64M fp32 elements (256 MB), 3 repeats
    python -m bench.codecs --size 8M         # smaller, human-readable table

Per codec: compression ratio (input bytes / payload bytes), relative error ‖x−y‖/‖x‖, max abs
error, and encode+decode throughput in GB/s of fp32 input (best of the repeats). hivemind codecs
that cannot be imported or fail at run time are reported with their error, not skipped silently.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

from protocol import decode_tensor, make_codec

OURS = [
    ("none", {}),
    ("fp16", {}),
    ("int8", {"block_size": 1024}),
    ("int8", {"block_size": 4096}),
    ("topk", {"ratio": 0.01}),
    ("powersgd", {"rank": 4}),
]
HIVEMIND = ["NoCompression", "Float16Compression", "ScaledFloat16Compression", "Uniform8BitQuantization", "Quantile8BitQuantization", "BlockwiseQuantization"]
EIGHT_BIT = ("Uniform8BitQuantization", "Quantile8BitQuantization", "BlockwiseQuantization")


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    try:
        return int(text[:-1]) * mult[text[-1]] if text[-1] in mult else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 64M)") from None


def measure(x: torch.Tensor, encode, decode, nbytes, repeats: int) -> dict:
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        enc = encode(x)
        t1 = time.perf_counter()
        y = decode(enc)
        t2 = time.perf_counter()
        if best is None or (t2 - t0) < best[0] + best[1]:
            best = (t1 - t0, t2 - t1, enc, y)
    t_enc, t_dec, enc, y = best
    y = y.reshape(x.shape).to(torch.float32)
    in_bytes = x.numel() * 4
    return {
        "ratio": round(in_bytes / nbytes(enc), 2),
        "rel_error": float((x - y).norm() / x.norm()),
        "max_abs_error": float((x - y).abs().max()),
        "encode_s": round(t_enc, 4),
        "decode_s": round(t_dec, 4),
        "gbps": round(in_bytes / (t_enc + t_dec) / 1e9, 3),
    }


def bench_ours(x, repeats):
    rows = []
    for name, params in OURS:
        codec = make_codec(name, **params)
        label = name + "".join(f"/{k}={v}" for k, v in params.items())
        rows.append({"impl": "swarmtrain", "codec": label, **measure(x, codec.encode, decode_tensor, lambda e: e.nbytes, repeats)})
    return rows


def bench_hivemind(x, repeats):
    rows = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import hivemind.compression as hc
    except Exception as e:  # report, do not hide
        return [{"impl": "hivemind", "codec": "*", "error": f"import failed: {type(e).__name__}: {e}"}]
    info = hc.CompressionInfo.from_tensor(x)
    for name in HIVEMIND:
        row = {"impl": "hivemind", "codec": name}
        try:
            codec = getattr(hc, name)()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row.update(measure(x, lambda t: codec.compress(t, info), codec.extract, lambda e: len(e.buffer), repeats))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        rows.append(row)
    return rows


def summarize(rows):
    ours = next(r for r in rows if r["codec"] == "int8/block_size=1024")
    working = [r for r in rows if r["impl"] == "hivemind" and r["codec"] in EIGHT_BIT and "error" not in r]
    usable = [r for r in working if r["rel_error"] < 0.1]  # an 8-bit codec with ~100% error is not one
    out = {"our_int8_gbps": ours["gbps"], "our_int8_rel_error": ours["rel_error"]}
    if usable:
        fastest = max(usable, key=lambda r: r["gbps"])
        out.update(
            hivemind_fastest_8bit=fastest["codec"],
            speed_ratio_ours_over_hivemind=round(ours["gbps"] / fastest["gbps"], 2),
            error_ratio_ours_over_hivemind=round(ours["rel_error"] / fastest["rel_error"], 3),
            target_met=ours["gbps"] >= fastest["gbps"] and ours["rel_error"] <= fastest["rel_error"],
        )
    else:
        out["hivemind_fastest_8bit"] = None
    fp16 = [r for r in rows if r["codec"] in ("fp16", "Float16Compression") and "error" not in r]
    if len(fp16) == 2:
        out["fp16_speed_ratio_ours_over_hivemind"] = round(fp16[0]["gbps"] / fp16[1]["gbps"], 2)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=64 << 20, help="fp32 elements (default 64M)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    x = torch.randn(args.size, generator=torch.Generator().manual_seed(0))
    rows = bench_ours(x, args.repeats) + bench_hivemind(x, args.repeats)
    result = {
        "elements": args.size,
        "input_mb": args.size * 4 / 1e6,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "summary": summarize(rows),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.size} fp32 elements ({result['input_mb']:.0f} MB), {result['torch_threads']} threads")
    print(f"{'impl':11} {'codec':26} {'ratio':>7} {'rel_err':>9} {'GB/s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:11} {r['codec']:26} failed: {r['error']}")
        else:
            print(f"{r['impl']:11} {r['codec']:26} {r['ratio']:7.1f} {r['rel_error']:9.5f} {r['gbps']:7.3f}")
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
