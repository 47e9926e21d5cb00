"""The RPC transport over real libp2p streams (real p2pd, in this process): limits, scores,
deadlines, refusals."""

import asyncio
import time

import pytest

from node.net.transport import RPC_PROTOCOL, CallTimeout, PeerScores, RemoteError, RPCError, Transport, TransportConfig
from protocol import Ack, Decoder, Error, Ping, Pong, StateChunk, encode
from tests.swarm import start_hosts

pytestmark = pytest.mark.timeout(120)


def run(coro_fn, n_hosts=2, **server_config):
    async def main():
        hosts = await start_hosts(n_hosts)
        server = Transport(hosts[0], TransportConfig(**server_config))
        clients = [Transport(h) for h in hosts[1:]]
        try:
            await server.start()
            for c in clients:
                await c.start()
            return await coro_fn(server, clients)
        finally:
            for t in [server, *clients]:
                await t.close()
            for h in hosts:
                await h.shutdown()

    return asyncio.run(main())


def test_concurrent_calls_beyond_the_per_peer_limit_are_refused():
    async def scenario(server, clients):
        release = asyncio.Event()

        async def slow(ctx):
            await release.wait()
            return Ack()

        server.on(StateChunk, slow)
        req = StateChunk(name="x", offset=0, total_size=0, sha256="0" * 64)
        calls = [asyncio.create_task(clients[0].call(server.peer_id, req, timeout=30)) for _ in range(8)]
        await asyncio.sleep(0)
        done = []
        while len(done) < 3:  # the calls over the limit are answered at once
            finished, _ = await asyncio.wait([c for c in calls if not c.done()], return_when=asyncio.FIRST_COMPLETED, timeout=20)
            assert finished, "over-limit calls were not refused"
            done += finished
        release.set()
        results = await asyncio.gather(*calls, return_exceptions=True)
        overloaded = [r for r in results if isinstance(r, RemoteError) and r.code == "overloaded"]
        served = [r for r in results if isinstance(r, Ack)]
        assert len(overloaded) == 3 and len(served) == 5, results
        assert isinstance(await clients[0].call(server.peer_id, Ping(), timeout=10), Pong)  # still served

    run(scenario, max_concurrent_per_peer=5)


def test_a_peer_cannot_make_us_hold_more_than_its_byte_budget():
    async def scenario(server, clients):
        async def handler(ctx):
            return Ack()

        server.on(StateChunk, handler)
        big = StateChunk(name="x", offset=0, total_size=1 << 20, sha256="0" * 64, data=bytes(1 << 20))
        with pytest.raises(RemoteError) as info:
            await clients[0].call(server.peer_id, big, timeout=20)
        assert info.value.code == "overloaded" and "bytes" in info.value.message
        small = StateChunk(name="x", offset=0, total_size=100, sha256="0" * 64, data=bytes(100))
        assert isinstance(await clients[0].call(server.peer_id, small, timeout=10), Ack)
        assert server.scores.peers[clients[0].peer_id].bytes_in_flight == 0  # nothing stays counted

    run(scenario, max_bytes_in_flight_per_peer=64 << 10)


def test_repeated_garbage_gets_a_peer_banned_and_others_keep_being_served():
    async def scenario(server, clients):
        bad, good = clients
        replies = []
        for _ in range(6):
            reader, writer = await bad.host.open_stream(server.peer_id, RPC_PROTOCOL)
            writer.write(b"\x00\x00\x00\x03abc")
            await writer.drain()
            replies += Decoder().feed(await asyncio.wait_for(reader.read(1 << 16), 10))
            writer.close()
        assert all(isinstance(r, Error) for r in replies)
        assert replies[0].code == "bad_request" and replies[-1].code == "unauthorized" and "banned" in replies[-1].message
        with pytest.raises(RemoteError, match="banned"):
            await bad.call(server.peer_id, Ping(), timeout=10)
        assert isinstance(await good.call(server.peer_id, Ping(), timeout=10), Pong)
        assert server.stats["bad_frames"] == 5

    run(scenario, n_hosts=3, ban_score=-10.0)


