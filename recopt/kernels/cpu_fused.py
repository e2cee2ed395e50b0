"""Native CPU pass that aggregates embedding gradients and applies the optimizer in one go.

A small C library (no torch headers, so it compiles in about a second) built with the system
C compiler at first use and cached; it works on raw float32 pointers, one thread per torch
intra-op thread. Each thread walks whole runs of equal ids in the id-sorted occurrences, sums
the (scaled) gradient rows of a run into a D-float buffer and updates that row and its state
in place, so no [U, D] temporary is ever materialised. When no compiler is available,
`available()` is False and the backend uses `updates.apply_update` (same formulas).
Legend: N occurrences (ids) of one table, D its dim.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import torch

logger = logging.getLogger(__name__)

# Optimizer codes shared with the C source.
OPTIMIZER_CODES: dict[str, int] = {
    "sgd": 0,
    "adagrad": 1,
    "row_wise_adagrad": 2,
    "adam": 3,
    "row_wise_adam": 4,
}

_C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int opt;
    int64_t begin, end, dim;
    const int64_t *ids, *goff;
    const float *scale, *grad;
    float *weight, *s1, *s2;
    float lr, eps, wd, sign, one_minus_beta1, one_minus_beta2, step_size;
} job_t;

/* Prefetch distance, in occurrences: hides the latency of the random row reads. */
#define PF 12

/* Sixteen partial sums: a vectorisable reduction (one serial chain would cost ~4 cycles/elem). */
static inline float sum_sq(const float *restrict x, int64_t n) {
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) part[l] += x[i + l] * x[i + l];
    float total = 0.0f;
    for (; i < n; i++) total += x[i] * x[i];
    for (int l = 0; l < 16; l++) total += part[l];
    return total;
}

/* Hyperparameters are copied to locals and pointers are restrict: otherwise every store to a
 * row could alias the job struct, which forces reloads and blocks vectorisation. */
static void update_row(const job_t *j, int64_t row, float *restrict acc) {
    const int64_t D = j->dim;
    const float lr = j->lr, eps = j->eps, wd = j->wd, step_size = j->step_size;
    const float omb1 = j->one_minus_beta1, omb2 = j->one_minus_beta2;
    float *restrict w = j->weight + row * D;
    if (wd != 0.0f)
        for (int64_t d = 0; d < D; d++) acc[d] += wd * w[d];
    switch (j->opt) {
    case 0:
        for (int64_t d = 0; d < D; d++) w[d] -= lr * acc[d];
        break;
    case 1: {
        float *restrict m = j->s1 + row * D;
        for (int64_t d = 0; d < D; d++) {
            m[d] += acc[d] * acc[d];
            w[d] -= lr * acc[d] / (sqrtf(m[d]) + eps);
        }
        break;
    }
    case 2: {
        const float mom = j->s1[row] + sum_sq(acc, D) / (float)D;
        j->s1[row] = mom;
        const float r = lr / (sqrtf(mom) + eps);
        for (int64_t d = 0; d < D; d++) w[d] -= r * acc[d];
        break;
    }
    case 3: {
        float *restrict m = j->s1 + row * D, *restrict v = j->s2 + row * D;
        for (int64_t d = 0; d < D; d++) {
            m[d] += (acc[d] - m[d]) * omb1;
            v[d] += (acc[d] * acc[d] - v[d]) * omb2;
            w[d] += -step_size * (m[d] / (sqrtf(v[d]) + eps));
        }
        break;
    }
    case 4: {
        float *restrict m = j->s1 + row * D;
        const float sq = sum_sq(acc, D);
        for (int64_t d = 0; d < D; d++) m[d] += (acc[d] - m[d]) * omb1;
        const float v = j->s2[row] + (sq / (float)D - j->s2[row]) * omb2;
        j->s2[row] = v;
        const float r = -step_size / (sqrtf(v) + eps);
        for (int64_t d = 0; d < D; d++) w[d] += r * m[d];
        break;
    }
    }
}

/* Prefetch every cache line of a row (D * 4 bytes: several lines). A macro, not a function:
 * GCC treats a static function made only of prefetches as pure and deletes its calls. */
#define PREFETCH_ROW(p, n, rw) \
    for (int64_t i_ = 0; i_ < (n); i_ += 16) __builtin_prefetch((p) + i_, rw, 3)

static void run_job(const job_t *j) {
    const int64_t D = j->dim;
    float *restrict acc = (float *)malloc(sizeof(float) * (size_t)D);
    const int rowwise_s1 = j->opt == 2, dense_s1 = j->opt == 1 || j->opt == 3 || j->opt == 4;
    int64_t k = j->begin;
    while (k < j->end) {
        const int64_t row = j->ids[k];
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        do {
            if (k + PF < j->end) {
                const int64_t pf_row = j->ids[k + PF];
                PREFETCH_ROW(j->weight + pf_row * D, D, 1);
                PREFETCH_ROW(j->grad + j->goff[k + PF], D, 0);
                if (rowwise_s1) __builtin_prefetch(j->s1 + pf_row, 1, 3);
                if (dense_s1) PREFETCH_ROW(j->s1 + pf_row * D, D, 1);
                if (j->opt == 3) PREFETCH_ROW(j->s2 + pf_row * D, D, 1);
                if (j->opt == 4) __builtin_prefetch(j->s2 + pf_row, 1, 3);
            }
            const float s = j->sign * (j->scale ? j->scale[k] : 1.0f);
            const float *restrict g = j->grad + j->goff[k];
            for (int64_t d = 0; d < D; d++) acc[d] += s * g[d];
            k++;
        } while (k < j->end && j->ids[k] == row);
        update_row(j, row, acc);
    }
    free(acc);
}

/* Chunks split the sorted occurrences at run boundaries, so each row has one owner. More
 * chunks than threads, taken dynamically, so a thread slowed by a busy core holds no one up.
 * OpenMP (not pthreads): the library links libgomp.so.1, which resolves to the copy torch has
 * loaded, so it shares torch's worker threads instead of fighting their spin-waits for cores. */
#define MAX_CHUNKS 256
int recopt_sparse_update(int opt, int64_t n, const int64_t *ids,
                         const int64_t *goff, const float *scale, const float *grad,
                         int64_t dim, float *weight, float *s1, float *s2, const float *hyper,
                         int num_threads) {
    if (num_threads < 1) num_threads = 1;
    int num_chunks = num_threads == 1 ? 1 : num_threads * 8;
    if (num_chunks > MAX_CHUNKS) num_chunks = MAX_CHUNKS;
    if (n < 2048 * (int64_t)num_chunks) num_chunks = (int)(n / 2048) + 1;
    job_t jobs[MAX_CHUNKS];
    int64_t cut[MAX_CHUNKS + 1];
    cut[0] = 0;
    cut[num_chunks] = n;
    for (int t = 1; t < num_chunks; t++) {
        int64_t c = n * t / num_chunks;
        if (c < cut[t - 1]) c = cut[t - 1];
        while (c > 0 && c < n && ids[c] == ids[c - 1]) c++;
        cut[t] = c;
    }
    for (int t = 0; t < num_chunks; t++) {
        job_t *j = &jobs[t];
        j->opt = opt; j->begin = cut[t]; j->end = cut[t + 1] > cut[t] ? cut[t + 1] : cut[t];
        j->dim = dim; j->ids = ids; j->goff = goff; j->scale = scale;
        j->grad = grad; j->weight = weight; j->s1 = s1; j->s2 = s2;
        j->lr = hyper[0]; j->eps = hyper[1]; j->wd = hyper[2]; j->sign = hyper[3];
        j->one_minus_beta1 = hyper[4]; j->one_minus_beta2 = hyper[5]; j->step_size = hyper[6];
    }
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_chunks > 1)
    for (int t = 0; t < num_chunks; t++) run_job(&jobs[t]);
    return 0;
}
"""

