"""The node daemon, as a few packages (each maps its own files in its __init__):

    net/          how a node reaches its peers: libp2p host (the only hivemind import), RPC
                  transport, the direct data plane, relays, the member gate, membership
    averaging/    the fault-tolerant compressed all-reduce, one averager per namespace
    roles/        the work a node does (replica, stage, expert, trainer), built from shared parts,
                  and the registry that maps an assignment to its role
    state/        checkpoint directories and their transfers between peers
    models/       the built-in GPT and MoE, how each is cut into stages, data, optimizers

and the process itself:

    daemon.py        Node: start/stop of all of the above; an assignment becomes a role (roles/registry.py)
    cli.py           swarmtrain-node
    model_cli.py     swarmtrain-model: export a checkpoint as a Hugging Face directory, sample, eval
    model_source.py  what its --checkpoint PATH names (a replica's checkpoint, or a pipeline's stages), as one model
    experts_export.py  its export of an experts run: every shard's and the dense parts' checkpoints
    config.py        NodeConfig, its [averager] / [transport] tables, the flag > env > file merge
    config_checks.py the checks across settings (and of SWARMTRAIN_* variables that name none)
    runconfig.py     RunConfig: the training run's settings, coordinator -> members
    preflight.py     the checks of a node's settings that need neither torch nor hivemind
    capabilities.py  device, memory, FLOP/s probe
    activity.py      what the role is doing (steps, rounds, queues, rates): one object roles update
    metrics.py       --http: GET /metrics (Prometheus) and GET /status (JSON) of this node
    progress_line.py the live line in a terminal (plain log lines elsewhere) while a role trains
    osutil.py        fsync, hashing, /proc helpers, a cancellable event wait
    demo.py          a local swarm (coordinator + replicas, or a pipeline, or experts) that trains and stops by itself

Import rules (tests/test_layers.py walks them): net imports neither averaging nor roles;
averaging never imports roles; state never imports roles; models import no network code; only
net/host.py imports hivemind; nothing in node imports coordinator.
"""
