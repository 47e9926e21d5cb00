"""Ed25519 keys, canonical signatures, and join tokens."""

import os
import stat

import pytest

from protocol import JoinToken, KeyFileError, LocalProtocolError, RemoteProtocolError, SigningKey, canonical, issue_token, verify, verify_token


def test_key_file_round_trip_and_mode(tmp_path):
    path = tmp_path / "id.pem"
    key = SigningKey.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = SigningKey.load_or_create(path)
    assert again.public_key == key.public_key


def test_key_file_errors_name_the_problem(tmp_path):
    with pytest.raises(KeyFileError, match="does not exist"):
        SigningKey.load(tmp_path / "missing.pem")
    bad = tmp_path / "bad.pem"
    bad.write_bytes(b"not a key")
    with pytest.raises(KeyFileError, match="corrupt"):
        SigningKey.load(bad)
    with pytest.raises(KeyFileError, match="corrupt"):
        SigningKey.load_or_create(bad)  # an existing corrupt file is never silently replaced
    assert bad.read_bytes() == b"not a key"


def test_sign_verify_canonical():
    key = SigningKey.generate()
    fields = ("record", "peer", 3, 1.5, b"\x00", ("a", "b"))
    sig = key.sign(fields)
    assert verify(key.public_key, fields, sig)
    assert not verify(key.public_key, ("record", "peer", 4, 1.5, b"\x00", ("a", "b")), sig)
    assert not verify(SigningKey.generate().public_key, fields, sig)
    assert not verify(key.public_key, fields, sig[:-1])
    assert canonical(fields) == canonical(tuple(fields))
    with pytest.raises(LocalProtocolError):
        canonical(({"a": 1},))
    with pytest.raises(LocalProtocolError):
        canonical(["not", "a", "tuple"])


NOW = 1_000_000.0


@pytest.fixture
def owner():
    return SigningKey.generate()


def test_token_ok_and_text_round_trip(owner):
    tok = issue_token(owner, "swarm", peer_id="peerA", roles=("replica",), expires_at=NOW + 60)
    back = JoinToken.from_text(tok.to_text())
    assert back == tok
    check = verify_token(back, owner.public_key, "swarm", "peerA", now=NOW, role="replica")
    assert check.ok and check.reason == "ok"


def test_token_without_expiry_survives_its_text_form(owner):
    tok = issue_token(owner, "swarm")  # never expires
    back = JoinToken.from_text(tok.to_text())
    assert back == tok and verify_token(back, owner.public_key, "swarm", "p", now=1e12)


def test_token_any_peer(owner):
    tok = issue_token(owner, "swarm", expires_at=NOW + 1)
    assert verify_token(tok, owner.public_key, "swarm", "anyone", now=NOW)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda t, o: JoinToken(t.swarm_id, "peerB", t.roles, t.expires_at, t.signature), "forged"),
        (lambda t, o: JoinToken(t.swarm_id, t.peer_id, t.roles, t.expires_at + 3600, t.signature), "forged"),
        (lambda t, o: issue_token(SigningKey.generate(), "swarm", "peerA", expires_at=NOW + 60), "forged"),
        (lambda t, o: issue_token(o, "swarm", "peerA", expires_at=NOW - 5), "expired"),
        (lambda t, o: issue_token(o, "swarm", "peerB", expires_at=NOW + 60), "other peer"),
        (lambda t, o: issue_token(o, "other", "peerA", expires_at=NOW + 60), "other swarm"),
        (lambda t, o: issue_token(o, "swarm", "peerA", roles=("expert",), expires_at=NOW + 60), "not allowed"),
    ],
)
def test_token_refusals_have_reasons(owner, mutate, reason):
    tok = mutate(issue_token(owner, "swarm", "peerA", expires_at=NOW + 60), owner)
    check = verify_token(tok, owner.public_key, "swarm", "peerA", now=NOW, role="replica")
    assert not check.ok
    assert reason in check.reason


@pytest.mark.parametrize("text", ["", "!!!", "AAAA", "kqCgoKCg"])
def test_garbage_token_text_is_a_remote_error(text):
    with pytest.raises(RemoteProtocolError):
        JoinToken.from_text(text)
