"""recopt's CUDA update for sgd, (row-wise) Adagrad and (row-wise) Adam, in two Triton launches.

The torch path finds the touched rows with ``torch.unique``, whose data-sized output makes the
host wait for the device once per table. Here nothing has a data-dependent size: a table's
occurrences are sorted by id (``torch.sort``, N known on the host) and one program per sorted
position runs. The sorted positions are cut into chunks of ``CHUNK`` (a segmented reduction): the
first position of each run of equal ids, and of each chunk a long run covers, sums that piece
(scaled; at most CHUNK copies). A run wholly inside one chunk is applied there (sign and L2,
then the row and its state updated as `cpu_fused.c`'s ``update_row``, same optimizer codes:
`OptimizerSpec.c_code`); a run crossing chunks leaves a partial sum per chunk, and a second
launch lets the chunk where it begins add them and update the row. A hot id with L copies takes
CHUNK + L / CHUNK serial steps, not L; distinct ids keep one program each, as many programs as
occurrences. Every row is written by exactly one program. Imported
only where Triton is; under ``TRITON_INTERPRET=1`` it also runs on CPU tensors (the CPU tests).
Legend: N occurrences of one table, D its dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor


# Occurrences one program sums. A run of L copies of one id costs at most CHUNK + L / CHUNK
# serial steps (its chunks in parallel, then one combine) instead of L: the DLRM script's
# power-law ids put ~1,600 copies of the hottest id in one feature at batch 16384.
CHUNK = 64


@triton.jit
def _apply_row(
    key,
    acc,
    cols,
    mask,
    weight_ptr,
    s1_ptr,
    s2_ptr,
    D,
    lr,
    eps,
    weight_decay,
    sign,
    one_minus_beta1,
    one_minus_beta2,
    step_size,
    OPT: tl.constexpr,
):
    """Row ``key``'s update from its summed gradient ``acc`` (cpu_fused.c's ``update_row``)."""
    row = weight_ptr + key * D + cols
    w = tl.load(row, mask=mask, other=0.0)
    acc = acc * sign + weight_decay * w
    if OPT == 0:  # sgd
        w = w - lr * acc
    elif OPT == 1:  # adagrad
        m = tl.load(s1_ptr + key * D + cols, mask=mask, other=0.0) + acc * acc
        tl.store(s1_ptr + key * D + cols, m, mask=mask)
        w = w - lr * acc / (tl.sqrt(m) + eps)
    elif OPT == 2:  # row-wise adagrad
        mom = tl.load(s1_ptr + key) + tl.sum(acc * acc, axis=0) / D
        tl.store(s1_ptr + key, mom)
        w = w - (lr / (tl.sqrt(mom) + eps)) * acc
    elif OPT == 3:  # adam
        m = tl.load(s1_ptr + key * D + cols, mask=mask, other=0.0)
        v = tl.load(s2_ptr + key * D + cols, mask=mask, other=0.0)
        m = m + (acc - m) * one_minus_beta1
        v = v + (acc * acc - v) * one_minus_beta2
        tl.store(s1_ptr + key * D + cols, m, mask=mask)
        tl.store(s2_ptr + key * D + cols, v, mask=mask)
        w = w - step_size * (m / (tl.sqrt(v) + eps))
    else:  # row-wise adam
        m = tl.load(s1_ptr + key * D + cols, mask=mask, other=0.0)
        m = m + (acc - m) * one_minus_beta1
        tl.store(s1_ptr + key * D + cols, m, mask=mask)
        v_row = tl.load(s2_ptr + key)
        v_row = v_row + (tl.sum(acc * acc, axis=0) / D - v_row) * one_minus_beta2
        tl.store(s2_ptr + key, v_row)
        w = w - (step_size / (tl.sqrt(v_row) + eps)) * m
    tl.store(row, w, mask=mask)


@triton.jit
def _piece_kernel(
    ids_ptr,
    goff_ptr,
    scale_ptr,
    grad_ptr,
    first_ptr,
    last_ptr,
    weight_ptr,
    s1_ptr,
    s2_ptr,
    N,
    D,
    lr,
    eps,
    weight_decay,
    sign,
    one_minus_beta1,
    one_minus_beta2,
    step_size,
    OPT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per sorted position; the first position of a run, and of each chunk a run
    covers, sums that piece (at most CHUNK copies). A run wholly inside one chunk updates its
    row here. A piece of a run that began in an earlier chunk goes to ``first[c]``; the piece
    where a run begins, when the run goes on past its chunk, to ``last[c]`` (for
    `_combine_kernel`)."""
    pos = tl.program_id(0).to(tl.int64)
    key = tl.load(ids_ptr + pos)
    previous = tl.load(ids_ptr + pos - 1, mask=pos > 0, other=-1)
    if (key != previous) | (pos % CHUNK == 0):  # a piece starts here
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        c = pos // CHUNK
        chunk_end = tl.minimum((c + 1) * CHUNK, N)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        j = pos
        more = pos < chunk_end
        while more:
            g = tl.load(grad_ptr + tl.load(goff_ptr + j) + cols, mask=mask, other=0.0)
            if HAS_SCALE:
                g = g * tl.load(scale_ptr + j)
            acc += g
            j += 1
            more = (j < chunk_end) & (tl.load(ids_ptr + j, mask=j < chunk_end, other=-1) == key)
        goes_on = (j == chunk_end) & (tl.load(ids_ptr + j, mask=j < N, other=-1) == key)
        if key == previous:  # the run began in an earlier chunk
            tl.store(first_ptr + c * D + cols, acc, mask=mask)
        elif goes_on:
            tl.store(last_ptr + c * D + cols, acc, mask=mask)
        else:
            _apply_row(key, acc, cols, mask, weight_ptr, s1_ptr, s2_ptr, D, lr, eps,
                       weight_decay, sign, one_minus_beta1, one_minus_beta2, step_size,
                       OPT)  # fmt: skip


