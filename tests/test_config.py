"""The typed configs: RunConfig (checked like a wire message, JSON driven by its type hints),
the node's and the coordinator's configs and how a TOML file, env vars and flags map onto them."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import pytest

from coordinator.config import CoordinatorConfig
from node.config import AGGREGATORS, GATHER_CODECS, AveragerSettings, ConfigError, NodeConfig, TransportSettings, averager_config, load_config, transport_config
from node.runconfig import CODECS, INT8_BLOCK_SIZES, MODEL_PRESETS, MOE_EXPERTS, SPARSE_BITS, SPARSE_CHUNKS, RunConfig, RunConfigError


def _load(tmp_path, toml: str = "", env: dict[str, str] | None = None, cli: dict | None = None, **kw):
    path = None
    if toml:
        path = tmp_path / "c.toml"
        path.write_text(toml)
    return load_config(cli or {}, str(path) if path else None, env=env or {}, **kw)


def _load_coordinator(tmp_path, toml: str = "", env: dict[str, str] | None = None, cli: dict | None = None):
    return _load(tmp_path, toml, env, cli, cls=CoordinatorConfig, env_prefix="SWARMTRAIN_COORDINATOR_")


# ---- RunConfig -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RunWithFlag(RunConfig):
    """A run config of a later version, with a bool field: the JSON form follows the hints."""

    exact: bool = False  # a yes/no setting


def test_run_config_round_trips_through_json():
    cfg = RunConfig(model="small", inner_steps=7, outer_lr=0.5, codec="fp16", join_timeout_s=3)
    assert RunConfig.from_json(cfg.to_json()) == cfg
    assert isinstance(cfg.join_timeout_s, float)  # an int where a float is meant is stored as a float
    flagged = _RunWithFlag(exact=True, seed=3)
    back = _RunWithFlag.from_json(flagged.to_json())
    assert back == flagged and back.exact is True
    assert json.loads(flagged.to_json())["exact"] is True
    with pytest.raises(RunConfigError, match=r"exact must be bool, got 1"):
        _RunWithFlag.from_json(json.dumps({"exact": 1}).encode())


def test_run_config_ignores_unknown_keys():
    # a newer coordinator may send settings this version does not know
    assert RunConfig.from_json(json.dumps({"inner_steps": 3, "future_knob": [1, 2]}).encode()) == RunConfig(inner_steps=3)
    # and an older node reads a newer node's config the same way
    assert RunConfig.from_json(_RunWithFlag(exact=True).to_json()) == RunConfig()


BAD_RUN_FIELDS = [
    ("model", "huge"), ("model", 3), ("inner_steps", 0), ("inner_steps", 2.0), ("inner_steps", True), ("inner_steps", "7"),
    ("batch_size", 0), ("inner_lr", 0.0), ("inner_lr", math.nan), ("inner_lr", math.inf), ("warmup_steps", -1),
    ("total_steps", 0), ("outer_lr", -1.0), ("outer_momentum", 1.0), ("outer_momentum", -0.1), ("codec", "zip"),
    ("block_size", INT8_BLOCK_SIZES[0] - 1), ("block_size", INT8_BLOCK_SIZES[1] + 1), ("max_outer_steps", -1),
    ("sparse_density", 0.0), ("sparse_density", 1.5), ("sparse_bits", 0), ("sparse_bits", 9), ("sparse_chunk", 8),
    ("checkpoint_every", 0), ("eval_batches", 0), ("seed", -1), ("join_timeout_s", 0), ("join_timeout_s", None),
    ("min_replicas", 0), ("outer_lr", 10**400), ("stage_routing", "mail"), ("stage_clip", "none"), ("synchronous_steps", "yes"), ("synchronous_steps", 1),
]  # fmt: skip


@pytest.mark.parametrize("name,value", BAD_RUN_FIELDS)
def test_each_bad_run_field_is_named(name, value):
    with pytest.raises(RunConfigError) as e:
        RunConfig(**{name: value})
    assert e.value.setting == name and str(e.value).startswith(f"{name} ")
    assert repr(value)[:20] in str(e.value) or str(value) in str(e.value)
    with pytest.raises(RunConfigError, match=f"^run config: {name} ") as e:
        RunConfig.from_json(json.dumps({name: value}).encode())
    assert e.value.setting == name


def test_every_run_field_has_a_bounds_check():
    from node import runconfig

    assert set(runconfig._CHECKS) == {f.name for f in dataclasses.fields(RunConfig)}


def test_run_config_names_match_the_registries():
    from node.models.gpt import PRESETS
    from node.models.moe import MOE_PRESETS
    from protocol import make_codec, sparse
    from protocol.codecs import Codec, Int8Codec

    assert MODEL_PRESETS == (*PRESETS, *MOE_PRESETS)
    assert MOE_EXPERTS == {name: moe.num_experts for name, (_, moe) in MOE_PRESETS.items()}
    assert set(CODECS) == set(Codec.codecs)
    assert INT8_BLOCK_SIZES == (Int8Codec.MIN_BLOCK, Int8Codec.MAX_BLOCK)
    assert SPARSE_BITS == (1, sparse.MAX_BITS) and SPARSE_CHUNKS == (sparse.MIN_CHUNK, sparse.MAX_CHUNK)
    for codec in CODECS:  # the run's params for its codec build it
        run = RunConfig(codec=codec)
        assert make_codec(codec, **run.codec_params()).params() == {**make_codec(codec).params(), **run.codec_params()}


def test_train_config_defaults_are_the_runs():
    from node.models.diloco import TrainConfig

    run, train = RunConfig(), TrainConfig()
    shared = [f.name for f in dataclasses.fields(TrainConfig) if hasattr(run, f.name)]
    assert len(shared) == 8
    assert all(getattr(train, n) == getattr(run, n) for n in shared)
    assert RunConfig(inner_steps=9, seed=4).train_config() == TrainConfig(inner_steps=9, seed=4)


# ---- the node's config -----------------------------------------------------------------------------


def test_averager_and_transport_tables_env_vars_and_flags(tmp_path):
    toml = """
