"""The coordinator's handlers and HTTP status on a real registry (SQLite in tmp_path), a real
checkpoint store and a real aiohttp server; no libp2p host is needed for these."""

import asyncio
import threading

import aiohttp
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.http import start_http
from coordinator.service import Coordinator
from node.net.transport import CallContext
from protocol import Heartbeat, Register, RoleAssignment

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
