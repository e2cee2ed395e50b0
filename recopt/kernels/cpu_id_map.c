/* Native remap of an id map (recopt/modules/id_map.py): O(batch) work per training batch
 * (lfu: plus one pass over the rows on a batch that evicts).
 *
 * The map's state stays in its torch buffers (row_ids, occupied, last_seen, frequency and the
 * candidate_* buffers), written here through raw pointers. Beside them this file keeps a cache
 * derived from the buffers, rebuilt by rim_rebuild when they changed elsewhere:
 *   - an open-addressing hash table raw id -> slot (linear probing, backward-shift erase);
 *   - the used slots in a queue ordered by (last seen, slot) (stale entries skipped, see
 *     cpu_id_map_slots.h): its head is the least recently seen slot (lru victims, ttl
 *     expiry, forgotten candidates);
 *   - the free slots in a min-heap (new ids take the lowest free row first).
 * The same structure serves the rows and the admission candidates. One training batch is three
 * calls (rim_begin, rim_middle, rim_finish; rim_step_many makes them for many maps at once).
 * lfu's decay powers are products of fixed squares (decay_power), the same bits as the torch
 * path's, so both paths give the same maps.
 * Legend: M ids of the batch, U distinct ids, N slots.
 */
#include "cpu_id_map_batch.h"
#include "cpu_id_map_fill.h"
#include "cpu_id_map_lfu.h"
#include "cpu_id_map_lfu_buckets.h"
#include "cpu_id_map_slots.h"

typedef struct {
    Slots rows, cand;
    int has_cand, recording;
    int64_t gen, cap_m, num_u, num_known, num_wanted, expired, admissions;
    Hash batch_hash;    /* the batch's new ids -> their index, first seen order */
    Powers powers;      /* lfu's decay powers */
    float *keys;        /* [N]: lfu_key of each used row while keys_valid (lfu's filter) */
    int keys_valid;     /* set by the first lfu step after a rebuild, kept up by each step */
    Buckets lfu_rows;   /* the used rows by key, while keys_valid (lfu's victims) */
    Cand *cands;        /* [5 M]: lfu's victim heap [M], the rows under its pivot [4 M], then
                         * KeyRow [8 M]: its key sample, the rows under its key filter */
    uint64_t *row_pos;  /* [N]: (batch generation << 32) | the row's index in known */
    uint64_t *row_bits; /* [N / 64 + 1]: the rows the batch touched (all 0 between batches) */
    int64_t *found;     /* [M]: each id's row, -1 if not live (admit: fresh candidates' slots) */
    int64_t *inverse;   /* [M]: each id's known row (>= 0) or ~(its index in ids_u) */
    int64_t *known, *count_k; /* [K]: the distinct known rows (first seen order), counts */
    int64_t *known_id;        /* [K]: their ids */
    int64_t *ids_u, *count_u, *slot_u; /* [U]: the distinct new ids (ascending), counts, rows */
    int64_t *wanted, *touched;
    uint64_t *sort_key, *sort_key_tmp;
    int64_t *sort_val, *sort_val_tmp;
    uint8_t *admitted;
} Map;


/* Slot r's old values into the batch's undo record, the first time the batch writes it; its
 * id and used flag given (`remember` reads them; a known row's are its id and 1, so the
 * caller saves two reads of rows far apart). */
static inline void remember_as(Map *m, Slots *s, int64_t r, int64_t id, uint8_t used) {
    if (m->recording != 1) return; /* not asked, or out of memory (reported by rim_finish) */
    uint64_t bit = 1ULL << (r & 63);
    if (s->mark[r >> 6] & bit) return; /* in the record already */
    Log *log = &s->log;
    if (log->size == log->cap && log_grow(log) != 0) {
        m->recording = -1;
        return;
    }
    s->mark[r >> 6] |= bit; /* once logged: forget_log clears the logged slots' bits */
    int64_t k = log->size++;
    log->slot[k] = r;
    log->ids[k] = id;
    log->seen[k] = s->seen[r];
    log->used[k] = used;
    log->count[k] = s->count ? s->count[r] : 0;
    log->freq[k] = s->freq ? s->freq[r] : 0.0;
}

