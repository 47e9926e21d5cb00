"""The coordinator's typed config; flags, SWARMTRAIN_COORDINATOR_* env vars and a TOML file
map onto it (see node/config.py for the merge rules). The training run it hands to every member
is a `RunConfig` (node/runconfig.py), nested here; its settings read like the others (top-level
keys in the file, `--inner-steps`, SWARMTRAIN_COORDINATOR_INNER_STEPS)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from node.config import LOG_LEVELS, Check, ConfigError, at_least, check_fields, non_empty, one_of, positive, record_ttl, swarm_id
from node.preflight import check_data_dir, check_http, check_maddrs, load_identity
from node.runconfig import HF_PIN, RunConfig, RunConfigError
from protocol.records import owner_of
from protocol.signatures import SigningKey, peer_id_from_public_key

MIN_HEARTBEAT_TIMEOUT_S = 2.0  # nodes heartbeat every 2 s by default (and every third of a shorter timeout: node/net/membership.py)

# the planning modes nodes serve
SERVED_MODES = ("replica", "pipeline", "experts")


@dataclass(frozen=True)
class CoordinatorConfig:
    swarm_id: str = "swarmtrain"  # the swarm this coordinator serves
    data_dir: str = "swarmtrain-coordinator"  # registry (SQLite), checkpoints, identity
    identity: str = ""  # Ed25519 key file; default DATA_DIR/identity.pem (created if missing)
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)  # libp2p listen addresses; fix the port so nodes find it after a restart
    announce_maddrs: tuple[str, ...] = ()  # addresses nodes should dial
    initial_peers: tuple[str, ...] = ()  # DHT peers to join (a bootstrap peer); empty: start a new DHT
    http: str = "127.0.0.1:8080"  # HOST:PORT of the dashboard (/), /status and /metrics; port 0 picks a free one; "" disables
    http_public: bool = False  # an owned swarm: serve the dashboard and /status to every address, not loopback only
    mode: str = "replica"  # role planning: replica | pipeline | experts
    heartbeat_timeout_s: float = 15.0  # seconds; members silent for longer are evicted
    rebalance_margin: float = 0.2  # pipeline: a peer moves to the slowest stage only if that raises its throughput by this fraction
    keep_checkpoints: int = 3  # how many checkpoints to keep on disk
    owner_public_key: str = ""  # hex Ed25519 public key of the swarm owner; set: Register needs a join token signed by it
    serve_relay: bool = False  # carry streams to nodes behind NATs that name this coordinator as their relay (node --relays)
    private: bool = False  # an owned swarm (swarm_id name@<owner>, see `init`): Register needs a join token signed by the owner's key, this coordinator's identity
    record_interval_s: float = 10.0  # seconds between two refreshes of the coordinator's DHT record
    log_level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR
    run: RunConfig = field(default_factory=RunConfig, metadata={"flatten": True})  # the training run, handed to every member with its role

    def __post_init__(self) -> None:
        check_fields(self, _CHECKS)
        for name, mode in (("num_stages", "pipeline"), ("stage_blocks", "pipeline"), ("expert_shards", "experts")):
            if getattr(self.run, name) and self.mode != mode:
                flag = f"--{name.replace('_', '-')}"
                raise ConfigError(f"{flag} ({name}) is for {mode} mode (--mode {mode}); this coordinator plans {self.mode} mode, which would ignore it")

    def run_config(self) -> dict:
        return self.run.to_dict()

    def resolved_identity(self) -> Path:
        return Path(self.identity) if self.identity else Path(self.data_dir) / "identity.pem"


_CHECKS: dict[str, Check] = {
    "swarm_id": swarm_id, "data_dir": non_empty, "host_maddrs": non_empty, "mode": one_of(*SERVED_MODES),
    "heartbeat_timeout_s": lambda v: positive(v) or (None if v >= MIN_HEARTBEAT_TIMEOUT_S else f"must be at least {MIN_HEARTBEAT_TIMEOUT_S:g} s (nodes heartbeat every 2 s by default; a node whose interval is longer heartbeats every third of the timeout)"), "rebalance_margin": positive, "keep_checkpoints": at_least(1),
    "owner_public_key": lambda v: None if re.fullmatch(r"([0-9a-fA-F]{64})?", v) else "must be 64 hex digits (an Ed25519 public key)",
    "record_interval_s": lambda v: record_ttl(v, 3), "log_level": one_of(*LOG_LEVELS),
}  # fmt: skip


def expert_slots(config: CoordinatorConfig) -> tuple[str, ...]:
    """The planner's slots: experts mode, the shards of the experts ("shard0", ...); a model
    that does not fit its mode is a RunConfigError (a ConfigError) naming it."""
    run = config.run
    if config.mode != "experts":
        if run.is_moe:
            raise RunConfigError(f"model {run.model!r} is a mixture of experts: it trains in experts mode (--mode experts), not {config.mode} mode", "model")
        return ()
    if run.stage_clip != "global":
        raise RunConfigError(f"stage_clip {run.stage_clip!r} is for pipeline mode: in experts mode the trainer clips the whole model's gradient by one norm, the hosts' experts' with its own", "stage_clip")
    if run.expert_shards < 1:
        raise RunConfigError("experts mode needs --expert-shards (how many shards the experts are split into; a host serves one)", "expert_shards")
    if not run.is_hf:
        run.check_experts()
    elif (experts := _hf_experts(config)) is not None:  # (a model without experts: check_model names its type)
        run.check_experts(experts)
    return tuple(f"shard{i}" for i in range(run.expert_shards))


def _hf_experts(c: CoordinatorConfig) -> int | None:
    """Experts per layer of the run's Hugging Face model (its directory, or the files of its pin
    under the data dir); None when it has none or cannot be read (check_model says why)."""
    from node.models.hf import ModelDirError, open_model_dir

    path = _model_path(c)
    if path is None:
        return None
    try:
        experts = getattr(open_model_dir(path).hf_config(), "num_local_experts", None)
    except ModelDirError:
        return None
    return experts if isinstance(experts, int) and not isinstance(experts, bool) else None


def check_model(c: CoordinatorConfig) -> None:
    """A Hugging Face model directory (`--model PATH`): it must open, and its architecture train
    in the run's mode (replica, pipeline and experts modes; in pipeline mode its cut must fit its
    decoder layers). ConfigError naming the problem."""
    run = c.run
    if not run.is_hf or HF_PIN.fullmatch(run.model):
        return
    from node.models.hf import ModelDirError, check_role, open_model_dir
    from node.models.tokens import load_tokenizer

    try:
        model_dir = open_model_dir(Path(run.model).expanduser())
        check_role(model_dir, c.mode)  # (the modes are the roles' families: replica, pipeline, experts)
        load_tokenizer(model_dir)  # (its ids must fit the model's embedding)
    except ModelDirError as e:
        raise RunConfigError(f"model: {e}", "model") from None
    if c.mode == "experts" and model_dir.weights is not None:
        raise RunConfigError(f"model: experts mode trains a Hugging Face model from its config for now; {model_dir.path} holds weights "
                             f"({model_dir.weights.name}) it would not read: give a directory without them", "model")  # fmt: skip
    if c.mode == "pipeline":
        run.stage_plan(cut_dims(c))


def _model_path(c: CoordinatorConfig) -> Path | None:
    """The run's Hugging Face model directory: the one given, or for a pin the files kept under
    DATA_DIR/model (None when they are not there)."""
    from node.state.model_files import local_model_dir

    model = c.run.model
    return local_model_dir(Path(c.data_dir).expanduser() / "model", model) if HF_PIN.fullmatch(model) else Path(model).expanduser()


def cut_dims(c: CoordinatorConfig):
    """What the run's pipeline cut is sized by: None for a preset (its config), a Hugging Face
    model's hf_stages.CutDims (read from its directory, or from the files kept under
    DATA_DIR/model for a pin). RunConfigError when they cannot be read."""
    run = c.run
    if not run.is_hf:
        return None
    from node.models.hf import ModelDirError, open_model_dir
    from node.models.hf_stages import dims_of

    path = _model_path(c)
    if path is None:
        raise RunConfigError(f"model {run.model}: its files are not in {Path(c.data_dir) / 'model'}; give the model's directory", "model")
    try:
        return dims_of(open_model_dir(path))
    except ModelDirError as e:
        raise RunConfigError(f"model: {e}", "model") from None


def context_length(c: CoordinatorConfig) -> int | None:
    """The run's tokens per sample (its model's context), for tokens/s; None when a Hugging Face
    model's config cannot be read here."""
    if not c.run.is_hf:
        return c.run.model_config().context
    from node.models.hf import ModelDirError, context_of, open_model_dir

    path = _model_path(c)
    try:
        return None if path is None else context_of(open_model_dir(path).hf_config())
    except ModelDirError:
        return None


