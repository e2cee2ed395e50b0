/* recopt's native CPU embedding kernel: pooling, sorted-occurrence preparation, gradient
 * aggregation fused with the optimizer update. Loaded through ctypes by cpu_fused.py, which
 * compiles it with the system C compiler at first use (no torch headers). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "cpu_round.h"

/* One slot of a table's rows, the weights or one optimizer state tensor: width values a row
 * (0: the optimizer has no such state), stored as float32 (kind 0) or as fp16 (1) or bf16 (2)
 * bit patterns, which are updated in float32 and rounded back. */
typedef struct {
    void *data;
    int64_t width;
    int kind;
} slot_t;

/* One table: its rows are keys [base, end) of the pass's global key space. */
typedef struct {
    int64_t base, end, dim;
    slot_t slot[3]; /* weights, state 1 (momentum1 / exp_avg), state 2 (exp_avg_sq) */
    uint64_t seed;  /* stochastic rounding: element (key, slot, column) hashes it */
    float step_size;
} table_t;

/* What every chunk of one backward pass shares. */
typedef struct {
    int opt, num_tables, stochastic; /* stochastic: else fp16/bf16 round to nearest even */
    int64_t max_dim;
    const uint64_t *packed; /* key << 32 | gradient-row offset, sorted by key */
    const float *scale, *grad;
    const table_t *tables;
    float lr, eps, wd, sign, one_minus_beta1, one_minus_beta2;
} pass_t;

/* Prefetch distance, in occurrences: hides the latency of the random row reads. */
#define PF 12

/* An occurrence is one word: its key (table base + row) above its gradient-row offset. */
#define KEY(w) ((int64_t)((w) >> 32))
#define GOFF(w) ((int64_t)((w) & 0xffffffffu))

/* Prefetch every cache line of a row (D * 4 bytes: several lines). A macro, not a function:
 * GCC treats a static function made only of prefetches as pure and deletes its calls. */
#define PREFETCH_ROW(p, n, rw) \
    for (int64_t i_ = 0; i_ < (n); i_ += 16) __builtin_prefetch((p) + i_, rw, 3)

/* The same for row `row` of a slot, by its bytes (4 or 2 a value), for writing. */
#define PREFETCH_SLOT(s, row)                                                                \
    do {                                                                                     \
        const int64_t bytes_ = (s)->width * ((s)->kind ? 2 : 4);                             \
        const char *at_ = (const char *)(s)->data + (row) * bytes_;                          \
        for (int64_t i_ = 0; i_ < bytes_; i_ += 64) __builtin_prefetch(at_ + i_, 1, 3);     \
    } while (0)

/* Row `row` of a slot as float32: the stored row itself for float32, else converted into buf. */
static inline float *open_slot(const slot_t *s, int64_t row, float *buf) {
    if (!s->kind) return (float *)s->data + row * s->width;
    load_row((const uint16_t *)s->data + row * s->width, buf, s->width, s->kind);
    return buf;
}

/* Write back a row that open_slot converted (fp16 / bf16), rounded with the slot's key. */
static inline void close_slot(const slot_t *s, int64_t row, const float *buf, int stochastic,
                              uint64_t key) {
    if (s->kind)
        store_row(buf, (uint16_t *)s->data + row * s->width, s->width, s->kind, stochastic, key);
}

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
 * row could alias the structs, which forces reloads and blocks vectorisation. fp16 / bf16
 * slots are updated in float32 copies (buf: three rows of max_dim) and rounded back. */