static inline void remember(Map *m, Slots *s, int64_t r) {
    if (m->recording == 1) remember_as(m, s, r, s->ids[r], s->used[r]);
}

/* The last batch's undo record is dropped: its slots' bits cleared (only those: O(record)). */
static void forget_log(Slots *s) {
    if (s->mark)
        for (int64_t k = 0; k < s->log.size; k++) s->mark[s->log.slot[k] >> 6] = 0;
    s->log.size = 0;
}

/* ---- the map ---- */

static void free_scratch(Map *m) {
    free(m->batch_hash.entries);
    free(m->ids_u);
    free(m->count_u);
    free(m->slot_u);
    free(m->inverse);
    free(m->found);
    free(m->known);
    free(m->count_k);
    free(m->known_id);
    free(m->wanted);
    free(m->touched);
    free(m->sort_key);
    free(m->sort_key_tmp);
    free(m->sort_val);
    free(m->sort_val_tmp);
    free(m->admitted);
    free(m->cands);
}

void rim_free(void *handle) {
    Map *m = handle;
    if (!m) return;
    slots_free(&m->rows);
    slots_free(&m->cand);
    free(m->row_pos);
    free(m->row_bits);
    free(m->powers.memo);
    free(m->keys);
    buckets_free(&m->lfu_rows);
    free_scratch(m);
    free(m);
}

void *rim_new(int64_t num_rows, int64_t num_candidates, double decay) {
    Map *m = calloc(1, sizeof(Map));
    if (!m) return NULL;
    m->has_cand = num_candidates > 0;
    if (powers_init(&m->powers, decay) != 0) {
        rim_free(m);
        return NULL;
    }
    m->row_pos = calloc(num_rows + 1, 8);
    m->row_bits = calloc((num_rows >> 6) + 1, 8);
    if (!m->row_pos || !m->row_bits || slots_init(&m->rows, num_rows) != 0 ||
        (m->has_cand && slots_init(&m->cand, num_candidates) != 0)) {
        rim_free(m);
        return NULL;
    }
    return m;
}

/* Per-batch scratch for up to `need` ids (touched rows: up to 2 per id). */
static int reserve(Map *m, int64_t need) {
    if (need <= m->cap_m) return 0;
    int64_t cap = need < 1024 ? 1024 : need;
    free_scratch(m);
    memset(&m->batch_hash, 0, sizeof(Hash));
    m->ids_u = malloc(8 * cap);
    m->count_u = malloc(8 * cap);
    m->slot_u = malloc(8 * cap);
    m->inverse = malloc(8 * cap);
    m->found = malloc(8 * cap);
    m->known = malloc(8 * cap);
    m->count_k = malloc(8 * cap);
    m->known_id = malloc(8 * cap);
    m->wanted = malloc(8 * cap);
    m->touched = malloc(16 * cap);
    m->sort_key = malloc(16 * cap);
    m->sort_key_tmp = malloc(16 * cap);
    m->sort_val = malloc(16 * cap);
    m->sort_val_tmp = malloc(16 * cap);
    m->admitted = malloc(cap);
    /* the heap [cap], the rows kept [4 cap], then the rows listed by key [8 cap] */
    m->cands = malloc(sizeof(Cand) * 5 * cap + sizeof(KeyRow) * 8 * cap);
    m->cap_m = 0;
    if (!m->ids_u || !m->count_u || !m->slot_u || !m->inverse || !m->found || !m->known ||
        !m->count_k || !m->known_id || !m->wanted ||
        !m->touched || !m->sort_key || !m->sort_key_tmp || !m->sort_val || !m->sort_val_tmp ||
        !m->admitted || !m->cands || hash_init(&m->batch_hash, cap) != 0)
        return -1;
    m->cap_m = cap;
    return 0;
}

