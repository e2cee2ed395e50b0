/* The batch side of the native id map (cpu_id_map.c): a remapped batch's ids of the shared
 * zero row dropped from their bags (id_map_batch.apply_rows). Header-only: included once, by
 * cpu_id_map.c.
 */
#ifndef RECOPT_CPU_ID_MAP_BATCH_H
#define RECOPT_CPU_ID_MAP_BATCH_H

#include <stdint.h>

/* The rows of num_keys x stride bags (offsets [num_keys * stride + 1] into rows, from 0), the
 * zero row's (-1) dropped from the bags of the keys marked in mapped (the other keys' values
 * stay, whatever they are; so do the values past the last bag, up to num_rows). Writes the
 * kept rows (and their weights, when weights is not NULL) in order, each bag's kept count
 * (lengths_out) and each key's (per_key_out); returns how many rows were kept. */
int64_t rim_drop_zero_rows(int64_t num_keys, int64_t stride, const int64_t *offsets,
                           const uint8_t *mapped, const int64_t *rows, int64_t num_rows,
                           const float *weights, int64_t *rows_out, float *weights_out,
                           int64_t *lengths_out, int64_t *per_key_out) {
    int64_t kept = 0;
    for (int64_t k = 0; k < num_keys; k++) {
        int64_t key_start = kept;
        for (int64_t bag = k * stride; bag < (k + 1) * stride; bag++) {
            int64_t bag_start = kept;
            for (int64_t i = offsets[bag]; i < offsets[bag + 1]; i++) {
                int64_t row = rows[i];
                if (weights) weights_out[kept] = weights[i];
                rows_out[kept] = row;
                kept += !(mapped[k] && row < 0); /* written either way, kept if not dropped */
            }
            lengths_out[bag] = kept - bag_start;
        }
        per_key_out[k] = kept - key_start;
    }
    for (int64_t i = offsets[num_keys * stride]; i < num_rows; i++) {
        if (weights) weights_out[kept] = weights[i];
        rows_out[kept++] = rows[i];
    }
    return kept;
}

#endif