def test_a_caller_that_hangs_up_before_its_request_is_not_punished():
    """Calls cancelled before their request went out (probes given up, sends of a finished
    round) close streams with nothing or half a request on them: a hang-up, not bad input."""

    async def scenario(server, clients):
        (caller,) = clients
        for k in range(12):
            reader, writer = await caller.host.open_stream(server.peer_id, RPC_PROTOCOL)
            if k % 2:
                writer.write(b"\x00\x00")  # half a frame header
                await writer.drain()
            writer.close()
        assert isinstance(await caller.call(server.peer_id, Ping(), timeout=10), Pong)
        st = server.scores.peers[caller.peer_id]
        deadline = time.monotonic() + 10
        while st.active and time.monotonic() < deadline:  # every stream's end seen by the server
            await asyncio.sleep(0.05)
        assert st.active == 0
        assert server.stats["bad_frames"] == 0
        assert server.scores.score(caller.peer_id, time.monotonic()) == 0.0

    run(scenario, ban_score=-10.0)


def test_valid_calls_between_bad_frames_do_not_wash_a_score():
    """A peer that sends a bad frame, then many cheap valid calls, again and again, is banned
    after as many bad frames as one that sends only bad frames."""

    async def scenario(server, clients):
        (bad,) = clients
        for k in range(5):
            if k:  # cheap valid calls between bad frames
                for _ in range(30):
                    assert isinstance(await bad.call(server.peer_id, Ping(), timeout=10), Pong)
            reader, writer = await bad.host.open_stream(server.peer_id, RPC_PROTOCOL)
            writer.write(b"\x00\x00\x00\x03abc")
            await writer.drain()
            (reply,) = Decoder().feed(await asyncio.wait_for(reader.read(1 << 16), 10))
            writer.close()
            assert reply.code == "bad_request"
        with pytest.raises(RemoteError, match="banned"):
            await bad.call(server.peer_id, Ping(), timeout=10)

    run(scenario, ban_score=-10.0)


def test_penalties_count_for_a_window_of_time_then_are_forgiven():
    scores = PeerScores(TransportConfig(ban_score=-10.0, score_window_s=100.0))
    scores.penalize("p", 6.0, now=0.0, reason="bad input: one")
    scores.penalize("p", 2.0, now=50.0, reason="bad input: two")
    assert scores.score("p", now=60.0) == -8.0
    assert not scores.penalize("p", 3.0, now=101.0, reason="bad input: three")  # the first penalty is forgiven by now: -5
    assert not scores.banned("p", 101.0) and scores.score("p", now=101.0) == -5.0
    assert scores.bans(101.0) == []
    assert scores.penalize("p", 5.0, now=102.0, reason="bad input: four")  # -10: banned, and the slate is clean after the ban
    assert scores.banned("p", 102.0) == pytest.approx(TransportConfig().ban_s)
    assert scores.score("p", now=102.0) == 0.0


def test_a_ban_keeps_what_earned_it_and_doubles_each_time():
    ban_s = TransportConfig().ban_s
    scores = PeerScores(TransportConfig(ban_score=-4.0, score_window_s=100.0))
    scores.penalize("p", 2.0, now=0.0, reason="bad input: NaN in a part")
    scores.penalize("q", 9.0, now=0.0, reason="checkpoint file model.safetensors: hash mismatch")
    scores.penalize("p", 2.0, now=1.0, reason="bad input: wrong shape (3,) for (4,)")
    assert scores.bans(1.0) == [
        {"peer_id": "p", "left_s": ban_s, "bans": 1, "reason": "2 offences in 100 s, the last: bad input: wrong shape (3,) for (4,)"},
        {"peer_id": "q", "left_s": ban_s - 1.0, "bans": 1, "reason": "1 offence in 100 s, the last: checkpoint file model.safetensors: hash mismatch"},
    ]
    later = 1.0 + ban_s  # p's ban is over: it may offend again, and is banned twice as long
    assert [b["peer_id"] for b in scores.bans(later)] == []
    scores.penalize("p", 4.0, now=later, reason="a malformed reply: truncated frame")
    assert scores.bans(later) == [{"peer_id": "p", "left_s": 2 * ban_s, "bans": 2, "reason": "1 offence in 100 s, the last: a malformed reply: truncated frame"}]


