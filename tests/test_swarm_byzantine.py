"""A Byzantine replica in a real swarm: it sends its pseudo-gradient reversed and scaled a
thousandfold in every round (well formed: the all-reduce's checks pass it). The honest replicas
average with CenteredClip, train on as if it were not there, hold one state, and ban it on the
evidence of its parts, each with the reason in its log and /status. Nobody honest is banned.
The liar has the smallest peer id, so it leads every round it is in: the worst case (once
banned, the honest ones must neither follow it nor wait for it).
Then stage servers and expert hosts that answer with lies (the trainers' checks catch them),
and an expert host that lies in its shard's syncs (the others' robust aggregate clips it)."""

from __future__ import annotations

import json
import re
import time

import pytest

from protocol import SigningKey
from protocol.signatures import peer_id_from_public_key
from tests.swarm import free_port, node_peer_id, wait_for
from tests.test_swarm_training import RUN, assert_same_hashes, history, replica, scrape, step_of, trained_steps

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]

HONEST = ["a", "b", "c"]
ROBUST = ["--aggregator", "centered_clip"]


def test_a_sign_flipping_replica_is_outvoted_and_banned_by_the_honest_ones(swarm):
    coord = swarm.coordinator("coordinator", None, None, *RUN, "--min-replicas", "4")
    maddr = coord.wait_ready()["maddrs"][0]
    http = free_port()
    keys = sorted((SigningKey.generate() for _ in range(4)), key=lambda k: peer_id_from_public_key(k.public_key))
    for n, key in zip(["liar", *HONEST], keys):  # the liar's peer id the smallest: it leads
        key.save(swarm.tmp / f"{n}.pem")
    procs = {n: replica(swarm, n, maddr, i, *ROBUST, "--identity", str(swarm.tmp / f"{n}.pem"), *(["--http", f"127.0.0.1:{http}"] if n == "a" else []))
             for i, n in enumerate(HONEST)}  # fmt: skip
    procs["liar"] = replica(swarm, "liar", maddr, 3, *ROBUST, "--identity", str(swarm.tmp / "liar.pem"), "--fault-attack", "sign-flip")
    ids = {n: node_peer_id(p) for n, p in procs.items()}
    assert min(ids.values()) == ids["liar"]

    def banned_by(n: str) -> set[str]:
        return set(re.findall(r"banned (\S+) for \d+ s", procs[n].log()))

    # every honest replica bans the liar on its own evidence: its parts far from the robust aggregate
    wait_for(lambda: all(ids["liar"] in banned_by(n) for n in HONEST), 300, "every honest replica to ban the liar")
    for n in HONEST:
        assert banned_by(n) == {ids["liar"]}, (n, banned_by(n))  # and nobody else
        assert re.search(rf"banned {ids['liar']} for \d+ s \(ban 1\): 5 offences in \d+ s, the last: round outer-\d+-\w+: its part of slice \d+ was [\d.]+x the group's spread", procs[n].log())
    bans = json.loads(scrape(http, "/status"))["bans"]
    assert [b["peer_id"] for b in bans] == [ids["liar"]] and "from the robust aggregate" in bans[0]["reason"], bans
    # the coordinator heard of each ban (its events, the dashboard's): the liar's, by each honest replica
    banners = lambda: {e["detail"].split()[2] for e in coord.status()["events"] if e["kind"] == "ban" and e["peer_id"] == ids["liar"]}  # noqa: E731
    wait_for(lambda: banners() == {ids[n] for n in HONEST}, 30, "the three bans among the coordinator's events")

    # the honest ones train on, in lockstep, and better than where they started
    at_ban = max(step_of(swarm, n) for n in HONEST)
    wait_for(lambda: min(step_of(swarm, n) for n in HONEST) >= at_ban + 3, 240, "three more outer steps of the honest replicas")
    together = set.intersection(*(trained_steps(swarm, n) for n in HONEST))
    assert len(together) >= 5, {n: history(swarm, n) for n in HONEST}
    assert_same_hashes(swarm, HONEST, together)
    h = history(swarm, "a")
    assert h[-1]["val_loss"] < h[0]["val_loss"] - 0.3, [(e["outer_step"], e.get("val_loss")) for e in h]


# ---- stage servers and expert hosts that answer with lies: the trainers' checks catch them