@triton.jit
def _combine_kernel(
    ids_ptr,
    first_ptr,
    last_ptr,
    weight_ptr,
    s1_ptr,
    s2_ptr,
    N,
    D,
    lr,
    eps,
    weight_decay,
    sign,
    one_minus_beta1,
    one_minus_beta2,
    step_size,
    OPT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The chunk where a run crossing chunks begins adds the later chunks' pieces to its own
    and updates the row: one load per chunk the run covers."""
    c = tl.program_id(0).to(tl.int64)
    start = c * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    key = tl.load(ids_ptr + stop - 1)
    goes_on = (tl.load(ids_ptr + stop, mask=stop < N, other=-1) == key).to(tl.int32)
    before = tl.load(ids_ptr + start - 1, mask=start > 0, other=-1)
    if goes_on * (before != key).to(tl.int32) != 0:  # the run begins here and goes on
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        acc = tl.load(last_ptr + c * D + cols, mask=mask, other=0.0)
        j = c + 1
        more = j * CHUNK < N
        while more:  # chunk j begins with a piece of the run
            acc += tl.load(first_ptr + j * D + cols, mask=mask, other=0.0)
            j += 1
            head = tl.load(ids_ptr + j * CHUNK, mask=j * CHUNK < N, other=-1)
            more = (j * CHUNK < N) & (head == key)
        _apply_row(key, acc, cols, mask, weight_ptr, s1_ptr, s2_ptr, D, lr, eps, weight_decay,
                   sign, one_minus_beta1, one_minus_beta2, step_size, OPT)  # fmt: skip


def sparse_update(
    code: int,
    ids_N: Tensor,
    goff_N: Tensor,
    scale_N: Tensor | None,
    grad_out: Tensor,
    weight: Tensor,
    state1: Tensor | None,
    state2: Tensor | None,
    hyper: tuple[float, float, float, float, float, float],
    step_size: float,
    chunk: int = CHUNK,
) -> None:
    """Sum each touched row's gradient and apply the optimizer to it and its state, in place.

    Args:
        code: the optimizer's `OptimizerSpec.c_code` (0 sgd ... 4 row-wise adam).
        ids_N: the table's ids, one per occurrence (any order; int64).
        goff_N: per occurrence, the flat offset of its bag's row in ``grad_out``.
        scale_N: per occurrence, the factor on its gradient (weights, 1/length), or None.
        grad_out: the pooled-output gradient, contiguous float32.
        weight: the ``[R, D]`` float32 table; ``state1`` / ``state2``: its state (or None).
        hyper: lr, eps, weight_decay, sign (-1 to maximize), 1 - beta1, 1 - beta2.
        step_size: Adam's bias-corrected step size (0 otherwise).
        chunk: occurrences a program sums (`CHUNK`; tests make it small to cross chunks).
    """
    count = ids_N.numel()
    if count == 0:
        return
    sorted_ids, order = torch.sort(ids_N.to(torch.int64))  # int64: row * D may pass 2^31
    goff = goff_N.index_select(0, order).to(torch.int64)
    scale = None if scale_N is None else scale_N.index_select(0, order).float()
    dim = weight.shape[1]
    chunks = triton.cdiv(count, chunk)
    # Pieces of runs that cross chunks: [chunks, D] each, only read where written.
    first = torch.empty(chunks, dim, dtype=torch.float32, device=weight.device)
    last = torch.empty(chunks, dim, dtype=torch.float32, device=weight.device)
    state = (weight if state1 is None else state1, weight if state2 is None else state2)
    hypers = (count, dim, *hyper, step_size)  # N, D, lr, eps, weight_decay, sign, 1-b1, 1-b2, ...
    block = triton.next_power_of_2(dim)
    _piece_kernel[(count,)](
        sorted_ids,
        goff,
        goff if scale is None else scale,  # an unused pointer when HAS_SCALE is False
        grad_out,
        first,
        last,
        weight,
        *state,
        *hypers,
        OPT=code,
        HAS_SCALE=scale is not None,
        BLOCK_D=block,
        CHUNK=chunk,
    )
    _combine_kernel[(chunks,)](
        sorted_ids, first, last, weight, *state, *hypers, OPT=code, BLOCK_D=block, CHUNK=chunk
    )
