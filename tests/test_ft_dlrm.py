"""make_fault_tolerant on the DLRM model on torchft: a late replica heals to the exact state.

Two replica groups run as threads of this process (each with its own `TorchftManager`, TCPStore,
healing server and gloo group) around an in-process torchft lighthouse: cheap, yet every byte
of the healing path (tensor-only transport over HTTP, strict in-place KeyedOptimizer load) is
the real one. Then the DLRM script itself: two ``train.py --fault-tolerant`` processes, one
killed and restarted.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchft", reason="the ft extra: pip install 'recopt[ft]'")

import ft_lighthouse  # noqa: E402

from recopt.ft.launch import (  # noqa: E402
    FaultTolerantTraining,
    fault_tolerance_config_from_env,
    make_fault_tolerant,
)
from recopt.ft.torchft_manager import TorchftConfig  # noqa: E402
from recopt.kernels.config import Backend  # noqa: E402
from recopt.models.dlrm import DLRM, DLRMConfig  # noqa: E402
from recopt.modules import (  # noqa: E402
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
    FusedOptimizerConfig,
)
from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper  # noqa: E402
from recopt.sparse import KeyedJaggedTensor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def _dlrm(seed: int) -> tuple[nn.Module, CombinedOptimizer]:
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=20, embedding_dim=8, feature_names=(f"f{i}",)
        )
        for i in range(2)
    ]
    sparse = FusedEmbeddingBagCollection(
        tables,
        optimizer=FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05, backend=Backend.FBGEMM),
    )
    model = DLRM(sparse, DLRMConfig(dense_in_features=4, bottom_mlp=(8, 8), top_mlp=(8,)))
    dense = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = CombinedOptimizer(
        [
            ("sparse", sparse.fused_optimizer),
            ("dense", KeyedOptimizerWrapper(dense, lambda p: torch.optim.Adam(p, lr=0.01))),
        ]
    )
    return model, optimizer


def _step(ft: FaultTolerantTraining, model: nn.Module, seed: int, after_quorum: Any = None) -> None:
    ft.optimizer.zero_grad()
    if after_quorum is not None:
        after_quorum()
    g = torch.Generator().manual_seed(seed + 1000 * ft.manager.current_step())
    ids = {
        f"f{i}": [[int(torch.randint(0, 20, (1,), generator=g))] for _ in range(4)]
        for i in range(2)
    }
    logits = model(torch.randn(4, 4, generator=g), KeyedJaggedTensor.from_id_lists(ids))
    nn.functional.binary_cross_entropy_with_logits(logits, torch.ones(4)).backward()
    ft.optimizer.step()


def _state(model: nn.Module, optimizer: CombinedOptimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()})


def _assert_equal(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.fixture
def lighthouse() -> Iterator[str]:
    # A long join timeout: a quorum waits for a heartbeating group that has not joined yet.
    server = ft_lighthouse.in_process(min_replicas=1, join_timeout_ms=30_000)
    try:
        yield ft_lighthouse.address(server)
    finally:
        server.shutdown()


@pytest.fixture
def stores() -> Iterator[dict[str, Any]]:
    """One TCPStore per replica group, as torchrun would provide (MASTER_ADDR/PORT)."""
    made: dict[str, Any] = {}
    yield made
    made.clear()


def _config(name: str, lighthouse: str, stores: dict[str, Any]) -> TorchftConfig:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores[name] = store
    return TorchftConfig(
        replica_id=name,
        lighthouse_addr=lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        timeout=datetime.timedelta(seconds=20),
    )


def test_late_replica_heals_to_the_exact_dlrm_state(
    lighthouse: str, stores: dict[str, Any]
) -> None:
    """fbgemm tables (row-wise Adagrad, trained per group: no grad_hook to sync them): b joins
    at a's step 3 with another seed and heals to a's exact state before its first forward."""
    model_a, opt_a = _dlrm(seed=1)
    model_b, opt_b = _dlrm(seed=2)
    with pytest.raises(ValueError, match="backend='recopt'"):  # fbgemm tables have no hook
        make_fault_tolerant(model_a, opt_a, _config("a", lighthouse, stores))
    ft_a = make_fault_tolerant(
        model_a, opt_a, _config("a", lighthouse, stores), sync_embeddings=False
    )
    ft_b = None
    try:
        for _ in range(3):
            _step(ft_a, model_a, seed=1)
        assert ft_a.manager.current_step() == 3
        ft_b = make_fault_tolerant(
            model_b, opt_b, _config("b", lighthouse, stores), sync_embeddings=False
        )
        a_before = _state(model_a, opt_a)
        healed: dict[str, Any] = {}

        def record() -> None:
            healed.update(_state(model_b, opt_b))  # right after b's quorum, i.e. its heal

        threads = [
            threading.Thread(target=_step, args=(ft_b, model_b, 2, record)),
            threading.Thread(target=_step, args=(ft_a, model_a, 1)),
        ]
        # b asks first: alone it is no majority of the two live groups, so the lighthouse
        # holds its request until a joins; a first would be let through alone (torchft's
        # fast quorum: a's previous quorum is complete) and b would heal a step later.
        threads[0].start()
        time.sleep(3)
        threads[1].start()
        for t in threads:
            t.join(timeout=120)
        assert healed, "b never ran its first step"
        _assert_equal(a_before, healed)  # weights, fused row-wise state, Adam moments
        assert ft_b.manager.current_step() == ft_a.manager.current_step() == 4
        assert ft_b.manager.batches_committed() == ft_a.manager.batches_committed() == 5
        # Healing copied the fused tables; the joint step then kept the dense part equal.
        dense = [k for k in a_before["model"] if "embedding_bags" not in k]
        for key in dense:
            assert torch.equal(model_a.state_dict()[key], model_b.state_dict()[key]), key
    finally:
        ft_a.shutdown()
        if ft_b is not None:
            ft_b.shutdown()


# ------------------------------------------------------------------ the DLRM script, processes


def _dlrm_args(out: Path, steps: int, seed: int) -> list[str]:
    sets = {
        "training.steps": steps,
        "training.log_every": 1,
        "training.eval_every": 0,
        "training.plot": "false",
        # Two replica processes share the machine's cores; the default (all cores each)
        # oversubscribes them and spinning OpenMP threads can stall a replica for minutes.
        "training.num_threads": 1,
        "training.output_dir": str(out),
        "checkpoint.every": 0,
        "data.batch_size": 32,
        "data.val_batches": 0,
        "data.synthetic.seed": seed,  # each replica group reads its own data
        "fault_tolerance.timeout_s": 30,
    }
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def _train_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(json.loads(line)["step"]) for line in lines if '"train"' in line]


def _start_dlrm(
    out: Path, name: str, store_port: int, lighthouse: str, args: list[str]
) -> subprocess.Popen[bytes]:
    """``train.py --fault-tolerant`` as replica group ``name`` (the environment torchrun and a
    job would give it), its output in ``out/<name>.log``."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TORCHFT_LIGHTHOUSE": lighthouse,
        "REPLICA_GROUP_ID": name,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store_port),
    }
    script = str(ROOT / "examples" / "dlrm" / "train.py")
    with open(out / f"{name}.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, script, "--fault-tolerant", *args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _logs(out: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in out.glob("*.log"))


@pytest.mark.multiprocess
def test_dlrm_script_replicas_agree_and_a_restarted_one_heals(tmp_path: Path) -> None:
    """torchft_lighthouse --min_replicas 2 + 2 `train.py --fault-tolerant` groups; b is
    SIGKILLed and restarted.

    Both finish bit-identical (state digest of model and optimizer); the restarted b starts
    at the step it healed to, not at step 1.
    """
    steps, port = 8, ft_lighthouse.free_port()
    lighthouse = ft_lighthouse.start_process(port, min_replicas=2)
    address = f"http://127.0.0.1:{port}"
    stores = {
        n: dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for n in "ab"
    }
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, seed: int) -> subprocess.Popen[bytes]:
        args = _dlrm_args(tmp_path / name, steps, seed)
        procs.append(_start_dlrm(tmp_path, name, stores[name].port, address, args))
        return procs[-1]

    try:
        a, b = start("a", 1), start("b", 2)
        _wait_for(lambda: len(_train_steps(tmp_path / "b")) >= 2, 120, "b's second step")
        b.send_signal(signal.SIGKILL)
        b.wait(timeout=10)
        before = _train_steps(tmp_path / "b")
        assert before == list(range(1, len(before) + 1)) and len(before) < steps
        b = start("b", 2)
        for proc in (a, b):
            assert proc.wait(timeout=150) == 0, _logs(tmp_path)
        after = _train_steps(tmp_path / "b")[len(before) :]
        assert after[0] > 1 and after[-1] == steps, after  # healed, not restarted at step 1
        digests = [json.loads((tmp_path / n / "state_digest.json").read_text()) for n in "ab"]
        assert digests[0] == digests[1] and digests[0]["step"] == steps, _logs(tmp_path)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        lighthouse.kill()
        lighthouse.wait(10)