swarm_id = "s"
[averager]
aggregator = "trimmed_mean"
trim = 1
min_group_size = 3
pace = false
[transport]
ban_s = 5
direct_congestion = ""
"""
    env = {"SWARMTRAIN_AVERAGER_MIN_GROUP_SIZE": "4", "SWARMTRAIN_TRANSPORT_CALL_TIMEOUT_S": "20", "SWARMTRAIN_AVERAGER_PACE": "yes"}
    c = _load(tmp_path, toml, env, {"averager.min_group_size": 5, "averager.aggregator": None})
    assert c.averager == AveragerSettings(aggregator="trimmed_mean", trim=1, min_group_size=5, pace=True)
    assert c.transport == TransportSettings(ban_s=5.0, call_timeout_s=20.0, direct_congestion="")
    avg = averager_config(c, namespace="replicas", codec="int8", codec_params={"block_size": 1024}, join_timeout_s=7.0)
    assert (avg.aggregator, avg.aggregator_params, avg.min_group_size, avg.pace) == ("trimmed_mean", {"trim": 1}, 5, True)
    assert (avg.codec, avg.join_timeout_s) == ("int8", 7.0)  # the run's settings win
    tc = transport_config(dataclasses.replace(c, direct_port=-1))
    assert (tc.ban_s, tc.call_timeout_s, tc.direct_congestion, tc.direct) == (5.0, 20.0, "", False)


def test_unset_settings_keep_the_components_defaults():
    from node.averaging import AveragerConfig
    from node.net.transport import TransportConfig

    c = NodeConfig()
    assert averager_config(c) == AveragerConfig()
    assert transport_config(c) == TransportConfig()
    # an empty env var (as compose passes `${X:-}`) leaves an optional setting unset
    assert load_config({}, None, env={"SWARMTRAIN_AVERAGER_AGGREGATOR": ""}).averager == AveragerSettings()


def test_every_offered_setting_reaches_its_component():
    from node.averaging import AveragerConfig
    from node.net.transport import TransportConfig

    averager = {f.name for f in dataclasses.fields(AveragerConfig)}
    offered = {f.name for f in dataclasses.fields(AveragerSettings)} - {"trim", "tau"}
    assert offered <= averager - {"codec", "codec_params", "join_timeout_s", "bandwidth", "swarm_id", "namespace"}
    assert {f.name for f in dataclasses.fields(TransportSettings)} <= {f.name for f in dataclasses.fields(TransportConfig)}
    from node.averaging.aggregators import AGGREGATORS as REAL

    assert AGGREGATORS == tuple(REAL)
    assert set(GATHER_CODECS) <= set(CODECS)


@pytest.mark.parametrize(
    "toml,env,cli,expect",
    [
        ("", {}, {"bandwidth_mbps": -5.0}, "--bandwidth-mbps: bandwidth_mbps must be ≥ 0"),
        ("", {}, {"threads": -1}, "--threads: threads must be ≥ 0"),
        ("", {}, {"shard_index": 3, "num_shards": 3}, "--shard-index: shard_index must be < num_shards (3), got 3"),
        ("", {}, {"shard_index": -2}, "--shard-index: shard_index must be ≥ -1"),
        ("", {}, {"num_shards": 0}, "--num-shards: num_shards must be ≥ 1"),
        ("", {}, {"heartbeat_interval_s": 0.0}, "--heartbeat-interval-s: heartbeat_interval_s must be > 0"),
        ("", {}, {"direct_port": 70000}, "--direct-port: direct_port must be a TCP port"),
        ("", {"SWARMTRAIN_RECORD_TTL_S": "inf"}, {}, "env SWARMTRAIN_RECORD_TTL_S: record_ttl_s must be > 0 and finite"),
        ("num_shards = 2.5\n", {}, {}, "num_shards must be int, got 2.5"),
        ("[averager]\nmin_group_size = 0\n", {}, {}, "c.toml [averager]: min_group_size must be ≥ 1, got 0"),
        ("[averager]\ntrim = 1\n", {}, {}, "c.toml [averager]: trim applies to aggregator 'trimmed_mean' only"),
        ("[averager]\nmax_abs = -1.0\n", {}, {}, "max_abs must be > 0"),
        ("[averager]\ncolour = 1\n", {}, {}, "unknown setting 'colour' in [averager]"),
        ("averager = 3\n", {}, {}, "averager must be a table"),
        ("", {"SWARMTRAIN_AVERAGER_AGGREGATOR": "median"}, {}, "env SWARMTRAIN_AVERAGER_AGGREGATOR: aggregator must be one of"),
        ("", {"SWARMTRAIN_AVERAGER_GATHER_CODEC": "topk"}, {}, "gather_codec must be one of"),
        ("", {"SWARMTRAIN_TRANSPORT_MAX_CONCURRENT_PER_PEER": "0"}, {}, "max_concurrent_per_peer must be ≥ 1"),
        ("[transport]\nhandler_timeout_s = nan\n", {}, {}, "c.toml [transport]: handler_timeout_s must be > 0 and finite"),
        ("[transport]\ndirect_congestion = \"no such; thing\"\n", {}, {}, "direct_congestion must be a congestion control name"),
    ],
)
def test_bad_node_settings_are_named_with_their_source(tmp_path, toml, env, cli, expect):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, toml, env, cli)
    assert expect in str(e.value)


def test_precedence_is_flag_env_file_default(tmp_path):
    toml = 'heartbeat_interval_s = 3.0\n[transport]\nban_s = 1.0\n'
    assert _load(tmp_path, toml).heartbeat_interval_s == 3.0
    assert _load(tmp_path, toml, {"SWARMTRAIN_HEARTBEAT_INTERVAL_S": "4"}).heartbeat_interval_s == 4.0
    c = _load(tmp_path, toml, {"SWARMTRAIN_HEARTBEAT_INTERVAL_S": "4", "SWARMTRAIN_TRANSPORT_BAN_S": "2"}, {"heartbeat_interval_s": 5.0})
    assert (c.heartbeat_interval_s, c.transport.ban_s) == (5.0, 2.0)


def test_frame_sized_in_flight_limit_is_checked_against_the_transport():
    c = NodeConfig(transport=TransportSettings(max_bytes_in_flight_per_peer=1000))
    with pytest.raises(ConfigError, match="max_bytes_in_flight_per_peer must be at least the frame size limit"):
        transport_config(c)


# ---- the coordinator's config ----------------------------------------------------------------------


def test_the_coordinator_nests_the_run_config(tmp_path):
    c = _load_coordinator(tmp_path, "inner_steps = 7\nmode = \"replica\"\n", {"SWARMTRAIN_COORDINATOR_CODEC": "fp16"}, {"outer_lr": 0.5})
    assert c.run == RunConfig(inner_steps=7, codec="fp16", outer_lr=0.5)
    assert RunConfig.from_json(json.dumps(c.run_config(), sort_keys=True).encode()) == c.run
    assert CoordinatorConfig().run == RunConfig()


def test_the_coordinators_planner_takes_its_rebalance_margin(tmp_path):
    from coordinator.service import Coordinator

    c = _load_coordinator(tmp_path, "mode = \"pipeline\"\nnum_stages = 2\n", {}, {"rebalance_margin": 3.0})
    assert Coordinator(c).planner.rebalance_margin == 3.0
    assert Coordinator(CoordinatorConfig(mode="pipeline", run=RunConfig(num_stages=2))).planner.rebalance_margin == 0.2


@pytest.mark.parametrize(
    "toml,env,cli,expect",
    [
        ("", {}, {"inner_steps": 0}, "--inner-steps: inner_steps must be ≥ 1, got 0"),
        ("join_timeout_s = -1\n", {}, {}, "c.toml: join_timeout_s must be > 0 and finite, got -1.0"),
        ("", {"SWARMTRAIN_COORDINATOR_MODEL": "huge"}, {}, "env SWARMTRAIN_COORDINATOR_MODEL: model is an unknown model preset"),
        ("", {}, {"heartbeat_timeout_s": 0.0}, "--heartbeat-timeout-s: heartbeat_timeout_s must be > 0"),
        ("rebalance_margin = -0.5\n", {}, {}, "c.toml: rebalance_margin must be > 0"),
        ("", {}, {"keep_checkpoints": 0}, "--keep-checkpoints: keep_checkpoints must be ≥ 1"),
        ("", {}, {"owner_public_key": "abc"}, "--owner-public-key: owner_public_key must be 64 hex digits"),
        ("", {}, {"num_stages": -1}, "--num-stages: num_stages must be ≥ 0"),
        ("run = 3\n", {}, {}, "unknown setting 'run'"),
        ('mode = "anarchy"\n', {}, {}, "c.toml: mode must be one of 'replica', 'pipeline', 'experts'"),
        ('experts = ["e0"]\n', {}, {}, "unknown setting 'experts'"),  # the shards come from --expert-shards
        ("", {}, {"expert_shards": -1}, "--expert-shards: expert_shards must be ≥ 0"),
    ],
)
def test_bad_coordinator_settings_are_named_with_their_source(tmp_path, toml, env, cli, expect):
    with pytest.raises(ConfigError) as e:
        _load_coordinator(tmp_path, toml, env, cli)
    assert expect in str(e.value)


@pytest.mark.parametrize(
    "announced,peers,warned",
    [
        (["/ip4/192.168.1.5/tcp/4001"], ["/ip4/8.8.8.8/tcp/31337/p2p/X"], True),  # a home LAN address to a public swarm
        (["/ip4/127.0.0.1/tcp/4001"], ["/ip4/8.8.8.8/tcp/31337/p2p/X"], True),
        (["/ip4/192.168.1.5/tcp/4001", "/ip4/8.8.4.4/tcp/4001"], ["/ip4/8.8.8.8/tcp/31337/p2p/X"], False),  # its public address too
        (["/ip4/8.8.8.8/tcp/1/p2p/R/p2p-circuit/p2p/Y", "/ip4/192.168.1.5/tcp/4001"], ["/ip4/8.8.8.8/tcp/31337/p2p/X"], False),  # through a relay
        (["/ip4/192.168.1.5/tcp/4001"], ["/ip4/192.168.1.1/tcp/31337/p2p/X"], False),  # a private swarm on the LAN
        (["/ip4/127.0.0.1/tcp/4001"], [], False),  # a swarm of its own
    ],
)
def test_announcing_a_private_address_to_a_public_swarm_is_warned_about(announced, peers, warned):
    from node.preflight import announce_warning

    w = announce_warning(announced, peers)
    assert (w is not None) == warned, w
    assert not warned or ("cannot dial us" in w and "--announce-maddrs" in w)


def test_a_join_token_names_the_swarm_a_node_joins():
    from protocol import SigningKey
    from protocol.signatures import peer_id_from_public_key
    from protocol.tokens import issue_token

    owner = SigningKey.generate()
    swarm = f"lab@{peer_id_from_public_key(owner.public_key)}"
    token = issue_token(owner, swarm).to_text()
    assert NodeConfig(token=token).swarm_id == swarm  # no --swarm-id: the token's
    assert NodeConfig(token=token, swarm_id=swarm).swarm_id == swarm
    assert NodeConfig().swarm_id == "swarmtrain"  # neither: the default swarm
    with pytest.raises(ConfigError, match=f"--token is a join token of swarm '{swarm}', not of --swarm-id 'other'"):
        NodeConfig(token=token, swarm_id="other")


def test_a_config_file_string_is_never_a_number_or_a_flag(tmp_path):
    for toml, expect in (('num_shards = "5"\n', "num_shards must be int, got '5'"), ('bandwidth_mbps = "100"\n', "bandwidth_mbps must be float"),
                         ('client_mode = "true"\n', "client_mode must be bool"), ('initial_peers = "/ip4/1.2.3.4/tcp/1/p2p/X"\n', "initial_peers must be a list of str")):  # fmt: skip
        with pytest.raises(ConfigError, match=expect):
            _load(tmp_path, toml)
    assert _load(tmp_path, "num_shards = 5\nbandwidth_mbps = 100\n").bandwidth_mbps == 100.0
    assert _load(tmp_path, env={"SWARMTRAIN_NUM_SHARDS": "5"}).num_shards == 5  # (the environment holds only strings)


def test_a_misspelt_environment_variable_is_refused_with_the_setting_it_nearly_names(tmp_path):
    with pytest.raises(ConfigError, match="env SWARMTRAIN_AVERAGER_PACE_SHAR is no setting: did you mean SWARMTRAIN_AVERAGER_PACE_SHARE"):
        _load(tmp_path, env={"SWARMTRAIN_AVERAGER_PACE_SHAR": "0.5"})
    # other tools' variables (compose's) and the coordinator's are no node's business
    assert _load(tmp_path, env={"SWARMTRAIN_IMAGE": "x", "SWARMTRAIN_COORDINATOR_INNER_STEP": "5", "SWARMTRAIN_OWNER_PUBLIC_KEY": ""}).swarm_id == "swarmtrain"
    with pytest.raises(ConfigError, match="did you mean SWARMTRAIN_COORDINATOR_INNER_STEPS"):
        _load_coordinator(tmp_path, env={"SWARMTRAIN_COORDINATOR_INNER_STEP": "5"})


def test_settings_that_cannot_work_together_are_refused_naming_both():
    from node.config_checks import check_node_settings

    peers = ("/ip4/127.0.0.1/tcp/1/p2p/X",)
    check_node_settings(NodeConfig(initial_peers=peers, threads=2), cores=2)  # all fine
    for config, cores, expect in (
        (NodeConfig(initial_peers=peers, client_mode=True, serve_relay=True), 2, "--serve-relay .* --client-mode"),
        (NodeConfig(initial_peers=peers, record_ttl_s=5, heartbeat_interval_s=10), 2, "--record-ttl-s 5 is shorter than --heartbeat-interval-s 10"),
        (NodeConfig(initial_peers=peers, threads=3), 2, "--threads 3: this process may run on 2 cores"),
        (NodeConfig(), 2, "no --initial-peers"),
    ):
        with pytest.raises(ConfigError, match=expect):
            check_node_settings(config, cores)
    check_node_settings(NodeConfig(coordinator="/ip4/127.0.0.1/tcp/1/p2p/X"), cores=2)  # the coordinator alone: its DHT is joined through it
    with pytest.raises(ConfigError, match="warmup_steps .100. must not exceed total_steps .10."):
        RunConfig(warmup_steps=100, total_steps=10)
    for mode, run in (("replica", RunConfig(num_stages=2)), ("experts", RunConfig(model="tiny-moe", expert_shards=2, num_stages=2)), ("pipeline", RunConfig(num_stages=2, expert_shards=2))):
        with pytest.raises(ConfigError, match="is for (pipeline|experts) mode"):
            CoordinatorConfig(mode=mode, run=run)


def test_a_node_heartbeats_within_the_coordinator_s_timeout():
    from node.net.membership import Membership

    m = Membership(None, None, NodeConfig(heartbeat_interval_s=10.0), {})
    m._heed_timeout(json.dumps({"inner_steps": 5, "heartbeat_timeout_s": 6.0}).encode())
    assert m.interval == 2.0  # a third of the coordinator's timeout: never evicted between two heartbeats
    m._heed_timeout(json.dumps({"heartbeat_timeout_s": 60.0}).encode())
    assert m.interval == 10.0  # its own, well within
    m._heed_timeout(b"{}")  # an older coordinator's: says nothing
    assert m.interval == 10.0
