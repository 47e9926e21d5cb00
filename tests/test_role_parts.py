"""The parts roles share, on their own: the swarm view (one read path, one freshness rule, the
reasons it skips a peer) over a real DHT, and the registry that makes a role of an assignment."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from node.config import NodeConfig
from node.net.membership import Progress
from node.roles.expert_host import ExpertHost
from node.roles.expert_trainer import ExpertTrainer
from node.roles.pipeline_trainer import PipelineTrainer
from node.roles.registry import ROLES, RoleSpec, make_role
from node.roles.replica import Replica
from node.roles.role import Role, RoleContext, RoleError
from node.roles.stage_server import StageServer
from node.roles.view import Members, SwarmView, stale
from node.runconfig import RunConfig
from protocol import RoleAssignment
from protocol.records import MemberRecord, members_key
from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(120)

SWARM = "parts-test"


def record(role: str, issued_at: float) -> MemberRecord:
    return MemberRecord(SWARM, "p", (), role, 0, issued_at)


def test_a_member_counts_while_its_record_is_younger_than_half_its_ttl_and_each_skip_says_why():
    now = 1000.0
    members = Members.of({"a": record("stage:0", now - 14.9), "b": record("stage:1", now - 15.0), "c": record("expert:shard1", now - 2)}, now, ttl_s=30.0)
    assert sorted(members.records) == ["a", "c"]
    assert members.skipped == {"b": "its record is 15 s old (fresh: under 15 s)"}
    assert stale(record("replica", now - 5), now, ttl_s=30.0) is None


def test_members_by_role_and_numbered_slot():
    now = 1000.0
    recs = {p: record(role, now) for p, role in (("a", "stage:0"), ("b", "stage:1"), ("c", "stage:1"), ("d", "stage:x"), ("e", "expert:shard2"), ("f", "trainer"), ("g", "stage:5"))}
    members = Members.of(recs, now, ttl_s=30.0)
    assert members.peers("stage", "1") == ["b", "c"] and members.peers("stage", "1", exclude="b") == ["c"]
    assert members.peers("trainer") == ["f"] and members.peers("replica") == []
    assert members.numbered("stage") == {0: ["a"], 1: ["b", "c"], 5: ["g"]}  # "stage:x" is no stage
    assert members.numbered("stage", below=2) == {0: ["a"], 1: ["b", "c"]}
    assert members.numbered("expert", "shard") == {2: ["e"]}


def test_the_view_reads_the_members_from_the_dht_and_keeps_the_last_read_when_the_dht_fails():
    async def main():
        a, b = await start_hosts(2)
        try:
            now = time.time()
            for host, role, age in ((a, "stage:0", 1.0), (b, "stage:1", 20.0)):
                rec = MemberRecord(SWARM, "", (), role, 0, now - age, expires_at=now + 60).sign(host.key)
                await host.dht_store(members_key(SWARM), rec.to_bytes(), rec.expires_at, subkey=host.peer_id)
            view = SwarmView(b, SWARM, ttl_s=30.0)
            deadline = time.monotonic() + 30
            while len((members := await view.read()).records) + len(members.skipped) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert members.ok and members.numbered("stage") == {0: [a.peer_id]}
            assert members.skipped == {b.peer_id: "its record is 20 s old (fresh: under 15 s)"}
            await b.shutdown()  # its DHT is gone: the read fails or times out
            again = await view.read()
            assert not again.ok and again.records == members.records  # the last read, marked not ok
        finally:
            for h in (a, b):
                await h.shutdown()

    asyncio.run(main())


# ---- the registry


class _Membership:
    def __init__(self):
        self.progress = Progress()
        self.coordinator = None


class Echo(Role):
    """A role a test adds with one registry entry."""

    name = "echo"

    def __init__(self, ctx, run, assignment):
        self.run_config, self.assignment = run, assignment

    async def start(self) -> None: ...

    async def run(self) -> None: ...

    async def stop(self, planned: bool) -> None: ...


def assigned(role: str, run: RunConfig, **slot) -> RoleAssignment:
    return RoleAssignment(peer_id="p", role=role, config=run.to_json(), **slot)


def test_each_assignment_makes_its_role_and_a_run_without_that_role_is_refused_with_the_reason(tmp_path):
    async def main():
        from node.net.transport import Transport

        (host,) = await start_hosts(1)
        try:
            ctx = RoleContext(host, Transport(host), _Membership(), NodeConfig(data_dir=str(tmp_path), threads=1))
            dense, pipeline, moe = RunConfig(model="tiny"), RunConfig(model="tiny", num_stages=2), RunConfig(model="tiny-moe", expert_shards=2)
            made = [
                make_role(ctx, assigned("replica", dense)),
                make_role(ctx, assigned("stage", pipeline, stage=1)),
                make_role(ctx, assigned("trainer", pipeline)),
                make_role(ctx, assigned("expert", moe, expert="shard1")),
                make_role(ctx, assigned("trainer", moe)),
            ]
            assert [type(r) for r in made] == [Replica, StageServer, PipelineTrainer, ExpertHost, ExpertTrainer]
            assert made[1].index == 1 and made[3].index == 1
            with pytest.raises(RoleError, match="a run of tiny-moe has no stage role"):
                make_role(ctx, assigned("stage", moe, stage=0))
            with pytest.raises(RoleError, match="the model tiny has no experts"):
                make_role(ctx, assigned("expert", pipeline, expert="shard0"))
            with pytest.raises(RoleError, match="run config is not JSON"):
                make_role(ctx, RoleAssignment(peer_id="p", role="replica", config=b"{nope"))
            with pytest.raises(RoleError, match="this node does not serve the replica role"):
                make_role(ctx, assigned("replica", dense), roles=tuple(s for s in ROLES if s.name != "replica"))
        finally:
            await host.shutdown()

    asyncio.run(main())


def test_a_new_role_is_one_class_and_one_registry_entry(tmp_path):
    ctx = RoleContext(None, None, _Membership(), NodeConfig(data_dir=str(tmp_path)))
    roles = (*ROLES, RoleSpec("idle", f"{__name__}:Echo"))
    role = make_role(ctx, assigned("idle", RunConfig(seed=7)), roles=roles)
    assert isinstance(role, Echo) and role.run_config.seed == 7


# ---- a slot's states


def test_a_state_without_a_hash_is_taken_only_where_the_slot_allows_it_and_never_from_our_own_disk(tmp_path):
    """A replica's run may start from a checkpoint its owner seeded (a warm start: no hash in its
    manifest); a stage's state must carry its hash. A state whose hash does not match is refused."""
    import torch

    from node.roles.slot_state import SlotState
    from node.state.checkpoint_dir import read_manifest, write_checkpoint_dir

    meta = {"model": "m"}
    state = {"model": {"w": torch.arange(4.0)}}
    hash_of = lambda s: "h-" + str(int(s["model"]["w"].sum()))  # noqa: E731

    async def compute(fn, *args):
        return fn(*args)

    def slot(name: str, unhashed_ok: bool) -> SlotState:
        return SlotState(None, tmp_path / name, tmp_path / f"{name}-dl", name, meta, hash_of, compute, unhashed_ok=unhashed_ok)

    async def main():
        seeded = write_checkpoint_dir(tmp_path / "seed", 0, state, meta)  # no hash
        manifest = read_manifest(seeded)
        strict, lenient = slot("stage", False), slot("replica", True)
        offer = strict.offer("coordinator", 0, manifest)
        assert offer is not None and offer.hash == ""
        offer = dataclasses.replace(offer, path=seeded)  # (read where it lies: no transfer)
        assert await strict.fetch(offer) is None  # refused, logged
        taken = await lenient.fetch(offer)
        assert taken is not None and torch.equal(taken["model"]["w"], state["model"]["w"])
        assert strict.offer("p", 0, {**manifest, "model_config": {"model": "other"}}) is None  # another model's
        hashed = write_checkpoint_dir(tmp_path / "hashed", 3, state, meta, "h-wrong")
        wrong = dataclasses.replace(offer, step=3, hash="h-wrong", manifest=read_manifest(hashed), path=hashed)
        assert await lenient.fetch(wrong) is None  # a hash that does not match is refused everywhere
        write_checkpoint_dir(tmp_path / "stage", 5, state, meta)  # what this node saved, without a hash
        assert strict.own() is None

    asyncio.run(main())


