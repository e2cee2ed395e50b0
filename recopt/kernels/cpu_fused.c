/* recopt's native CPU embedding kernel: pooling, sorted-occurrence preparation, gradient
 * aggregation fused with the optimizer update. Loaded through ctypes by cpu_fused.py, which
 * compiles it with the system C compiler at first use (no torch headers). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* One table: its rows are keys [base, end) of the pass's global key space. */
typedef struct {
    int64_t base, end, dim;
    float *weight, *s1, *s2;
    uint16_t *half; /* the weights when kind is 1 (fp16) or 2 (bf16); weight is then NULL */
    int kind;
    uint64_t seed; /* stochastic rounding of fp16/bf16 rows: element (key, d) hashes it */
    float step_size;
} table_t;

/* What every chunk of one backward pass shares. */
typedef struct {
    int opt, num_tables;
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

/* Stochastic rounding of float32 to fp16 or bf16 bit patterns, in blocks (a table row, or
 * 256 elements of a flat array): block b draws a 64-bit key mix64(seed ^ b * odd) once, and
 * lane j of it 32 random bits from a 32-bit hash of (key, j) (a bijection of the lane for a
 * given key), so the result depends on (seed, block, lane) only, not on threads. The per-lane
 * work is branch-free 32-bit integer and float arithmetic, so GCC vectorises it.
 * The magnitude's pattern gets a random integer below 2^k (k = 13 fp16, 16 bf16) added and
 * its k low bits cleared: rounded up with probability (x - lo) / (hi - lo). fp16 subnormals
 * (|x| < 2^-14, even steps of 2^-24) round up with probability frac(|x| * 2^24), 24 bits.
 * NaN stays NaN, inf stays inf, values past fp16's largest finite value become inf. */
static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline uint64_t block_key(uint64_t seed, uint64_t block) {
    return mix64(seed ^ (block * 0xD1B54A32D192ED03ull));
}

/* Lane j's 32 bits: a Weyl step from the key's low half, then a multiply-xorshift finaliser
 * (Wellons' lowbias32 constants) with the high half folded in between. */
static inline uint32_t lane_bits(uint32_t lo, uint32_t hi, uint32_t j) {
    uint32_t x = lo + j * 0x9E3779B9u;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= hi;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static inline uint16_t round_bf16(uint32_t bits, uint32_t r) {
    const uint32_t nan = (bits >> 16) | 0x40u;
    const uint32_t rounded = (bits + (r & 0xffffu)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline uint16_t round_fp16(float x, uint32_t bits, uint32_t r) {
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u; /* NaN */
    if (a == 0x7f800000u) return sign | 0x7c00u; /* inf */
    if (a < 0x38800000u) { /* below 2^-14: fp16 subnormal steps of 2^-24 */
        const float m = fabsf(x) * 16777216.0f; /* exact: a power-of-two scaling, m < 1024 */
        const float whole = floorf(m);
        const float u = (float)(r >> 8) * (1.0f / 16777216.0f);
        return sign | (uint16_t)((uint32_t)whole + (m - whole > u ? 1u : 0u));
    }
    const uint32_t t = (a + (r & 0x1fffu)) & ~0x1fffu;
    const int32_t exponent = (int32_t)(t >> 23) - 127 + 15;
    if (exponent >= 31) return sign | 0x7c00u;
    return sign | (uint16_t)(((uint32_t)exponent << 10) | ((t >> 13) & 0x3ffu));
}

#if defined(__AVX2__) && defined(__F16C__)
/* lane_bits for eight lanes; weyl holds lo + j * 0x9E3779B9 for each lane j. */
static inline __m256i lane_bits8(__m256i weyl, __m256i hi) {
    __m256i x = weyl;
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, hi);
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* round_fp16 on eight lanes, the same results: each case's float32 value is computed (all
 * exactly representable in fp16), the lane's one is picked and F16C converts it (round to
 * nearest: exact, and what lies past 65504 becomes inf). */
static inline __m128i round_fp16_8(__m256 x, __m256i r) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i a = _mm256_and_si256(bits, abs_mask);
    const __m256i sign = _mm256_andnot_si256(abs_mask, bits);
    /* normal: noise in the 13 bits fp16 drops, then truncated (inf stays inf) */
    const __m256i t = _mm256_andnot_si256(
        _mm256_set1_epi32(0x1fff), _mm256_add_epi32(a, _mm256_and_si256(r, _mm256_set1_epi32(0x1fff))));
    /* subnormal: whole + (frac > u) steps of 2^-24 */
    const __m256 m = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(16777216.0f));
    const __m256 whole = _mm256_floor_ps(m);
    const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r, 8)),
                                   _mm256_set1_ps(1.0f / 16777216.0f));
    const __m256 up = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(m, whole), u, _CMP_GT_OQ),
                                    _mm256_set1_ps(1.0f));
    const __m256 sub = _mm256_mul_ps(_mm256_add_ps(whole, up), _mm256_set1_ps(1.0f / 16777216.0f));
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x38800000), a);
    const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
    __m256i mag = _mm256_blendv_epi8(t, _mm256_castps_si256(sub), small);
    mag = _mm256_blendv_epi8(mag, _mm256_set1_epi32(0x7fc00000), nan);
    return _mm256_cvtps_ph(_mm256_castsi256_ps(_mm256_or_si256(mag, sign)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif

#if defined(__AVX512F__)
/* The same on sixteen lanes with AVX-512 (mask registers for the selections). */
static inline __m512i lane_bits16(__m512i weyl, __m512i hi) {
    __m512i x = weyl;
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, hi);
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

static inline __m256i round_fp16_16(__m512 x, __m512i r) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i a = _mm512_and_si512(bits, abs_mask);
    const __m512i sign = _mm512_andnot_si512(abs_mask, bits);
    const __m512i t = _mm512_andnot_si512(
        _mm512_set1_epi32(0x1fff), _mm512_add_epi32(a, _mm512_and_si512(r, _mm512_set1_epi32(0x1fff))));
    const __mmask16 small = _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(0x38800000));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000));
    /* subnormal lanes only: whole + (frac > u) steps of 2^-24 */
    const __m512 m = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(16777216.0f));
    const __m512 whole = _mm512_roundscale_ps(m, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(r, 8)),
                                   _mm512_set1_ps(1.0f / 16777216.0f));
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(m, whole), u, _CMP_GT_OQ);
    const __m512 sub = _mm512_mul_ps(_mm512_mask_add_ps(whole, up, whole, _mm512_set1_ps(1.0f)),
                                     _mm512_set1_ps(1.0f / 16777216.0f));
    __m512i mag = _mm512_mask_mov_epi32(t, small, _mm512_castps_si512(sub));
    mag = _mm512_mask_mov_epi32(mag, nan, _mm512_set1_epi32(0x7fc00000));
    return _mm512_cvtps_ph(_mm512_castsi512_ps(_mm512_or_si512(mag, sign)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif

/* A row (or block) of n float32 to fp16 (kind 1) or bf16 (kind 2) with the block's key. */
static inline void round_row(const float *restrict w, uint16_t *restrict h, int64_t n,
                             int kind, uint64_t key) {
    const uint32_t lo = (uint32_t)key, hi = (uint32_t)(key >> 32);
    if (kind == 2) { /* branch-free: GCC vectorises it */
        for (int64_t d = 0; d < n; d++) {
            uint32_t bits;
            __builtin_memcpy(&bits, &w[d], 4);
            h[d] = round_bf16(bits, lane_bits(lo, hi, (uint32_t)d));
        }
        return;
    }
    int64_t d = 0;
#if defined(__AVX512F__)
    const __m512i vhi = _mm512_set1_epi32((int)hi), step = _mm512_set1_epi32((int)(16u * 0x9E3779B9u));
    __m512i weyl = _mm512_add_epi32(
        _mm512_set1_epi32((int)lo),
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32((int)0x9E3779B9u)));
    for (; d + 16 <= n; d += 16) {
        _mm256_storeu_si256((__m256i *)(h + d),
                            round_fp16_16(_mm512_loadu_ps(w + d), lane_bits16(weyl, vhi)));
        weyl = _mm512_add_epi32(weyl, step);
    }
#elif defined(__AVX2__) && defined(__F16C__)
    const __m256i vhi = _mm256_set1_epi32((int)hi), step = _mm256_set1_epi32((int)(8u * 0x9E3779B9u));
    __m256i weyl = _mm256_add_epi32(
        _mm256_set1_epi32((int)lo),
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                           _mm256_set1_epi32((int)0x9E3779B9u)));
    for (; d + 8 <= n; d += 8) {
        _mm_storeu_si128((__m128i *)(h + d),
                         round_fp16_8(_mm256_loadu_ps(w + d), lane_bits8(weyl, vhi)));
        weyl = _mm256_add_epi32(weyl, step);
    }
#endif
    for (; d < n; d++) {
        uint32_t bits;
        __builtin_memcpy(&bits, &w[d], 4);
        h[d] = round_fp16(w[d], bits, lane_bits(lo, hi, (uint32_t)d));
    }
}