/* buffers: row_ids, occupied, last_seen, frequency, [candidate_ids, candidate_used,
 * candidate_count, candidate_last_seen] (int64, bool, int64, float64 | int64, bool, int64,
 * int64), contiguous. */
static void bind(Map *m, void **buffers) {
    Slots *r = &m->rows;
    r->ids = buffers[0];
    r->used = buffers[1];
    r->seen = buffers[2];
    r->freq = buffers[3];
    r->count = NULL;
    if (m->has_cand) {
        Slots *c = &m->cand;
        c->ids = buffers[4];
        c->used = buffers[5];
        c->count = buffers[6];
        c->seen = buffers[7];
        c->freq = NULL;
    }
}

int rim_rebuild(void *handle, void **buffers) {
    Map *m = handle;
    bind(m, buffers);
    m->keys_valid = 0;
    if (slots_rebuild(&m->rows) != 0) return -1;
    if (m->has_cand && slots_rebuild(&m->cand) != 0) return -1;
    return 0;
}

/* Read only (eval): the row of each id, -1 if unknown or unseen for more than ttl steps. */
int rim_lookup(void *handle, void **buffers, const int64_t *ids, int64_t num_ids, int64_t step,
               int64_t ttl, int64_t *rows_out) {
    Map *m = handle;
    bind(m, buffers);
    for (int64_t i = 0; i < num_ids; i++) {
        int64_t r = hash_find(&m->rows.hash, ids[i]);
        if (r >= 0 && ttl > 0 && step - m->rows.seen[r] > ttl) r = -1;
        rows_out[i] = r;
    }
    return 0;
}

/* Each id of the batch looked up: the distinct known rows (first seen order) with their
 * counts, and the distinct new ids in ascending order with theirs; inverse says which each id
 * is. Only the new ids are sorted (their order decides who gets a row when rows run short). */
static void scan_batch(Map *m, const int64_t *ids, int64_t num_ids) {
    const Hash *h = &m->rows.hash;
    for (int64_t i = 0; i < num_ids; i++) { /* the rows, the hash misses overlapped */
        if (i + AHEAD < num_ids) prefetch_home(h, ids[i + AHEAD]);
        int64_t r = hash_find(h, ids[i]);
        m->found[i] = r;
        if (r >= 0) __builtin_prefetch(&m->row_pos[r], 1);
    }
    uint64_t gen = (uint32_t)m->gen;
    Hash *b = &m->batch_hash;
    int64_t k = 0, u = 0;
    for (int64_t i = 0; i < num_ids; i++) {
        int64_t r = m->found[i], at;
        /* a new id's home in the batch's hash: many maps' scratch does not stay in cache */
        if (i + AHEAD < num_ids && m->found[i + AHEAD] < 0) prefetch_home(b, ids[i + AHEAD]);
        if (r >= 0) {
            uint64_t pos = m->row_pos[r];
            if ((pos >> 32) != gen) {
                at = k++;
                m->row_pos[r] = gen << 32 | (uint64_t)at;
                m->known[at] = r;
                m->known_id[at] = ids[i];
                m->count_k[at] = 0;
            } else {
                at = (int64_t)(pos & 0xffffffffULL);
            }
            m->count_k[at]++;
            m->inverse[i] = r;
            continue;
        }
        at = hash_put(b, ids[i], u);
        if (at < 0) {
            m->sort_key[u] = signed_key(ids[i]);
            m->sort_val[u] = u;
            m->count_u[u] = 0;
            at = u++;
        }
        m->count_u[at]++;
        m->inverse[i] = ~at;
    }
    for (int64_t j = 0; j < u; j++) { /* clear only what the batch used */
        int64_t e = (int64_t)(mix64(m->sort_key[j] ^ (1ULL << 63)) & (uint64_t)b->mask);
        while (b->entries[e].slot >= 0) {
            b->entries[e].slot = -1;
            e = (e + 1) & b->mask;
        }
    }
    radix_sort(m->sort_key, m->sort_val, m->sort_key_tmp, m->sort_val_tmp, u);
    /* sort_val[j]: first-seen index of the j-th smallest new id; renumber to sorted order */
    for (int64_t j = 0; j < u; j++) {
        m->ids_u[j] = (int64_t)(m->sort_key[j] ^ (1ULL << 63));
        m->wanted[m->sort_val[j]] = j; /* wanted: scratch for first-seen -> sorted */
        m->slot_u[j] = m->count_u[m->sort_val[j]];
    }
    for (int64_t j = 0; j < u; j++) {
        m->count_u[j] = m->slot_u[j];
        m->slot_u[j] = -1;
    }
    for (int64_t i = 0; i < num_ids; i++)
        if (m->inverse[i] < 0) m->inverse[i] = ~m->wanted[~m->inverse[i]];
    m->num_u = u;
    m->num_known = k;
}