static void update_row(const pass_t *p, const table_t *tb, int64_t row, float *restrict acc,
                       float *restrict buf) {
    const int64_t D = tb->dim;
    const float lr = p->lr, eps = p->eps, wd = p->wd, step_size = tb->step_size;
    const float omb1 = p->one_minus_beta1, omb2 = p->one_minus_beta2;
    const slot_t *slot = tb->slot;
    float *restrict w = open_slot(&slot[0], row, buf);
    float *restrict s1 = slot[1].width ? open_slot(&slot[1], row, buf + p->max_dim) : NULL;
    float *restrict s2 = slot[2].width ? open_slot(&slot[2], row, buf + 2 * p->max_dim) : NULL;
    if (wd != 0.0f)
        for (int64_t d = 0; d < D; d++) acc[d] += wd * w[d];
    switch (p->opt) {
    case 0:
        for (int64_t d = 0; d < D; d++) w[d] -= lr * acc[d];
        break;
    case 1:
        for (int64_t d = 0; d < D; d++) {
            s1[d] += acc[d] * acc[d];
            w[d] -= lr * acc[d] / (sqrtf(s1[d]) + eps);
        }
        break;
    case 2: {
        s1[0] += sum_sq(acc, D) / (float)D;
        const float r = lr / (sqrtf(s1[0]) + eps);
        for (int64_t d = 0; d < D; d++) w[d] -= r * acc[d];
        break;
    }
    case 3:
        for (int64_t d = 0; d < D; d++) {
            s1[d] += (acc[d] - s1[d]) * omb1;
            s2[d] += (acc[d] * acc[d] - s2[d]) * omb2;
            w[d] += -step_size * (s1[d] / (sqrtf(s2[d]) + eps));
        }
        break;
    case 4: {
        const float sq = sum_sq(acc, D);
        for (int64_t d = 0; d < D; d++) s1[d] += (acc[d] - s1[d]) * omb1;
        s2[0] += (sq / (float)D - s2[0]) * omb2;
        const float r = -step_size / (sqrtf(s2[0]) + eps);
        for (int64_t d = 0; d < D; d++) w[d] += r * s1[d];
        break;
    }
    }
    if (!(slot[0].kind | slot[1].kind | slot[2].kind)) return; /* float32: updated in place */
    const uint64_t key = p->stochastic ? block_key(tb->seed, (uint64_t)(tb->base + row)) : 0;
    close_slot(&slot[0], row, w, p->stochastic, key);
    if (s1) close_slot(&slot[1], row, s1, p->stochastic, slot_key(key, 1));
    if (s2) close_slot(&slot[2], row, s2, p->stochastic, slot_key(key, 2));
}

/* A macro for the reason PREFETCH_ROW is one. */
#define PREFETCH_OCCURRENCE(p, tb, k)                                              \
    do {                                                                           \
        const int64_t row_ = KEY((p)->packed[k]) - (tb)->base;                     \
        for (int s_ = 0; s_ < 3; s_++) PREFETCH_SLOT(&(tb)->slot[s_], row_);       \
        PREFETCH_ROW((p)->grad + GOFF((p)->packed[k]), (tb)->dim, 0);              \
    } while (0)

/* Keys are sorted, so the table of the current (and of the prefetched) key only moves up. */
static void run_chunk(const pass_t *p, int64_t begin, int64_t end) {
    float *restrict acc = (float *)malloc(sizeof(float) * (size_t)p->max_dim);
    float *restrict buf = (float *)malloc(sizeof(float) * 3 * (size_t)p->max_dim);
    int t = 0, pt = 0;
    while (p->tables[t].end <= KEY(p->packed[begin])) t++;
    pt = t;
    int64_t k = begin;
    while (k < end) {
        const int64_t key = KEY(p->packed[k]);
        while (p->tables[t].end <= key) t++;
        const table_t *tb = &p->tables[t];
        const int64_t D = tb->dim;
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        do {
            if (k + PF < end) {
                while (p->tables[pt].end <= KEY(p->packed[k + PF])) pt++;
                PREFETCH_OCCURRENCE(p, &p->tables[pt], k + PF);
            }
            const float s = p->sign * (p->scale ? p->scale[k] : 1.0f);
            const float *restrict g = p->grad + GOFF(p->packed[k]);
            for (int64_t d = 0; d < D; d++) acc[d] += s * g[d];
            k++;
        } while (k < end && KEY(p->packed[k]) == key);
        update_row(p, tb, key - tb->base, acc, buf);
    }
    free(acc);
    free(buf);
}