def check_caught(swarm, coord, trainer, liar: str, peers: dict[str, str], http: int, served, stats_file) -> None:
    """`trainer` banned `liar` (a peer id) and nobody else, with the check's reason in its log,
    its /status and the coordinator's events (the dashboard's); after the ban the liar serves it
    no more calls, the honest peers do. `served(name)`: the calls a peer's stats file counts;
    `stats_file(name)`: its path."""
    banned = lambda: set(re.findall(r"banned (\S+) for \d+ s", trainer.log()))  # noqa: E731
    wait_for(lambda: liar in banned(), 180, "the trainer to ban the lying peer")
    assert banned() == {liar}, (banned(), peers)
    assert re.search(rf"banned {liar} for \d+ s \(ban 1\): 1 offence in \d+ s, the last: a wrong answer \(.+\), caught by a check: it answered the same call twice", trainer.log())
    bans = json.loads(scrape(http, "/status"))["bans"]
    assert [b["peer_id"] for b in bans] == [liar] and "caught by a check" in bans[0]["reason"], bans
    told = lambda: [e for e in coord.status()["events"] if e["kind"] == "ban"]  # noqa: E731
    (event,) = wait_for(told, 30, "the ban among the coordinator's events")
    assert event["peer_id"] == liar and event["detail"].startswith(f"banned by {node_peer_id(trainer)} for 60 s (ban 1)") and "caught by a check" in event["detail"], event
    name = next(n for n, p in peers.items() if p == liar)
    honest = [n for n in peers if n != name]

    def written_after(t: float) -> bool:  # (a slot server rewrites its stats file with every sync)
        return stats_file(name).stat().st_mtime > t

    def progress(what: str) -> int:
        """The liar's count of calls served, read from a stats file written after the honest peers
        served 24 more calls."""
        start = {n: served(n) for n in honest}
        wait_for(lambda: sum(served(n) for n in honest) >= sum(start.values()) + 24, 60, f"24 more calls served by the honest peers ({what})")
        t = time.time()
        try:  # (a slot server rewrites its stats with its steps and syncs: one that serves nothing and is
            # alone in its slot, its partner moved away by the planner, writes nothing)
            wait_for(lambda: stats_file(name).stat().st_mtime > t, 10, f"the liar's stats written again ({what})")
        except TimeoutError:
            pass
        return served(name)

    # the ban lasts 60 s: within it, calls go to the honest peers only (after the few that were
    # on their way to the liar when it was banned)
    after = progress("after the ban")
    assert progress("later") == after, (served(name), after)


def liar_and_trainer(swarm, run: list[str], slots) -> tuple:
    """A coordinator of `run` whose trainers check a quarter of their calls, four servers (s0
    answering noise) on two slots (`slots(coord)`: slot -> peer ids), and a trainer serving
    /status: (coordinator, trainer, peer ids of the servers, the trainer's http port)."""
    from tests.test_swarm_pipeline import NODE

    coord = swarm.coordinator("coordinator", None, None, *run, "--audit-fraction", "0.25")
    maddr = coord.wait_ready()["maddrs"][0]
    servers = {f"s{i}": swarm.node(f"s{i}", [maddr], *NODE, *(["--fault-attack", "noise"] if i == 0 else [])) for i in range(4)}
    # (the planner spreads them by measured throughput, once the trainer's calls measure it: the
    # liar shares its slot with an honest peer by then, if not from the start)
    wait_for(lambda: len(slots(coord)) == 2 and sum(map(len, slots(coord).values())) == 4, 120, "four servers on two slots")
    http = free_port()
    trainer = swarm.node("t", [maddr], *NODE, "--wanted-role", "trainer", "--http", f"127.0.0.1:{http}")
    return coord, trainer, {n: node_peer_id(p) for n, p in servers.items()}, http


def trains_on(swarm, more: int) -> None:
    """The trainer caught one liar, trains `more` micro-batches on, and its loss fell."""
    from tests.test_swarm_pipeline import micro_batches, stats

    checks = wait_for(lambda: stats(swarm, "t", "trainer").get("checks", {}).get("caught") and stats(swarm, "t", "trainer")["checks"], 30, "the trainer's stats")
    assert checks["caught"] == 1, checks
    start = micro_batches(swarm, "t")
    wait_for(lambda: micro_batches(swarm, "t") >= start + more, 180, f"{more} more micro-batches")
    st = stats(swarm, "t", "trainer")
    assert st["history"][-1]["loss"] < st["first_loss"] - 0.3, [(e["micro_batches"], round(e["loss"], 3)) for e in st["history"]]


