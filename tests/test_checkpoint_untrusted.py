"""A checkpoint's files are untrusted input: forged names, links and JSON whose checksums were
re-signed (as a forger would) are refused with a CheckpointError before anything is read
outside the checkpoint folder or changed in the live model."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import recopt.checkpoint.manifest as manifest_module
from recopt.checkpoint import CheckpointError, export_full, load, read_manifest, reshard, save
from recopt.checkpoint.manifest import DCP_METADATA_NAME, SKELETON_NAME, file_entry
from recopt.checkpoint.reader import SafeFileSystemReader


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return model, opt


def _saved(tmp_path: Path) -> Path:
    model, opt = _model(0)
    return save(tmp_path / "ck", model, opt, step=1)


def _resign(path: Path, **changes: Any) -> None:
    """Re-sign every file's size and CRC and the manifest itself (a forger's consistent copy)."""
    manifest = read_manifest(path)
    for name in manifest.files:
        if "/" not in name:
            manifest.files[name] = file_entry(path / name)
    for key, value in changes.items():
        setattr(manifest, key, value)
    manifest.write(path)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        state |= {f"optim/{i}/{k}": v.clone() for k, v in s.items()}
    return state


def _refused(path: Path, match: str) -> CheckpointError:
    """Load into a live model: it must raise ``match`` and leave the model and optimizer as
    they were."""
    model, opt = _model(7)
    before = _state(model, opt)
    with pytest.raises(CheckpointError, match=match) as info:
        load(path, model, opt)
    after = _state(model, opt)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    return info.value


def _spy_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file the manifest's verification reads (checksums)."""
    seen: list[Path] = []
    original = manifest_module.file_entry

    def spy(path: Path) -> Any:
        seen.append(Path(path).resolve())
        return original(path)

    monkeypatch.setattr(manifest_module, "file_entry", spy)
    return seen


@pytest.mark.parametrize("name", ["../secret.txt", "../../../../etc/hostname", "/etc/hostname"])
def test_manifest_naming_a_file_outside_the_checkpoint_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    path = _saved(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of any checkpoint")
    manifest = read_manifest(path)
    target = (path / name).resolve()  # where the name leads (an absolute name replaces path)
    # Its true size and CRC where it exists: without the check, verification would pass.
    manifest.files[name] = file_entry(target if target.is_file() else secret)
    manifest.write(path)  # the manifest's own CRC recomputed
    seen = _spy_reads(monkeypatch)
    error = _refused(path, "not a plain file name inside the checkpoint folder")
    assert repr(name) in str(error)
    assert target.resolve() not in seen and secret.resolve() not in seen


def test_a_link_leaving_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.move(path / SKELETON_NAME, outside)
    (path / SKELETON_NAME).symlink_to(outside)  # same bytes: the checksums still match
    _refused(path, r"objects\.json \(named in .*\) leads to .*elsewhere\.json, outside the")


def test_dcp_metadata_pointing_outside_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    metadata = SafeFileSystemReader(path).read_metadata()
    data_files = {info.relative_path for info in metadata.storage_data.values()}
    for name in data_files:
        shutil.copyfile(path / name, tmp_path / name)  # a forged copy outside
    for info in metadata.storage_data.values():
        info.relative_path = f"../{info.relative_path}"
    (path / DCP_METADATA_NAME).write_bytes(pickle.dumps(metadata))
    _resign(path)
    _refused(path, r"names the file '\.\./__0_0\.distcp', which is not a plain file name")
    with pytest.raises(CheckpointError, match="not a plain file name"):
        export_full(path, tmp_path / "full")


@pytest.mark.parametrize(
    ("skeleton", "match"),
    [
        ({"d": 5}, r"\(top\): 'd' holds a int, not a list"),
        ([], r"\(top\): '\[\]' is not a one-tag node"),
        ({"v": 1}, r"\(top\): not a dict node"),
        ({"d": [[1, 2, 3]]}, r"entry '\[1, 2, 3\]' is not a \[str or int key, node\] pair"),
        ({"d": [["model", {"t": 5}]]}, r"model: tensor key 5 is not a str"),
        ({"d": [["model", {"d": [["w", {"v": {"x": 1}}]]}]]}, r"model/w: value .* not a scalar"),
    ],
)
def test_malformed_skeleton_is_a_checkpoint_error(
    tmp_path: Path, skeleton: Any, match: str
) -> None:
    path = _saved(tmp_path)
    (path / SKELETON_NAME).write_text(json.dumps(skeleton))
    _resign(path)
    error = _refused(path, match)
    assert not isinstance(error.__cause__, TypeError)


def test_skeleton_not_json_or_too_deep_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    (path / SKELETON_NAME).write_bytes(b'{"d": [')
    _resign(path)
    _refused(path, r"objects\.json is not JSON")
    deep: Any = {"v": 1}
    for _ in range(300):
        deep = {"l": [deep]}
    (path / SKELETON_NAME).write_text(json.dumps({"d": [["extra", deep]]}))
    _resign(path)
    _refused(path, "nested deeper than 200")


@pytest.mark.parametrize("state", [5, {"rank": 0, "rng": 5}, {"rank": 0, "rng": {"torch": 1}}])
def test_malformed_rank_file_is_a_checkpoint_error(tmp_path: Path, state: Any) -> None:
    path = _saved(tmp_path)
    (path / "rank_0.json").write_text(json.dumps(state))
    _resign(path)
    _refused(path, r"rank_0\.json does not hold a rank's RNG state")


@pytest.mark.parametrize(
    ("field", "value"),
    [("world_size", "1"), ("world_size", 0), ("step", "5"), ("plan", 3), ("finite", "yes")],
)
def test_manifest_fields_of_the_wrong_type_are_refused(
    tmp_path: Path, field: str, value: Any
) -> None:
    path = _saved(tmp_path)
    _resign(path, **{field: value})
    _refused(path, rf"field {field} \({value!r}\) is not of the type recopt writes")


def test_reshard_refuses_a_forged_name_and_writes_nothing_outside(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    outside = tmp_path / "victim.json"
    outside.write_text("{}")
    manifest = read_manifest(path)
    # _finish_copy copies rank files by name: this one would land outside the output folder.
    manifest.files["rank_/../../victim.json"] = file_entry(outside)
    manifest.write(path)
    with pytest.raises(CheckpointError, match="not a plain file name"):
        reshard(path, tmp_path / "out" / "r", world_size=2)
    assert outside.read_text() == "{}"
    assert not (tmp_path / "out" / "r").exists()