/* Per occurrence (parallel over bags): its key (table base + id), the offset of its bag's
 * gradient row in grad_out, and its scale (per-sample weight, times 1/length when mean). */
int recopt_prepare(int64_t num_bags, int64_t batch, const int64_t *offsets, const int64_t *ids,
                   const float *weights, int mean, const int64_t *feature_base,
                   const int64_t *feature_col, int64_t out_dim, uint64_t *packed,
                   float *scale, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_bags > 4096)
    for (int64_t bag = 0; bag < num_bags; bag++) {
        const int64_t f = bag / batch, lo = offsets[bag], hi = offsets[bag + 1];
        const int64_t base = feature_base[f], row = (bag - f * batch) * out_dim + feature_col[f];
        const float inv = mean && hi > lo ? 1.0f / (float)(hi - lo) : 1.0f;
        for (int64_t k = lo; k < hi; k++) {
            packed[k] = ((uint64_t)(base + ids[k]) << 32) | (uint64_t)row;
            if (scale) scale[k] = weights ? weights[k] * inv : inv;
        }
    }
    return 0;
}

/* One bag: the accumulator lives in registers when D is a compile-time constant. */
#define POOL_BAG(DIM)                                                                      \
    do {                                                                                   \
        float acc_[DIM];                                                                   \
        for (int64_t d = 0; d < (DIM); d++) acc_[d] = 0.0f;                                \
        for (int64_t k = lo; k < hi; k++) {                                                \
            if (k + PF < feature_end) PREFETCH_ROW(table + ids[k + PF] * (DIM), (DIM), 0); \
            const float s = weights ? weights[k] : 1.0f;                                   \
            const float *restrict row = table + ids[k] * (DIM);                            \
            for (int64_t d = 0; d < (DIM); d++) acc_[d] += s * row[d];                     \
        }                                                                                  \
        const float inv = mean && hi > lo ? 1.0f / (float)(hi - lo) : 1.0f;                \
        for (int64_t d = 0; d < (DIM); d++) o[d] = acc_[d] * inv;                          \
    } while (0)

/* The same for bf16 rows (kind 2), converted to float32 (a 16-bit shift) as they are summed. */
#define POOL_BAG_REDUCED(DIM, AT)                                                         \
    do {                                                                                   \
        float acc_[DIM];                                                                   \
        for (int64_t d = 0; d < (DIM); d++) acc_[d] = 0.0f;                                \
        for (int64_t k = lo; k < hi; k++) {                                                \
            if (k + PF < feature_end) PREFETCH_HALF_ROW(half + ids[k + PF] * (DIM), (DIM)); \
            const float s = weights ? weights[k] : 1.0f;                                   \
            const uint16_t *restrict row = half + ids[k] * (DIM);                          \
            for (int64_t d = 0; d < (DIM); d++) acc_[d] += s * AT(row, d);                 \
        }                                                                                  \
        const float inv = mean && hi > lo ? 1.0f / (float)(hi - lo) : 1.0f;                \
        for (int64_t d = 0; d < (DIM); d++) o[d] = acc_[d] * inv;                          \
    } while (0)
#ifdef __F16C__
/* fp16 rows with F16C: eight lanes converted at a time, the sums kept in registers. */
#define POOL_BAG_F16(DIM)                                                                  \
    do {                                                                                   \
        __m256 acc_[(DIM) / 8];                                                            \
        for (int j = 0; j < (DIM) / 8; j++) acc_[j] = _mm256_setzero_ps();                 \
        for (int64_t k = lo; k < hi; k++) {                                                \
            if (k + PF < feature_end) PREFETCH_HALF_ROW(half + ids[k + PF] * (DIM), (DIM)); \
            const __m256 s = _mm256_set1_ps(weights ? weights[k] : 1.0f);                  \
            const uint16_t *restrict row = half + ids[k] * (DIM);                          \
            for (int j = 0; j < (DIM) / 8; j++)                                            \
                acc_[j] += s * _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 8 * j))); \
        }                                                                                  \
        const __m256 inv = _mm256_set1_ps(mean && hi > lo ? 1.0f / (float)(hi - lo) : 1.0f); \
        for (int j = 0; j < (DIM) / 8; j++) _mm256_storeu_ps(o + 8 * j, acc_[j] * inv);    \
    } while (0)
