/* Native routing of a rank's ids to the virtual features of every rank: what
 * recopt/sharding/bucketizer.py's torch ops do for row-split layouts (`Bucketizer.bucketize`),
 * the same output bit for bit, in two passes over the ids instead of a dozen tensor ops and a
 * sort.
 *
 * Feature f's id v (bag b of the batch) lies in one row block of its table (its blocks:
 * feature_blocks[f] .. feature_blocks[f + 1] - 1): the last whose start (block_bounds, v +
 * feat_base[f]) is at or below it; or, for an id-mapped
 * feature (hashed[f]), the block of the shard that `route_shard` names for the raw id. The
 * block's routes (route_gv[route_start .. + route_count]) are the virtual features that get
 * it, as v - row_offset[block]. The output groups the ids by virtual feature, in input order
 * within one (a stable counting sort), with each virtual feature's bag lengths.
 * Legend: F features, B bags per feature, N ids, G virtual features, M ids routed (N x
 * routes).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_splitmix.h"

/* recopt.modules.id_map_rows.route_shard: the row shard (of `shards`) that owns a raw id,
 * (splitmix_finish(id + salt) >> 1) % shards; the remainder through a multiply by inverse =
 * UINT64_MAX / shards (the quotient it gives is at most 2 short), not a division. */
static inline int64_t route_shard(int64_t id, uint64_t shards, uint64_t inverse) {
    uint64_t key = splitmix_finish((uint64_t)id + 0x5851F42D4C957F2DULL) >> 1;
    uint64_t rest = key - (uint64_t)(((unsigned __int128)key * inverse) >> 64) * shards;
    while (rest >= shards) rest -= shards;
    return (int64_t)rest;
}

/* The last of blocks [first, end) (one feature's, end > first) whose start is at or below
 * key; the first if none is (an id out of range stays in its feature's blocks). Few blocks:
 * counted without branches; many: a binary search. */
static inline int64_t block_of_key(const int64_t *bounds, int64_t first, int64_t end,
                                   int64_t key) {
    int64_t block = first;
    if (end - first <= 16) {
        for (int64_t k = first + 1; k < end; k++) block += bounds[k] <= key;
        return block;
    }
    int64_t lo = first + 1, hi = end; /* the first start above key, in [lo, hi] */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (bounds[mid] <= key) lo = mid + 1;
        else hi = mid;
    }
    return lo - 1;
}

typedef struct { /* how one feature's ids find their block */
    const int64_t *bounds;
    int64_t first, end, base; /* its blocks [first, end), its rows' offset in bounds */
    const int64_t *shard_block; /* id-mapped: the block of each of its shards; else NULL */
    uint64_t shards, inverse;
} FeatureBlocks;

static inline int64_t block_of(const FeatureBlocks *fb, int64_t id) {
    if (fb->shard_block) return fb->shard_block[route_shard(id, fb->shards, fb->inverse)];
    return block_of_key(fb->bounds, fb->first, fb->end, id + fb->base);
}

static FeatureBlocks feature_blocks_of(int64_t f, const int64_t *feature_blocks,
                                       const int64_t *block_bounds, const int64_t *feat_base,
                                       const uint8_t *hashed, const int64_t *hash_shards,
                                       const int64_t *hash_base, const int64_t *hash_block) {
    FeatureBlocks fb = {block_bounds, feature_blocks[f], feature_blocks[f + 1], feat_base[f],
                        NULL, 1, UINT64_MAX};
    if (hashed && hashed[f]) {
        fb.shard_block = hash_block + hash_base[f];
        fb.shards = (uint64_t)hash_shards[f];
        fb.inverse = UINT64_MAX / fb.shards;
    }
    return fb;
}

/* Routes the ids (values [num_ids], weights [num_ids] or NULL; F x B bag lengths) into ids_out
 * and weights_out (grouped by virtual feature) and lengths_out [G x B]; returns M, or -1
 * (nothing written) when the lengths do not sum to num_ids. next [G] and
 * hashed_block_at [N] (when hashed is not NULL) are scratch. hashed may be NULL (no feature
 * id-mapped). Two passes over the ids (counts, then places); an id's row block is found again
 * in the second (a compare or two: cheaper than writing it and reading it back), a raw id's
 * hashed block kept from the first. */
int64_t rb_bucketize(int64_t num_features, int64_t batch, const int64_t *lengths,
                     int64_t num_ids, const int64_t *values, const float *weights,
                     const int64_t *feature_blocks, const int64_t *block_bounds,
                     const int64_t *feat_base,
                     const int64_t *row_offset, const int64_t *route_count,
                     const int64_t *route_start, const int64_t *route_gv, const uint8_t *hashed,
                     const int64_t *hash_shards, const int64_t *hash_base,
                     const int64_t *hash_block, int64_t num_virtual, int64_t *next,
                     int32_t *hashed_block_at, int64_t *ids_out, float *weights_out,
                     int64_t *lengths_out) {
    int64_t sum = 0;
    for (int64_t k = 0; k < num_features * batch; k++) sum += lengths[k];
    if (sum != num_ids) return -1;
    memset(next, 0, sizeof(int64_t) * (size_t)num_virtual);
    memset(lengths_out, 0, sizeof(int64_t) * (size_t)(num_virtual * batch));
    int64_t i = 0;
    for (int64_t f = 0; f < num_features; f++) {
        FeatureBlocks fb = feature_blocks_of(f, feature_blocks, block_bounds, feat_base, hashed,
                                             hash_shards, hash_base, hash_block);
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t end = i + lengths[f * batch + b]; i < end; i++) {
                int64_t block = block_of(&fb, values[i]);
                if (fb.shard_block) hashed_block_at[i] = (int32_t)block;
                const int64_t *gv = route_gv + route_start[block];
                for (int64_t r = 0; r < route_count[block]; r++) {
                    next[gv[r]]++;
                    lengths_out[gv[r] * batch + b]++;
                }
            }
        }
    }
    int64_t total = 0;
    for (int64_t g = 0; g < num_virtual; g++) {
        int64_t count = next[g];
        next[g] = total;
        total += count;
    }
    i = 0;
    for (int64_t f = 0; f < num_features; f++) {
        FeatureBlocks fb = feature_blocks_of(f, feature_blocks, block_bounds, feat_base, hashed,
                                             hash_shards, hash_base, hash_block);
        int64_t count = 0;
        for (int64_t b = 0; b < batch; b++) count += lengths[f * batch + b];
        for (int64_t end = i + count; i < end; i++) {
            int64_t block = fb.shard_block ? hashed_block_at[i] : block_of(&fb, values[i]);
            int64_t id = values[i] - row_offset[block];
            const int64_t *gv = route_gv + route_start[block];
            for (int64_t r = 0; r < route_count[block]; r++) {
                int64_t at = next[gv[r]]++;
                ids_out[at] = id;
                if (weights) weights_out[at] = weights[i];
            }
        }
    }
    return total;
}
