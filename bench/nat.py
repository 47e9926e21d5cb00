"""A node behind a NAT against the same node with a public address: what joining from behind a
NAT costs a replica swarm.

    python -m bench.nat --json [--steps 6] [--rate 100mbit]

Each arm runs a coordinator, two public replicas and a third replica, every process in its own
network namespace behind a `rate` link (bench/netns.py):
  direct  the third replica on the bridge like the others;
  natted  the third replica behind a masquerading router (no inbound path): the connections it
          opens carry the others' calls to it;
  relayed the second and the third replica each behind its own NAT (no path between them), with
          the first as their relay (`--relays`, `--serve-relay`): what they send each other
          crosses the relay's link twice.
Reported per arm: seconds per outer step of the third replica (its averaging rounds included)
over `steps` steps after its first, the bytes each link carried meanwhile, and what the relay
counted it carried. Root only. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

RUN = ["--model", "tiny", "--inner-steps", "5", "--eval-batches", "2", "--warmup-steps", "5", "--join-timeout-s", "8", "--heartbeat-timeout-s", "10",
       "--min-replicas", "3"]  # fmt: skip
NODE = ["--threads", "1", "--bandwidth-mbps", "100", "--heartbeat-interval-s", "0.5", "--num-shards", "4"]


def _steps(work: Path, name: str) -> list[tuple[float, int]]:
    try:
        h = json.loads((work / name / "replica-stats.json").read_text())["history"]
    except (OSError, ValueError, KeyError):
        return []
    return [(e["time"], e["outer_step"]) for e in h if "start" not in e and "caught_up_from" not in e and "time" in e]


NATTED = {"direct": frozenset(), "natted": frozenset({3}), "relayed": frozenset({2, 3})}


def _relayed_bytes(work: Path) -> int:
    try:
        return int(json.loads((work / "a" / "transport-stats.json").read_text()).get("relayed_bytes", 0))
    except (OSError, ValueError):
        return 0


def run_arm(arm: str, steps: int, rate: str, work: Path) -> dict:
    from bench import netns
    from tests.swarm import Swarm, wait_for

    netns.remove_stale()
    topo = netns.Topology.create(4, rate, natted=NATTED[arm])
    sw = Swarm(work)
    try:
        coord = sw.start("coordinator", "swarmtrain-coordinator", "--data-dir", str(work / "coordinator"), "--http", "",
                         "--host-maddrs", f"/ip4/{topo.ip(0)}/tcp/0", *RUN, prefix=topo.wrap(0, []))  # fmt: skip
        maddr = wait_for(lambda: re.search(rf"/ip4/{re.escape(topo.ip(0))}/tcp/\d+/p2p/\w+", coord.log()), 60, "the coordinator's address").group(0)
        extra: dict[str, list[str]] = {"a": ["--serve-relay"]} if arm == "relayed" else {}
        for i, name in ((1, "a"), (2, "b"), (3, "n")):
            proc = sw.node(name, [maddr], *NODE, "--shard-index", str(i), "--host-maddrs", f"/ip4/{topo.ip(i)}/tcp/0", *extra.get(name, []), prefix=topo.wrap(i, []))
            if arm == "relayed" and name == "a":
                a_maddr = wait_for(lambda: re.search(rf"/ip4/{re.escape(topo.ip(1))}/tcp/\d+/p2p/\w+", proc.log()), 60, "a's address").group(0)
                extra = {"b": ["--relays", a_maddr], "n": ["--relays", a_maddr]}
        wait_for(lambda: _steps(work, "n"), 300, "the third replica's first averaged step")
        t0, first = _steps(work, "n")[-1]
        before, relayed_before = topo.tx_bytes(), _relayed_bytes(work)
        wait_for(lambda: _steps(work, "n")[-1][1] >= first + steps, 60 + 60 * steps, f"{steps} more steps")
        t1, last = _steps(work, "n")[-1]
        after = topo.tx_bytes()
        sent = [b - a for a, b in zip(before, after)]
        return {"seconds_per_step": round((t1 - t0) / (last - first), 3), "steps": last - first,
                "bytes_sent": {"coordinator": sent[0], "a": sent[1], "b": sent[2], "third": sent[3]},
                "relayed_bytes": _relayed_bytes(work) - relayed_before}  # fmt: skip
    finally:
        sw.close()
        topo.destroy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.nat", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="(the output is JSON either way)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rate", default="100mbit")
    args = p.parse_args(argv)
    from bench import netns

    try:
        netns.check_available(nat=True)  # the natted and relayed arms' routers need iptables
    except netns.NetnsUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = {}
    for arm in NATTED:
        work = Path(tempfile.mkdtemp(prefix=f"bench-nat-{arm}-"))
        t = time.monotonic()
        try:
            rows[arm] = {"status": "ok", **run_arm(arm, args.steps, args.rate, work)}
        except Exception as e:  # one arm failing must not hide the other's result
            rows[arm] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rows[arm]["wall_s"] = round(time.monotonic() - t, 1)
        print(json.dumps({arm: rows[arm]}), file=sys.stderr)
    ratios = {}
    if all(r["status"] == "ok" for r in rows.values()):
        ratios["natted_over_direct_seconds_per_step"] = round(rows["natted"]["seconds_per_step"] / rows["direct"]["seconds_per_step"], 3)
        d, n = rows["direct"]["bytes_sent"], rows["natted"]["bytes_sent"]
        ratios["natted_over_direct_coordinator_link_bytes"] = round(n["coordinator"] / max(d["coordinator"], 1), 3)
        r = rows["relayed"]["bytes_sent"]
        ratios["relayed_over_direct_seconds_per_step"] = round(rows["relayed"]["seconds_per_step"] / rows["direct"]["seconds_per_step"], 3)
        ratios["relayed_over_direct_relay_link_bytes"] = round(r["a"] / max(d["a"], 1), 3)
        ratios["relayed_over_direct_all_links_bytes"] = round(sum(r.values()) / max(sum(d.values()), 1), 3)
    print(json.dumps({"settings": vars(args), "arms": rows, "ratios": ratios}, indent=1))
    return 0 if all(r["status"] == "ok" for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
