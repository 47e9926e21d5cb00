"""The node daemon.

Files:
    p2p.py               the only hivemind import: p2pd + DHT host, streams, DHT get/store
    transport.py         RPC over libp2p streams (unary, server/client streaming), limits, peer scores
    membership.py        find the coordinator, register, heartbeat, publish signed member records
    dht_records.py       the DHT's record validator: only valid, owner-signed records under the swarm's keys
    gate.py              an owned swarm's membership gate: certificates presented, checked before every call
    relay.py             relay hops to peers nobody can dial (behind a NAT): hello, splice, nonces
    compat.py            each touch of a library's private internals (asyncio, hivemind), version-stamped
    averaging/           fault-tolerant compressed all-reduce, one averager per namespace (its
                         __init__ maps its files: matchmaking, round, schedule, buffers, decisions)
    aggregators.py       mean, trimmed mean, CenteredClip: how a slice owner combines contributions
    faults.py            typed fault injection (corrupt / delay outgoing parts) for tests and drills
    roles.py             the role interface (start, run, stop(planned)) and the runner that switches roles
    replica.py           the replica role: DiLoCo rounds, catch-up, state serving, checkpoints
    stages.py            the built-in GPT cut into pipeline stages (plan_stages, Stage)
    pipeline.py          the stage server and trainer roles: stage calls, retries, stage syncs
    pause.py             PauseWatch: notices this process was frozen (a jump of the clocks between ticks)
    model.py             the built-in GPT (presets tiny, small)
    data.py              the built-in corpus (Python's stdlib sources) or --data, shards, evaluation
    diloco.py            inner/outer optimizers, state hash, a one-process DiLoCo simulation
    checkpoint_dir.py    the checkpoint directory format: write, verify, place atomically, load,
                         temp dirs (shared with the coordinator's store)
    checkpoint_client.py download / upload checkpoints between peers, verified
    state_server.py      serve checkpoint directories over RPC (replicas and the coordinator)
    capabilities.py      device, memory, FLOP/s probe
    osutil.py            fsync, hashing, /proc helpers, a cancellable event wait
    config.py            NodeConfig, its [averager] / [transport] tables, the flag > env > file merge
    runconfig.py         RunConfig: the training run's settings, coordinator -> members
    daemon.py            Node: start/stop of all of the above; which role object an assignment makes
    cli.py               swarmtrain-node
    demo.py              a local swarm (coordinator + replicas) that trains and stops by itself
"""
