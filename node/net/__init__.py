"""The net layer: how a node reaches its peers. It imports neither averaging nor roles.

Files:
    host.py          the only module that imports hivemind: p2pd + DHT host, streams, DHT get/store,
                     and the DHT's validator of the swarm's records (`SwarmRecords`)
    addresses.py     multiaddr helpers (standard library only)
    transport.py     `Transport`: the facade for RPC over libp2p streams (unary, server/client
                     streaming); a handler registry with one owner per message type; composes:
    rpc.py           what both sides share: protocols, `TransportConfig`, the errors, `CallContext`,
                     `PeerScores` (bans for bad input)
    streams.py       frames on a stream: `FrameReader` (read straight into the decoder), write, close
    serving.py       `Server`: calls peers open with us (limits, gate, refusals), relayed streams,
                     relay hops
    dialing.py       `Dialer`: opening streams (companions beside a hanging open, through relays) and
                     the route check before dialing a peer that stopped answering
    pipes.py         `Pipes`: streams kept open between bulk calls, direct TCP where possible, pacing
    presenting.py    `Presenter`: our membership certificate, presented once to each peer we call
    direct.py        the direct data plane: bulk pipes over sealed TCP where a peer can be reached
    relay.py         relay hops to peers nobody can dial (behind a NAT): hello, splice, nonces
    gate.py          an owned swarm's membership gate: certificates presented, checked before every call
    membership.py    find the coordinator, register, heartbeat, publish signed member records; read them
    traffic.py       `Traffic`: bytes moved by plane (libp2p, direct, relayed), peer and direction; a `Meter` per stream
    http.py          `serve_http`: the node's and the coordinator's --http HOST:PORT (an aiohttp app)
    compat.py        each touch of a library's private internals (asyncio, hivemind), version-stamped

Nothing here is imported at package import: the CLI's checks read `addresses` and `relay` before
torch or hivemind load.
"""