/* Frees the rows unseen for more than ttl steps (the head of the recency queue). */
static void expire(Map *m, int64_t step, int64_t ttl) {
    Slots *s = &m->rows;
    for (int64_t r; (r = queue_head(s)) >= 0 && step - s->seen[r] > ttl;) {
        remember(m, s, r);
        hash_erase(&s->hash, s->ids[r]);
        s->used[r] = 0;
        s->ids[r] = -1;
        heap_push(s, r);
        s->live--;
        m->expired++;
    }
}

/* Training batch, part 1: ttl expiry, lookup, distinct ids. Returns how many distinct ids are
 * known, or -1 (out of memory). */
int64_t rim_begin(void *handle, void **buffers, const int64_t *ids, int64_t num_ids,
                  int64_t step, int64_t ttl, int record) {
    Map *m = handle;
    bind(m, buffers);
    if (reserve(m, num_ids) != 0) return -1;
    m->recording = record;
    m->gen++;
    if (record && !m->rows.mark) m->rows.mark = calloc((m->rows.n >> 6) + 1, 8);
    if (record && m->has_cand && !m->cand.mark) m->cand.mark = calloc((m->cand.n >> 6) + 1, 8);
    if (record && (!m->rows.mark || (m->has_cand && !m->cand.mark))) return -1;
    forget_log(&m->rows);
    forget_log(&m->cand);
    m->expired = m->admissions = 0;
    if ((uint32_t)m->gen == 0) { /* the generation in row_pos wrapped: no stale match */
        memset(m->row_pos, 0, 8 * (size_t)(m->rows.n + 1));
        m->gen++;
    }
    if (ttl > 0) expire(m, step, ttl);
    scan_batch(m, ids, num_ids);
    return m->num_known;
}

/* Known ids were seen: frequency (decayed from its last seen to now) plus count; last seen =
 * now (so their queue entries are stale: the queue's live entries are the evictable rows until
 * rim_finish queues them again). */
static void count_known(Map *m, int64_t step) {
    Slots *s = &m->rows;
    for (int64_t k = 0; k < m->num_known; k++) {
        int64_t r = m->known[k];
        if (k + AHEAD < m->num_known) {
            int64_t ahead = m->known[k + AHEAD];
            __builtin_prefetch(&s->freq[ahead], 1);
            __builtin_prefetch(&s->seen[ahead], 1);
            if (m->keys_valid) { /* lfu's key and bucket generation, rewritten below */
                __builtin_prefetch(&m->keys[ahead], 1);
                if (m->lfu_rows.valid) __builtin_prefetch(&m->lfu_rows.gen[ahead], 1);
            }
        }
        remember_as(m, s, r, m->known_id[k], 1); /* a known row: its id, used */
        double kept = s->freq[r];
        if (m->powers.memo) kept = kept * decay_power(&m->powers, step - s->seen[r]);
        s->freq[r] = kept + (double)m->count_k[k];
        s->seen[r] = step; /* its queue entry is stale now: not a victim of this batch */
        if (m->keys_valid) {
            float key = lfu_key(s->freq[r], step, &m->powers);
            if (key != m->keys[r]) buckets_push(&m->lfu_rows, r, key); /* (same: same entry) */
            m->keys[r] = key;
        }
        m->touched[k] = r;
    }
}

