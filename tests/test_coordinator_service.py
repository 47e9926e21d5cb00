"""The coordinator's handlers and HTTP status on a real registry (SQLite in tmp_path), a real
checkpoint store and a real aiohttp server; no libp2p host is needed for these."""

import asyncio
import re
import threading

import aiohttp
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.http import start_http
from coordinator.service import Coordinator
from node.net.transport import CallContext, RPCError
from protocol import Deregister, Heartbeat, Register, RoleAssignment

pytestmark = pytest.mark.timeout(60)


def _ctx(peer_id, request):
    async def receive():
        raise AssertionError("these handlers take one frame")

    return CallContext(peer_id, request, receive)


def test_heartbeats_are_written_off_the_event_loop_in_the_order_they_arrive(tmp_path):
    coord = Coordinator(CoordinatorConfig(data_dir=str(tmp_path), http=""))
    coord.validate()
    reg = coord.registry.registry
    writes = []  # (thread, step) per heartbeat write, in the order the registry ran them
    real_heartbeat = reg.heartbeat

    def heartbeat(peer_id, now, step=None, *args):
        writes.append((threading.get_ident(), step))
        return real_heartbeat(peer_id, now, step, *args)

    reg.heartbeat = heartbeat

    async def main():
        try:
            reply = await coord.on_register(_ctx("peer-a", Register(peer_id="peer-a", capabilities={"device": "cpu"})))
            assert isinstance(reply, RoleAssignment) and reply.role == "replica"
            replies = await asyncio.gather(
                *(coord.on_heartbeat(_ctx("peer-a", Heartbeat(peer_id="peer-a", step=i, loss=10.0 - i))) for i in range(30))
            )
            assert all(r.role == "replica" and r.epoch == reply.epoch for r in replies)
            status = await coord.status()
        finally:
            await coord.stop()
        return status

    status = asyncio.run(main())
    loop_thread = threading.get_ident()  # asyncio.run ran the loop on this thread
    assert [step for _, step in writes] == list(range(30))
    assert len({t for t, _ in writes}) == 1 and loop_thread not in {t for t, _ in writes}
    assert [p["step"] for p in status["progress"]] == list(range(30))  # progress points kept their order
    assert status["members"][0]["step"] == 29 and status["epoch"] == status["members"][0]["epoch"] == 1


def test_http_status_on_port_zero_reports_the_port_it_listens_on(tmp_path):
    coord = Coordinator(CoordinatorConfig(data_dir=str(tmp_path), http="127.0.0.1:0"))
    coord.validate()

    async def main():
        http = await start_http(coord, "127.0.0.1:0")
        try:
            host, port = http.address.rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://{http.address}/status", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    assert resp.status == 200
                    body = await resp.json()
            assert body["swarm_id"] == "swarmtrain" and body["members"] == []
        finally:
            await http.stop()
            await coord.stop()

    asyncio.run(main())


def test_status_shows_a_failed_member_and_the_swarms_events_and_metrics_type_counters_as_counters(tmp_path):
    coord = Coordinator(CoordinatorConfig(data_dir=str(tmp_path), http="", heartbeat_timeout_s=2.0))
    coord.validate()

    async def get(http, path):
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{http.address}{path}", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                assert resp.status == 200
                return await (resp.json() if path == "/status" else resp.text())

    async def main():
        http = await start_http(coord, "127.0.0.1:0")
        evict_loop = None
        try:
            for p in ("peer-a", "peer-b"):
                assert (await coord._on_register(_ctx(p, Register(peer_id=p, capabilities={"device": "cpu", "software": "swarmtrain/0.1"})))).role == "replica"
            with pytest.raises(RPCError, match="cannot act for"):  # refused: it speaks for another peer
                await coord._on_register(_ctx("peer-x", Register(peer_id="peer-y")))
            failure = "the replica role failed: training diverged (non-finite gradient norm at inner step 1 (loss nan))"
            reply = await coord.on_heartbeat(_ctx("peer-a", Heartbeat(peer_id="peer-a", step=0, loss=5.5, failure=failure)))
            assert reply.role == "idle" and failure in reply.reason  # planned idle at once
            await coord.on_heartbeat(_ctx("peer-a", Heartbeat(peer_id="peer-a", step=0, loss=5.5, failure=failure)))  # told once
            await coord.on_heartbeat(_ctx("peer-b", Heartbeat(peer_id="peer-b", step=1, loss=5.0, notes=("outer step 1: averaging failed (too late or alone)",))))
            status = await get(http, "/status")
            assert {m["peer_id"]: m["failed"] for m in status["members"]} == {"peer-a": failure, "peer-b": None}
            assert {m["peer_id"]: m["role"] for m in status["members"]} == {"peer-a": "idle", "peer-b": "replica"}
            assert [(p["step"], p["loss"], p["peer_id"]) for p in status["progress"]] == [(0, 5.5, "peer-a"), (1, 5.0, "peer-b")]  # one per outer step
            await coord.on_deregister(_ctx("peer-b", Deregister(peer_id="peer-b", reason="interrupted")))
            evict_loop = asyncio.create_task(coord._evict_loop())  # peer-a stays silent: evicted after 2 s
            for _ in range(100):
                if coord.evictions:
                    break
                await asyncio.sleep(0.1)
            status, metrics = await get(http, "/status"), await get(http, "/metrics")
        finally:
            if evict_loop is not None:
                evict_loop.cancel()
                await asyncio.gather(evict_loop, return_exceptions=True)
            await http.stop()
            await coord.stop()
        return status, metrics

    status, metrics = asyncio.run(main())
    events = [(e["kind"], e["peer_id"]) for e in status["events"]]
    assert events == [("join", "peer-a"), ("join", "peer-b"), ("refused", "peer-x"), ("role_failed", "peer-a"), ("round_failed", "peer-b"),
                      ("leave", "peer-b"), ("evict", "peer-a")]  # fmt: skip
    details = [e["detail"] for e in status["events"]]
    assert details[0] == "assigned replica (cpu, swarmtrain/0.1)" and "cannot act for peer-y" in details[2]
    assert details[4:6] == ["outer step 1: averaging failed (too late or alone)", "interrupted"] and details[6].startswith("no heartbeat for")
    assert status["members"] == [] and all(set(e) == {"time", "kind", "peer_id", "detail"} for e in status["events"])
    # (the text format names a counter's family with or without _total, by the client's version)
    assert re.search(r"^# TYPE swarmtrain_evictions(_total)? counter$", metrics, re.M) and "\nswarmtrain_evictions_total 1.0\n" in metrics
    assert re.search(r"^# TYPE swarmtrain_rpc(_total)? counter$", metrics, re.M) and "# TYPE swarmtrain_failed_members gauge" in metrics
    assert not re.search(r"^# TYPE \S*(evictions|rpc)\S* gauge$", metrics, re.M)
