"""Measure this machine for the planner: memory bandwidth and gloo collective bandwidth.

`recopt-plan --calibrate` runs `calibrate` and writes the result as a topology file. Inter-host
bandwidth cannot be measured on one machine; the file carries the default and says so.
"""

from __future__ import annotations

import datetime
import os
import time

import torch

from recopt.sharding import comm
from recopt.sharding.planner.topology import NETWORK_10GBE_BANDWIDTH, Topology
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
    ddr = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // rph
    hbm = torch.cuda.get_device_properties(0).total_memory if cuda else 0
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
        + body
        + "\n"
    )
