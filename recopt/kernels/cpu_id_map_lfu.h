/* lfu in the native id map (cpu_id_map.c): the decay powers and the choice of victims.
 * Header-only (static functions): included once, by cpu_id_map.c.
 */
#ifndef RECOPT_CPU_ID_MAP_LFU_H
#define RECOPT_CPU_ID_MAP_LFU_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_id_map_slots.h"

#define POWER_MEMO 4096 /* ages whose decay power is kept */
#define LFU_SAMPLE 256      /* rows sampled for the pivot (without keys) */
#define LFU_KEY_SAMPLE 512  /* keys sampled for the pivot, at least */

typedef struct {
    double squares[64]; /* decay^(2^b) by repeated squaring */
    double *memo;       /* [POWER_MEMO]: the powers of the small ages; NULL: no decay (1.0) */
    double rate;        /* -log2(decay): how fast a static key (lfu_key) grows a step */
} Powers;

/* decay^age as the product of squares[b] over the set bits b of age, lowest bit first: a fixed
 * sequence of float64 products, so the torch path (`recopt.modules.id_map.decay_powers`) gets
 * the same bits on every device and kernel. */
static double power_of(const Powers *p, int64_t age) {
    double r = 1.0;
    for (int b = 0; age > 0; b++, age >>= 1)
        if (age & 1) r *= p->squares[b];
    return r;
}

static int powers_init(Powers *p, double decay) {
    p->squares[0] = decay;
    for (int b = 1; b < 64; b++) p->squares[b] = p->squares[b - 1] * p->squares[b - 1];
    p->memo = NULL;
    p->rate = -log2(decay);
    if (decay == 1.0) return 0;
    p->memo = malloc(sizeof(double) * POWER_MEMO);
    if (!p->memo) return -1;
    for (int64_t a = 0; a < POWER_MEMO; a++) p->memo[a] = power_of(p, a);
    return 0;
}

/* decay^age (ages below 0 count as 0). */
static inline double decay_power(const Powers *p, int64_t age) {
    if (!p->memo) return 1.0;
    if (age < 0) age = 0;
    return age < POWER_MEMO ? p->memo[age] : power_of(p, age);
}

typedef struct { /* an evictable row: its decayed count, last seen, row */
    double key;
    int64_t seen, row;
} Cand;

/* QUICKSELECT(name, T, before) defines `static void name(T *a, int64_t n, int64_t k)`, which
 * reorders a[0 .. n) so that a[k] holds the element of rank k by `before` (x goes first when
 * before(x, y)), the elements that go first before it and the others after it (k < n). */
#define QUICKSELECT(name, T, before)                                                          \
    static void name(T *a, int64_t n, int64_t k) {                                            \
        int64_t lo = 0, hi = n - 1;                                                           \
        while (lo < hi) {                                                                     \
            T x = a[lo + (hi - lo) / 2];                                                      \
            int64_t i = lo, j = hi;                                                           \
            while (i <= j) {                                                                  \
                while (before(a[i], x)) i++;                                                  \
                while (before(x, a[j])) j--;                                                  \
                if (i <= j) {                                                                 \
                    T t = a[i];                                                               \
                    a[i++] = a[j];                                                            \
                    a[j--] = t;                                                               \
                }                                                                             \
            }                                                                                 \
            if (k <= j) hi = j; /* a[lo .. j] go no later than x, a[i .. hi] no earlier */   \
            else if (k >= i) lo = i;                                                          \
            else break; /* a[j + 1 .. i - 1] tie with x */                                    \
        }                                                                                     \
    }

static inline int cand_before(Cand a, Cand b) { /* a is evicted before b */
    if (a.key != b.key) return a.key < b.key;
    if (a.seen != b.seen) return a.seen < b.seen;
    return a.row < b.row;
}