/* Slot r of s, taken as a victim, loses its id (its queue entry goes stale). */
static void evict(Map *m, Slots *s, int64_t r) {
    remember(m, s, r);
    hash_erase(&s->hash, s->ids[r]);
    s->used[r] = 0;
    s->ids[r] = -1;
    s->live--;
}

/* Evicts slots[from .. to) of s in order, prefetching ahead (their ids, then hash homes). */
static void evict_range(Map *m, Slots *s, const int64_t *slots, int64_t from, int64_t to) {
    for (int64_t j = from; j < to; j++) {
        if (j + 2 * AHEAD < to) __builtin_prefetch(&s->ids[slots[j + 2 * AHEAD]], 1);
        if (j + AHEAD < to) prefetch_home(&s->hash, s->ids[slots[j + AHEAD]]);
        evict(m, s, slots[j]);
    }
}

/* The least recently seen live slots of s (out[placed ..], up to want: lru's victims, the
 * candidates forgotten), taken off the recency queue and evicted. The queue is read in order,
 * so the slots it names are prefetched ahead; each victim is evicted 2 * AHEAD victims behind
 * the read. Returns the new placed. */
static int64_t queue_victims(Map *m, Slots *s, int64_t *out, int64_t placed, int64_t want) {
    int64_t first = placed, done = placed, e = s->qhead;
    while (placed < want && e < s->qtail) {
        if (e + AHEAD < s->qtail) {
            int64_t ahead = s->queue[e + AHEAD].slot;
            __builtin_prefetch(&s->used[ahead]);
            __builtin_prefetch(&s->seen[ahead]);
            __builtin_prefetch(&s->ids[ahead], 1);
            if (m->recording == 1) /* the undo record reads its counter too */
                __builtin_prefetch(s->freq ? (void *)&s->freq[ahead] : (void *)&s->count[ahead]);
        }
        QEntry entry = s->queue[e++];
        if (!queued_live(s, entry)) continue;
        out[placed++] = entry.slot;
        if (placed - first > AHEAD) prefetch_home(&s->hash, s->ids[out[placed - 1 - AHEAD]]);
        if (placed - first > 2 * AHEAD) evict(m, s, out[done++]);
    }
    s->qhead = e;
    evict_range(m, s, out, done, placed);
    return placed;
}

/* Queues slots[0 .. count) of s (distinct, seen at step) at the tail in ascending order,
 * after making room: through the bitmap of the rows when s is the rows and the slots are
 * many next to the rows' words, else sorted by radix (slots is reordered). */
static void queue_push_sorted(Map *m, Slots *s, int64_t *slots, int64_t count, int64_t step) {
    queue_reserve(s, count);
    int64_t words = (s->n >> 6) + 1;
    if (s != &m->rows || count * 8 < words) {
        for (int64_t i = 0; i < count; i++) m->sort_key[i] = (uint64_t)slots[i];
        radix_sort(m->sort_key, slots, m->sort_key_tmp, m->sort_val_tmp, count);
        for (int64_t i = 0; i < count; i++) queue_push(s, slots[i], step);
        return;
    }
    uint64_t *bits = m->row_bits;
    for (int64_t i = 0; i < count; i++) bits[slots[i] >> 6] |= 1ULL << (slots[i] & 63);
    for (int64_t w = 0; w < words; w++) {
        for (uint64_t b = bits[w]; b; b &= b - 1) queue_push(s, (w << 6) + __builtin_ctzll(b), step);
        bits[w] = 0;
    }
}