def test_every_call_has_a_deadline():
    async def scenario(server, clients):
        async def never(ctx):
            await asyncio.Event().wait()

        server.on(StateChunk, never)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(CallTimeout):
            await clients[0].call(server.peer_id, StateChunk(name="x", offset=0, total_size=0, sha256="0" * 64), timeout=1.0)
        assert asyncio.get_running_loop().time() - t0 < 5
        # a handler that overruns the server's own limit is answered with "timeout"
        with pytest.raises(RemoteError) as info:
            await clients[0].call(server.peer_id, StateChunk(name="x", offset=0, total_size=0, sha256="0" * 64), timeout=10)
        assert info.value.code == "timeout"

    run(scenario, handler_timeout_s=1.5)


def _parts(n: int, size: int = 300_000):
    from protocol import make_codec, split

    enc = make_codec("none").encode(__import__("torch").zeros(size))
    return split(enc, f"k{n}", chunk_size=64 << 10)


def test_pipes_carry_calls_one_after_another_and_recover_from_errors():
    """Sends with reuse=True go over one stream kept open: sequential calls share it, concurrent
    ones take more, a refusal closes the one it happened on and the next call gets a fresh one,
    and what the handler reads is exactly what each call sent."""

    async def scenario(server, clients):
        from protocol import TensorAssembler, TensorPart

        seen, refuse = [], set()

        async def on_part(ctx):
            asm, part = TensorAssembler(), ctx.request
            while (enc := asm.add(part)) is None:
                part = await ctx.receive()
            if ctx.request.key in refuse:
                raise RPCError("not_found", "refused on purpose")
            seen.append((ctx.request.key, enc.nbytes))
            return Ack()

        server.on(TensorPart, on_part)
        c = clients[0]
        for i in range(5):
            parts = _parts(i)
            assert isinstance(await c.send(server.peer_id, parts[0], parts[1:], timeout=20, reuse=True), Ack)
        assert c.stats["pipes_opened"] == 1
        assert seen == [(f"k{i}", 1_200_000) for i in range(5)]
        batch = [_parts(10 + i) for i in range(3)]
        await asyncio.gather(*(c.send(server.peer_id, p[0], p[1:], timeout=20, reuse=True) for p in batch))
        assert 2 <= c.stats["pipes_opened"] <= 4  # the idle one, plus new ones for the others
        opened = c.stats["pipes_opened"]
        refuse.add("k20")
        parts = _parts(20)
        with pytest.raises(RemoteError, match="refused on purpose"):
            await c.send(server.peer_id, parts[0], parts[1:], timeout=20, reuse=True)
        parts = _parts(21)
        assert isinstance(await c.send(server.peer_id, parts[0], parts[1:], timeout=20, reuse=True), Ack)
        assert ("k21", 1_200_000) in seen and ("k20", 1_200_000) not in seen
        assert c.stats["pipes_opened"] <= opened + 1
        assert server.scores.peers[c.peer_id].bytes_in_flight == 0

    run(scenario)


async def _read_all_parts(ctx):
    """A TensorPart handler that reads every part of the tensor and acknowledges it."""
    part = ctx.request
    while part.index < part.count - 1:
        part = await ctx.receive()
    return Ack()


def test_a_pipe_the_server_closed_while_idle_is_replaced_on_the_next_call():
    async def scenario(server, clients):
        from protocol import TensorPart

        server.on(TensorPart, _read_all_parts)
        c = clients[0]
        parts = _parts(0)
        await c.send(server.peer_id, parts[0], parts[1:], timeout=20, reuse=True)
        deadline = asyncio.get_running_loop().time() + 20
        while not c._pipes[server.peer_id][0].reader.at_eof():  # the server's idle timeout (1 s) closed it
            assert asyncio.get_running_loop().time() < deadline, "the server never closed the idle pipe"
            await asyncio.sleep(0.1)
        assert isinstance(await c.send(server.peer_id, parts[0], parts[1:], timeout=20, reuse=True), Ack)
        assert c.stats["pipes_opened"] == 2

    run(scenario, pipe_idle_s=1.0)


