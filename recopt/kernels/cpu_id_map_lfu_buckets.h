/* lfu's rows by static key, in buckets (cpu_id_map.c): a step that evicts reads the lowest
 * buckets only, where lfu_select reads every row's key. Header-only (static functions):
 * included once, by cpu_id_map.c.
 *
 * A used row sits in bucket floor(key x scale) of its static key (lfu_key), scale = 1 / rate:
 * a bucket a step's worth of decay wide (rows seen once at the same step share one). Its entry
 * is (row, generation); the row's generation moves on whenever it gets a new entry (its key
 * changed when the batch counted it, or a new id took it), which makes its older entries
 * stale, as freeing it does (unused). Stale entries are dropped when their bucket is read, and
 * all of them when the entries outnumber the rows 4 to 1 (rebuilt from the keys). Reading
 * the buckets from the lowest, a heap keeps the `need` lowest rows by exact decayed count
 * (lfu_cand, cand_before); it stops after a bucket once the highest of those lies below the
 * lowest decayed count a row of a later bucket can have (its key's bucket bound less the keys'
 * rounding margin, as lfu_key_limit's): the rows not read come after every row chosen, so the
 * choice is exactly lfu_select's. Without decay (rows only ordered by count, most in a few
 * buckets), with keys that are not finite (a count of 0 or NaN loaded) and with key ranges too
 * wide for BUCKETS_MAX the buckets stay off: lfu_select then reads every row. So they do in
 * maps of fewer than lfu_buckets_min_rows rows, where that read is cheap (4 bytes a row,
 * in order) and the buckets' upkeep (an entry per counted row) costs about as much.
 */
#ifndef RECOPT_CPU_ID_MAP_LFU_BUCKETS_H
#define RECOPT_CPU_ID_MAP_LFU_BUCKETS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_id_map_lfu.h"

#define BUCKETS_MAX ((int64_t)1 << 20) /* the widest range of buckets kept */

/* Maps with fewer rows read every row's key instead (rim_set_lfu_buckets_min_rows: tests).
 * From the asymptotics more than a machine: from 2^19 rows on, reading all keys is 2 MiB a
 * map and step, past a core's private cache, while the buckets' work grows with the batch
 * alone (benchmarks/bench_id_map_lfu.py on one machine: even at 250k-500k rows, 1.25x faster
 * at 1M, 2.2x at 4M; slower on 100k-row maps beside a training step). */
static int64_t lfu_buckets_min_rows = (int64_t)1 << 19;

typedef struct {
    uint32_t row, gen;
} BucketEntry;

typedef struct {
    BucketEntry *at;
    int64_t size, cap;
} Bucket;

typedef struct {
    Bucket *ring;     /* [slots]: bucket k at ring[k & (slots - 1)] */
    int64_t slots;    /* a power of 2 */
    int64_t lo, hi;   /* buckets lo .. hi - 1 may hold entries; the others are empty */
    uint32_t *gen;    /* [rows]: each row's generation */
    int64_t entries;  /* held, stale ones included */
    double scale;     /* buckets per unit of key: 1 / rate */
    int valid;        /* the buckets hold every used row (else lfu_select reads them all) */
} Buckets;

static void buckets_free(Buckets *q) {
    for (int64_t i = 0; i < q->slots; i++) free(q->ring[i].at);
    free(q->ring);
    free(q->gen);
    memset(q, 0, sizeof(*q));
}

/* Makes bucket k addressable (the ring grown when the range needs it); 0, or -1. */
static int buckets_reach(Buckets *q, int64_t k) {
    if (q->lo == q->hi) q->lo = q->hi = k;
    int64_t lo = k < q->lo ? k : q->lo, hi = k + 1 > q->hi ? k + 1 : q->hi;
    if (hi - lo > BUCKETS_MAX) return -1;
    if (hi - lo > q->slots) {
        int64_t slots = q->slots ? q->slots : 1024;
        while (slots < hi - lo) slots <<= 1;
        Bucket *ring = calloc((size_t)slots, sizeof(Bucket));
        if (!ring) return -1;
        for (int64_t b = q->lo; b < q->hi; b++) { /* moved; the other slots' memory freed */
            Bucket *old = &q->ring[b & (q->slots - 1)];
            ring[b & (slots - 1)] = *old;
            old->at = NULL;
        }
        for (int64_t i = 0; i < q->slots; i++) free(q->ring[i].at);
        free(q->ring);
        q->ring = ring;
        q->slots = slots;
    }
    q->lo = lo;
    q->hi = hi;
    return 0;
}

