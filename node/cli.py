"""`swarmtrain-node` / `python -m node`: run a node daemon until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

# Only light imports here: flag and config errors must come back at once, not after torch and
# hivemind have loaded (seconds); the daemon's modules are imported once the config is good.
from .config import AGGREGATORS, LOG_LEVELS, ConfigError, NodeConfig, load_config


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    d = NodeConfig()
    p = _Parser(prog="swarmtrain-node", description="Join a swarmtrain swarm and train.")
    p.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below, and [averager] / [transport] tables (flag > env > file)")
    p.add_argument("--swarm-id", help=f"swarm to join (default: the --token's swarm, else {d.swarm_id})")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="multiaddrs of running peers, e.g. the coordinator's (needed unless --coordinator is given)")
    p.add_argument("--identity", metavar="FILE", help="Ed25519 key file; created if missing (default DATA_DIR/identity.pem)")
    p.add_argument("--host-maddrs", nargs="+", metavar="MADDR", help=f"listen addresses (default {' '.join(d.host_maddrs)})")
    p.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="addresses others should dial")
    p.add_argument("--client-mode", action="store_true", default=None, help="accept no inbound connections (behind a NAT or firewall): dial out only; the coordinator gives such a node a role that only calls out (a trainer)")
    p.add_argument("--relays", nargs="+", metavar="MADDR", help="behind a NAT nobody can dial through: be reached through these relays (nodes or a coordinator started with --serve-relay; each multiaddr with /p2p/<peer id>)")
    p.add_argument("--serve-relay", action="store_true", default=None, help="carry streams to peers behind NATs that name this node as their relay (needs a public address)")
    p.add_argument("--direct-port", type=int, metavar="PORT", help="TCP port for bulk transfers between nodes (default: any free port; -1: off, all traffic over libp2p)")
    p.add_argument("--device", help=f"torch device (default {d.device})")
    p.add_argument("--data-dir", metavar="DIR", help=f"working directory (default ./{d.data_dir})")
    p.add_argument("--coordinator", metavar="MADDR", help="coordinator multiaddr; default: find it in the DHT")
    p.add_argument("--token", help="join token for a private swarm")
    p.add_argument("--wanted-role", help="ask for a role (replica, stage, expert, trainer)")
    p.add_argument("--heartbeat-interval-s", type=float, help=f"seconds between heartbeats (default {d.heartbeat_interval_s})")
    p.add_argument("--record-ttl-s", type=float, help=f"seconds our member record lives in the DHT; refreshed (with the owner's revocation list read) every third of it (default {d.record_ttl_s})")
    p.add_argument("--bandwidth-mbps", type=float, help="your link's bandwidth: reported instead of measured, and averaging paces its uploads to it")
    p.add_argument("--data", metavar="PATH", help="text file or directory to train on (default: the built-in corpus)")
    p.add_argument("--text-field", metavar="NAME", help=f"the field of a JSON line, or the column of a table, that holds the text (default {d.text_field})")
    p.add_argument("--shard-index", type=int, help="data shard this replica reads (default: from the peer id)")
    p.add_argument("--num-shards", type=int, help=f"number of data shards (default {d.num_shards})")
    p.add_argument("--threads", type=int, help="torch threads, at most the cores (default: cores - 1)")
    p.add_argument("--fault-delay-parts-s", type=float, help=argparse.SUPPRESS)  # chaos drills and tests
    p.add_argument("--fault-slowdown", type=float, help=argparse.SUPPRESS)  # chaos drills and tests
    p.add_argument("--fault-attack", help=argparse.SUPPRESS)  # chaos drills, tests and benches: a Byzantine replica
    p.add_argument("--fault-attack-scale", type=float, help=argparse.SUPPRESS)
    p.add_argument("--log-level", choices=LOG_LEVELS)
    p.add_argument("--http", metavar="HOST:PORT", help="serve this node's /metrics (Prometheus) and /status (JSON) there; port 0 picks a free one (default: none)")
    avg = p.add_argument_group("averaging (more in the config file's [averager] table)")
    avg.add_argument("--aggregator", dest="averager.aggregator", choices=AGGREGATORS, help="how averaged contributions are combined; trimmed_mean and centered_clip survive some malicious peers (default: the plain mean)")
    avg.add_argument("--min-group-size", dest="averager.min_group_size", type=int, metavar="N", help="a round left with fewer members than this aborts")
    return p


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


async def serve(node_factory, stop_signals=(signal.SIGINT, signal.SIGTERM)) -> int:
    """Start a daemon, run until a stop signal, stop it cleanly."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in stop_signals:
        loop.add_signal_handler(sig, stop.set)
    daemon = node_factory()
    try:
        await daemon.start()
        # until a stop signal, or an error that ends the daemon (`fatal`: the coordinator refused a node)
        stopped = asyncio.ensure_future(stop.wait())
        fatal = getattr(daemon, "fatal", None) or asyncio.get_running_loop().create_future()
        await asyncio.wait([stopped, fatal], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not fatal.done():
            logging.getLogger("swarmtrain").info("stopping")
    finally:
        await daemon.stop()
    if fatal.done():
        raise fatal.exception()
    return 0


def run_daemon(node_factory, fatal_errors=()) -> int:
    """Run until stopped; a bad setting or an unreachable swarm is one line on stderr, exit 2; a
    node the coordinator refuses stops, one line on stderr, exit 3."""
    import faulthandler

    import uvloop

    from .net.host import HostError
    from .net.membership import Refused

    faulthandler.enable(all_threads=True)  # a crash in native code leaves every thread's stack in the log

    try:
        code = uvloop.run(serve(node_factory))
    except (ConfigError, HostError, *fatal_errors) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Refused as e:  # (after a clean stop: deregistered, p2pd down)
        logging.shutdown()
        print(f"error: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)
    except KeyboardInterrupt:
        code = 0
    # Everything that matters is shut down (deregistered, p2pd stopped, files renamed into
    # place). Do not wait for a worker thread still inside a long torch call: exit now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None) -> int:
    from .osutil import keep_freed_memory

    keep_freed_memory()  # before any thread exists: averaging reuses its buffers' pages every round
    args = build_parser().parse_args(argv)
    cli = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        config = load_config(cli, args.config)
        from .preflight import check_node

        check_node(config)  # files, addresses, ports: before torch and hivemind load (seconds)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    from .daemon import Node

    return run_daemon(lambda: Node(config))


if __name__ == "__main__":
    sys.exit(main())