def test_a_handler_that_stops_reading_holds_back_the_sender_and_chunks_arrive_uncopied():
    """The server reads at most one frame ahead of its handler, so a slow handler holds the
    sender back instead of filling our memory; tensor chunks arrive as views of the frame
    they came in, and arrive intact."""

    async def scenario(server, clients):
        import torch

        from protocol import TensorAssembler, TensorPart, make_codec, split

        started, release, views, got = asyncio.Event(), asyncio.Event(), [], []

        async def on_part(ctx):
            part = ctx.request
            started.set()
            await release.wait()
            asm = TensorAssembler()
            while True:
                views.append(isinstance(part.data, memoryview))
                if (enc := asm.add(part)) is not None:
                    break
                part = await ctx.receive()
            got.append(bytes(enc.payload))
            return Ack()

        server.on(TensorPart, on_part)
        enc = make_codec("none").encode(torch.arange(8 << 20, dtype=torch.float32))  # 32 MiB
        parts = split(enc, "big", chunk_size=1 << 20)
        call = asyncio.create_task(clients[0].send(server.peer_id, parts[0], parts[1:], timeout=60))
        await asyncio.wait_for(started.wait(), 20)
        await asyncio.sleep(1.0)  # the sender keeps pushing; we check what the server took in
        held = server.scores.peers[clients[0].peer_id].bytes_in_flight
        assert 1 << 20 <= held <= (2 << 20) + (64 << 10), held  # the first frame, at most one more
        release.set()
        assert isinstance(await call, Ack)
        assert got == [bytes(enc.payload)] and len(views) == 32 and all(views)
        assert server.scores.peers[clients[0].peer_id].bytes_in_flight == 0

    run(scenario)


def test_tls_only_hosts_talk_to_hosts_that_prefer_noise():
    """Our hosts offer TLS 1.3 only (cheaper per byte than Noise where the CPU has AES
    instructions); a host with p2pd's default (Noise first) still reaches them, both ways."""
    from node.osutil import children_of
    from node.net.host import Host, HostConfig, HostError
    from protocol import SigningKey

    def daemon_flags(host) -> str:
        pids = [p for c in children_of(__import__("os").getpid()) for p in [c, *children_of(c)]]
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
            if "p2pd" in cmd.split(" ")[0] and str(host._keyfile_dir) in cmd:
                return cmd
        raise AssertionError("no p2pd found for the host")

    async def main():
        with pytest.raises(HostError, match="security"):
            await Host.start(SigningKey.generate(), HostConfig(security="ssl"))
        tls = await Host.start(SigningKey.generate(), HostConfig())
        noise = await Host.start(SigningKey.generate(), HostConfig(initial_peers=tuple(await tls.visible_maddrs()), security="noise+tls"))
        ends = [Transport(tls), Transport(noise)]
        try:
            assert "-noise=0" in daemon_flags(tls) and "-noise=0" not in daemon_flags(noise)
            for t in ends:
                await t.start()
            assert isinstance(await ends[1].call(tls.peer_id, Ping(), timeout=10), Pong)
            assert isinstance(await ends[0].call(noise.peer_id, Ping(), timeout=10), Pong)
        finally:
            for t in ends:
                await t.close()
            await tls.shutdown()
            await noise.shutdown()

    asyncio.run(main())


def test_closing_a_transport_with_handlers_waiting_logs_no_tracebacks(caplog):
    async def scenario(server, clients):
        from protocol import TensorPart

        server.on(TensorPart, _read_all_parts)
        parts = _parts(0)
        await clients[0].send(server.peer_id, parts[0], parts[1:], timeout=20, reuse=True)
        assert server._tasks  # the pipe's handler waits for the next call
        with caplog.at_level("ERROR", logger="asyncio"):
            await server.close()
            await asyncio.sleep(0.1)  # the stream server's done-callbacks run
        assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text

    run(scenario)