_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp"]
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_failed = False


def _cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"recopt-cpu-fused-{os.getuid()}")


def _build() -> ctypes.CDLL:
    """Compile the C source (once per source, flags and machine) and load it."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    key = hashlib.sha256(
        "\0".join([_C_SOURCE, *_CFLAGS, platform.machine(), platform.node()]).encode()
    ).hexdigest()[:16]
    directory = _cache_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"recopt_cpu_fused_{key}.so")
    if not os.path.exists(path):
        source = os.path.join(directory, f"src_{key}_{os.getpid()}.c")
        tmp = path + f".{os.getpid()}.tmp"
        with open(source, "w") as f:
            f.write(_C_SOURCE)
        subprocess.run(
            [compiler, *_CFLAGS, source, "-o", tmp, "-lm"], check=True, capture_output=True
        )
        os.replace(tmp, path)  # atomic: concurrent builders never see a partial library
        os.remove(source)
    library = ctypes.CDLL(path)
    fn = library.recopt_sparse_update
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64]
    fn.argtypes += [ctypes.c_void_p] * 4 + [ctypes.c_int]
    return library


def available() -> bool:
    """Whether the native library is built and loaded (builds it on first call)."""
    global _library, _load_failed
    with _lock:
        if _library is None and not _load_failed:
            try:
                _library = _build()
            except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
                _load_failed = True
                logger.warning("recopt native CPU kernel unavailable (%s); using torch ops", err)
    return _library is not None


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def sparse_update(
    code: int,
    sorted_ids_N: torch.Tensor,
    goff_N: torch.Tensor,
    scale_N: torch.Tensor | None,
    grad: torch.Tensor,
    weight: torch.Tensor,
    state1: torch.Tensor | None,
    state2: torch.Tensor | None,
    hyper: list[float],
) -> None:
    """Aggregate the gradient of every touched row and update the row and its state.

    Args:
        code: optimizer code (`OPTIMIZER_CODES`).
        sorted_ids_N: the table's occurrence ids, sorted (int64, contiguous).
        goff_N: per sorted occurrence, element offset of its gradient row in ``grad`` (in
            sorted order, so the pass reads it sequentially and can prefetch the row early).
        scale_N: per sorted occurrence, the factor on its gradient (per-sample weight,
            1/length for mean pooling), or None for 1.
        grad: the pooled-output gradient, contiguous float32.
        weight: ``[R, D]`` contiguous float32 table, updated in place.
        state1: first state tensor (momentum1 / exp_avg) or None.
        state2: second state tensor (exp_avg_sq) or None.
        hyper: lr, eps, weight_decay, sign (-1 to maximize), 1 - beta1, 1 - beta2,
            step_size (the differences taken in double, as torch's optimizers do).

    Raises:
        RuntimeError: the native library is not available.
    """
    if _library is None:
        raise RuntimeError("sparse_update: native library not loaded; call available() first")
    hyper_t = torch.tensor(hyper + [0.0] * (8 - len(hyper)), dtype=torch.float32)
    _library.recopt_sparse_update(
        code,
        sorted_ids_N.numel(),
        _ptr(sorted_ids_N),
        _ptr(goff_N),
        _ptr(scale_N),
        _ptr(grad),
        weight.shape[1],
        _ptr(weight),
        _ptr(state1),
        _ptr(state2),
        _ptr(hyper_t),
        torch.get_num_threads(),
    )