static void cand_sift_down(Cand *heap, int64_t size, int64_t i) { /* max-heap by cand_before */
    Cand top = heap[i];
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= size) break;
        if (child + 1 < size && cand_before(heap[child], heap[child + 1])) child++;
        if (!cand_before(top, heap[child])) break;
        heap[i] = heap[child];
        i = child;
    }
    heap[i] = top;
}

/* Adds c to the max-heap (by cand_before) of the size lowest of `need`. */
static inline void keep_lowest(Cand *heap, int64_t *size, int64_t need, Cand c) {
    if (*size < need) {
        int64_t i = (*size)++; /* sift up */
        while (i > 0 && cand_before(heap[(i - 1) / 2], c)) {
            heap[i] = heap[(i - 1) / 2];
            i = (i - 1) / 2;
        }
        heap[i] = c;
    } else if (cand_before(c, heap[0])) {
        heap[0] = c;
        cand_sift_down(heap, *size, 0);
    }
}

QUICKSELECT(cand_select, Cand, cand_before)

static inline int evictable(const Slots *s, int64_t step, int64_t r) {
    return s->used[r] && s->seen[r] != step; /* used, and not seen in this batch */
}

static inline Cand lfu_cand(const Slots *s, const Powers *p, int64_t step, int64_t r) {
    Cand c = {s->freq[r] * decay_power(p, step - s->seen[r]), s->seen[r], r};
    return c;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A decayed count below which, judging by a sample of the rows, a few times `need` evictable
 * rows lie (INFINITY: no use, most rows would). Only a filter: lfu_select checks that it kept
 * at least `need` rows, and every row above it comes after every row at or below it. */
static double lfu_pivot(const Slots *s, const Powers *p, int64_t step, int64_t need,
                        int64_t num_evictable) {
    double sample[LFU_SAMPLE];
    int64_t stride = s->n / LFU_SAMPLE, count = 0;
    if (stride < 4 || num_evictable <= 0) return INFINITY;
    for (int64_t i = 0; i < LFU_SAMPLE; i++)
        if (evictable(s, step, i * stride)) sample[count++] = lfu_cand(s, p, step, i * stride).key;
    int64_t at = (int64_t)((double)count * (double)(4 * need + 64) / (double)num_evictable);
    if (at >= count) return INFINITY;
    qsort(sample, (size_t)count, sizeof(double), compare_doubles);
    return sample[at];
}

/* A row's static key: log2 of its decayed count, undecayed back to step 0 (log2(freq) +
 * seen x rate). Decay scales every row's count alike, so between two of its own updates a row's
 * place in the order of decayed counts is the order of these keys: a row's decayed count at
 * `step` is 2^(key - step x rate). Stored as float: only a filter (lfu_select), whose margin
 * covers the rounding. */
static inline float lfu_key(double freq, int64_t seen, const Powers *p) {
    return (float)(log2(freq) + (double)seen * p->rate);
}

/* The static key at or below which (with its margin) every row whose decayed count at `step`
 * is at or below `pivot` lies; -INFINITY when the keys cannot tell (a pivot so small that
 * decayed counts underflow: every row is then checked exactly). */
static double lfu_key_limit(double pivot, int64_t step, const Powers *p) {
    if (!(pivot > 1e-290)) return -INFINITY; /* subnormal, zero or NaN: no key filter */
    double limit = log2(pivot) + (double)step * p->rate;
    /* float rounding of the keys (2^-24 relative) and of the products of powers, 16x over */
    return limit + (fabs(limit) + 64.0) * 0x1p-20;
}

typedef struct { /* a row whose static key passed the filter, and that key */
    int64_t row;
    float key;
} KeyRow;

/* The rows whose static key is at or below limit, with their keys, in row order, into below
 * (at most cap: returns cap + 1 when more are). NaN keys count as -INFINITY (always listed).
 * Reads only the keys: a word of 64 compared at a time, vectorised. */
static int64_t lfu_list_by_keys(const float *keys, int64_t n, float limit, KeyRow *below,
                                int64_t cap) {
    int64_t listed = 0;
    for (int64_t base = 0; base < n; base += 64) {
        int64_t width = n - base < 64 ? n - base : 64;
        uint64_t bits = 0;
        for (int64_t i = 0; i < width; i++) bits |= (uint64_t)!(keys[base + i] > limit) << i;
        for (; bits; bits &= bits - 1) {
            int64_t r = base + __builtin_ctzll(bits);
            if (listed == cap) return cap + 1;
            float key = keys[r];
            below[listed].row = r;
            below[listed++].key = key == key ? key : -INFINITY;
        }
    }
    return listed;
}

static inline int key_before(KeyRow a, KeyRow b) { return a.key < b.key; }

QUICKSELECT(key_select, KeyRow, key_before)

/* The k-th smallest key (0-based) of a[0 .. n), k < n; reorders a. */
static float lfu_select_key(KeyRow *a, int64_t n, int64_t k) {
    key_select(a, n, k);
    return a[k].key;
}

/* The decayed count at `step` of a row whose key is `key`, plus the keys' rounding margin
 * (lfu_key_limit's): rows of equal counts (often hundreds: ids seen once at the same step)
 * are all at or below it, not split by the rounding of this computation. */
static double lfu_count_at_key(double key, int64_t step, const Powers *p) {
    return exp2(key + (fabs(key) + 64.0) * 0x1p-20 - (double)step * p->rate);
}

/* lfu_pivot from the keys alone (no row's count read): the count at the key below which, in a
 * sample of the keys (runs of 8: a run is half a cache line, read once), a few times `need`
 * rows lie. The sample grows with the rows (at least LFU_KEY_SAMPLE keys, at most `room`
 * runs), so that about 8 sampled keys lie below that key. sample: [8 x room]. */
static double lfu_pivot_by_keys(const float *keys, int64_t n, const Powers *p, int64_t step,
                                int64_t need, KeyRow *sample, int64_t room) {
    double target = (double)(4 * need + 64);
    int64_t size = (int64_t)(8.0 * (double)n / target) & ~(int64_t)7;
    size = size < LFU_KEY_SAMPLE ? LFU_KEY_SAMPLE : size > 8 * room ? 8 * room : size;
    int64_t stride = n / (size / 8);
    int64_t at = (int64_t)((double)size * target / (double)n);
    if (stride < 8 || at >= size) return INFINITY; /* (runs apart) */
    for (int64_t i = 0; i < size; i++) {
        int64_t r = (i >> 3) * stride + (i & 7);
        float key = keys[r];
        sample[i].row = r;
        sample[i].key = key == key ? key : -INFINITY;
    }
    return lfu_count_at_key((double)lfu_select_key(sample, size, at), step, p);
}

/* The evictable rows of below [listed] of decayed count at or below pivot into low (at most
 * cap: returns cap + 1 when more are), reading counts only of rows whose key is at or below
 * limit; the rows' slots prefetched ahead (they are far apart). */
static int64_t lfu_keep_listed(const Slots *s, const Powers *p, const KeyRow *below,
                               int64_t listed, float limit, int64_t step, double pivot, Cand *low,
                               int64_t cap) {
    int64_t kept = 0;
    for (int64_t i = 0; i < listed; i++) {
        if (i + 16 < listed && !(below[i + 16].key > limit)) {
            int64_t ahead = below[i + 16].row;
            __builtin_prefetch(&s->used[ahead]);
            __builtin_prefetch(&s->seen[ahead]);
            __builtin_prefetch(&s->freq[ahead]);
        }
        if (below[i].key > limit) continue;
        int64_t r = below[i].row;
        if (!evictable(s, step, r)) continue;
        Cand c = lfu_cand(s, p, step, r);
        if (c.key > pivot) continue;
        if (kept == cap) return cap + 1;
        low[kept++] = c;
    }
    return kept;
}

/* lfu_select's pass with keys. The sampled pivot's key filter lists its rows (keys only: a few
 * times `need`); a quickselect on their keys then finds a tighter pivot, the decayed count of
 * the key a little above the need-th, so that counts are read (three rows' worth of memory
 * each, far apart) only for about `need` rows; when too few of those are evictable, the sampled
 * pivot's rows are read. Returns the rows kept into low as lfu_select's pass does (cap + 1: too
 * many; fewer than need: too few for either pivot). */
static int64_t lfu_keep_by_keys(const Slots *s, const Powers *p, const float *keys, float limit,
                                int64_t step, double pivot, int64_t need, KeyRow *below,
                                Cand *low, int64_t cap) {
    int64_t listed = lfu_list_by_keys(keys, s->n, limit, below, cap);
    if (listed > cap || listed < need) return listed;
    int64_t tight_rank = need + need / 8 + 16; /* a margin for rows seen in this batch */
    if (tight_rank < listed) {
        double tight = lfu_count_at_key((double)lfu_select_key(below, listed, tight_rank), step, p);
        if (tight < pivot) {
            double tight_limit = lfu_key_limit(tight, step, p);
            if (tight_limit > -INFINITY) {
                int64_t kept = lfu_keep_listed(s, p, below, listed, (float)tight_limit, step,
                                               tight, low, cap);
                if (kept >= need) return kept;
            }
        }
    }
    return lfu_keep_listed(s, p, below, listed, limit, step, pivot, low, cap);
}

/* The `need` (at most `room`) evictable rows of lowest decayed count (ties: least recently
 * seen, then lowest row), in no order (lfu_victims sorts them by row), written to out; returns
 * how many. One pass over the rows keeps those at or below a pivot (when enough are, and they
 * fit in 4 x room), a quickselect the lowest of them; else a heap keeps the lowest of every
 * row. With keys (lfu_key of every used row, or NULL), the pass
 * reads only keys, and counts only of rows whose key may be at or below the pivot's
 * (lfu_keep_by_keys). scratch: [5 x room] Cands, then [8 x room] KeyRows. */
static int64_t lfu_select(const Slots *s, const Powers *p, const float *keys, int64_t step,
                          int64_t need, int64_t num_evictable, Cand *scratch, int64_t room,
                          int64_t *out) {
    int64_t size = 0, kept = 0, cap = 4 * room;
    Cand *heap = scratch, *low = scratch + room;
    KeyRow *below = (KeyRow *)(scratch + 5 * room); /* [8 room] */
    double pivot = keys ? lfu_pivot_by_keys(keys, s->n, p, step, need, below, room)
                        : lfu_pivot(s, p, step, need, num_evictable);
    double limit = keys && pivot < INFINITY ? lfu_key_limit(pivot, step, p) : INFINITY;
    const float *use_keys = limit > -INFINITY ? keys : NULL;
    if (use_keys && pivot < INFINITY)
        kept = lfu_keep_by_keys(s, p, use_keys, (float)limit, step, pivot, need, below, low, cap);
    for (int64_t r = 0; r < s->n && pivot < INFINITY && !use_keys; r++) {
        if (!evictable(s, step, r)) continue;
        Cand c = lfu_cand(s, p, step, r);
        if (c.key > pivot) continue;
        if (kept == cap) break; /* too many at or below the pivot: every row then */
        low[kept++] = c;
    }
    if (pivot < INFINITY && kept < cap && kept >= need) {
        if (need < kept) cand_select(low, kept, need); /* the need lowest first */
        for (int64_t i = 0; i < need; i++) out[i] = low[i].row;
        return need;
    }
    for (int64_t r = 0; r < s->n; r++)
        if (evictable(s, step, r)) keep_lowest(heap, &size, need, lfu_cand(s, p, step, r));
    for (int64_t i = 0; i < size; i++) out[i] = heap[i].row;
    return size;
}

#endif