#endif
#define BF16_AT(h, i) bf16_to_float((h)[i])
/* A row of n 2-byte values: one prefetch per 64-byte line. */
#define PREFETCH_HALF_ROW(p, n) \
    for (int64_t i_ = 0; i_ < (n); i_ += 32) __builtin_prefetch((p) + i_, 0, 3)

/* Forward: every bag of every feature in one parallel loop (one fork/join per batch, not
 * one per feature). meta: per feature, the table's weight pointer (as int64), its dim, and its
 * weight kind (0 float32, 1 fp16, 2 bf16: converted to float32 as they are summed). */
int recopt_pool(int64_t num_bags, int64_t batch, const int64_t *offsets, const int64_t *ids,
                const float *weights, int mean, const int64_t *meta, const int64_t *feature_col,
                int64_t out_dim, float *out, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t num_features = num_bags / (batch > 0 ? batch : 1);
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_bags > 1024)
    for (int64_t bag = 0; bag < num_bags; bag++) {
        const int64_t f = bag / batch, lo = offsets[bag], hi = offsets[bag + 1];
        const float *restrict table = (const float *)(intptr_t)meta[f];
        const int64_t D = meta[num_features + f];
        const int64_t feature_end = offsets[(f + 1) * batch];
        float *restrict o = out + (bag - f * batch) * out_dim + feature_col[f];
        const int kind = (int)meta[2 * num_features + f];
        const uint16_t *half = (const uint16_t *)(intptr_t)meta[f];
#ifdef __F16C__
        if (kind == 1 && (D == 32 || D == 64 || D == 128)) {
            if (D == 32) POOL_BAG_F16(32);
            else if (D == 64) POOL_BAG_F16(64);
            else POOL_BAG_F16(128);
            continue;
        }
#endif
        if (kind == 2 && (D == 32 || D == 64 || D == 128)) {
            if (D == 32) POOL_BAG_REDUCED(32, BF16_AT);
            else if (D == 64) POOL_BAG_REDUCED(64, BF16_AT);
            else POOL_BAG_REDUCED(128, BF16_AT);
            continue;
        }
        if (kind) {
            float row_[256];
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            for (int64_t k = lo; k < hi; k++) {
                if (k + PF < feature_end) PREFETCH_ROW(half + ids[k + PF] * D, D, 0);
                const float s = weights ? weights[k] : 1.0f;
                const uint16_t *row = half + ids[k] * D;
                for (int64_t d0 = 0; d0 < D; d0 += 256) { /* converted in blocks of 256 */
                    const int64_t n = D - d0 < 256 ? D - d0 : 256;
                    load_row(row + d0, row_, n, kind);
                    for (int64_t d = 0; d < n; d++) o[d0 + d] += s * row_[d];
                }
            }
            if (mean && hi > lo) {
                const float inv = 1.0f / (float)(hi - lo);
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
            continue;
        }
        switch (D) {
        case 16: POOL_BAG(16); break;
        case 32: POOL_BAG(32); break;
        case 64: POOL_BAG(64); break;
        case 128: POOL_BAG(128); break;
        case 256: POOL_BAG(256); break;
        default: {
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            for (int64_t k = lo; k < hi; k++) {
                if (k + PF < feature_end) PREFETCH_ROW(table + ids[k + PF] * D, D, 0);
                const float s = weights ? weights[k] : 1.0f;
                const float *restrict row = table + ids[k] * D;
                for (int64_t d = 0; d < D; d++) o[d] += s * row[d];
            }
            if (mean && hi > lo) {
                const float inv = 1.0f / (float)(hi - lo);
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
        }
        }
    }
    return 0;
}

/* Gradient of each run of equal keys (one touched row), for updates done outside: run u
 * spans sorted words [starts[u], starts[u + 1]); its summed, scaled rows go to out[u]. */
int recopt_aggregate(int64_t num_runs, const int64_t *starts, const uint64_t *packed,
                     const float *scale, const float *grad, int64_t dim, float *out,
                     int num_threads) {
    if (num_threads < 1) num_threads = 1;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_runs > 1024)
    for (int64_t u = 0; u < num_runs; u++) {
        float *restrict o = out + u * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
        for (int64_t k = starts[u]; k < starts[u + 1]; k++) {
            const float s = scale ? scale[k] : 1.0f;
            const float *restrict g = grad + GOFF(packed[k]);
            for (int64_t d = 0; d < dim; d++) o[d] += s * g[d];
        }
    }
    return 0;
}

