/* A 16-lane dot product in one fixed order, the same bits in every ISA variant (trserve,
 * engine/model/csrc/): forward.c's norms and attention scores. Always-inlined helpers: they sit in
 * the attention's innermost loops (several keys' accumulators side by side in registers).
 */
#ifndef TRSERVE_DOT_H
#define TRSERVE_DOT_H

#include "isa.h"

/* ---- a 16-lane dot product ----------------------------------------------------------------------
 * acc[l] = 0 for the 16 lanes l = 0..15; per block of 32, for each lane l:
 *   acc[l] = fma(a[32b + l], b[32b + l], acc[l]); acc[l] = fma(a[32b + 16 + l], b[32b + 16 + l], acc[l])
 * then s8[i] = acc[i] + acc[i + 8] (i < 8); s4[i] = s8[i] + s8[i + 4] (i < 4); s2[i] = s4[i] + s4[i + 2]
 * (i < 2); s = s2[0] + s2[1]. AVX-512 holds acc in one zmm; AVX2 in two ymm; scalar in 16 floats. */
#if defined(__AVX512F__)
typedef struct { __m512 v; } acc_t;
typedef struct { __m512 lo, hi; } wblock_t; /* a[32b + 0..15], a[32b + 16..31] */
INLINE acc_t acc_zero(void) { acc_t a = {_mm512_setzero_ps()}; return a; }
INLINE wblock_t float_block(const float *p) { wblock_t w = {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)}; return w; }
INLINE void acc_block(acc_t *a, const wblock_t *w, const float *xb)
{
    a->v = _mm512_fmadd_ps(w->lo, _mm512_loadu_ps(xb), a->v);
    a->v = _mm512_fmadd_ps(w->hi, _mm512_loadu_ps(xb + 16), a->v);
}
INLINE float acc_reduce(acc_t a)
{
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4)); /* lanes 0, 1: s4[i] + s4[i + 2] */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))); /* s2[0] + s2[1] */
}
/* acc_reduce of 16 accumulators at once, bit for bit (the same pairing tree, whole vectors per
 * step). Output lane L holds a[4 (L % 4) + L / 4]: to have key j in lane j, slot s takes key
 * REDUCE_KEY(s) (a 4 x 4 transpose, its own inverse). */
