"""The coordinator: tracks membership, plans roles, keeps checkpoints. Never in the data path.

Files:
    config.py       CoordinatorConfig: every setting with its meaning and unit; the run's
                    settings nested as node/runconfig.py's RunConfig (sent to every member)
    planner.py      pure decisions: evict(now, members, config), plan_roles(members, config)
    registry.py     SQLite registry of members, plan epoch and the history tables (restart-safe);
                    AsyncRegistry runs it on one thread of its own, off the event loop, in order
    history.py      pure decisions of the swarm's history: a loss point per outer step (replicas)
                    or per interval (trainers), throughput per interval, thinning with age (a day
                    stays a bounded number of rows), how many events a peer may add
    journal.py      the history in the registry file (progress, throughput, events) and the
                    Recorder that fills it from heartbeats, on the registry's thread
    checkpoints.py  the checkpoint store: keep-K, a verdict cache, uploads; the directory format
                    itself is node/state/checkpoint_dir.py, shared with nodes
    expert_stores.py  experts mode: each shard's and the trainers' dense parts' stores, their hash reports
    service.py      the RPC handlers, eviction loop, DHT record; glue between the above
    status.py       what /status shows of the members, stages, shards and checkpoints (pure)
    http.py         GET / (the dashboard: dashboard/), GET /status (JSON: members, history,
                    events) and GET /metrics (Prometheus); loopback only for an owned swarm
    cli.py          swarmtrain-coordinator
"""
