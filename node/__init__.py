"""The node daemon.

Files:
    p2p.py           the only hivemind import: p2pd + DHT host, streams, DHT get/store
    transport.py     RPC over libp2p streams (unary, server/client streaming), limits, peer scores
    membership.py    find the coordinator, register, heartbeat, publish signed member records
    capabilities.py  device, memory, FLOP/s probe
    config.py        NodeConfig and the flag > env > file merge
    daemon.py        Node: start/stop of all of the above
    cli.py           swarmtrain-node
"""