/* Stable LSD radix sort of the words by their key (bits 32 .. 32 + key_bits), the scales
 * moved along. Threads histogram their slice, agree on offsets, scatter; 11-bit digits. */
#define RADIX_BITS 11
#define RADIX (1 << RADIX_BITS)
#define MAX_SORT_THREADS 64
int recopt_sort(int64_t n, uint64_t *words, float *scale, uint64_t *tmp_words,
                float *tmp_scale, int key_bits, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_SORT_THREADS) num_threads = MAX_SORT_THREADS;
    if (n < 65536) num_threads = 1;
    int64_t *hist = (int64_t *)malloc(sizeof(int64_t) * RADIX * (size_t)num_threads);
    uint64_t *src = words, *dst = tmp_words;
    float *src_s = scale, *dst_s = tmp_scale;
    int passes = 0;
    for (int shift = 32; shift < 32 + key_bits; shift += RADIX_BITS, passes++) {
        #pragma omp parallel num_threads(num_threads)
        {
            int tid = 0, nt = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            nt = omp_get_num_threads();
#endif
            const int64_t lo = n * tid / nt, hi = n * (tid + 1) / nt;
            int64_t *h = hist + (size_t)tid * RADIX;
            for (int b = 0; b < RADIX; b++) h[b] = 0;
            for (int64_t i = lo; i < hi; i++) h[(src[i] >> shift) & (RADIX - 1)]++;
            #pragma omp barrier
            #pragma omp single
            {
                int64_t running = 0;
                for (int b = 0; b < RADIX; b++)
                    for (int t = 0; t < nt; t++) {
                        const int64_t c = hist[(size_t)t * RADIX + b];
                        hist[(size_t)t * RADIX + b] = running;
                        running += c;
                    }
            }
            for (int64_t i = lo; i < hi; i++) {
                const int64_t at = h[(src[i] >> shift) & (RADIX - 1)]++;
                dst[at] = src[i];
                if (src_s) dst_s[at] = src_s[i];
            }
        }
        uint64_t *w = src; src = dst; dst = w;
        float *f = src_s; src_s = dst_s; dst_s = f;
    }
    free(hist);
    return passes % 2; /* 1: the sorted data is in the tmp buffers */
}

/* Chunks split the sorted keys at run boundaries, so each row has one owner. More chunks than
 * threads, taken dynamically, so a thread slowed by a busy core holds no one up. OpenMP (not
 * pthreads): the library links libgomp.so.1, which resolves to the copy torch has loaded, so
 * it shares torch's worker threads instead of fighting their spin-waits for the cores.
 * meta: bases[T+1], then for each slot (weights, state 1, state 2) its addresses [T] (as
 * int64; 0 for a state the optimizer lacks), values a row [T] (the weights': the dim; a
 * state's: the dim, or 1 for a row-wise statistic) and storage kinds [T] (0 float32, 1 fp16,
 * 2 bf16); then the pass's rounding seed. stochastic: round fp16 / bf16 slots stochastically
 * (seeded), else to nearest even. hyper: lr, eps, weight_decay, sign, 1 - beta1, 1 - beta2,
 * then step_size[T]. Returns 0; -1 for an optimizer code it does not know, -2 when a state
 * slot the code updates is missing. */
#define MAX_CHUNKS 256
/* The state slots each optimizer code updates (sgd none, adagrads one, adams two) and their
 * values a row: -1 for the weights' dim, 1 for a row-wise statistic. A slot of another width
 * would be read and written past its rows, so it is refused (-3). */
