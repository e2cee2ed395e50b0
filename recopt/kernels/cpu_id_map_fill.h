/* The fresh rows of the native id map (cpu_id_map.c): their hashed initial values
 * (id_map_lookup.hash_uniform, bit for bit) and their zeroed optimizer state, and the
 * library's functions that write them (rim_*). Header-only: included once, by cpu_id_map.c.
 */
#ifndef RECOPT_CPU_ID_MAP_FILL_H
#define RECOPT_CPU_ID_MAP_FILL_H

#include <stdint.h>
#include <string.h>

#include "cpu_splitmix.h"

/* How many rows ahead the row loops prefetch (the rows are random: their misses overlap). */
#define ROWS_AHEAD 8

static inline uint64_t row_key(int64_t id, int64_t step) {
    return splitmix_finish((uint64_t)id * 0x9E3779B97F4A7C15ULL + (uint64_t)step);
}

/* out [dim]: float64 in [0, 1), a fixed function of (id, step, column). */
static inline void hash_row(int64_t id, int64_t step, int64_t dim, double *out) {
    const uint64_t golden = 0x9E3779B97F4A7C15ULL;
    uint64_t key = row_key(id, step);
    for (int64_t c = 0; c < dim; c++) {
        uint64_t x = splitmix_finish(key + (uint64_t)(c + 1) * golden);
        out[c] = (double)(x >> 11) * 0x1p-53; /* exact, as torch's / 2^53 */
    }
}

/* The write-prefetch of the bytes [at, at + bytes). */
static inline void prefetch_bytes(const void *at, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)at + b, 1);
}

/* weight[rows[i], :dim] = (float)(lo + (hi - lo) * hash_uniform(ids[i], step, column)): the
 * torch path's init_rows on float32 rows, the same rounding (two float64 ops, then float). */
static void fill_rows(const int64_t *ids, const int64_t *rows, int64_t num_rows, int64_t step,
                      int64_t dim, double lo, double hi, float *weight, int64_t row_stride) {
    const uint64_t golden = 0x9E3779B97F4A7C15ULL;
    double span = hi - lo;
    for (int64_t i = 0; i < num_rows; i++) {
        if (i + ROWS_AHEAD < num_rows)
            prefetch_bytes(weight + rows[i + ROWS_AHEAD] * row_stride, 4 * dim);
        uint64_t key = row_key(ids[i], step);
        float *row = weight + rows[i] * row_stride;
        for (int64_t c = 0; c < dim; c++) {
            uint64_t x = splitmix_finish(key + (uint64_t)(c + 1) * golden);
            double unit = (double)(x >> 11) * 0x1p-53;
            double scaled = span * unit;
            row[c] = (float)(lo + scaled);
        }
    }
}

/* The first `width` bytes of each of `rows` (row r at base + r * stride bytes) set to 0. */
static void zero_rows(const int64_t *rows, int64_t num_rows, uint8_t *base, int64_t stride,
                      int64_t width) {
    for (int64_t i = 0; i < num_rows; i++) {
        if (i + ROWS_AHEAD < num_rows)
            __builtin_prefetch(base + rows[i + ROWS_AHEAD] * stride, 1);
        memset(base + rows[i] * stride, 0, (size_t)width);
    }
}

/* ---- the library's functions (cpu_id_map.py) ---- */

/* out [num_ids, dim]: float64 in [0, 1), a fixed function of (id, step, column). */
void rim_hash_uniform(const int64_t *ids, int64_t num_ids, int64_t step, int64_t dim,
                      double *out) {
    for (int64_t i = 0; i < num_ids; i++) hash_row(ids[i], step, dim, out + i * dim);
}

/* weight[rows[i], :] = (float)(lo + (hi - lo) * hash_uniform(ids[i], step, column)): the
 * torch path's init_rows on float32 rows, the same rounding (two float64 ops, then float). */
void rim_fill_uniform(const int64_t *ids, const int64_t *rows, int64_t num_rows, int64_t step,
                      int64_t dim, double lo, double hi, float *weight, int64_t row_stride) {
    fill_rows(ids, rows, num_rows, step, dim, lo, hi, weight, row_stride);
}

/* weight[rows[i], :dim] = values[i, :dim] (values: the rows fill_rows would write, made
 * earlier, e.g. by a pipeline's worker thread while the rows were still in use). */
static void copy_rows(const float *values, const int64_t *rows, int64_t num_rows, int64_t dim,
                      float *weight, int64_t row_stride) {
    for (int64_t i = 0; i < num_rows; i++) {
        if (i + ROWS_AHEAD < num_rows)
            prefetch_bytes(weight + rows[i + ROWS_AHEAD] * row_stride, 4 * dim);
        memcpy(weight + rows[i] * row_stride, values + i * dim, 4 * (size_t)dim);
    }
}

/* The fresh rows of num_tables tables in one call, the tables over threads. Table t: rows[t]
 * and ids[t] (num_rows[t] each) are written as rim_fill_uniform writes them (steps[t],
 * dims[t], lo_hi[2t], lo_hi[2t + 1], weights[t], weight_strides[t] floats a row), or copied
 * from values[t] ([num_rows[t], dims[t]], those same values made earlier) when values and
 * values[t] are not NULL; then the rows' bytes of states first_state[t] ..
 * first_state[t + 1] - 1 are zeroed: state s starts at states[s], row r at
 * r * state_strides[s] bytes, state_widths[s] bytes of it. */
void rim_reset_many(int64_t num_tables, int64_t **rows, int64_t **ids, const int64_t *num_rows,
                    const int64_t *steps, const int64_t *dims, const double *lo_hi,
                    float **weights, const int64_t *weight_strides, const int64_t *first_state,
                    uint8_t **states, const int64_t *state_strides,
                    const int64_t *state_widths, const float **values, int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < num_tables; t++) {
        if (values && values[t])
            copy_rows(values[t], rows[t], num_rows[t], dims[t], weights[t], weight_strides[t]);
        else
            fill_rows(ids[t], rows[t], num_rows[t], steps[t], dims[t], lo_hi[2 * t],
                      lo_hi[2 * t + 1], weights[t], weight_strides[t]);
        for (int64_t s = first_state[t]; s < first_state[t + 1]; s++)
            zero_rows(rows[t], num_rows[t], states[s], state_strides[s], state_widths[s]);
    }
}

#endif
