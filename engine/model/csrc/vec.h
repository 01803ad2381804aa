/* 16 float lanes (v16) and their operations, one written-out version per ISA variant (trserve,
 * engine/model/csrc/): the lanes are 16 outputs of a panel in qlinear.c, 16 elements of a head's
 * vector in forward.c's attention. Tiny always-inlined helpers: they sit in the kernels' innermost
 * loops, so they stay in a header rather than behind a call.
 */
#ifndef TRSERVE_VEC_H
#define TRSERVE_VEC_H

#include "isa.h"

/* ---- float16 -> float32 (exact), for the scalar build (the vector ones convert 8/16 at a time) -- */
#if !defined(__AVX512F__) && !defined(__AVX2__)
/* Portable: every float16 (normal, subnormal, zero, inf, nan) is exactly a float32. */
INLINE float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13); /* inf, nan (payload kept) */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13); /* rebias 15 -> 127 */
    } else {
        const float f = (float)man * 0x1p-24f; /* zero or subnormal: man * 2^-24, exact in float32 */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* float32 -> float16 rounded to nearest even, as vcvtps2ph does, for x within +-65504 (v_to_half
 * clamps first; a NaN becomes -65504). Subnormal halves included. */
INLINE uint16_t float_to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7FFFFFFFu;
    if (a < 0x38800000u) { /* below 2^-14: a subnormal half (or zero), in units of 2^-24 (exact product) */
        float m;
        memcpy(&m, &a, sizeof m);
        return sign | (uint16_t)nearbyintf(m * 0x1p24f);
    }
    const uint32_t h = a - 0x38000000u; /* exponent rebiased 127 -> 15 */
    return sign | (uint16_t)((h + 0xFFFu + ((h >> 13) & 1u)) >> 13); /* 23 -> 10 mantissa bits, ties to even */
}

/* ---- the ISA-specific part: v16 = 16 float lanes ----------------------------------------------
 * v_half: 16 halves -> floats (exact); v_to_half: 16 floats -> halves (clamped to +-65504, a NaN to
 * -65504, then rounded to nearest even: the same bits in every build); v_fma(w, x, acc): acc =
 * fma(w, broadcast(*x), acc) per lane; v_mul(v, x): v * broadcast(*x); v_fmav(a, b, acc): fma(a, b,
 * acc) per lane; v_u8, v_i8: 16 unsigned or signed bytes -> floats (exact); v_mulv(a, b): a * b per
 * lane; v_neg: the sign bit flipped (-0.0 for +0.0, as C's unary minus). */
#if defined(__AVX512F__)

typedef __m512 v16;
INLINE v16 v_zero(void) { return _mm512_setzero_ps(); }
INLINE v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
INLINE void v_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
INLINE v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
INLINE v16 v_div(v16 a, float s) { return _mm512_div_ps(a, _mm512_set1_ps(s)); }
INLINE v16 v_fma(v16 w, const float *x, v16 acc) { return _mm512_fmadd_ps(w, _mm512_set1_ps(*x), acc); }
INLINE v16 v_half(const uint16_t *h) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)); }
INLINE void v_to_half(const float *x, uint16_t *h)
{
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_loadu_ps(x), _mm512_set1_ps(-65504.0f)), _mm512_set1_ps(65504.0f));
    _mm256_storeu_si256((__m256i *)h, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
INLINE v16 v_mul(v16 v, const float *x) { return _mm512_mul_ps(v, _mm512_set1_ps(*x)); }
INLINE v16 v_fmav(v16 a, v16 b, v16 acc) { return _mm512_fmadd_ps(a, b, acc); }
INLINE v16 v_u8(const uint8_t *c) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c))); }
INLINE v16 v_i8(const uint8_t *c) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))); }
INLINE v16 v_mulv(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
INLINE v16 v_neg(v16 a)
{
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u)));
}

#elif defined(__AVX2__)