/* Candidates: the new ids' counts (the torch path's IdMap._admit); sets admitted[u]. */
static void admit(Map *m, int64_t step, int64_t admit_after) {
    Slots *c = &m->cand;
    int64_t num_touched = 0, num_fresh = 0;
    int64_t *cslot = m->sort_val, *total = m->sort_val_tmp, *ctouched = m->wanted;
    for (int64_t u = 0; u < m->num_u; u++) {
        if (u + AHEAD < m->num_u) prefetch_home(&c->hash, m->ids_u[u + AHEAD]);
        int64_t at = hash_find(&c->hash, m->ids_u[u]);
        cslot[u] = at;
        total[u] = m->count_u[u] + (at >= 0 ? c->count[at] : 0);
        m->admitted[u] = total[u] >= admit_after;
        if (m->admitted[u]) m->admissions++;
        if (at >= 0 && m->admitted[u]) { /* admitted ids leave the candidates */
            remember(m, c, at);
            c->used[at] = 0;
            hash_erase(&c->hash, m->ids_u[u]);
            heap_push(c, at);
            c->live--;
        }
    }
    for (int64_t u = 0; u < m->num_u; u++) {
        if (m->admitted[u]) continue;
        int64_t at = cslot[u];
        if (at >= 0) {
            remember(m, c, at);
            c->count[at] = total[u];
            c->seen[at] = step; /* stale queue entry: not forgotten by this batch */
            ctouched[num_touched++] = at;
        } else {
            num_fresh++;
        }
    }
    /* the fresh ids' slots: free ones lowest first, then the least recently seen candidates
     * not seen in this batch, forgotten */
    int64_t *spare = m->found, got = 0, placed = 0;
    while (got < num_fresh && c->heap_size > 0) spare[got++] = heap_pop(c);
    got = queue_victims(m, c, spare, got, num_fresh);
    for (int64_t u = 0; u < m->num_u && placed < got; u++) {
        if (m->admitted[u] || cslot[u] >= 0) continue;
        int64_t at = spare[placed];
        if (placed + AHEAD < got) {
            __builtin_prefetch(&c->count[spare[placed + AHEAD]], 1);
            __builtin_prefetch(&c->seen[spare[placed + AHEAD]], 1);
        }
        remember(m, c, at);
        c->ids[at] = m->ids_u[u];
        c->count[at] = total[u];
        c->seen[at] = step;
        c->used[at] = 1;
        hash_put(&c->hash, m->ids_u[u], at);
        c->live++;
        ctouched[num_touched++] = at;
        placed++;
    }
    queue_push_sorted(m, c, ctouched, num_touched, step); /* now seen: the tail, by slot */
}

/* Training batch, part 2: count the known ids, admission, and the new ids to place, most
 * frequent first (ties: ascending id). */
int rim_middle(void *handle, void **buffers, int64_t step, int64_t admit_after) {
    Map *m = handle;
    bind(m, buffers);
    count_known(m, step);
    for (int64_t u = 0; u < m->num_u; u++) m->admitted[u] = 1;
    if (m->has_cand && m->num_u > 0) admit(m, step, admit_after);
    int64_t w = 0;
    for (int64_t u = 0; u < m->num_u; u++) {
        if (!m->admitted[u]) continue;
        m->sort_key[w] = ~(uint64_t)m->count_u[u]; /* descending count, stable */
        m->sort_val[w++] = u;
    }
    radix_sort(m->sort_key, m->sort_val, m->sort_key_tmp, m->sort_val_tmp, w);
    memcpy(m->wanted, m->sort_val, 8 * w);
    m->num_wanted = w;
    return 0;
}

/* lfu: the victims (fresh_rows[placed ..], up to want), chosen by lfu_select
 * (cpu_id_map_lfu.h) and evicted. Returns the new placed. */
