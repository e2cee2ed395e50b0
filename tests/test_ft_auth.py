"""Fault tolerance, trust: loopback by default, signed messages, refused healing states,
duplicate replica ids. In-process servers on loopback; no spawned processes."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator

import pytest
import torch

from recopt.ft import ManagerConfig
from recopt.ft.auth import AuthError, read_secret
from recopt.ft.client import envelope, request, wait_for_replicas
from recopt.ft.healing import CheckpointServer, HealingRefused, fetch_checkpoint
from recopt.ft.lighthouse import DuplicateReplicaError, Lighthouse, LighthouseConfig, QuorumState
from recopt.ft.manager import Manager

SECRET = b"0123456789abcdef-the-job-secret"
WRONG = b"0123456789abcdef-another-secret"
SHORT = datetime.timedelta(seconds=2)


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    config = LighthouseConfig(heartbeat_timeout=datetime.timedelta(seconds=1))
    server = Lighthouse(config, port=0, secret=SECRET)
    server.start()
    yield server
    server.shutdown()


def _address(server: Lighthouse) -> tuple[str, int]:
    return ("127.0.0.1", server.port)


def test_servers_bind_loopback_by_default_and_refuse_open_binds_without_a_secret() -> None:
    server = Lighthouse(LighthouseConfig(), port=0)
    server.start()
    try:
        assert server._server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
    assert ManagerConfig(replica_id="a", lighthouse=("h", 1)).bind_host == "127.0.0.1"
    state = CheckpointServer("127.0.0.1", SHORT)
    assert state.server_address[0] == "127.0.0.1"
    state.stop()
    with pytest.raises(ValueError, match="'0.0.0.0' without a shared secret.*RECOPT_FT_SECRET"):
        Lighthouse(LighthouseConfig(), host="0.0.0.0", port=0)
    with pytest.raises(ValueError, match="state server would listen on '0.0.0.0'"):
        ManagerConfig(replica_id="a", lighthouse=("h", 1), bind_host="0.0.0.0")
    assert "secret" not in repr(ManagerConfig(replica_id="a", lighthouse=("h", 1), secret=SECRET))


def test_lighthouse_refuses_clients_without_or_with_a_wrong_secret(lighthouse: Lighthouse) -> None:
    beat = {"op": "heartbeat", "replica_id": "rogue", "session": "x"}
    with pytest.raises(ConnectionError, match="AuthError: unauthenticated message"):
        request(_address(lighthouse), beat, SHORT)
    with pytest.raises(ConnectionError, match="reply refused .*bad signature"):
        request(_address(lighthouse), beat, SHORT, WRONG)
    with pytest.raises(ConnectionError, match="reply refused"):
        wait_for_replicas(_address(lighthouse), 1, datetime.timedelta(seconds=60), WRONG)
    status = {"op": "status"}
    assert request(_address(lighthouse), status, SHORT, SECRET)["live"] == []  # rogue not let in
    # A recorded, correctly signed request cannot be replayed.
    line = envelope(SECRET, "lighthouse", {**beat, "replica_id": "real", "timeout_s": 2.0})
    replies = []
    for _ in range(2):
        with socket.create_connection(_address(lighthouse), timeout=5) as sock:
            sock.sendall(line)
            replies.append(sock.makefile("rb").readline())
    assert b"error" not in replies[0] and b"replayed message" in replies[1]


def _served(state: dict, secret: bytes | None) -> tuple[CheckpointServer, str]:
    server = CheckpointServer("127.0.0.1", SHORT, secret)
    server.publish(3, state)
    return server, f"http://127.0.0.1:{server.port}/checkpoint/3"


def test_healing_refuses_unauthenticated_clients_and_tampered_or_nan_states() -> None:
    good = {"user": {"w": torch.arange(4.0)}, "step": 3}
    server, url = _served(good, SECRET)
    try:
        for secret in (None, WRONG):
            with pytest.raises(AuthError, match="refused this replica"):
                fetch_checkpoint(url, SHORT, secret)
        assert torch.equal(fetch_checkpoint(url, SHORT, SECRET)["user"]["w"], good["user"]["w"])
        # Bytes altered after the digest was announced: refused, never loaded.
        payload, sha = server.get("/checkpoint/3")  # type: ignore[misc]
        server._payload = payload[:-8] + bytes(8)
        with pytest.raises(HealingRefused, match="SHA-256 .* altered in transit"):
            fetch_checkpoint(url, SHORT, SECRET)
    finally:
        server.stop()
    for secret in (SECRET, None):
        nan = {"user": {"w": torch.tensor([1.0, float("nan")]), "b": torch.ones(2)}, "step": 3}
        server, url = _served(nan, secret)
        try:
            with pytest.raises(HealingRefused, match="NaN or inf in user/w; the source"):
                fetch_checkpoint(url, SHORT, secret)
        finally:
            server.stop()


def test_quorum_state_refuses_a_second_live_process_with_the_same_replica_id() -> None:
    state = QuorumState(LighthouseConfig(heartbeat_timeout=datetime.timedelta(seconds=2)))
    state.heartbeat("a", 0.0, 0, session="first")
    state.heartbeat("a", 1.0, 0, session="first")
    with pytest.raises(DuplicateReplicaError, match="replica id 'a' \\(rank 0\\) is already"):
        state.heartbeat("a", 2.0, 0, session="second")
    state.heartbeat("a", 3.5, 0, session="second")  # the first went silent: a restart
    with pytest.raises(DuplicateReplicaError):
        state.heartbeat("a", 3.6, 0, session="first")


def test_manager_with_a_duplicate_replica_id_is_refused_naming_it(lighthouse: Lighthouse) -> None:
    def config(replica_id: str) -> ManagerConfig:
        return ManagerConfig(
            replica_id=replica_id, lighthouse=_address(lighthouse), timeout=SHORT, secret=SECRET
        )

    model = torch.nn.Linear(2, 1)
    first = Manager(config("a"), state_dict=model.state_dict, load_state_dict=model.load_state_dict)
    try:
        with pytest.raises(ValueError, match="replica id 'a' \\(rank 0\\) is already used"):
            Manager(config("a"), state_dict=model.state_dict, load_state_dict=print)
        other = Manager(config("b"), state_dict=model.state_dict, load_state_dict=print)
        other.shutdown()
    finally:
        first.shutdown()


def test_read_secret_from_env_or_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert read_secret({}) is None
    assert read_secret({"RECOPT_FT_SECRET": SECRET.decode()}) == SECRET
    (tmp_path / "s").write_bytes(SECRET + b"\n")
    assert read_secret({"RECOPT_FT_SECRET_FILE": str(tmp_path / "s")}) == SECRET
    with pytest.raises(ValueError, match="has 5 bytes; use at least 16"):
        read_secret({"RECOPT_FT_SECRET": "short"})