def resolve_model(c: CoordinatorConfig, data: Path) -> RunConfig:
    """The run as members get it: a model directory (checked by check_coordinator, run first)
    replaced by its pin, its config and tokenizer files packed under DATA_DIR/model for nodes to
    fetch (node/state/model_files.py)."""
    run = c.run
    if not run.is_hf:
        return run
    from node.state.model_files import ModelFilesError, local_model_dir, pack_model_files

    root = data / "model"
    if HF_PIN.fullmatch(run.model):
        if local_model_dir(root, run.model) is None:
            raise RunConfigError(f"model {run.model}: its files are not in {root}; give the model's directory", "model")
        return run
    try:
        return dataclasses.replace(run, model=pack_model_files(Path(run.model).expanduser(), root))
    except (ModelFilesError, OSError) as e:
        raise RunConfigError(f"model: {e}", "model") from None


def check_coordinator(c: CoordinatorConfig) -> tuple[Path, SigningKey]:
    """A coordinator's light checks (node/preflight.py's kind: no torch, no hivemind); creates the
    data dir and the identity if missing. Returns the data dir and the identity."""
    if c.mode == "pipeline":  # Coordinator() checks the rest of the plan, the pipeline cut (that needs the model's code) too
        from .planner import PlannerConfig

        try:
            PlannerConfig(mode=c.mode, num_stages=c.run.num_stages, heartbeat_timeout_s=c.heartbeat_timeout_s)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    expert_slots(c)  # a MoE model in experts mode, split into shards that fit it
    check_model(c)
    if c.http:
        check_http(c.http)  # before anything starts, not after p2pd is up
    data = check_data_dir(c.data_dir)
    key = load_identity(c.resolved_identity())
    owner = owner_of(c.swarm_id)
    if c.http_public and (owner is None or not c.http):
        raise ConfigError("--http-public is for an owned swarm's dashboard and /status (they answer loopback only otherwise); "
                          + (f"swarm {c.swarm_id!r} is not owned: they answer every address already" if c.http else "--http is off"))
    if c.private and owner is None:
        raise ConfigError(f"--private needs an owned swarm id (name@<owner peer id>), not {c.swarm_id!r}: `swarmtrain-coordinator init` prints one")
    if owner is not None and peer_id_from_public_key(key.public_key) != owner:
        raise ConfigError(f"swarm {c.swarm_id!r} is owned by {owner}: only a coordinator with that identity may serve it; "
                          f"this identity ({c.resolved_identity()}) is {peer_id_from_public_key(key.public_key)}")  # fmt: skip
    check_maddrs(c.initial_peers, c.host_maddrs, c.announce_maddrs)
    return data, key