/* Row r (key) gets a new entry, its older ones stale; a key the buckets cannot hold turns them
 * off. */
static void buckets_push(Buckets *q, int64_t r, float key) {
    if (!q->valid) return;
    double scaled = floor((double)key * q->scale);
    if (!(fabs(scaled) < 0x1p62) || buckets_reach(q, (int64_t)scaled) != 0) {
        q->valid = 0; /* not finite, or out of range */
        return;
    }
    Bucket *b = &q->ring[(int64_t)scaled & (q->slots - 1)];
    if (b->size == b->cap) {
        int64_t cap = b->cap ? 2 * b->cap : 16;
        BucketEntry *at = realloc(b->at, sizeof(BucketEntry) * (size_t)cap);
        if (!at) {
            q->valid = 0;
            return;
        }
        b->at = at;
        b->cap = cap;
    }
    BucketEntry e = {(uint32_t)r, ++q->gen[r]};
    b->at[b->size++] = e;
    q->entries++;
}

/* Every used row of s in its bucket (keys: lfu_key of each used row); valid unless there is
 * no decay, or a key or the memory did not allow it. */
static void buckets_build(Buckets *q, const Slots *s, const float *keys, const Powers *p) {
    for (int64_t i = 0; i < q->slots; i++) q->ring[i].size = 0;
    q->lo = q->hi = 0;
    q->entries = 0;
    q->scale = p->rate > 0x1p-16 ? 1.0 / p->rate : 0.0; /* (decays closer to 1: off) */
    if (q->scale < 1.0) q->scale = 1.0;
    if (!q->gen) q->gen = calloc((size_t)s->n + 1, sizeof(uint32_t));
    q->valid = q->gen != NULL && s->n <= UINT32_MAX && p->memo != NULL && p->rate > 0x1p-16 &&
               s->n >= lfu_buckets_min_rows;
    for (int64_t r = 0; r < s->n && q->valid; r++)
        if (s->used[r]) buckets_push(q, r, keys[r]);
}

/* The lowest decayed count at `step` of a row whose key is at least `key` (keys' rounding
 * taken off, as lfu_key_limit adds it); 0 where it cannot be told apart from underflow. */
static double bucket_floor_count(double key, int64_t step, const Powers *p) {
    double low = key - (fabs(key) + 64.0) * 0x1p-20 - (double)step * p->rate;
    double count = exp2(low);
    return count > 1e-290 ? count : 0.0;
}

/* lfu_select through the buckets: the `need` evictable rows of lowest decayed count (ties:
 * least recently seen, then lowest row), in no order, into out; how many.
 * heap: [need]. */
static int64_t buckets_select(Buckets *q, const Slots *s, const Powers *p, int64_t step,
                              int64_t need, Cand *heap, int64_t *out) {
    int64_t size = 0;
    for (int64_t k = q->lo; k < q->hi; k++) {
        Bucket *b = &q->ring[k & (q->slots - 1)];
        int64_t held = 0;
        for (int64_t i = 0; i < b->size; i++) {
            if (i + 8 < b->size) {
                int64_t ahead = b->at[i + 8].row;
                __builtin_prefetch(&s->used[ahead]);
                __builtin_prefetch(&s->seen[ahead]);
                __builtin_prefetch(&s->freq[ahead]);
                __builtin_prefetch(&q->gen[ahead]);
            }
            BucketEntry e = b->at[i];
            if (!s->used[e.row] || q->gen[e.row] != e.gen) { /* stale: dropped */
                q->entries--;
                continue;
            }
            b->at[held++] = e;
            if (s->seen[e.row] != step) /* (seen by this batch: not evictable) */
                keep_lowest(heap, &size, need, lfu_cand(s, p, step, e.row));
        }
        b->size = held;
        if (size == need && heap[0].key < bucket_floor_count((double)(k + 1) / q->scale, step, p))
            break;
    }
    while (q->lo < q->hi && q->ring[q->lo & (q->slots - 1)].size == 0) q->lo++;
    for (int64_t i = 0; i < size; i++) out[i] = heap[i].row;
    return size;
}

/* The rows from which maps keep lfu's buckets (maps built or rebuilt after the call); the
 * previous value. A negative n only reads it. */
int64_t rim_set_lfu_buckets_min_rows(int64_t n) {
    int64_t was = lfu_buckets_min_rows;
    if (n >= 0) lfu_buckets_min_rows = n;
    return was;
}

#endif
