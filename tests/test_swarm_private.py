"""A private swarm set up from the CLI only (`swarmtrain-coordinator init`, `token`, `revoke`):
members train, while a peer without a membership certificate (none, forged, expired, of another
swarm or of another peer) gets every call refused with the reason, a node without a join token
never becomes a member, and a revoked peer is refused by the others within a record refresh.
Real console scripts, real p2pd."""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.state.checkpoint_client import fetch_manifest
from node.net.host import Host, HostConfig
from node.net.transport import RemoteError, Transport
from protocol import Ack, Hello, MemberProof, SigningKey
from protocol.signatures import peer_id_from_public_key
from protocol.tokens import issue_certificate
from tests.swarm import node_peer_id, wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

RUN = ["--model", "tiny", "--inner-steps", "5", "--eval-batches", "2", "--warmup-steps", "5", "--join-timeout-s", "8", "--heartbeat-timeout-s", "10",
       "--min-replicas", "2", "--record-interval-s", "1"]  # fmt: skip
NODE = ["--threads", "1", "--bandwidth-mbps", "1000", "--heartbeat-interval-s", "0.5", "--num-shards", "4", "--record-ttl-s", "3"]


def tool(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "swarmtrain-coordinator"
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=60)


def outer_step(swarm, name) -> int:
    try:
        h = json.loads((Path(swarm.tmp) / name / "replica-stats.json").read_text())["history"]
    except (OSError, ValueError, KeyError):
        return -1
    return h[-1]["outer_step"] if h else -1


def refusals(proc) -> list[str]:
    """The lines of a node's output that say the coordinator refused it."""
    return [line for line in proc.log().splitlines() if "refused this node" in line or "refused us" in line]


async def _stranger(maddr: str, targets: list[str], owner: SigningKey, swarm_id: str) -> dict[str, list[str]]:
    """A peer of the swarm's network with no certificate of its own: what each call it tries
    gets back from each target."""
    key = SigningKey.generate()
    me = peer_id_from_public_key(key.public_key)
    host = await Host.start(key, HostConfig(initial_peers=(maddr,)))
    transport = Transport(host)
    now = time.time()
    bad_certificates = {
        "forged": issue_certificate(SigningKey.generate(), swarm_id, me, "replica", now),
        "expired": issue_certificate(owner, swarm_id, me, "replica", now - 1000, ttl_s=600),
        "other swarm": issue_certificate(owner, "other@" + swarm_id.split("@")[1], me, "replica", now),
        "other peer": issue_certificate(owner, swarm_id, peer_id_from_public_key(SigningKey.generate().public_key), "replica", now),
    }
    answers: dict[str, list[str]] = {}
    try:
        for peer in targets:
            got = answers.setdefault(peer, [])
            for call in (lambda: transport.call(peer, Hello(peer_id=me, swarm_id=swarm_id), 10), lambda: fetch_manifest(transport, peer, timeout=10)):
                try:
                    await call()
                    got.append("served")
                except RemoteError as e:
                    got.append(f"{e.code}: {e.message}")
            for what, cert in bad_certificates.items():
                try:
                    await transport.call(peer, MemberProof(certificate=cert.to_bytes()), 10)
                    got.append(f"{what}: accepted")
                except RemoteError as e:
                    got.append(f"{what}: {e.code}: {e.message}")
    finally:
        await transport.close()
        await host.shutdown()
    return answers


