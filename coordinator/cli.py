"""`swarmtrain-coordinator` / `python -m coordinator`: run the coordinator until SIGINT / SIGTERM."""

from __future__ import annotations

import sys

from node.cli import _Parser, run_daemon, setup_logging
from node.config import ConfigError, load_config

from .checkpoints import CheckpointError
from .config import CoordinatorConfig
from .registry import RegistryError


def build_parser():
    d = CoordinatorConfig()
    p = _Parser(prog="swarmtrain-coordinator", description="Track a swarm's members, plan roles, keep checkpoints.")
    p.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below (flag > env > file)")
    p.add_argument("--swarm-id", help=f"swarm to serve (default {d.swarm_id})")
    p.add_argument("--data-dir", metavar="DIR", help=f"registry, checkpoints, identity (default ./{d.data_dir})")
    p.add_argument("--identity", metavar="FILE", help="Ed25519 key file; created if missing (default DATA_DIR/identity.pem)")
    p.add_argument("--host-maddrs", nargs="+", metavar="MADDR", help="libp2p listen addresses (fix the port for restarts)")
    p.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="addresses nodes should dial")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="DHT peers to join")
    p.add_argument("--http", metavar="HOST:PORT", help=f"status/metrics address (default {d.http}; '' disables)")
    p.add_argument("--mode", choices=["replica", "pipeline", "experts"], help="how roles are planned (default replica)")
    p.add_argument("--num-stages", type=int, help="pipeline mode: number of stages")
    p.add_argument("--experts", nargs="+", help="experts mode: expert names")
    p.add_argument("--heartbeat-timeout-s", type=float, help=f"evict members silent this long (default {d.heartbeat_timeout_s})")
    p.add_argument("--keep-checkpoints", type=int, help=f"checkpoints kept on disk (default {d.keep_checkpoints})")
    p.add_argument("--owner-public-key", metavar="HEX", help="private swarm: require join tokens signed by this key")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cli = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        config = load_config(cli, args.config, cls=CoordinatorConfig, env_prefix="SWARMTRAIN_COORDINATOR_")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    from .service import Coordinator

    return run_daemon(lambda: Coordinator(config), fatal_errors=(RegistryError, CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
