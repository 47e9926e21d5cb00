"""The swarm's records as every node's DHT keeps them (hivemind's record validator interface).

A node's DHT checks each value under the swarm's coordinator, members and revocation keys when a peer asks
it to store one and when a peer's answer carries one (protocol/records.py `check_stored`): a value
that is not a well-formed record of this swarm, signed by the key that owns it, is neither kept
nor served, and an answer that carries one is dropped whole (hivemind drops a dictionary with one
bad subkey). So a read takes the newest *valid* record: a stranger that stores junk, a record
signed by its own key in the owner's place, or another's record with a later expiry, under the
swarm's keys, changes nothing for honest nodes. In an owned swarm a member record must also
carry its peer's membership certificate from the owner (node/gate.py), and only the owner signs
the revocation list. Other keys (the averager's matchmaking) pass.
"""

from __future__ import annotations

import logging
import time

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from protocol import RemoteProtocolError
from protocol.records import check_stored, coordinator_key, members_key, revoked_key

log = logging.getLogger(__name__)


class SwarmRecords(RecordValidatorBase):
    """Installed in the DHT of every node and coordinator of swarm `swarm_id` (it runs in the
    DHT's own process: plain, picklable fields only)."""

    def __init__(self, swarm_id: str):
        self.swarm_id = swarm_id
        keys = {"coordinator": coordinator_key(swarm_id), "members": members_key(swarm_id), "revoked": revoked_key(swarm_id)}
        self.kinds = {DHTID.generate(source=key).to_bytes(): kind for kind, key in keys.items()}

    def validate(self, record: DHTRecord) -> bool:
        kind = self.kinds.get(record.key)
        if kind is None:
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
            subkey = MSGPackSerializer.loads(record.subkey)
            if not isinstance(value, bytes) or not (subkey is None or isinstance(subkey, str)):
                raise RemoteProtocolError(f"a {type(value).__name__} value under a {type(subkey).__name__} subkey", kind)
            check_stored(self.swarm_id, kind, value, subkey, record.expiration_time, time.time())
        except Exception as e:  # RemoteProtocolError, or bytes msgpack cannot read
            log.info("refused a value under the swarm's %s key: %s", kind, e)
            return False
        return True