def test_a_private_swarm_from_the_cli_serves_members_only_and_revokes(swarm):
    data = Path(swarm.tmp) / "coordinator"
    init = tool("init", "--data-dir", str(data), "--name", "lab")
    assert init.returncode == 0, init.stderr
    swarm_id = next(line.split(": ", 1)[1] for line in init.stdout.splitlines() if line.startswith("swarm id: "))
    owner = SigningKey.load(data / "identity.pem")
    assert swarm_id == f"lab@{peer_id_from_public_key(owner.public_key)}"
    token = tool("token", "--data-dir", str(data), "--swarm-id", swarm_id, "--expires-in", "1h")
    assert token.returncode == 0 and token.stdout.strip(), token.stderr
    bad = tool("token", "--data-dir", str(data), "--swarm-id", swarm_id, "--expires-in", "forever")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--expires-in 'forever'" in bad.stderr, bad.stderr

    coord = swarm.coordinator("coordinator", None, None, "--swarm-id", swarm_id, "--private", *RUN)
    maddr = coord.wait_ready()["maddrs"][0]
    join = ["--swarm-id", swarm_id, *NODE]
    nodes = {n: swarm.node(n, [maddr], *join, "--shard-index", str(i), "--token", token.stdout.strip()) for i, n in enumerate(["a", "b", "c"])}
    outsider = swarm.node("x", [maddr], *join, "--shard-index", "3")  # no token
    trainer_only = tool("token", "--data-dir", str(data), "--swarm-id", swarm_id, "--roles", "trainer").stdout.strip()
    trainer = swarm.node("t", [maddr], *join, "--token", trainer_only)  # asks for no role: replica mode has none its token allows
    ids = {n: node_peer_id(p) for n, p in nodes.items()}
    wait_for(lambda: min(outer_step(swarm, n) for n in nodes) >= 1, 240, "the members to train an outer step")
    t = coord.members().get(node_peer_id(trainer)) or wait_for(lambda: coord.members().get(node_peer_id(trainer)), 60, "t to register")
    assert t["role"] == "idle", t
    assert "role: idle (its join token allows only trainer: replica mode has no place for that)" in trainer.log()
    trainer.terminate()
    assert trainer.wait(30) == 0
    # refused: it says so in one line and exits (no retrying for ever), never a member
    assert outsider.wait(60) == 3 and node_peer_id(outsider) not in coord.members()
    assert refusals(outsider) == ["error: the coordinator refused this node: this swarm is private: a join token is required"], outsider.log()

    answers = asyncio.run(_stranger(maddr, [ids["a"], ids["b"]], owner, swarm_id))
    for peer, got in answers.items():
        assert all(a.startswith("unauthorized: no valid membership certificate presented") for a in got[:2]), got  # Hello, a state download
        assert [a.split(": unauthorized: membership certificate refused: ")[0] for a in got[2:]] == ["forged", "expired", "other swarm", "other peer"], got
        assert "not signed by the swarm owner" in got[2] and "expired" in got[3] and "other swarm" in got[4] and "other peer" in got[5], got
    at = {n: outer_step(swarm, n) for n in nodes}
    wait_for(lambda: all(outer_step(swarm, n) > at[n] for n in nodes), 120, "the members to train on")

    # the owner revokes c and a peer it had certified: the coordinator drops c, and a and b,
    # which served that peer, refuse it within a record refresh; they train on without c
    seconds = asyncio.run(_revoked(maddr, [ids["a"], ids["b"]], owner, swarm_id, lambda peer: tool("revoke", "--data-dir", str(data), ids["c"], peer)))
    assert all(s < 15 for s in seconds), seconds  # (a refresh is 1 s here: the coordinator's record interval, a third of the nodes' record TTL)
    wait_for(lambda: ids["c"] not in coord.members(), 30, "the coordinator to drop c")
    assert nodes["c"].wait(60) == 3, nodes["c"].log()  # refused at its next heartbeat: it stops training and exits
    assert refusals(nodes["c"]) == [f"error: the coordinator refused this node: {ids['c']} is revoked by the owner of swarm {swarm_id}"]
    at = {n: outer_step(swarm, n) for n in ("a", "b")}
    wait_for(lambda: all(outer_step(swarm, n) > at[n] for n in ("a", "b")), 120, "a and b to train on without c")


async def _revoked(maddr: str, targets: list[str], owner: SigningKey, swarm_id: str, revoke) -> list[float]:
    """A peer the owner certified is served by `targets`; then `revoke(its peer id)` runs: how
    long each target takes to refuse it as revoked."""
    key = SigningKey.generate()
    me = peer_id_from_public_key(key.public_key)
    host = await Host.start(key, HostConfig(initial_peers=(maddr,)))
    transport = Transport(host)
    hello = Hello(peer_id=me, swarm_id=swarm_id)
    try:
        cert = issue_certificate(owner, swarm_id, me, "replica", time.time())
        for peer in targets:
            assert isinstance(await transport.call(peer, MemberProof(certificate=cert.to_bytes()), 10), Ack)
            assert isinstance(await transport.call(peer, hello, 10), Hello)  # a member: served
        done = await asyncio.to_thread(revoke, me)
        assert done.returncode == 0, done.stderr
        t0, took = time.monotonic(), []
        for peer in targets:
            while True:
                try:
                    await transport.call(peer, hello, 10)
                except RemoteError as e:
                    assert e.code == "unauthorized" and "is revoked by the owner" in e.message, e
                    took.append(time.monotonic() - t0)
                    break
                assert time.monotonic() - t0 < 60, f"{peer} still serves a revoked peer after 60 s"
                await asyncio.sleep(0.2)
        return took
    finally:
        await transport.close()
        await host.shutdown()
