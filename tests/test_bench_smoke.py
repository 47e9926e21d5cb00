"""The codec benchmark runs end to end and reports what it measured (small size)."""

import json
import subprocess
import sys


def test_codec_bench_json():
    out = subprocess.run(
        [sys.executable, "-m", "bench.codecs", "--size", "64K", "--repeats", "1", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    result = json.loads(out.stdout)
    ours = {r["codec"]: r for r in result["rows"] if r["impl"] == "swarmtrain"}
    assert ours["none"]["rel_error"] == 0 and ours["none"]["ratio"] == 1
    assert ours["int8/block_size=1024"]["ratio"] > 3.9 and ours["int8/block_size=1024"]["rel_error"] < 0.01
    assert ours["topk/ratio=0.01"]["ratio"] > 40
    hivemind = {r["codec"]: r for r in result["rows"] if r["impl"] == "hivemind"}
    assert "Float16Compression" in hivemind and "Uniform8BitQuantization" in hivemind
    assert "our_int8_gbps" in result["summary"]