#define REDUCE_KEYS 16
#define REDUCE_KEY(s) ((((s) & 3) << 2) | ((s) >> 2))
INLINE __m512 acc_reduce_keys(const acc_t a[REDUCE_KEYS])
{
    __m512 s8[8], s4[4], s2[2];
    for (int k = 0; k < 8; k++) /* [A s8 | B s8]: lanes i and i + 8 of each */
        s8[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k].v, a[2 * k + 1].v, 0x44),
                              _mm512_shuffle_f32x4(a[2 * k].v, a[2 * k + 1].v, 0xEE));
    for (int k = 0; k < 4; k++) /* [A s4 | B s4 | C s4 | D s4]: lanes i and i + 4 of each s8 */
        s4[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * k], s8[2 * k + 1], 0x88),
                              _mm512_shuffle_f32x4(s8[2 * k], s8[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++) /* per 128-bit lane: lanes i and i + 2 of two s4 */
        s2[k] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * k], s4[2 * k + 1], 0x44),
                              _mm512_shuffle_ps(s4[2 * k], s4[2 * k + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], 0x88), _mm512_shuffle_ps(s2[0], s2[1], 0xDD));
}
/* out[L] = acc_reduce(key L's accumulator) * scale, L < REDUCE_KEYS (slot s holds key REDUCE_KEY(s)) */
INLINE void reduce_keys_store(const acc_t a[REDUCE_KEYS], float scale, float *out)
{
    _mm512_storeu_ps(out, _mm512_mul_ps(acc_reduce_keys(a), _mm512_set1_ps(scale)));
}
#elif defined(__AVX2__)
typedef struct { __m256 a, b; } acc_t; /* lanes 0..7, 8..15 */
typedef struct { __m256 w0, w1, w2, w3; } wblock_t; /* a[32b + 8k .. 32b + 8k + 7], k = 0..3 */
INLINE acc_t acc_zero(void) { acc_t a = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return a; }
INLINE wblock_t float_block(const float *p)
{
    wblock_t w = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)};
    return w;
}
/* Lanes 0..7 (a): a[0..7] b[0..7], then a[16..23] b[16..23]; lanes 8..15: a[8..15], then a[24..31]. */
INLINE void acc_block(acc_t *a, const wblock_t *w, const float *xb)
{
    a->a = _mm256_fmadd_ps(w->w0, _mm256_loadu_ps(xb), a->a);
    a->b = _mm256_fmadd_ps(w->w1, _mm256_loadu_ps(xb + 8), a->b);
    a->a = _mm256_fmadd_ps(w->w2, _mm256_loadu_ps(xb + 16), a->a);
    a->b = _mm256_fmadd_ps(w->w3, _mm256_loadu_ps(xb + 24), a->b);
}
INLINE float acc_reduce(acc_t a)
{
    const __m256 s8 = _mm256_add_ps(a.a, a.b); /* acc[i] + acc[i + 8] */
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
/* acc_reduce of 8 accumulators at once, bit for bit; output lane L holds a[2 (L % 4) + L / 4], so
 * slot s takes key REDUCE_KEY(s) = 4 (s % 2) + s / 2. */
#define REDUCE_KEYS 8
#define REDUCE_KEY(s) ((((s) & 1) << 2) | ((s) >> 1))
INLINE __m256 acc_reduce_keys(const acc_t a[REDUCE_KEYS])
{
    __m256 s8[8], s4[4], s2[2];
    for (int k = 0; k < 8; k++) s8[k] = _mm256_add_ps(a[k].a, a[k].b);
    for (int k = 0; k < 4; k++) /* [A s4 | B s4] */
        s4[k] = _mm256_add_ps(_mm256_permute2f128_ps(s8[2 * k], s8[2 * k + 1], 0x20),
                              _mm256_permute2f128_ps(s8[2 * k], s8[2 * k + 1], 0x31));
    for (int k = 0; k < 2; k++)
        s2[k] = _mm256_add_ps(_mm256_shuffle_ps(s4[2 * k], s4[2 * k + 1], 0x44),
                              _mm256_shuffle_ps(s4[2 * k], s4[2 * k + 1], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(s2[0], s2[1], 0x88), _mm256_shuffle_ps(s2[0], s2[1], 0xDD));
}
INLINE void reduce_keys_store(const acc_t a[REDUCE_KEYS], float scale, float *out)
{
    _mm256_storeu_ps(out, _mm256_mul_ps(acc_reduce_keys(a), _mm256_set1_ps(scale)));
}
#else
typedef struct { float v[16]; } acc_t;
typedef struct { float v[32]; } wblock_t;
INLINE acc_t acc_zero(void) { acc_t a; for (int l = 0; l < 16; l++) a.v[l] = 0.0f; return a; }
INLINE wblock_t float_block(const float *p) { wblock_t w; memcpy(w.v, p, sizeof w.v); return w; }
INLINE void acc_block(acc_t *a, const wblock_t *w, const float *xb)
{
    for (int l = 0; l < 16; l++) {
        a->v[l] = fmaf(w->v[l], xb[l], a->v[l]);
        a->v[l] = fmaf(w->v[16 + l], xb[16 + l], a->v[l]);
    }
}
INLINE float acc_reduce(acc_t a)
{
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = a.v[i] + a.v[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}
#define REDUCE_KEYS 1 /* scalar: one accumulator at a time */
#define REDUCE_KEY(s) (s)
INLINE void reduce_keys_store(const acc_t a[REDUCE_KEYS], float scale, float *out) { *out = acc_reduce(a[0]) * scale; }
#endif

/* dot(a, b) over n (n % 32 == 0) in the 16-lane order above: lane l of block k takes a[32k + l] b[32k + l],
 * then a[32k + 16 + l] b[32k + 16 + l]; the fixed 16 -> 1 reduction. */
INLINE float dot32(const float *a, const float *b, int64_t n)
{
    acc_t acc = acc_zero();
    for (int64_t i = 0; i < n; i += 32) {
        const wblock_t w = float_block(a + i);
        acc_block(&acc, &w, b + i);
    }
    return acc_reduce(acc);
}

#endif