static int64_t lfu_victims(Map *m, int64_t step, int64_t *fresh_rows, int64_t placed,
                           int64_t want) {
    Slots *s = &m->rows;
    if (!m->keys_valid) { /* once after a rebuild: every used row's key (the steps keep them) */
        if (!m->keys) m->keys = malloc(sizeof(float) * (size_t)(s->n + 1));
        for (int64_t r = 0; m->keys && r < s->n; r++) /* (free rows: never in a sample's low) */
            m->keys[r] = s->used[r] ? lfu_key(s->freq[r], s->seen[r], &m->powers) : INFINITY;
        m->keys_valid = m->keys != NULL;
        if (m->keys_valid) buckets_build(&m->lfu_rows, s, m->keys, &m->powers);
    } else if (m->lfu_rows.valid && m->lfu_rows.entries > 4 * s->n + 64) {
        buckets_build(&m->lfu_rows, s, m->keys, &m->powers); /* the stale entries dropped */
    }
    int64_t chosen =
        m->keys_valid && m->lfu_rows.valid
            ? buckets_select(&m->lfu_rows, s, &m->powers, step, want - placed, m->cands,
                             fresh_rows + placed)
            : lfu_select(s, &m->powers, m->keys_valid ? m->keys : NULL, step, want - placed,
                         m->rows.live - m->num_known, m->cands, m->cap_m, fresh_rows + placed);
    int64_t *victims = fresh_rows + placed; /* to the new ids in row order */
    for (int64_t i = 0; i < chosen; i++) m->sort_key[i] = (uint64_t)victims[i];
    radix_sort(m->sort_key, victims, m->sort_key_tmp, m->sort_val_tmp, chosen);
    evict_range(m, &m->rows, fresh_rows, placed, placed + chosen);
    return placed + chosen;
}

/* Training batch, part 3: rows for the wanted ids (free rows lowest first, then victims: the
 * lowest decayed counts (lfu) or the recency queue's head (lru)), the batch's rows, and the
 * stats [new ids, evictions, expired, admissions, zero-row ids, live rows]. Returns 0, or -1
 * when an undo record could not be allocated. */
int rim_finish(void *handle, void **buffers, int64_t step, int lfu, int64_t *rows_out,
               int64_t num_ids, int64_t *fresh_rows, int64_t *fresh_ids, int64_t *stats_out) {
    Map *m = handle;
    bind(m, buffers);
    Slots *s = &m->rows;
    int64_t want = m->num_wanted, placed = 0, evicted = 0;
    while (placed < want && s->heap_size > 0) fresh_rows[placed++] = heap_pop(s);
    int64_t first_victim = placed;
    if (placed < want) /* the victims' queue entries go stale as they go */
        placed = lfu ? lfu_victims(m, step, fresh_rows, placed, want)
                     : queue_victims(m, &m->rows, fresh_rows, placed, want);
    evicted = placed - first_victim;
    int64_t num_touched = m->num_known;
    for (int64_t j = 0; j < placed; j++) {
        int64_t u = m->wanted[j], r = fresh_rows[j];
        if (j + AHEAD < placed) {
            int64_t ahead = fresh_rows[j + AHEAD];
            prefetch_home(&s->hash, m->ids_u[m->wanted[j + AHEAD]]);
            __builtin_prefetch(&s->seen[ahead], 1);
            __builtin_prefetch(&s->freq[ahead], 1);
            __builtin_prefetch(&s->used[ahead], 1);
            if (m->keys_valid) { /* lfu's key and bucket generation */
                __builtin_prefetch(&m->keys[ahead], 1);
                if (m->lfu_rows.valid) __builtin_prefetch(&m->lfu_rows.gen[ahead], 1);
            }
        }
        remember(m, s, r);
        s->ids[r] = m->ids_u[u];
        s->used[r] = 1;
        s->seen[r] = step;
        s->freq[r] = (double)m->count_u[u];
        if (m->keys_valid) {
            m->keys[r] = lfu_key(s->freq[r], step, &m->powers);
            buckets_push(&m->lfu_rows, r, m->keys[r]); /* a new id: always a new entry */
        }
        hash_put(&s->hash, m->ids_u[u], r);
        s->live++;
        m->slot_u[u] = r;
        fresh_ids[j] = m->ids_u[u];
        m->touched[num_touched++] = r;
    }
    queue_push_sorted(m, s, m->touched, num_touched, step); /* seen now: the tail, by row */
    for (int64_t i = 0; i < num_ids; i++) {
        int64_t v = m->inverse[i];
        rows_out[i] = v >= 0 ? v : m->slot_u[~v];
    }
    stats_out[0] = placed;
    stats_out[1] = evicted;
    stats_out[2] = m->expired;
    stats_out[3] = m->admissions;
    stats_out[4] = m->num_u - placed;
    stats_out[5] = s->live;
    return m->recording < 0 ? -1 : 0;
}