def test_dlrm_script_fault_tolerant_settings() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "dlrm"))
    import dlrm_config
    import train as dlrm_train

    config = dlrm_config.load_config(None)
    synced = dlrm_config.fault_tolerant_config(config)
    assert synced.embedding.optimizer.backend == Backend.RECOPT  # kernels with a grad_hook
    own = dlrm_config.load_config(None, ["fault_tolerance.sync_embeddings=false"])
    assert dlrm_config.fault_tolerant_config(own).embedding.optimizer.backend == Backend.AUTO
    ft_config = TorchftConfig(
        replica_id="a", lighthouse_addr="http://h:1", store_addr="h", store_port=1
    )
    with pytest.raises(ValueError, match="drop --resume"):
        dlrm_train.train(config, dlrm_train.RunEnv(), resume=True, ft_config=ft_config)
    # The first quorum waits for torchft_lighthouse --min_replicas: no setting of recopt's.
    with pytest.raises(ValueError, match="fault_tolerance.replicas"):
        dlrm_config.load_config(None, ["fault_tolerance.replicas=2"])
    env = {
        "TORCHFT_LIGHTHOUSE": "http://h:1",
        "RECOPT_FT_REPLICA_ID": "g",
        "RECOPT_FT_HOSTNAME": "n1",
        "MASTER_PORT": "29500",
    }
    config_env = fault_tolerance_config_from_env(env)
    assert (config_env.hostname, config_env.replica_id) == ("n1", "g")
    # recopt's retired lighthouse: refused, naming what to run and set instead.
    with pytest.raises(ValueError, match="RECOPT_FT_LIGHTHOUSE='h:1'.*torchft_lighthouse"):
        fault_tolerance_config_from_env({**env, "RECOPT_FT_LIGHTHOUSE": "h:1"})