static const int STATE_SLOTS[5] = {0, 1, 1, 2, 2};
static const int STATE_WIDTHS[5][2] = {{0, 0}, {-1, 0}, {1, 0}, {-1, -1}, {-1, 1}};
int recopt_fused_update(int opt, int stochastic, int64_t n, const uint64_t *packed,
                        const float *scale, const float *grad, int num_tables,
                        const int64_t *meta, const float *hyper, int num_threads) {
    if (opt < 0 || opt > 4) return -1;
    const int64_t T = num_tables;
    for (int t = 0; t < num_tables; t++)
        for (int s = 1; s <= STATE_SLOTS[opt]; s++)
            if (!meta[T + 1 + 3 * s * T + t] || !meta[T + 1 + (3 * s + 1) * T + t]) return -2;
    for (int t = 0; t < num_tables; t++) {
        const int64_t dim = meta[T + 1 + T + t]; /* the weights' values a row */
        for (int s = 1; s <= STATE_SLOTS[opt]; s++) {
            const int want = STATE_WIDTHS[opt][s - 1];
            if (meta[T + 1 + (3 * s + 1) * T + t] != (want < 0 ? dim : want)) return -3;
        }
    }
    if (n == 0) return 0;
    table_t *tables = (table_t *)malloc(sizeof(table_t) * (size_t)num_tables);
    int64_t max_dim = 1;
    for (int t = 0; t < num_tables; t++) {
        table_t *tb = &tables[t];
        tb->base = meta[t];
        tb->end = meta[t + 1];
        for (int s = 0; s < 3; s++) {
            const int64_t *column = meta + T + 1 + 3 * s * T + t;
            slot_t *sl = &tb->slot[s];
            sl->data = (void *)(intptr_t)column[0];
            sl->width = sl->data ? column[T] : 0;
            sl->kind = sl->width ? (int)column[2 * T] : 0;
        }
        tb->dim = tb->slot[0].width;
        tb->seed = (uint64_t)meta[10 * T + 1];
        tb->step_size = hyper[6 + t];
        if (tb->dim > max_dim) max_dim = tb->dim;
    }
    pass_t p = {opt, num_tables, stochastic, max_dim, packed, scale, grad, tables,
                hyper[0], hyper[1], hyper[2], hyper[3], hyper[4], hyper[5]};
    if (num_threads < 1) num_threads = 1;
    int num_chunks = num_threads == 1 ? 1 : num_threads * 8;
    if (num_chunks > MAX_CHUNKS) num_chunks = MAX_CHUNKS;
    if (n < 2048 * (int64_t)num_chunks) num_chunks = (int)(n / 2048) + 1;
    int64_t cut[MAX_CHUNKS + 1];
    cut[0] = 0;
    cut[num_chunks] = n;
    for (int c = 1; c < num_chunks; c++) {
        int64_t at = n * c / num_chunks;
        if (at < cut[c - 1]) at = cut[c - 1];
        while (at > 0 && at < n && KEY(packed[at]) == KEY(packed[at - 1])) at++;
        cut[c] = at;
    }
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_chunks > 1)
    for (int c = 0; c < num_chunks; c++)
        if (cut[c + 1] > cut[c]) run_chunk(&p, cut[c], cut[c + 1]);
    free(tables);
    return 0;
}

/* A float32 array rounded to fp16 (kind 1) or bf16 (kind 2): stochastically (blocks of 256
 * elements: block b's key is block_key(seed, b)) or to nearest even (stochastic 0). */
int recopt_round(int64_t n, const float *x, uint16_t *out, int kind, int stochastic,
                 uint64_t seed, int num_threads) {
    if (kind != 1 && kind != 2) return -1;
    if (num_threads < 1) num_threads = 1;
    const int64_t blocks = (n + 255) / 256;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (n > 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = b * 256, len = n - at < 256 ? n - at : 256;
        store_row(x + at, out + at, len, kind, stochastic, block_key(seed, (uint64_t)b));
    }
    return 0;
}