/* One training batch of each of num_maps maps, over threads: the step counter *steps[i]
 * (the map's step buffer) incremented, then the three parts back to back, each map's undo
 * record kept when record is 1 (rim_undo_copy_many). Per map i: handles[i], lfu[i] (0: lru),
 * buffers[8i..8i+7], ids[i] (num_ids[i]), and outputs rows_out[i] [num_ids], fresh_rows[i]
 * and fresh_ids[i] [num_ids], stats_out[7i..7i+6] (as rim_finish, then the new step),
 * status[i] (0, or -1: out of memory; the step counter moved either way). */
void rim_step_many(int64_t num_maps, void **handles, const int64_t *lfu, void **buffers,
                   int64_t **ids,
                   const int64_t *num_ids, int64_t **steps, const int64_t *ttls,
                   const int64_t *admit_after, int64_t **rows_out, int64_t **fresh_rows,
                   int64_t **fresh_ids, int64_t *stats_out, int64_t *status, int record,
                   int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < num_maps; i++) {
        void **own = buffers + 8 * i;
        int64_t step = ++*steps[i];
        stats_out[7 * i + 6] = step;
        status[i] = -1;
        if (rim_begin(handles[i], own, ids[i], num_ids[i], step, ttls[i], record) < 0)
            continue;
        rim_middle(handles[i], own, step, admit_after[i]);
        status[i] = rim_finish(handles[i], own, step, (int)lfu[i], rows_out[i], num_ids[i],
                               fresh_rows[i], fresh_ids[i], stats_out + 7 * i);
    }
}

/* out[i] = decay^ages[i] as the maps compute it (decay_power), for the tests. */
void rim_decay_powers(double decay, const int64_t *ages, int64_t n, double *out) {
    Powers powers;
    if (powers_init(&powers, decay) != 0) return;
    for (int64_t i = 0; i < n; i++) out[i] = decay_power(&powers, ages[i]);
    free(powers.memo);
}

/* The undo record of the last batch: which = 0 rows, 1 candidates. */
int64_t rim_undo_size(void *handle, int which) {
    Map *m = handle;
    return which ? m->cand.log.size : m->rows.log.size;
}

void rim_undo_copy(void *handle, int which, int64_t *slot, int64_t *ids, uint8_t *used,
                   int64_t *seen, double *freq, int64_t *count) {
    Map *m = handle;
    Log *log = which ? &m->cand.log : &m->rows.log;
    int64_t n = log->size;
    memcpy(slot, log->slot, 8 * n);
    memcpy(ids, log->ids, 8 * n);
    memcpy(used, log->used, n);
    memcpy(seen, log->seen, 8 * n);
    if (freq) memcpy(freq, log->freq, 8 * n);
    if (count) memcpy(count, log->count, 8 * n);
}

/* The undo records of num_maps maps' last batches (which: 0 rows, 1 candidates): sizes[i],
 * then (rim_undo_copy_many) copied to the arrays at offsets[i] (freq or count may be NULL). */
void rim_undo_sizes(int64_t num_maps, void **handles, int which, int64_t *sizes) {
    for (int64_t i = 0; i < num_maps; i++) sizes[i] = rim_undo_size(handles[i], which);
}

void rim_undo_copy_many(int64_t num_maps, void **handles, int which, const int64_t *offsets,
                        int64_t *slot, int64_t *ids, uint8_t *used, int64_t *seen, double *freq,
                        int64_t *count) {
    for (int64_t i = 0; i < num_maps; i++) {
        int64_t at = offsets[i];
        rim_undo_copy(handles[i], which, slot + at, ids + at, used + at, seen + at,
                      freq ? freq + at : NULL, count ? count + at : NULL);
    }
}
