"""Checkpoint save/load in one process: exact round trips, resume, faults, manager, encoding."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from recopt.checkpoint import CheckpointError, CheckpointManager, load, read_manifest, save
from recopt.checkpoint.manifest import DCP_METADATA_NAME, MANIFEST_NAME, file_entry
from recopt.checkpoint.reader import SafeFileSystemReader
from recopt.checkpoint.state import decode_tree, encode_tree


class Stream:
    """A data source whose position is checkpointed through state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        x = torch.randn(16, 6, generator=g)
        return x, (x.sum(1, keepdim=True) > 0).float()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def make_model(hidden: int = 8) -> torch.nn.Module:
    layers = [torch.nn.Linear(6, hidden), torch.nn.Dropout(0.3), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 1))


def make_run(seed: int) -> tuple[torch.nn.Module, Any, Any, Stream]:
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched, Stream()


def train_step(model: torch.nn.Module, opt: Any, sched: Any, data: Stream) -> float:
    x, y = data.next_batch()
    # Every RNG a real job uses: dropout (torch), sampling noise (numpy, python).
    noise = float(np.random.rand()) * 1e-3 + random.random() * 1e-3
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x) + noise, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            assert_same_state(a[k], b[k])
        else:
            assert a[k] == b[k], k


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    random.seed(5)
    np.random.seed(5)
    model, opt, sched, data = make_run(0)
    reference = [train_step(model, opt, sched, data) for _ in range(8)]

    random.seed(5)
    np.random.seed(5)
    model, opt, sched, data = make_run(0)
    first = [train_step(model, opt, sched, data) for _ in range(4)]
    save(tmp_path / "ck", model, opt, extra={"sched": sched, "data": data, "note": "x"}, step=4)
    saved_opt = opt.state_dict()

    # A new process: other seeds, other initial weights, another lr; everything must be restored.
    random.seed(99)
    np.random.seed(99)
    model, opt, sched, data = make_run(123)
    extras = load(tmp_path / "ck", model, opt, extra={"sched": sched, "data": data})
    assert extras["note"] == "x" and extras["data"] == {"position": 4}
    manifest = read_manifest(tmp_path / "ck")
    assert manifest.step == 4
    # Sums taken while writing equal the files read back.
    assert {n: file_entry(tmp_path / "ck" / n) for n in manifest.files} == manifest.files
    assert_same_state(opt.state_dict(), saved_opt)
    rest = [train_step(model, opt, sched, data) for _ in range(4)]
    assert first + rest == reference  # bit-identical losses


def test_optimizer_state_is_keyed_by_name_not_index(tmp_path: Path) -> None:
    model, opt, sched, data = make_run(0)
    train_step(model, opt, sched, data)
    save(tmp_path / "ck", model, opt)
    keys = read_manifest(tmp_path / "ck").tensors
    assert "optim/state/0.weight/exp_avg" in keys and "optim/state/3.bias/exp_avg_sq" in keys
    # Same parameters given to the optimizer in another order: state follows the names.
    model2 = make_model()
    opt2 = torch.optim.Adam(list(model2.parameters())[::-1], lr=0.01)
    load(tmp_path / "ck", model2, opt2)
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[p2]["exp_avg"]), name


def test_cuda_rng_of_a_host_with_more_gpus_restores_the_gpus_this_one_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from recopt.checkpoint.state import capture_rng, restore_rng

    state = capture_rng()  # CPU generators, plus the two GPUs of the host that saved it:
    state["cuda"] = [state["torch"], state["torch"]]
    restored: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda value, index: restored.append(index))
    restore_rng(state)
    assert restored == [0]


def test_tree_encoding_round_trips_types() -> None:
    tree = {"a": (1, 2.5, None), "b": [True, "s", {3: float("inf")}], "t": torch.ones(2)}
    tensors: dict[str, Any] = {}
    skeleton = json.loads(json.dumps(encode_tree(tree, "", tensors)))
    assert list(tensors) == ["t"]
    back = decode_tree(skeleton, tensors)
    assert back["a"] == (1, 2.5, None) and back["b"] == [True, "s", {3: float("inf")}]
    with pytest.raises(CheckpointError, match="cannot checkpoint a object"):
        encode_tree({"x": object()}, "", {})


def _checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module, Any]:
    model, opt, sched, data = make_run(0)
    train_step(model, opt, sched, data)
    path = save(tmp_path / "ck", model, opt, step=1)
    return path, model, opt


def _fresh_unchanged_after_failed_load(path: Path, match: str) -> None:
    model, opt, _, _ = make_run(7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=match) as info:
        load(path, model, opt)
    assert_same_state(model.state_dict(), before)  # nothing was partially loaded
    assert opt.state_dict()["state"] == {}
    return info.value  # type: ignore[return-value]


