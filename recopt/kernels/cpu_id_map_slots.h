/* The slot structures of the native id map (cpu_id_map.c): the hash table raw id -> slot,
 * the recency queue, the free-slot heap, undo logs, and a stable radix sort. Header-only
 * (static functions): included once, by cpu_id_map.c.
 */
#ifndef RECOPT_CPU_ID_MAP_SLOTS_H
#define RECOPT_CPU_ID_MAP_SLOTS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef struct {
    int64_t key;
    int64_t slot; /* -1: empty */
} Entry;

typedef struct {
    Entry *entries;
    int64_t mask;
} Hash;

typedef struct { /* old values of the slots one batch wrote (an undo record) */
    int64_t *slot, *ids, *seen, *count;
    double *freq;
    uint8_t *used;
    int64_t size, cap;
} Log;

typedef struct { /* a slot of the recency queue and its last seen when it was queued */
    int64_t slot, seen;
} QEntry;

typedef struct {
    int64_t n, live, heap_size;
    Hash hash;
    QEntry *queue; /* [2n + 2]: entries queue[qhead .. qtail) */
    int64_t qhead, qtail;
    int64_t *heap;
    uint64_t *mark; /* [n / 64 + 1] bits: the slots the batch's undo record holds already */
    /* the buffers: ids, used (bool), last seen; freq (rows) or count (candidates) */
    int64_t *ids, *seen, *count;
    uint8_t *used;
    double *freq;
    Log log;
} Slots;

/* Memory for a structure read at random (a map's hash table, its queue): from 2 MiB up,
 * 2 MiB-aligned and marked for transparent huge pages before its first touch, so that a
 * lookup's address translation mostly hits the TLB (26 maps of 100k rows hold ~200 MiB of
 * them; in 4 KiB pages nearly every random read also walks the page table). free() frees it. */
static void *big_alloc(size_t bytes) {
    const size_t huge = (size_t)2 << 20;
    if (bytes < huge) return malloc(bytes);
    size_t rounded = (bytes + huge - 1) & ~(huge - 1);
    void *p = NULL;
    if (posix_memalign(&p, huge, rounded) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, rounded, MADV_HUGEPAGE); /* a hint: without it the pages stay small */
#endif
    return p;
}

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static int hash_init(Hash *h, int64_t n) {
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    free(h->entries);
    h->entries = big_alloc(sizeof(Entry) * cap);
    if (!h->entries) return -1;
    h->mask = cap - 1;
    for (int64_t i = 0; i < cap; i++) h->entries[i].slot = -1;
    return 0;
}

static inline int64_t hash_find(const Hash *h, int64_t key) {
    int64_t i = (int64_t)(mix64((uint64_t)key) & (uint64_t)h->mask);
    while (h->entries[i].slot >= 0) {
        if (h->entries[i].key == key) return h->entries[i].slot;
        i = (i + 1) & h->mask;
    }
    return -1;
}

/* Sets key's slot; returns the slot the key had (-1: it was absent). */
static inline int64_t hash_put(Hash *h, int64_t key, int64_t slot) {
    int64_t i = (int64_t)(mix64((uint64_t)key) & (uint64_t)h->mask);
    while (h->entries[i].slot >= 0) {
        if (h->entries[i].key == key) return h->entries[i].slot;
        i = (i + 1) & h->mask;
    }
    h->entries[i].key = key;
    h->entries[i].slot = slot;
    return -1;
}

static void hash_erase(Hash *h, int64_t key) {
    int64_t i = (int64_t)(mix64((uint64_t)key) & (uint64_t)h->mask);
    while (h->entries[i].slot >= 0 && h->entries[i].key != key) i = (i + 1) & h->mask;
    if (h->entries[i].slot < 0) return;
    /* backward shift: move later entries of the probe run into the hole (no tombstones) */
    int64_t j = i;
    for (;;) {
        j = (j + 1) & h->mask;
        if (h->entries[j].slot < 0) break;
        int64_t home = (int64_t)(mix64((uint64_t)h->entries[j].key) & (uint64_t)h->mask);
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (stays) continue;
        h->entries[i] = h->entries[j];
        i = j;
    }
    h->entries[i].slot = -1;
}

/* Stable LSD radix sort of (key, val) pairs by unsigned key; bytes equal everywhere skipped. */
static void radix_sort(uint64_t *key, int64_t *val, uint64_t *key_tmp, int64_t *val_tmp,
                       int64_t n) {
    int64_t counts[256];
    uint64_t any = 0, all = ~0ULL;
    for (int64_t i = 0; i < n; i++) {
        any |= key[i];
        all &= key[i];
    }
    for (int shift = 0; shift < 64; shift += 8) {
        if ((((any ^ all) >> shift) & 255) == 0) continue; /* this byte is the same in all */
        memset(counts, 0, sizeof(counts));
        for (int64_t i = 0; i < n; i++) counts[(key[i] >> shift) & 255]++;
        int64_t total = 0;
        for (int b = 0; b < 256; b++) {
            int64_t c = counts[b];
            counts[b] = total;
            total += c;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t at = counts[(key[i] >> shift) & 255]++;
            key_tmp[at] = key[i];
            val_tmp[at] = val[i];
        }
        memcpy(key, key_tmp, sizeof(uint64_t) * n);
        memcpy(val, val_tmp, sizeof(int64_t) * n);
    }
}

/* How far ahead the loops over random slots prefetch (their cache misses overlap). */
#define AHEAD 12