def test_a_save_cancelled_mid_write_still_writes_and_the_leaver_saves_above_it(tmp_path):
    """A stage's sync round cancelled by SIGTERM while saving: its write finishes (`writes_done`),
    and the last peer's hand-over saves its state as a round above it, never the same number."""
    import torch

    from node.roles.slot_state import SlotState
    from node.roles.slot_sync import handover_round

    state = {"model": {"w": torch.arange(4.0)}}

    async def compute(fn, *args):
        return fn(*args)

    async def main():
        st = SlotState(None, tmp_path / "s", tmp_path / "dl", "stage", {"model": "m"}, lambda s: "h", compute)
        assert st.newest() == -1
        await st.save(7, state, "h")
        saving = asyncio.create_task(st.save(10, state, "h"))
        await asyncio.sleep(0.001)  # in its thread now
        saving.cancel()
        await asyncio.gather(saving, return_exceptions=True)
        await st.writes_done()
        assert st.newest() == 10

    asyncio.run(main())
    # held 9 (the cancelled round 10 saved, not held yet), the clock in round 10: round 11 (the
    # leaver waits for the clock to reach it); otherwise the clock's round, or one above the held
    assert handover_round(9, 10, 10.3, 1.0) == 11
    assert handover_round(10, 10, 12.5, 1.0) == 12
    assert handover_round(10, 10, 10.9, 1.0) == 11