def test_flipped_bytes_are_detected_with_file_and_checksums(tmp_path: Path) -> None:
    path, _, _ = _checkpoint(tmp_path)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    err = _fresh_unchanged_after_failed_load(path, "corrupt: crc32")
    assert "__0_0.distcp" in str(err) and "expected" in str(err)


def test_truncated_and_missing_files_are_detected(tmp_path: Path) -> None:
    path, _, _ = _checkpoint(tmp_path)
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    _fresh_unchanged_after_failed_load(path, r"__0_0.distcp: truncated")
    shard.unlink()
    _fresh_unchanged_after_failed_load(path, r"__0_0.distcp: missing")
    manifest = path / MANIFEST_NAME
    manifest.write_text(manifest.read_text()[:-40])
    _fresh_unchanged_after_failed_load(path, "truncated or not a recopt manifest")
    manifest.unlink()
    _fresh_unchanged_after_failed_load(path, "not a complete recopt checkpoint")


def test_corrupt_manifest_body_is_detected(tmp_path: Path) -> None:
    path, _, _ = _checkpoint(tmp_path)
    manifest = path / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"step": 1', '"step": 2'))
    _fresh_unchanged_after_failed_load(path, "manifest.json is corrupt: checksum")


def test_checkpoint_of_another_model_lists_mismatching_keys(tmp_path: Path) -> None:
    path, _, _ = _checkpoint(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load(path, other, torch.optim.Adam(other.parameters()))
    message = str(info.value)
    assert "keys the checkpoint lacks: model/2.bias, model/2.weight" in message
    assert "keys the model lacks: model/3.bias, model/3.weight" in message
    assert "model/0.weight: checkpoint [8, 6] float32, model [5, 6] float32" in message
    assert_same_state(other.state_dict(), before)


def test_metadata_unpickler_refuses_foreign_globals(tmp_path: Path) -> None:
    path, _, _ = _checkpoint(tmp_path)
    (path / DCP_METADATA_NAME).write_bytes(pickle.dumps(print))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        SafeFileSystemReader(path).read_metadata()


def test_existing_checkpoint_is_kept_unless_overwrite(tmp_path: Path) -> None:
    path, model, opt = _checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        save(path, model, opt)
    save(path, model, opt, step=9, overwrite=True)
    assert read_manifest(path).step == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no .partial / .old left


def test_manager_keeps_last_k_and_finds_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run", keep_last=2)
    assert manager.latest() is None and manager.load_latest(make_model()) is None
    model, opt, sched, data = make_run(0)
    for step in (1, 2, 3):
        train_step(model, opt, sched, data)
        manager.save(step, model, opt, extra={"data": data})
    # A crashed save leaves only a '.partial' directory: never reported as latest.
    (tmp_path / "run" / ".step_000000004.partial").mkdir()
    assert [s for s, _ in manager.complete()] == [2, 3]
    assert manager.latest() == tmp_path / "run" / "step_000000003"
    fresh, fresh_opt, _, fresh_data = make_run(1)
    restored = manager.load_latest(fresh, fresh_opt, extra={"data": fresh_data})
    assert restored is not None and restored[0] == 3 and fresh_data.position == 3
    assert_same_state(fresh.state_dict(), model.state_dict())
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    manager.close()


def test_manager_finds_a_step_whose_resave_died_between_its_renames(tmp_path: Path) -> None:
    """Re-saving an existing step moves the old copy aside, then renames the new one into
    place; a crash between the two left the step only in ``.step_<n>.old``, which latest()
    ignored (and the next save of the step deleted). It is found there now."""
    root = tmp_path / "run"
    manager = CheckpointManager(root, keep_last=3)
    model, opt, sched, data = make_run(0)
    for step in (1, 2):
        train_step(model, opt, sched, data)
        manager.save(step, model, opt)
    (root / "step_000000002").rename(root / ".step_000000002.old")  # the crash's leftovers
    (root / ".step_000000002.partial").mkdir()
    assert manager.latest() == root / ".step_000000002.old"
    fresh = make_model()
    restored = manager.load_latest(fresh)
    assert restored is not None and restored[0] == 2
    assert_same_state(fresh.state_dict(), model.state_dict())
    manager.save(2, model, opt)  # the next save of that step replaces the old copy
    assert [(s, p.name) for s, p in manager.complete()] == [
        (1, "step_000000001"),
        (2, "step_000000002"),
    ]
    assert not (root / ".step_000000002.old").exists()
    manager.close()


def test_an_interrupted_save_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (KeyboardInterrupt) while a save writes: the interrupt goes on as it is, and no
    '.partial' folder stays (it used to, as a failed save's does not)."""
    from recopt.checkpoint import save_load

    path, model, opt = _checkpoint(tmp_path)
    real = save_load._write_own

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)  # (the shard files are written, then the interrupt comes)
        raise KeyboardInterrupt

    monkeypatch.setattr(save_load, "_write_own", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path / "next", model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_weights_only_load_and_missing_stateful_extra(tmp_path: Path) -> None:
    path, model, _ = _checkpoint(tmp_path)
    fresh = make_model()
    assert load(path, fresh) == {}
    assert_same_state(fresh.state_dict(), model.state_dict())
    with pytest.raises(CheckpointError, match="no extra 'data' to restore"):
        load(path, make_model(), extra={"data": Stream()})


def test_non_contiguous_and_odd_dtypes_round_trip(tmp_path: Path) -> None:
    # A transposed (dense, non-contiguous) tensor is stored with its strides: the direct-read
    # path must not take its bytes as row-major; bf16/int/bool go through byte views.
    class Odd(torch.nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.register_buffer("t", torch.randn(5, 3, generator=g).t())
            self.register_buffer("b", torch.randn(4, 2, generator=g).to(torch.bfloat16))
            self.register_buffer("i", torch.randint(0, 9, (6,), generator=g))
            self.register_buffer("m", torch.rand(3, generator=g) > 0.5)
            self.register_buffer("s", torch.tensor(float(seed)))

    save(tmp_path / "ck", Odd(1))
    fresh = Odd(2)
    load(tmp_path / "ck", fresh)
    assert_same_state(fresh.state_dict(), Odd(1).state_dict())


def _rewrite_manifest(path: Path, **changes: Any) -> None:
    """Re-sign the manifest after a change, as a forger (or a bug) would: CRCs all consistent."""
    manifest = read_manifest(path)
    for name in manifest.files:
        manifest.files[name] = file_entry(path / name)
    for key, value in changes.items():
        setattr(manifest, key, value)
    manifest.write(path)


def _trained(seed: int) -> tuple[torch.nn.Module, Any, dict[str, torch.Tensor]]:
    model, opt, sched, data = make_run(seed)
    train_step(model, opt, sched, data)  # the optimizer has live state too
    live = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        live |= {f"optim/{i}/{k}": v.clone() for k, v in state.items()}
    return model, opt, live


def _assert_live_unchanged(model: torch.nn.Module, opt: Any, live: dict) -> None:
    now = {f"model/{k}": v for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        now |= {f"optim/{i}/{k}": v for k, v in state.items()}
    assert now.keys() == live.keys()
    for key, value in live.items():
        assert torch.equal(now[key], value), key


def _spoil_last_item(path: Path) -> None:
    """Zero the start of the stored item DCP reads last, then re-sign the checksums."""
    metadata = SafeFileSystemReader(path).read_metadata()
    last = max(metadata.storage_data.values(), key=lambda info: info.offset)
    data = bytearray((path / last.relative_path).read_bytes())
    data[last.offset : last.offset + 64] = bytes(64)
    (path / last.relative_path).write_bytes(bytes(data))
    _rewrite_manifest(path)


def test_load_failing_partway_changes_nothing(tmp_path: Path) -> None:
    path, saved_model, _ = _checkpoint(tmp_path)
    # Spoil the stored item read last (checksums re-signed): DCP fails after it has already
    # copied the items before it into the live tensors.
    _spoil_last_item(path)
    model, opt, live = _trained(7)
    assert not torch.equal(model.state_dict()["0.weight"], saved_model.state_dict()["0.weight"])
    with pytest.raises(CheckpointError, match="nothing was changed") as info:
        load(path, model, opt)
    assert not isinstance(info.value, AssertionError)
    _assert_live_unchanged(model, opt, live)


def test_undecodable_skeleton_changes_nothing(tmp_path: Path) -> None:
    path, _, _ = _checkpoint(tmp_path)
    skeleton = json.loads((path / "objects.json").read_text())
    skeleton["d"][1][1] = {"?": 1}  # the optimizer's node: an unknown tag
    (path / "objects.json").write_text(json.dumps(skeleton))
    _rewrite_manifest(path)
    model, opt, live = _trained(7)
    with pytest.raises(CheckpointError, match="unknown checkpoint skeleton tag"):
        load(path, model, opt)
    _assert_live_unchanged(model, opt, live)


def test_forged_manifest_shape_fails_before_allocating(tmp_path: Path) -> None:
    path, _, _ = _checkpoint(tmp_path)
    manifest = read_manifest(path)
    key = "optim/state/0.weight/exp_avg"
    tensors = dict(manifest.tensors)
    tensors["extra/huge"] = type(tensors[key])(shape=[10**7, 10**7], dtype="float32")  # 400 TB
    _rewrite_manifest(path, tensors=tensors)
    with pytest.raises(CheckpointError, match=r"tensors need 4\d{14} bytes but its data files"):
        load(path, make_model(), extra={})
    manifest.tensors = {key: type(tensors[key])(shape=[-1], dtype="float32")}
    manifest.write(path)
    with pytest.raises(CheckpointError, match="invalid shape"):
        read_manifest(path)


@pytest.mark.parametrize("where", ["tensor data", "manifest"])
def test_disk_full_during_save_names_it_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    import errno

    from recopt.checkpoint import guards
    from recopt.checkpoint import manifest as manifest_module

    manager = CheckpointManager(tmp_path / "run", keep_last=1)
    model, opt, sched, data = make_run(0)
    train_step(model, opt, sched, data)
    manager.save(1, model, opt)

    def full(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "tensor data":
        monkeypatch.setattr(manifest_module._SummingFile, "write", full)
    else:
        monkeypatch.setattr(manifest_module.Manifest, "write", full)
    train_step(model, opt, sched, data)
    with pytest.raises(CheckpointError, match="no space left on device") as info:
        manager.save(2, model, opt)
    message = str(info.value)
    assert ".step_000000002.partial" in message and "bytes of tensors" in message
    assert guards.is_no_space(OSError(errno.ENOSPC, "x"))
    manager.close()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_000000001"]
    fresh, fresh_opt, _, _ = make_run(3)
    load(manager.latest(), fresh, fresh_opt)  # type: ignore[arg-type]
    assert read_manifest(tmp_path / "run" / "step_000000001").step == 1


def test_manager_never_rotates_away_the_last_finite_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run", keep_last=2)
    model, opt, sched, data = make_run(0)
    train_step(model, opt, sched, data)
    manager.save(1, model, opt)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")  # the run diverged
    for step in (2, 3, 4):
        manager.save(step, model, opt)
    assert [s for s, _ in manager.complete()] == [1, 3, 4]
    assert read_manifest(tmp_path / "run" / "step_000000001").finite is True
    assert read_manifest(tmp_path / "run" / "step_000000004").finite is False
    with torch.no_grad():
        model[0].weight[0, 0] = 0.0
    manager.save(5, model, opt)  # finite again: the old good one may go now
    manager.save(6, model, opt)
    assert [s for s, _ in manager.complete()] == [5, 6]
    manager.close()
    fresh = make_model()
    load(tmp_path / "run" / "step_000000005", fresh)
    assert torch.equal(fresh.state_dict()["0.weight"][1:], good["0.weight"][1:])


def test_manager_refuses_another_runs_checkpoints_unless_resuming_or_overwriting(
    tmp_path: Path,
) -> None:
    model, opt, sched, data = make_run(0)
    with CheckpointManager(tmp_path / "run", keep_last=2) as old_run:
        for step in (10, 20):
            train_step(model, opt, sched, data)
            old_run.save(step, model, opt)
    with pytest.raises(CheckpointError, match=r"another run \(steps \[10, 20\]\).*resume=True"):
        CheckpointManager(tmp_path / "run", keep_last=2)
    with CheckpointManager(tmp_path / "run", keep_last=2, resume=True) as resumed:
        restored = resumed.load_latest(make_model())
        assert restored is not None and restored[0] == 20
    # A fresh run told to overwrite: its own checkpoints are kept, the old run's go.
    with CheckpointManager(tmp_path / "run", keep_last=2, overwrite=True) as fresh:
        assert [s for s, _ in fresh.complete()] == [10, 20]
        fresh.save(1, model, opt)
        assert [s for s, _ in fresh.complete()] == [1]
        fresh.save(2, model, opt)
        assert [s for s, _ in fresh.complete()] == [1, 2]


def test_manager_locks_its_directory_against_a_second_writer(tmp_path: Path) -> None:
    import os

    first = CheckpointManager(tmp_path / "run")
    with pytest.raises(CheckpointError, match=f"in use by another run \\(pid {os.getpid()} "):
        CheckpointManager(tmp_path / "run", resume=True)
    first.close()
    second = CheckpointManager(tmp_path / "run", resume=True)
    second.close()
    assert not (tmp_path / "run").exists()  # the lock file (and the empty root) go with it


def test_manager_leaves_no_directory_when_it_saved_nothing(tmp_path: Path) -> None:
    CheckpointManager(tmp_path / "run").close()
    assert not (tmp_path / "run").exists()


def test_reshard_of_an_undecodable_item_is_a_checkpoint_error(tmp_path: Path) -> None:
    from recopt.checkpoint.reshard import export_full, reshard

    path, _, _ = _checkpoint(tmp_path)
    _spoil_last_item(path)
    with pytest.raises(CheckpointError, match="cannot read"):
        reshard(path, tmp_path / "r", world_size=2)
    with pytest.raises(CheckpointError, match="cannot read"):
        export_full(path, tmp_path / "full")
