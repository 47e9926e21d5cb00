"""The node daemon.

Files:
    p2p.py               the only hivemind import: p2pd + DHT host, streams, DHT get/store
    transport.py         RPC over libp2p streams (unary, server/client streaming), limits, peer scores
    membership.py        find the coordinator, register, heartbeat, publish signed member records
    averaging.py         fault-tolerant compressed all-reduce (matchmaking, butterfly, decisions)
    aggregators.py       mean, trimmed mean, CenteredClip: how a slice owner combines contributions
    faults.py            typed fault injection (corrupt / delay outgoing parts) for tests and drills
    replica.py           the replica role: DiLoCo rounds, catch-up, state serving, checkpoints
    model.py             the built-in GPT (presets tiny, small)
    data.py              the built-in corpus (Python's stdlib sources) or --data, shards, evaluation
    diloco.py            inner/outer optimizers, state hash, a one-process DiLoCo simulation
    checkpoint_client.py download / upload / write / load checkpoint directories, verified
    state_server.py      serve checkpoint directories over RPC (replicas and the coordinator)
    capabilities.py      device, memory, FLOP/s probe
    osutil.py            fsync, hashing, /proc helpers
    config.py            NodeConfig and the flag > env > file merge
    daemon.py            Node: start/stop of all of the above
    cli.py               swarmtrain-node
    demo.py              a local swarm (coordinator + replicas) that trains and stops by itself
"""
