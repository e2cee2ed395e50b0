"""make_fault_tolerant on the DLRM model: a late replica heals to the exact DLRM state.

Two replica groups run as threads of this process (each with its own Manager, checkpoint
server and gloo group) around an in-process lighthouse: cheap, yet every byte of the healing
path (serialise, HTTP, strict in-place KeyedOptimizer load) is the real one.
"""

from __future__ import annotations

import copy
import datetime
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ft_cluster import Cluster, wait_for
from torch import nn

from recopt.ft.launch import FaultTolerantTraining, make_fault_tolerant, manager_config_from_env
from recopt.ft.lighthouse import Lighthouse, LighthouseConfig
from recopt.ft.manager import ManagerConfig
from recopt.kernels.config import Backend
from recopt.models.dlrm import DLRM, DLRMConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, FusedOptimizerConfig
from recopt.optim import CombinedOptimizer, KeyedOptimizerWrapper
from recopt.sparse import KeyedJaggedTensor

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
def lighthouse() -> Iterator[Lighthouse]:
    # Long: under load, b may take a while to join, and a must wait for it.
    config = LighthouseConfig(join_timeout=datetime.timedelta(seconds=30))
    server = Lighthouse(config, host="127.0.0.1", port=0)
    server.start()
    try:
        yield server
    finally:
        server.shutdown()


def _config(name: str, port: int) -> ManagerConfig:
    timeout = datetime.timedelta(seconds=20)
    return ManagerConfig(
        replica_id=name,
        lighthouse=("127.0.0.1", port),
        timeout=timeout,
        quorum_timeout=timeout,
        hostname="127.0.0.1",
    )


def test_late_replica_heals_to_the_exact_dlrm_state(lighthouse: Lighthouse) -> None:
    model_a, opt_a = _dlrm(seed=1)
    model_b, opt_b = _dlrm(seed=2)
    with pytest.raises(ValueError, match="backend='recopt'"):  # fbgemm tables have no hook
        make_fault_tolerant(model_a, opt_a, _config("a", lighthouse.port))
    ft_a = make_fault_tolerant(model_a, opt_a, _config("a", lighthouse.port), sync_embeddings=False)
    ft_b = None
    try:
        for _ in range(3):
            _step(ft_a, model_a, seed=1)
        assert ft_a.manager.current_step() == 3
        ft_b = make_fault_tolerant(
            model_b, opt_b, _config("b", lighthouse.port), sync_embeddings=False
        )
        a_before = _state(model_a, opt_a)
        healed: dict[str, Any] = {}

        def record() -> None:
            healed.update(_state(model_b, opt_b))  # right after b's quorum, i.e. its heal

        threads = [
            threading.Thread(target=_step, args=(ft_a, model_a, 1)),
            threading.Thread(target=_step, args=(ft_b, model_b, 2, record)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
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
        "fault_tolerance.replicas": 2,
        "fault_tolerance.timeout_s": 30,
    }
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def _train_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(json.loads(line)["step"]) for line in lines if '"train"' in line]


@pytest.mark.multiprocess
def test_dlrm_script_replicas_agree_and_a_restarted_one_heals(tmp_path: Path) -> None:
    """Lighthouse + 2 `train.py --fault-tolerant` replicas; b is SIGKILLed and restarted.

    Both finish bit-identical (state digest of model and optimizer); the restarted b starts
    at the step it healed to, not at step 1. ``--min-replicas 2`` makes a wait for b.
    """
    steps = 8
    cluster = Cluster(tmp_path)
    try:
        cluster.start_lighthouse(min_replicas=2, join_s=1.0, hb_s=1.0, cli=True)
        cluster.start_dlrm("a", *_dlrm_args(tmp_path / "a", steps, seed=1))
        cluster.start_dlrm("b", *_dlrm_args(tmp_path / "b", steps, seed=2))
        wait_for(lambda: len(_train_steps(tmp_path / "b")) >= 2, 120, "b's second step")
        cluster.kill("b")
        before = _train_steps(tmp_path / "b")
        assert before == list(range(1, len(before) + 1)) and len(before) < steps
        cluster.start_dlrm("b", *_dlrm_args(tmp_path / "b", steps, seed=2))
        for name in ("a", "b"):
            assert cluster.replicas[name].wait(timeout=120) == 0, cluster.logs()
        after = _train_steps(tmp_path / "b")[len(before) :]
        assert after[0] > 1 and after[-1] == steps, after  # healed, not restarted at step 1
        digests = [json.loads((tmp_path / n / "state_digest.json").read_text()) for n in "ab"]
        assert digests[0] == digests[1] and digests[0]["step"] == steps, cluster.logs()
    finally:
        cluster.close()


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
    with pytest.raises(ValueError, match="drop --resume"):
        dlrm_train.train(config, dlrm_train.RunEnv(), resume=True, ft_config=_config("a", 1))
    with pytest.raises(ValueError, match="fault_tolerance.replicas must be >= 1"):
        dlrm_config.load_config(None, ["fault_tolerance.replicas=0"])
    env = {"RECOPT_FT_LIGHTHOUSE": "h:1", "RECOPT_FT_REPLICA_ID": "g", "RECOPT_FT_HOSTNAME": "n1"}
    assert manager_config_from_env(env).hostname == "n1"