def test_a_served_stream_stays_open_until_the_caller_hangs_up():
    """p2pd ends a stream with close-then-reset, and a reset that overtakes a reply between the
    daemons throws the reply away (a busy machine lost about one call in a thousand). So the
    server does not close first: after its reply, the stream stays open until the caller hangs
    up (its task ends then), or until linger_s has passed."""

    async def scenario(server, clients):
        (caller,) = clients
        for hang_up in (True, False):
            reader, writer = await caller.host.open_stream(server.peer_id, RPC_PROTOCOL)
            writer.write(encode(Ping()))
            await writer.drain()
            decoder, msgs = Decoder(), []
            async with asyncio.timeout(10):
                while not msgs:
                    msgs = decoder.feed(await reader.read(1 << 16))
            assert [type(m) for m in msgs] == [Pong]
            assert len(server._tasks) == 1
            t0 = time.monotonic()
            if hang_up:
                with pytest.raises(TimeoutError):  # still open: no end of stream from the server
                    await asyncio.wait_for(reader.read(1), 0.5)
                writer.close()
                async with asyncio.timeout(2.0):  # the server lets go at once, well before linger_s
                    while server._tasks:
                        await asyncio.sleep(0.02)
            else:  # a caller that never hangs up is let go after linger_s
                assert await asyncio.wait_for(reader.read(1), 10) == b""
                assert time.monotonic() - t0 >= 2.5
                writer.close()

    run(scenario, linger_s=3.0)


class _OpensHang:
    """Stands in for a libp2p host in `Transport._open_stream` alone: its first opens hang as p2pd's
    does on a dial that will fail, later ones answer at once (the peer connected to us meanwhile)."""

    def __init__(self, hanging: int, fail: bool = False):
        self.hanging, self.fail, self.opens, self.closed = hanging, fail, 0, 0
        self.routes: dict = {}  # no peer announced relays

    async def open_stream(self, peer_id, protocol):
        self.opens += 1
        if self.opens <= self.hanging:
            await asyncio.sleep(3600)
        if self.fail:
            raise ConnectionError("refused")
        host = self

        class Writer:
            def close(self):
                host.closed += 1

        return object(), Writer()


def test_a_stream_open_that_hangs_gets_a_companion_and_the_first_to_open_wins(monkeypatch):
    from node.net import dialing

    monkeypatch.setattr(dialing, "OPEN_AGAIN_S", 0.05)

    async def main():
        quick = Transport(_OpensHang(hanging=1))
        t0 = time.monotonic()
        _, writer = await quick._open_stream("peer", RPC_PROTOCOL)
        took = time.monotonic() - t0
        assert quick.host.opens == 2 and quick.stats["opens_again"] == 1 and quick.host.closed == 0
        stuck = Transport(_OpensHang(hanging=10))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await stuck._open_stream("peer", RPC_PROTOCOL)
        assert stuck.host.opens == 3  # at most OPEN_ATTEMPTS at once, all given up with the call
        failing = Transport(_OpensHang(hanging=0, fail=True))
        with pytest.raises(ConnectionError):
            await failing._open_stream("peer", RPC_PROTOCOL)
        assert failing.host.opens == 1  # a failed open is not retried here
        return took

    assert asyncio.run(main()) < 1.0


def test_dht_reads_their_callers_gave_up_on_end_quietly_in_the_event_loop():
    """A read of the DHT abandoned mid-flight (a caller's timeout) is kept until its reply
    comes: nothing pending is collected (asyncio logged "Task was destroyed but it is
    pending!" once per read given up)."""
    import gc
    import logging

    from node.net.host import Host, HostConfig
    from protocol import SigningKey

    destroyed = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "destroyed but it is pending" in record.getMessage():
                destroyed.append(record.getMessage())

    catch = Catch()
    logging.getLogger("asyncio").addHandler(catch)

    async def main():
        host = await Host.start(SigningKey.generate(), HostConfig())
        try:
            for i in range(50):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(host.dht_get(f"key-{i}"), 0.0001)
            await asyncio.sleep(1.0)  # their replies come (a lone DHT answers at once)
            gc.collect()
            assert await host.dht_get("key-0") is None  # and the DHT still answers
        finally:
            await host.shutdown()

    try:
        asyncio.run(main())
    finally:
        logging.getLogger("asyncio").removeHandler(catch)
    assert destroyed == []