typedef struct { __m256 a, b; } v16; /* lanes 0..7, 8..15 */
INLINE v16 v_zero(void) { v16 v = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return v; }
INLINE v16 v_load(const float *p) { v16 v = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return v; }
INLINE void v_store(float *p, v16 v) { _mm256_storeu_ps(p, v.a), _mm256_storeu_ps(p + 8, v.b); }
INLINE v16 v_add(v16 x, v16 y) { v16 v = {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; return v; }
INLINE v16 v_div(v16 x, float s)
{
    const __m256 d = _mm256_set1_ps(s);
    v16 v = {_mm256_div_ps(x.a, d), _mm256_div_ps(x.b, d)};
    return v;
}
INLINE v16 v_fma(v16 w, const float *x, v16 acc)
{
    const __m256 s = _mm256_broadcast_ss(x);
    v16 v = {_mm256_fmadd_ps(w.a, s, acc.a), _mm256_fmadd_ps(w.b, s, acc.b)};
    return v;
}
INLINE v16 v_half(const uint16_t *h)
{
    v16 v = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8)))};
    return v;
}
INLINE void v_to_half(const float *x, uint16_t *h)
{
    const __m256 lo = _mm256_set1_ps(-65504.0f), hi = _mm256_set1_ps(65504.0f);
    for (int k = 0; k < 2; k++) {
        const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(x + 8 * k), lo), hi);
        _mm_storeu_si128((__m128i *)(h + 8 * k), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}
INLINE v16 v_mul(v16 x, const float *s)
{
    const __m256 b = _mm256_broadcast_ss(s);
    v16 v = {_mm256_mul_ps(x.a, b), _mm256_mul_ps(x.b, b)};
    return v;
}
INLINE v16 v_fmav(v16 x, v16 y, v16 acc)
{
    v16 v = {_mm256_fmadd_ps(x.a, y.a, acc.a), _mm256_fmadd_ps(x.b, y.b, acc.b)};
    return v;
}
INLINE v16 v_u8(const uint8_t *c)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)c);
    v16 v = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8)))};
    return v;
}
INLINE v16 v_i8(const uint8_t *c)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)c);
    v16 v = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)))};
    return v;
}
INLINE v16 v_mulv(v16 x, v16 y) { v16 v = {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; return v; }
INLINE v16 v_neg(v16 x)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    v16 v = {_mm256_xor_ps(x.a, sign), _mm256_xor_ps(x.b, sign)};
    return v;
}

#else /* scalar */

typedef struct { float v[16]; } v16;
INLINE v16 v_zero(void) { v16 v; for (int l = 0; l < 16; l++) v.v[l] = 0.0f; return v; }
INLINE v16 v_load(const float *p) { v16 v; memcpy(v.v, p, sizeof v.v); return v; }
INLINE void v_store(float *p, v16 v) { memcpy(p, v.v, sizeof v.v); }
INLINE v16 v_add(v16 x, v16 y) { for (int l = 0; l < 16; l++) x.v[l] += y.v[l]; return x; }
INLINE v16 v_div(v16 x, float s) { for (int l = 0; l < 16; l++) x.v[l] /= s; return x; }
INLINE v16 v_fma(v16 w, const float *x, v16 acc)
{
    const float s = *x;
    for (int l = 0; l < 16; l++) acc.v[l] = fmaf(w.v[l], s, acc.v[l]);
    return acc;
}
INLINE v16 v_half(const uint16_t *h) { v16 v; for (int l = 0; l < 16; l++) v.v[l] = half_to_float(h[l]); return v; }
INLINE void v_to_half(const float *x, uint16_t *h)
{
    for (int l = 0; l < 16; l++) { /* as maxps / minps: a NaN takes the bound */
        float v = x[l] > -65504.0f ? x[l] : -65504.0f;
        v = v < 65504.0f ? v : 65504.0f;
        h[l] = float_to_half(v);
    }
}
INLINE v16 v_mul(v16 x, const float *s) { for (int l = 0; l < 16; l++) x.v[l] *= *s; return x; }
INLINE v16 v_fmav(v16 x, v16 y, v16 acc)
{
    for (int l = 0; l < 16; l++) acc.v[l] = fmaf(x.v[l], y.v[l], acc.v[l]);
    return acc;
}
INLINE v16 v_u8(const uint8_t *c) { v16 v; for (int l = 0; l < 16; l++) v.v[l] = (float)c[l]; return v; }
INLINE v16 v_i8(const uint8_t *c) { v16 v; for (int l = 0; l < 16; l++) v.v[l] = (float)(int8_t)c[l]; return v; }
INLINE v16 v_mulv(v16 x, v16 y) { for (int l = 0; l < 16; l++) x.v[l] *= y.v[l]; return x; }
INLINE v16 v_neg(v16 x) { for (int l = 0; l < 16; l++) x.v[l] = -x.v[l]; return x; }

#endif

#endif