def test_a_stage_server_answering_noise_is_caught_by_the_trainers_checks_and_routed_around(swarm):
    from tests.test_swarm_pipeline import TWO_STAGES, placed, stats

    coord, trainer, ids, http = liar_and_trainer(swarm, TWO_STAGES, placed)

    def served(n: str) -> int:
        calls = stats(swarm, n, "stage").get("calls", {})
        return sum(calls.get(k, 0) for k in ("forward", "train", "through"))

    check_caught(swarm, coord, trainer, ids["s0"], ids, http, served, lambda n: swarm.tmp / n / "stage-stats.json")
    trains_on(swarm, 16)


def test_an_expert_host_answering_noise_is_caught_by_the_trainers_checks_and_routed_around(swarm):
    from tests.test_swarm_experts import RUN as EXPERTS, hosts_of
    from tests.test_swarm_pipeline import stats

    coord, trainer, ids, http = liar_and_trainer(swarm, EXPERTS, hosts_of)
    served = lambda n: stats(swarm, n, "expert").get("calls", {}).get("forward", 0)  # noqa: E731
    check_caught(swarm, coord, trainer, ids["s0"], ids, http, served, lambda n: swarm.tmp / n / "expert-stats.json")
    trains_on(swarm, 16)


# ---- a slot peer that lies in its slot's syncs: the others' robust aggregate clips it


def test_an_expert_host_lying_in_its_shards_syncs_is_clipped_and_nobody_is_banned(swarm):
    """Three hosts of one shard (CenteredClip), one sending its pseudo-gradient reversed and
    scaled a thousandfold in every sync. The trainer learns all the same, the three hold one
    state, and nobody is banned: slot syncs accuse nobody (the trainer calls its fastest host
    most, and beside partners that took a step or none, the busy honest host's update was the
    far one: it was banned, in one run of two, before syncs stopped accusing)."""
    from tests.test_swarm_experts import RUN as EXPERTS, hosts_of, micro_batches
    from tests.test_swarm_pipeline import NODE, since_start, stats

    run = [*EXPERTS]
    run[run.index("--expert-shards") + 1] = "1"
    coord = swarm.coordinator("coordinator", None, None, *run)
    maddr = coord.wait_ready()["maddrs"][0]
    hosts = {n: swarm.node(n, [maddr], *NODE, *ROBUST, *extra) for n, extra in {"liar": ["--fault-attack", "sync-sign-flip"], "a": [], "b": []}.items()}
    swarm.node("t", [maddr], *NODE, "--wanted-role", "trainer", "--shard-index", "0")
    ids = {n: node_peer_id(p) for n, p in hosts.items()}
    wait_for(lambda: sorted(hosts_of(coord).get("shard0", [])) == sorted(ids.values()), 120, "the three hosts on the one shard")

    def lies() -> list[dict]:
        """Syncs of all three in which the liar sent a lie of some size (it had taken steps: a
        thousand times no update is none)."""
        return [e for e in since_start(stats(swarm, "liar", "expert").get("history", [])) if e.get("group") == 3 and e.get("lie_norm", 0) >= 100]

    wait_for(lambda: micro_batches(swarm, "t") >= 96 and len(lies()) >= 5, 240, "96 micro-batches and five syncs the liar lied in")
    # the update the three applied (one: they hold one state) was clipped: a plain mean's would be a third of the lie
    assert all(e["update_norm"] < e["lie_norm"] / 10 for e in lies()), [(e["lie_norm"], e["update_norm"]) for e in lies()]
    for n, p in hosts.items():
        assert "banned" not in p.log(), (n, [line for line in p.log().splitlines() if "banned" in line])
    seen = [{e["sync"]: e["state_hash"] for e in since_start(stats(swarm, n, "expert").get("history", [])) if e.get("group") == 3} for n in hosts]
    common = set.intersection(*map(set, seen))
    assert len(common) >= 5 and all(len({s[k] for s in seen}) == 1 for k in common), seen
    st = stats(swarm, "t", "trainer")
    assert st["history"][-1]["loss"] < st["first_loss"] - 0.3, [(e["micro_batches"], round(e["loss"], 3)) for e in st["history"]]
