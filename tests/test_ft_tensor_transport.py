"""TensorTransport: torchft healing with tensors and plain values only, checked before loading."""

from __future__ import annotations

import datetime
import hashlib
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("torchft", reason="the ft extra: pip install 'recopt[ft]'")

from recopt.ft.healing_state import HealingRefused  # noqa: E402
from recopt.ft.tensor_transport import TensorTransport, decode_state, encode_state  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=5)


def _state() -> dict[str, object]:
    """What a healing state holds: a torchft envelope around model and optimizer state dicts."""
    return {
        "user": {
            "default": {
                "model": {
                    "w": torch.randn(3, 4),
                    "b": torch.zeros(0),
                    "half": torch.ones(2).bfloat16(),
                },
                "optimizer": {
                    "state": {0: {"step": torch.tensor(7.0), "mask": torch.tensor([True, False])}},
                    "param_groups": [
                        {"lr": 0.01, "betas": (0.9, 0.999), "params": [0], "name": None}
                    ],
                },
            }
        },
        "torchft": {"step": 12, "batches_committed": 24},
    }


def _assert_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            _assert_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal(x, y)
    else:
        assert a == b


def test_round_trip_keeps_values_types_and_keys() -> None:
    state = _state()
    _assert_equal(state, decode_state(encode_state(state)))


def test_objects_that_would_need_pickle_are_refused() -> None:
    with pytest.raises(TypeError, match="user/extra: set is neither"):
        encode_state({"user": {"extra": {1, 2}}})
    with pytest.raises(TypeError, match="key 1.5"):
        encode_state({1.5: torch.zeros(1)})


def test_a_payload_is_served_for_its_step_only_until_disallowed() -> None:
    source, healer = TensorTransport(TIMEOUT), TensorTransport(TIMEOUT)
    try:
        source.send_checkpoint([1], 12, _state(), TIMEOUT)
        got = healer.recv_checkpoint(0, source.metadata(), 12, TIMEOUT)
        _assert_equal(_state()["torchft"], got["torchft"])
        source.disallow_checkpoint()
        with pytest.raises(TimeoutError, match="no checkpoint"):
            healer.recv_checkpoint(0, source.metadata(), 12, datetime.timedelta(seconds=0.3))
    finally:
        source.shutdown()
        healer.shutdown()


def test_altered_or_nonfinite_states_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    source, healer = TensorTransport(TIMEOUT), TensorTransport(TIMEOUT)
    try:
        bad = _state()
        bad["user"]["default"]["model"]["w"][1, 2] = float("inf")  # type: ignore[index]
        source.send_checkpoint([1], 3, bad, TIMEOUT)
        with pytest.raises(HealingRefused, match="NaN or inf in user/default/model/w"):
            healer.recv_checkpoint(0, source.metadata(), 3, TIMEOUT)
        source.send_checkpoint([1], 4, _state(), TIMEOUT)
        payload, sha = source.served("/checkpoint/4") or (b"", "")
        assert sha == hashlib.sha256(payload).hexdigest()
        tampered = payload[:-1] + bytes([payload[-1] ^ 1])
        monkeypatch.setattr(source, "served", lambda path: (tampered, sha))
        with pytest.raises(HealingRefused, match="altered in transit"):
            healer.recv_checkpoint(0, source.metadata(), 4, TIMEOUT)
    finally:
        source.shutdown()
        healer.shutdown()


def test_a_truncated_payload_is_refused() -> None:
    payload = encode_state(_state())
    with pytest.raises(HealingRefused):
        decode_state(payload[: len(payload) - 5])
    with pytest.raises(HealingRefused, match="not a recopt tensor state"):
        decode_state(b"\x80\x04pickle")


def test_other_paths_are_not_found() -> None:
    source = TensorTransport(TIMEOUT)
    try:
        source.send_checkpoint([1], 5, _state(), TIMEOUT)
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"{source.metadata()}/checkpoint/4", timeout=5)
    finally:
        source.shutdown()
