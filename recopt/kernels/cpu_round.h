/* Conversions between float32 and the fp16 / bf16 storage of recopt's native CPU kernel
 * (cpu_fused.c includes this file): loading rows to float32, and writing them back rounded,
 * stochastically (seeded, hashed per element) or to nearest even, in vector lanes where the
 * CPU has them (AVX-512, AVX2 + F16C) and in scalar code elsewhere, with the same results.
 * Storage kinds: 0 float32, 1 fp16, 2 bf16 (the latter two as uint16 bit patterns). */
#ifndef RECOPT_CPU_ROUND_H
#define RECOPT_CPU_ROUND_H
#include <math.h>
#include <stdint.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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
static inline void round_row_stochastic(const float *restrict w, uint16_t *restrict h, int64_t n,
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

/* Round to nearest even, as torch's float32 -> bf16 conversion: the carry of the rounding
 * bias runs into the exponent (past the largest finite value: inf). NaN stays NaN (quiet). */
static inline uint16_t nearest_bf16(uint32_t bits) {
    const uint32_t nan = (bits >> 16) | 0x40u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* Round to nearest even float32 -> fp16 in scalar code (subnormals, overflow to inf): the
 * float addition of a power of two whose ulp is fp16's at x's exponent does the rounding (the
 * FP16 library's fp16_ieee_from_fp32_value, as torch's c10::Half). F16C does the same. */
static inline uint16_t nearest_fp16(float x) {
    uint32_t w, bits;
    __builtin_memcpy(&w, &x, 4);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float base = (fabsf(x) * 0x1.0p+112f) * 0x1.0p-110f, anchor;
    __builtin_memcpy(&anchor, &bias_bits, 4);
    base = anchor + base;
    __builtin_memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

/* A row of n float32 to fp16 (kind 1) or bf16 (kind 2), rounded to nearest even. */
static inline void round_row_nearest(const float *restrict w, uint16_t *restrict h, int64_t n,
                                     int kind) {
    int64_t d = 0;
    if (kind == 2) { /* branch-free: GCC vectorises it */
        for (; d < n; d++) {
            uint32_t bits;
            __builtin_memcpy(&bits, &w[d], 4);
            h[d] = nearest_bf16(bits);
        }
        return;
    }
#if defined(__AVX512F__)
    for (; d + 16 <= n; d += 16)
        _mm256_storeu_si256((__m256i *)(h + d),
                            _mm512_cvtps_ph(_mm512_loadu_ps(w + d),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#ifdef __F16C__
    for (; d + 8 <= n; d += 8)
        _mm_storeu_si128((__m128i *)(h + d),
                         _mm256_cvtps_ph(_mm256_loadu_ps(w + d),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; d < n; d++) h[d] = nearest_fp16(w[d]);
}

/* A row of n float32 written back to fp16 / bf16 storage: stochastically with the row's key,
 * or to nearest even. */
static inline void store_row(const float *restrict w, uint16_t *restrict h, int64_t n, int kind,
                             int stochastic, uint64_t key) {
    if (stochastic) round_row_stochastic(w, h, n, kind, key);
    else round_row_nearest(w, h, n, kind);
}

/* The key of slot s of a row (0 the weights, 1 and 2 the optimizer's state tensors) from the
 * row's key: the weights use the row's key itself, each state slot a remix, so every element
 * of every slot has its own bits, a function of (seed, row key, slot, column). */
static inline uint64_t slot_key(uint64_t row_key, int slot) {
    return slot ? mix64(row_key ^ ((uint64_t)slot * 0x9FB21C651E98DF25ull)) : row_key;
}
#endif