/* fp16 / bf16 bit patterns to float32 (exact). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        const float f = (float)m * (1.0f / 16777216.0f);
        __builtin_memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    float out;
    __builtin_memcpy(&out, &bits, 4);
    return out;
}

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float out;
    __builtin_memcpy(&out, &bits, 4);
    return out;
}

/* Weight storage kinds: 0 float32, 1 fp16, 2 bf16 (the latter two as uint16 patterns). */
/* A row of n fp16 / bf16 patterns to float32: eight at a time with F16C where available. */
static inline void load_row(const uint16_t *restrict h, float *restrict out, int64_t n,
                            int kind) {
    int64_t i = 0;
    if (kind == 2) {
        for (; i < n; i++) out[i] = bf16_to_float(h[i]);
        return;
    }
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = half_to_float(h[i]);
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
 * row could alias the structs, which forces reloads and blocks vectorisation. */
static void update_row(const pass_t *p, const table_t *tb, int64_t row, float *restrict acc,
                       float *restrict wbuf) {
    const int64_t D = tb->dim;
    const float lr = p->lr, eps = p->eps, wd = p->wd, step_size = tb->step_size;
    const float omb1 = p->one_minus_beta1, omb2 = p->one_minus_beta2;
    /* fp16/bf16 rows are updated in float32 (wbuf) and rounded back stochastically. */
    float *restrict w = tb->kind ? wbuf : tb->weight + row * D;
    if (tb->kind) load_row(tb->half + row * D, w, D, tb->kind);
    if (wd != 0.0f)
        for (int64_t d = 0; d < D; d++) acc[d] += wd * w[d];
    switch (p->opt) {
    case 0:
        for (int64_t d = 0; d < D; d++) w[d] -= lr * acc[d];
        break;
    case 1: {
        float *restrict m = tb->s1 + row * D;
        for (int64_t d = 0; d < D; d++) {
            m[d] += acc[d] * acc[d];
            w[d] -= lr * acc[d] / (sqrtf(m[d]) + eps);
        }
        break;
    }
    case 2: {
        const float mom = tb->s1[row] + sum_sq(acc, D) / (float)D;
        tb->s1[row] = mom;
        const float r = lr / (sqrtf(mom) + eps);
        for (int64_t d = 0; d < D; d++) w[d] -= r * acc[d];
        break;
    }
    case 3: {
        float *restrict m = tb->s1 + row * D, *restrict v = tb->s2 + row * D;
        for (int64_t d = 0; d < D; d++) {
            m[d] += (acc[d] - m[d]) * omb1;
            v[d] += (acc[d] * acc[d] - v[d]) * omb2;
            w[d] += -step_size * (m[d] / (sqrtf(v[d]) + eps));
        }
        break;
    }
    case 4: {
        float *restrict m = tb->s1 + row * D;
        const float sq = sum_sq(acc, D);
        for (int64_t d = 0; d < D; d++) m[d] += (acc[d] - m[d]) * omb1;
        const float v = tb->s2[row] + (sq / (float)D - tb->s2[row]) * omb2;
        tb->s2[row] = v;
        const float r = -step_size / (sqrtf(v) + eps);
        for (int64_t d = 0; d < D; d++) w[d] += r * m[d];
        break;
    }
    }
    if (tb->kind)
        round_row(w, tb->half + row * D, D, tb->kind,
                  block_key(tb->seed, (uint64_t)(tb->base + row)));
}

/* A macro for the reason PREFETCH_ROW is one. */
#define PREFETCH_OCCURRENCE(p, tb, k)                                              \
    do {                                                                           \
        const int64_t row_ = KEY((p)->packed[k]) - (tb)->base, d_ = (tb)->dim;     \
        if ((tb)->kind) PREFETCH_ROW((tb)->half + row_ * d_, d_, 1);               \
        else PREFETCH_ROW((tb)->weight + row_ * d_, d_, 1);                        \
        PREFETCH_ROW((p)->grad + GOFF((p)->packed[k]), d_, 0);                     \
        if ((p)->opt == 2) __builtin_prefetch((tb)->s1 + row_, 1, 3);              \
        if ((p)->opt == 1 || (p)->opt == 3 || (p)->opt == 4)                       \
            PREFETCH_ROW((tb)->s1 + row_ * d_, d_, 1);                             \
        if ((p)->opt == 3) PREFETCH_ROW((tb)->s2 + row_ * d_, d_, 1);              \
        if ((p)->opt == 4) __builtin_prefetch((tb)->s2 + row_, 1, 3);              \
    } while (0)

/* Keys are sorted, so the table of the current (and of the prefetched) key only moves up. */
static void run_chunk(const pass_t *p, int64_t begin, int64_t end) {
    float *restrict acc = (float *)malloc(sizeof(float) * (size_t)p->max_dim);
    float *restrict wbuf = (float *)malloc(sizeof(float) * (size_t)p->max_dim);
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
        update_row(p, tb, key - tb->base, acc, wbuf);
    }
    free(acc);
    free(wbuf);
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
 * meta: bases[T+1], dims[T], then weight, state1, state2 pointers [T] each (as int64),
 * weight kinds [T] (0 float32, 1 fp16, 2 bf16) and the rounding seed.
 * hyper: lr, eps, weight_decay, sign, 1 - beta1, 1 - beta2, then step_size[T]. */
#define MAX_CHUNKS 256
int recopt_fused_update(int opt, int64_t n, const uint64_t *packed, const float *scale,
                        const float *grad, int num_tables,
                        const int64_t *meta, const float *hyper, int num_threads) {
    if (n == 0) return 0;
    table_t *tables = (table_t *)malloc(sizeof(table_t) * (size_t)num_tables);
    int64_t max_dim = 1;
    for (int t = 0; t < num_tables; t++) {
        table_t *tb = &tables[t];
        tb->base = meta[t];
        tb->end = meta[t + 1];
        tb->dim = meta[num_tables + 1 + t];
        tb->weight = (float *)(intptr_t)meta[2 * num_tables + 1 + t];
        tb->s1 = (float *)(intptr_t)meta[3 * num_tables + 1 + t];
        tb->s2 = (float *)(intptr_t)meta[4 * num_tables + 1 + t];
        tb->kind = (int)meta[5 * num_tables + 1 + t];
        tb->seed = (uint64_t)meta[6 * num_tables + 1];
        tb->half = tb->kind ? (uint16_t *)tb->weight : NULL;
        if (tb->kind) tb->weight = NULL;
        tb->step_size = hyper[6 + t];
        if (tb->dim > max_dim) max_dim = tb->dim;
    }
    pass_t p = {opt, num_tables, max_dim, packed, scale, grad, tables,
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

/* Stochastic rounding of a float32 array: see the helpers above update_row. */
int recopt_stochastic_round(int64_t n, const float *x, uint16_t *out, int kind, uint64_t seed,
                            int num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int64_t blocks = (n + 255) / 256;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (n > 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = b * 256, len = n - at < 256 ? n - at : 256;
        round_row(x + at, out + at, len, kind ? 2 : 1, block_key(seed, (uint64_t)b));
    }
    return 0;
}