static inline void prefetch_home(const Hash *h, int64_t key) {
    __builtin_prefetch(&h->entries[mix64((uint64_t)key) & (uint64_t)h->mask]);
}

static inline uint64_t signed_key(int64_t x) { return (uint64_t)x ^ (1ULL << 63); }

/* ---- the recency queue (used slots by (last seen, slot)) and the free-slot heap ----
 * Each batch queues the slots it saw (after its own, by slot), with their last seen then.
 * An entry is stale once its slot is seen again (a later entry) or freed: skipped, never
 * unlinked, so a slot seen again costs no write beside its own entry. The live entries, in
 * queue order, are the used slots by (last seen, slot); the stale ones are dropped when the
 * queue is full (there are at most n live ones: 2n + 2 entries always make room). */

static inline int queued_live(const Slots *s, QEntry e) {
    return s->used[e.slot] && s->seen[e.slot] == e.seen;
}

/* The least recently seen used slot (it stays queued), or -1. */
static inline int64_t queue_head(Slots *s) {
    while (s->qhead < s->qtail && !queued_live(s, s->queue[s->qhead])) s->qhead++;
    return s->qhead < s->qtail ? s->queue[s->qhead].slot : -1;
}

/* Room for `more` entries (more + live <= 2n + 2): the stale entries are dropped. */
static void queue_reserve(Slots *s, int64_t more) {
    if (s->qtail + more <= 2 * s->n + 2) return;
    int64_t k = 0;
    for (int64_t e = s->qhead; e < s->qtail; e++) {
        if (e + 16 < s->qtail) { /* the rows' counters, far apart: their misses overlap */
            __builtin_prefetch(&s->used[s->queue[e + 16].slot]);
            __builtin_prefetch(&s->seen[s->queue[e + 16].slot]);
        }
        if (queued_live(s, s->queue[e])) s->queue[k++] = s->queue[e];
    }
    s->qhead = 0;
    s->qtail = k;
}

static inline void queue_push(Slots *s, int64_t r, int64_t seen) {
    s->queue[s->qtail].slot = r;
    s->queue[s->qtail++].seen = seen;
}

static void heap_push(Slots *s, int64_t r) {
    int64_t i = s->heap_size++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (s->heap[parent] <= r) break;
        s->heap[i] = s->heap[parent];
        i = parent;
    }
    s->heap[i] = r;
}

static int64_t heap_pop(Slots *s) {
    int64_t top = s->heap[0], last = s->heap[--s->heap_size], i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= s->heap_size) break;
        if (child + 1 < s->heap_size && s->heap[child + 1] < s->heap[child]) child++;
        if (s->heap[child] >= last) break;
        s->heap[i] = s->heap[child];
        i = child;
    }
    if (s->heap_size > 0) s->heap[i] = last;
    return top;
}

/* ---- undo records: a slot's old values, the first time a batch writes it ---- */

static int log_grow(Log *log) {
    int64_t cap = log->cap ? 2 * log->cap : 1024;
    void *p[6] = {realloc(log->slot, 8 * cap), realloc(log->ids, 8 * cap),
                  realloc(log->seen, 8 * cap), realloc(log->count, 8 * cap),
                  realloc(log->freq, 8 * cap), realloc(log->used, cap)};
    if (p[0]) log->slot = p[0];
    if (p[1]) log->ids = p[1];
    if (p[2]) log->seen = p[2];
    if (p[3]) log->count = p[3];
    if (p[4]) log->freq = p[4];
    if (p[5]) log->used = p[5];
    for (int i = 0; i < 6; i++) if (!p[i]) return -1;
    log->cap = cap;
    return 0;
}

static void slots_free(Slots *s) {
    free(s->hash.entries);
    free(s->queue);
    free(s->heap);
    free(s->mark);
    free(s->log.slot);
    free(s->log.ids);
    free(s->log.seen);
    free(s->log.count);
    free(s->log.freq);
    free(s->log.used);
}

static int slots_init(Slots *s, int64_t n) {
    memset(s, 0, sizeof(*s));
    s->n = n;
    s->queue = big_alloc(sizeof(QEntry) * (2 * n + 2));
    s->heap = malloc(8 * (n + 1));
    if (!s->queue || !s->heap) return -1;
    return hash_init(&s->hash, n);
}

static int slots_rebuild(Slots *s) {
    int64_t n = s->n, live = 0;
    uint64_t *key = malloc(8 * (n + 1)), *key_tmp = malloc(8 * (n + 1));
    int64_t *val = malloc(8 * (n + 1)), *val_tmp = malloc(8 * (n + 1));
    int ok = key && key_tmp && val && val_tmp;
    if (ok) {
        for (int64_t i = 0; i <= s->hash.mask; i++) s->hash.entries[i].slot = -1;
        s->heap_size = 0;
        for (int64_t r = 0; r < n; r++) {
            if (s->used[r]) {
                hash_put(&s->hash, s->ids[r], r);
                key[live] = signed_key(s->seen[r]);
                val[live++] = r;
            } else {
                s->heap[s->heap_size++] = r; /* ascending: already a min-heap */
            }
        }
        radix_sort(key, val, key_tmp, val_tmp, live); /* stable: by (last seen, slot) */
        s->qhead = s->qtail = 0;
        for (int64_t i = 0; i < live; i++) queue_push(s, val[i], s->seen[val[i]]);
        s->live = live;
    }
    free(key);
    free(key_tmp);
    free(val);
    free(val_tmp);
    return ok ? 0 : -1;
}

#endif
