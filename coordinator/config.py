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
    # -- the training run, handed to every member with its role --
    model: str = "tiny"  # model preset: tiny | small
    inner_steps: int = 20  # H: local AdamW steps between two averaging rounds
    batch_size: int = 16  # sequences per inner step, per replica
    inner_lr: float = 3e-3  # peak AdamW learning rate
    warmup_steps: int = 50  # inner steps of linear warmup
    total_steps: int = 5000  # inner steps of cosine decay
    outer_lr: float = 1.0  # outer Nesterov SGD learning rate
    outer_momentum: float = 0.9
    codec: str = "int8"  # pseudo-gradient codec: none | fp16 | int8 | topk | powersgd
    block_size: int = 1024  # int8 codec: values per absmax block
    max_outer_steps: int = 0  # replicas stop training after this many outer steps; 0: never
    checkpoint_every: int = 5  # outer steps between checkpoints
    eval_batches: int = 8  # validation batches per outer step
    seed: int = 0  # model init and data sampling
    join_timeout_s: float = 15.0  # how long an averaging round waits for late replicas
    min_replicas: int = 1  # training starts when this many replicas are registered

    RUN_FIELDS = (
        "model", "inner_steps", "batch_size", "inner_lr", "warmup_steps", "total_steps", "outer_lr", "outer_momentum",
        "codec", "block_size", "max_outer_steps", "checkpoint_every", "eval_batches", "seed", "join_timeout_s", "min_replicas",
    )

    def run_config(self) -> dict:
        return {name: getattr(self, name) for name in self.RUN_FIELDS}

    def resolved_identity(self) -> Path:
        return Path(self.identity) if self.identity else Path(self.data_dir) / "identity.pem"
