"""The coordinator's typed config; flags, SWARMTRAIN_COORDINATOR_* env vars and a TOML file
map onto it (see node/config.py for the merge rules)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CoordinatorConfig:
    swarm_id: str = "swarmtrain"  # the swarm this coordinator serves
    data_dir: str = "swarmtrain-coordinator"  # registry (SQLite), checkpoints, identity
    identity: str = ""  # Ed25519 key file; default DATA_DIR/identity.pem (created if missing)
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)  # libp2p listen addresses; fix the port so nodes find it after a restart
    announce_maddrs: tuple[str, ...] = ()  # addresses nodes should dial
    initial_peers: tuple[str, ...] = ()  # DHT peers to join (a bootstrap peer); empty: start a new DHT
    http: str = "127.0.0.1:8080"  # HOST:PORT of /status and /metrics; port 0 picks a free one; "" disables
    mode: str = "replica"  # role planning: replica | pipeline | experts
    num_stages: int = 0  # pipeline mode: stages of the model
    experts: tuple[str, ...] = ()  # experts mode: expert names
    heartbeat_timeout_s: float = 15.0  # members silent for longer are evicted
    keep_checkpoints: int = 3  # how many checkpoints to keep on disk
    owner_public_key: str = ""  # hex Ed25519 public key of the swarm owner; set: Register needs a join token signed by it
    record_interval_s: float = 10.0  # how often the coordinator's DHT record is refreshed
    log_level: str = "INFO"

    def resolved_identity(self) -> Path:
        return Path(self.identity) if self.identity else Path(self.data_dir) / "identity.pem"
