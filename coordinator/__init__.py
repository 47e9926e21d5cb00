"""The coordinator: tracks membership, plans roles, keeps checkpoints. Never in the data path.

Files:
    config.py       CoordinatorConfig: every setting with its meaning and unit
    planner.py      pure decisions: evict(now, members, config), plan_roles(members, config)
    registry.py     SQLite registry of members, plan epoch, progress history (restart-safe)
    checkpoints.py  safetensors checkpoints + signed manifests, atomic writes, keep-K, uploads
    service.py      the RPC handlers, eviction loop, DHT record; glue between the above
    http.py         GET /status (JSON) and GET /metrics (Prometheus)
    cli.py          swarmtrain-coordinator
"""
