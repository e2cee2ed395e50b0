"""Measure this machine for the planner: memory bandwidth (HBM and UVM on a GPU), gloo collective
bandwidth, and each fused optimizer's kernel speed per backend, with the one AUTO picks.

`recopt-plan --calibrate` runs `calibrate` and writes the result as a topology file. Inter-host
bandwidth cannot be measured on one machine; the file carries the default and says so.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch

from recopt import comm
from recopt.kernels.autotune import (
    PROBE_MAX_ROWS,
    ShapeClass,
    default_resolver,
    measure,
    probe_samplers,
)
from recopt.kernels.config import Backend, FusedOptimizerConfig, TableSpec
from recopt.kernels.fbgemm_backend import fbgemm_problems
from recopt.kernels.registry import OPTIMIZERS
from recopt.sharding.planner.topology import NETWORK_10GBE_BANDWIDTH, Topology, host_memory_bytes
from recopt.testing import run_on_ranks


def measure_memory_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second read or written by one large tensor copy (best of ``repeats``).

    A copy reads ``num_bytes`` and writes ``num_bytes``, so both count.
    """
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages is not what we measure
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def measure_cuda_bandwidths(num_bytes: int = 256 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """(HBM, UVM) bytes per second on the current GPU, best of ``repeats``.

    HBM: one device-to-device copy (read + write). UVM: the GPU gathers rows by random index
    (``index_select``) from a unified tensor made as fbgemm makes its UVM tables
    (``new_unified_tensor``, host-preferred managed memory); rows of 256 bytes (dim 64).
    """
    device = torch.device("cuda")
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    hbm = 2 * src.numel() * 4 / _best_cuda_seconds(lambda: dst.copy_(src), repeats)
    import fbgemm_gpu  # noqa: F401  registers torch.ops.fbgemm

    rows = num_bytes // 4 // 64
    host = torch.ops.fbgemm.new_unified_tensor(
        torch.zeros(1, device=device), [rows, 64], is_host_mapped=False
    )
    index = torch.randint(0, rows, (rows // 4,), device=device)
    out = torch.empty(rows // 4, 64, device=device)
    seconds = _best_cuda_seconds(lambda: torch.index_select(host, 0, index, out=out), repeats)
    return hbm, index.numel() * 64 * 4 / seconds


def _best_cuda_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first touch and kernel load are not what we measure
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _all_to_all_rank(rank: int, world_size: int, num_bytes: int, repeats: int) -> float:
    """Best seconds for one all-to-all of ``num_bytes`` per rank (runs on every rank)."""
    numel = num_bytes // 4 // world_size * world_size
    send = torch.ones(numel, dtype=torch.float32)
    recv = torch.empty_like(send)
    timeout = datetime.timedelta(seconds=60)
    best = float("inf")
    for i in range(repeats + 1):
        comm.barrier(None, timeout)
        start = time.perf_counter()
        splits = [numel // world_size] * world_size
        comm.all_to_all_flat(send, splits, splits, None, out=recv)
        if i > 0:  # the first exchange sets up the connections
            best = min(best, time.perf_counter() - start)
    return best


def measure_collective_bandwidth(
    num_bytes: int = 64 * 2**20, world_size: int = 2, repeats: int = 5
) -> float:
    """Bytes per second one rank sends to the others in a gloo all-to-all on this machine.

    Args:
        num_bytes: bytes each rank exchanges per all-to-all.
        world_size: local ranks to spawn.
        repeats: measured exchanges (the best one counts).
    """
    seconds = run_on_ranks(_all_to_all_rank, world_size, num_bytes, repeats, timeout_s=300.0)
    sent = num_bytes * (world_size - 1) / world_size
    return sent / max(seconds)


def measure_kernels(
    device: str = "cpu", dim: int = 64, rows: int = PROBE_MAX_ROWS
) -> tuple[dict[str, str], dict[str, float]]:
    """Time every fused optimizer's kernel on each backend that can run it, on AUTO's probe.

    fbgemm-capable optimizers go through the process's AUTO resolver, so the choice recorded
    here is the one training will make (it honours a pin and fills the decision cache).

    Args:
        device: ``cpu`` or ``cuda``.
        dim: the probe's embedding dim.
        rows: the probe's rows (a power of two).

    Returns:
        (optimizer -> chosen backend, ``"<optimizer>/<backend>"`` -> seconds per id of a
        forward + backward + fused update).
    """
    resolver = default_resolver()
    config = resolver.config
    ids = config.probe_bags * config.ids_per_bag
    backends: dict[str, str] = {}
    seconds_per_id: dict[str, float] = {}
    probe = [TableSpec(name="probe", num_embeddings=rows, embedding_dim=dim)]
    for name in OPTIMIZERS:
        optimizer = FusedOptimizerConfig(name=name)
        shape = ShapeClass(device=device, optimizer=name, dim=dim, rows=rows)
        able = not fbgemm_problems(probe, optimizer, torch.device(device))
        candidates = [Backend.FBGEMM, Backend.RECOPT] if able else [Backend.RECOPT]
        decision = resolver.resolve(shape, optimizer, candidates)
        seconds = dict(decision.seconds)
        if set(seconds) != {b.value for b in candidates}:  # pinned or one candidate: time it
            samplers = probe_samplers(shape, optimizer, candidates, config)
            seconds = {b.value: s for b, s in measure(samplers, config.repeats).items()}
        backends[name] = decision.backend.value
        for backend, s in seconds.items():
            seconds_per_id[f"{name}/{backend}"] = s / ids
    return backends, seconds_per_id


def calibrate(ranks_per_host: int | None = None, quick: bool = False) -> Topology:
    """A topology for this machine (``world_size`` = ``ranks_per_host``, one host).

    Args:
        ranks_per_host: ranks that will share this machine (default: the GPU count on cuda,
            else 2, the ranks the collective measurement spawns); its memory is divided among
            them.
        quick: smaller transfers (for tests; less accurate).

    Returns:
        The measured topology; the inter-host bandwidth is not measured: 10 Gb/s, capped at the
        measured local all-to-all bandwidth.
    """
    cuda = torch.cuda.is_available()
    rph = ranks_per_host or (torch.cuda.device_count() if cuda else 2)
    scale = 16 if quick else 1
    memory_bw = measure_memory_bandwidth(256 * 2**20 // scale, repeats=3 if quick else 5)
    comm_bw = measure_collective_bandwidth(64 * 2**20 // scale, repeats=2 if quick else 5)
    backends, kernel_seconds = measure_kernels(
        "cuda" if cuda else "cpu", rows=PROBE_MAX_ROWS // scale
    )
    ddr = host_memory_bytes(rph)
    # The GPU's whole memory (a file describes the machine, not this moment's free memory).
    hbm = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    uvm: dict[str, float] = {}
    if cuda:  # the tables live in HBM, and UVM tables are read over the host link
        hbm_bw, uvm_bw = measure_cuda_bandwidths(256 * 2**20 // scale, repeats=3 if quick else 5)
        memory_bw = hbm_bw
        uvm = {"uvm_bandwidth": float(int(uvm_bw))}
    return Topology(
        world_size=rph,
        ranks_per_host=rph,
        device="cuda" if cuda else "cpu",
        hbm_bytes=int(hbm),
        ddr_bytes=int(ddr),
        memory_bandwidth=float(int(memory_bw)),
        intra_host_bandwidth=float(int(comm_bw)),
        # Not measurable here; a 10 Gb/s network, never assumed faster than local gloo.
        inter_host_bandwidth=min(NETWORK_10GBE_BANDWIDTH, float(int(comm_bw))),
        kernel_backends=backends,
        kernel_seconds_per_id=kernel_seconds,
        **uvm,
    )


def topology_file_text(topology: Topology) -> str:
    """The topology as a commented TOML file (``world_size`` left to ``--world-size``)."""
    body = "\n".join(
        line for line in topology.to_toml().splitlines() if not line.startswith("world_size")
    )
    return (
        "# Written by `recopt-plan --calibrate`; read with `recopt-plan --topology FILE`.\n"
        "# memory_bandwidth: one tensor copy; intra_host_bandwidth: gloo all-to-all between\n"
        "# local ranks. inter_host_bandwidth is NOT measured (one machine): 10 Gb/s capped at the\n"
        "# local figure; edit it for your network (bytes/s; 1.25e9 is 10 Gb/s).\n"
        "# seconds_per_id and row_stat_seconds_per_id are NOT measured: the defaults come from\n"
        "# the sharded module on the development VM (docs/planner.md, 'Does the model predict?').\n"
        "# kernel_backends: the backend Backend.AUTO picks for each fused optimizer here;\n"
        "# kernel_seconds_per_id: each optimizer's kernel, per backend, timed on AUTO's probe\n"
        "# (fwd + bwd + update, seconds per id); the cost model uses the one that will run.\n"
        "# On cuda, memory_bandwidth is one HBM copy and uvm_bandwidth a random row gather from\n"
        "# host-mapped memory; elsewhere uvm_bandwidth is the default (no UVM on cpu).\n"
        + body
        + "\n"
    )
