/* splitmix64's finaliser: the mixing step of the hashes that must give the torch path's bits
 * (recopt.modules.id_map_rows: `hash_uniform`'s values, `route_shard`'s shards). Header-only:
 * included by cpu_id_map_fill.h and cpu_bucketize.c.
 */
#ifndef RECOPT_CPU_SPLITMIX_H
#define RECOPT_CPU_SPLITMIX_H

#include <stdint.h>

static inline uint64_t splitmix_finish(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

#endif
