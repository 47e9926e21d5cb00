"""The net layer: how a node reaches its peers. It imports neither averaging nor roles.

Files:
    host.py          the only module that imports hivemind: p2pd + DHT host, streams, DHT get/store,
                     and the DHT's validator of the swarm's records (`SwarmRecords`)
    addresses.py     multiaddr helpers (standard library only)
    transport.py     RPC over libp2p streams (unary, server/client streaming), limits, peer scores;
                     a handler registry with one owner per message type
    direct.py        the direct data plane: bulk pipes over sealed TCP where a peer can be reached
    relay.py         relay hops to peers nobody can dial (behind a NAT): hello, splice, nonces
    gate.py          an owned swarm's membership gate: certificates presented, checked before every call
    membership.py    find the coordinator, register, heartbeat, publish signed member records; read them
    compat.py        each touch of a library's private internals (asyncio, hivemind), version-stamped

Nothing here is imported at package import: the CLI's checks read `addresses` and `relay` before
torch or hivemind load.
"""
