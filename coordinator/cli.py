"""`swarmtrain-coordinator` / `python -m coordinator`: run the coordinator until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import sys

from node.cli import _Parser, run_daemon, setup_logging
from node.config import LOG_LEVELS, ConfigError, load_config
from node.runconfig import ACTIVATION_CODECS, CODECS, INNER_PHASES, STAGE_CLIPS, STAGE_ROUTINGS

from .config import SERVED_MODES, CoordinatorConfig
from .tools import TOOLS, tools_help


def build_parser():
    c = CoordinatorConfig()
    d = c.run
    p = _Parser(prog="swarmtrain-coordinator", description="Track a swarm's members, plan roles, keep checkpoints.", epilog=tools_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below (flag > env > file)")
    p.add_argument("--swarm-id", help=f"swarm to serve (default {c.swarm_id})")
    p.add_argument("--data-dir", metavar="DIR", help=f"registry, checkpoints, identity (default ./{c.data_dir})")
    p.add_argument("--identity", metavar="FILE", help="Ed25519 key file; created if missing (default DATA_DIR/identity.pem)")
    p.add_argument("--host-maddrs", nargs="+", metavar="MADDR", help="libp2p listen addresses (fix the port for restarts)")
    p.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="addresses nodes should dial")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="DHT peers to join")
    p.add_argument("--http", metavar="HOST:PORT", help=f"dashboard (/), /status and /metrics address (default {c.http}; '' disables)")
    p.add_argument("--http-public", action="store_true", default=None, help="an owned swarm: serve the dashboard and /status to every address (default: loopback only; /metrics is never limited)")
    p.add_argument("--mode", choices=SERVED_MODES, help=f"how roles are planned (default {c.mode})")
    p.add_argument("--heartbeat-timeout-s", type=float, help=f"evict members silent this long (default {c.heartbeat_timeout_s})")
    p.add_argument("--rebalance-margin", type=float, metavar="FRACTION", help=f"pipeline: move a peer to the slowest stage only if that raises it by this fraction (default {c.rebalance_margin}; higher: fewer moves)")
    p.add_argument("--keep-checkpoints", type=int, help=f"checkpoints kept on disk (default {c.keep_checkpoints})")
    p.add_argument("--serve-relay", action="store_true", default=None, help="carry streams to nodes behind NATs that name this coordinator as their relay (node --relays)")
    p.add_argument("--private", action="store_true", default=None, help="an owned swarm (see `init`): Register needs a join token signed by the owner's key (`token`)")
    p.add_argument("--owner-public-key", metavar="HEX", help="private swarm of an unowned swarm id: require join tokens signed by this key")
    p.add_argument("--record-interval-s", type=float, help=f"seconds between refreshes of the coordinator's DHT record and revocation list (default {c.record_interval_s})")
    p.add_argument("--log-level", choices=LOG_LEVELS)
    run = p.add_argument_group("the training run (handed to every member)")
    run.add_argument("--model", metavar="PRESET|DIR", help=f"model preset: tiny | small; experts mode: tiny-moe | small-moe; or a local Hugging Face model directory (any causal LM on replicas; GPT-2, Llama, Qwen2, Mistral in pipeline mode; Mixtral in experts mode; its config and tokenizer files travel to the nodes) (default {d.model})")
    run.add_argument("--inner-steps", type=int, help=f"H: inner steps per outer step (default {d.inner_steps})")
    run.add_argument("--batch-size", type=int, help=f"sequences per inner step per replica (default {d.batch_size})")
    run.add_argument("--inner-lr", type=float, help=f"peak AdamW learning rate (default {d.inner_lr})")
    run.add_argument("--warmup-steps", type=int, help=f"inner warmup steps (default {d.warmup_steps})")
    run.add_argument("--total-steps", type=int, help=f"inner steps of cosine decay (default {d.total_steps})")
    run.add_argument("--outer-lr", type=float, help=f"outer Nesterov learning rate (default {d.outer_lr})")
    run.add_argument("--outer-momentum", type=float, help=f"outer momentum (default {d.outer_momentum})")
    run.add_argument("--codec", choices=CODECS, help=f"pseudo-gradient codec (default {d.codec})")
    run.add_argument("--block-size", type=int, help=f"int8 block size (default {d.block_size})")
    run.add_argument("--sparse-density", type=float, metavar="FRACTION", help=f"sparse codec: fraction of each chunk's values sent, the largest (default {d.sparse_density})")
    run.add_argument("--sparse-bits", type=int, help=f"sparse codec: bits per sent value, a sign and bits - 1 of level (default {d.sparse_bits})")
    run.add_argument("--sparse-chunk", type=int, help=f"sparse codec: elements per chunk, each sending its own largest values (default {d.sparse_chunk})")
    run.add_argument("--max-outer-steps", type=int, help="stop training after this many outer steps (default: never)")
    run.add_argument("--checkpoint-every", type=int, help=f"outer steps between checkpoints (default {d.checkpoint_every})")
    run.add_argument("--eval-batches", type=int, help=f"validation batches per outer step (default {d.eval_batches})")
    run.add_argument("--seed", type=int, help=f"init and data seed (default {d.seed})")
    run.add_argument("--join-timeout-s", type=float, help=f"how long a round waits for late replicas (default {d.join_timeout_s})")
    run.add_argument("--min-replicas", type=int, help=f"replicas to wait for before training starts, and the fewest that take an outer step (1: a lone replica trains on its own; default {d.min_replicas})")
    run.add_argument("--fragments", type=int, help=f"replicas average the model in this many fragments, one at a time, each while the inner steps go on (at most --inner-steps; 1: all at once, training paused meanwhile; default {d.fragments})")
    run.add_argument("--inner-phase", choices=INNER_PHASES, help=f"steps: every replica takes --inner-steps per outer step, and a round waits for the slowest; time: a replica stops early once half of the replicas wait to average (a slower one takes fewer steps, its pseudo-gradient weighed by its samples) (default {d.inner_phase})")
    pipe = p.add_argument_group("the pipeline (--mode pipeline)")
    pipe.add_argument("--num-stages", type=int, help="stages the model is cut into; each holds at least one block")
    pipe.add_argument("--stage-blocks", metavar="N,N,...", help="blocks per stage, e.g. 2,1,1 (default: spread evenly)")
    pipe.add_argument("--activation-codec", choices=ACTIVATION_CODECS, help=f"how activations travel between stages (default {d.activation_codec})")
    pipe.add_argument("--stage-step-samples", type=int, help=f"samples per optimizer step of a stage server (default {d.stage_step_samples})")
    pipe.add_argument("--micro-batches-in-flight", type=int, help=f"micro-batches a trainer keeps in the pipeline (default {d.micro_batches_in_flight})")
    pipe.add_argument("--synchronous-steps", action="store_true", default=None, help="a trainer starts a step's micro-batches only once the previous step's came back (one trainer: synchronous pipeline training)")
    pipe.add_argument("--stage-routing", choices=STAGE_ROUTINGS, help=f"through: stages hand activations on to each other; relay: through the trainer, stage by stage (default {d.stage_routing})")
    pipe.add_argument("--stage-clip", choices=STAGE_CLIPS, help=f"global: clip a step's gradient by the whole model's norm, as one process does (stages wait for each other's norms); stage: each stage by its own norm, as torch.distributed.pipelining's ranks do (default {d.stage_clip})")
    pipe.add_argument("--stage-sync-every-s", type=float, help=f"seconds between two synchronisations of a stage's peers (default {d.stage_sync_every_s})")
    pipe.add_argument("--stage-outer-momentum", type=float, help="outer momentum of those syncs (default 0: plain parameter averaging)")
    pipe.add_argument("--audit-fraction", type=float, metavar="FRACTION", help=f"trainers send this fraction of their calls to a second peer of the stage or shard too, and ban a peer caught answering wrong (0: never; default {d.audit_fraction})")
    moe = p.add_argument_group("the experts (--mode experts, a -moe model); the stage settings above apply to expert hosts too")
    moe.add_argument("--expert-shards", type=int, help="shards the experts are split into; a host serves one (expert e of every layer: shard e mod N)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:  # the owner's tools (coordinator/tools.py)
        from .tools import run_tool

        return run_tool(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    cli = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        config = load_config(cli, args.config, cls=CoordinatorConfig, env_prefix="SWARMTRAIN_COORDINATOR_")
        from .config import check_coordinator

        check_coordinator(config)  # files, addresses, ports: before torch and hivemind load (seconds)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    # heavy imports (torch, hivemind) only once the flags, the config file and the checks above are good
    from .checkpoints import CheckpointError
    from .registry import RegistryError
    from .service import Coordinator

    return run_daemon(lambda: Coordinator(config), fatal_errors=(RegistryError, CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
