/* Exact dequantise-on-the-fly linear layers for x86-64 CPUs (trserve, engine/model/qlinear.py).
 *
 * y[n, O] = x[n, I] @ W^T (+ bias) where W is stored compressed and rebuilt exactly in registers:
 *   q4: W[o, 32b + j] = q * d[o, b] + m[o, b], q in 0..15   (codes[o, 16b + j] = q_j | q_{j+16} << 4)
 *   q8: W[o, 32b + j] = q * d[o, b],           q in -128..127 (codes[o, 32b + j] = q_j)
 * d and m are float16 values (stored as IEEE half bits, converted exactly to float32 here). q * d is
 * exact in float32 for these ranges (8 bits x 11 bits), so q * d + m has a single rounding and the
 * rebuilt weight equals the stored float32 weight bit for bit (engine/model/qlinear.py checks this at
 * load); fused or not, the rebuild gives the same float.
 *
 * One source, three builds (engine/model/qlinear.py picks the one the CPU runs):
 *   avx512: -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c
 *   avx2:   -mavx2 -mfma -mf16c
 *   scalar: baseline x86-64 (fmaf from libm; slow, the fallback of last resort)
 * all with -ffp-contract=off so the compiler never fuses or splits a multiply-add on its own.
 *
 * The arithmetic of every output element is written out and is the same in all three builds, so
 * their outputs are bit-identical, and the same whatever n is and wherever the row sits in a tile
 * (tree verification with n nodes and plain decoding with n = 1 get identical numbers):
 *   acc[l] = 0 for the 16 lanes l = 0..15
 *   per block b, for each lane l:  acc[l] = fma(w[32b + l], x[32b + l], acc[l])
 *                                  acc[l] = fma(w[32b + 16 + l], x[32b + 16 + l], acc[l])
 *   s8[i] = acc[i] + acc[i + 8]  (i < 8);  s4[i] = s8[i] + s8[i + 4]  (i < 4)
 *   s2[i] = s4[i] + s4[i + 2]    (i < 2);  s = s2[0] + s2[1];  y = s (+ bias[o])
 * AVX-512 holds acc in one zmm; AVX2 in two ymm (lanes 0..7 and 8..15); scalar in 16 floats.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Builds are chosen by compile flags; each variant needs all the flags its intrinsics use. */
#if defined(__AVX512F__)
#if !defined(__AVX512BW__) || !defined(__AVX512DQ__) || !defined(__AVX512VL__) || !defined(__FMA__) || !defined(__F16C__)
#error "the avx512 build needs -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c"
#endif
#define ISA_NAME "avx512"
#elif defined(__AVX2__)
#if !defined(__FMA__) || !defined(__F16C__)
#error "the avx2 build needs -mavx2 -mfma -mf16c"
#endif
#define ISA_NAME "avx2"
#else
#include <math.h>
#define ISA_NAME "scalar"
#endif

/* A tile = rows x outputs computed side by side, per ISA and block kind, sized so the accumulators
 * stay in registers and chosen by measurement on the bundled model's shapes (-D overrides exist
 * only to measure). Per kind k: batches of n <= NARROW_ROWS_Qk rows use a NARROW_ROWS_Qk x
 * NARROW_OUTS_Qk tile (0 rows: no narrow plan), wider ones ROWS_Qk x OUTS_Qk tiles. The tile only
 * changes which independent dot products run side by side, never the arithmetic of one of them. */
#if defined(__AVX512F__)
#define DEFAULT_ROWS_Q4 8 /* 8 x 2 outputs x 1 zmm = 16 of 32 zmm */
#define DEFAULT_OUTS_Q4 2
#define DEFAULT_NARROW_ROWS_Q4 0
#define DEFAULT_NARROW_OUTS_Q4 2
#define DEFAULT_ROWS_Q8 8
#define DEFAULT_OUTS_Q8 2
#define DEFAULT_NARROW_ROWS_Q8 4 /* n <= 4: one output at a time is faster for q8 (n = 2, 4: -25%) */
#define DEFAULT_NARROW_OUTS_Q8 1
#elif defined(__AVX2__)
#define DEFAULT_ROWS_Q4 4 /* 4 x 1 output x 2 ymm = 8 of 16 ymm: no spills (fastest for n >= 2) */
#define DEFAULT_OUTS_Q4 1
#define DEFAULT_NARROW_ROWS_Q4 1 /* n = 1: two outputs share each x load (-15% against one) */
#define DEFAULT_NARROW_OUTS_Q4 2
#define DEFAULT_ROWS_Q8 4
#define DEFAULT_OUTS_Q8 1
#define DEFAULT_NARROW_ROWS_Q8 0
#define DEFAULT_NARROW_OUTS_Q8 1
#else
#define DEFAULT_ROWS_Q4 4
#define DEFAULT_OUTS_Q4 1
#define DEFAULT_NARROW_ROWS_Q4 0
#define DEFAULT_NARROW_OUTS_Q4 1
#define DEFAULT_ROWS_Q8 4
#define DEFAULT_OUTS_Q8 1
#define DEFAULT_NARROW_ROWS_Q8 0
#define DEFAULT_NARROW_OUTS_Q8 1
#endif
#ifndef ROWS_Q4
#define ROWS_Q4 DEFAULT_ROWS_Q4
#endif
#ifndef OUTS_Q4
#define OUTS_Q4 DEFAULT_OUTS_Q4
#endif
#ifndef NARROW_ROWS_Q4
#define NARROW_ROWS_Q4 DEFAULT_NARROW_ROWS_Q4
#endif
#ifndef NARROW_OUTS_Q4
#define NARROW_OUTS_Q4 DEFAULT_NARROW_OUTS_Q4
#endif
#ifndef ROWS_Q8
#define ROWS_Q8 DEFAULT_ROWS_Q8
#endif
#ifndef OUTS_Q8
#define OUTS_Q8 DEFAULT_OUTS_Q8
#endif
#ifndef NARROW_ROWS_Q8
#define NARROW_ROWS_Q8 DEFAULT_NARROW_ROWS_Q8
#endif
#ifndef NARROW_OUTS_Q8
#define NARROW_OUTS_Q8 DEFAULT_NARROW_OUTS_Q8
#endif
#define MAX_ROWS 8
#define MAX_OUTS 2
#if ROWS_Q4 < 1 || ROWS_Q4 > MAX_ROWS || ROWS_Q8 < 1 || ROWS_Q8 > MAX_ROWS
#error "tile rows must be 1..8"
#endif
#if NARROW_ROWS_Q4 < 0 || NARROW_ROWS_Q4 > MAX_ROWS || NARROW_ROWS_Q8 < 0 || NARROW_ROWS_Q8 > MAX_ROWS
#error "narrow tile rows must be 0..8"
#endif
#if (OUTS_Q4 != 1 && OUTS_Q4 != 2) || (OUTS_Q8 != 1 && OUTS_Q8 != 2) || (NARROW_OUTS_Q4 != 1 && NARROW_OUTS_Q4 != 2) \
    || (NARROW_OUTS_Q8 != 1 && NARROW_OUTS_Q8 != 2)
#error "tile outputs must be 1 or 2"
#endif
/* a narrow plan of 0 rows is never used; its tile then compiles with 1 row */
#define NARROW_TILE_ROWS_Q4 (NARROW_ROWS_Q4 ? NARROW_ROWS_Q4 : 1)
#define NARROW_TILE_ROWS_Q8 (NARROW_ROWS_Q8 ? NARROW_ROWS_Q8 : 1)

#define INLINE static inline __attribute__((always_inline))

/* ---- float16 -> float32 (exact) ------------------------------------------------------------- */
#if defined(__F16C__)
INLINE float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
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

/* ---- the ISA-specific part -------------------------------------------------------------------
 * acc_t: one dot product's 16 lane accumulators; wblock_t: one block's 32 rebuilt weights, from its
 * codes c and its scales *d, *m (float32) by block_weights; acc_block: the block's 32 fmas into acc;
 * acc_reduce: the fixed 16 -> 1 reduction; halves_to_floats: exact conversion of a run of scales. */
#if defined(__AVX512F__)

typedef struct { __m512 v; } acc_t; /* lanes 0..15 */
typedef struct { __m512 lo, hi; } wblock_t; /* w[32b + 0..15], w[32b + 16..31] */
INLINE acc_t acc_zero(void) { acc_t a = {_mm512_setzero_ps()}; return a; }

/* f[i] = h[i], i < k, 16 at a time. A ragged tail is converted as the last 16 (overlapping the
 * previous run: same values), so nothing past h[k - 1] is read and no masked load is needed (those
 * are slow on some CPUs, measured here on AMD); only k < 16 goes one by one. */
INLINE void cvt16(const uint16_t *h, float *f) { _mm512_storeu_ps(f, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h))); }
INLINE void halves_to_floats(const uint16_t *h, float *f, int64_t k)
{
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) cvt16(h + i, f + i);
    if (i < k && k >= 16) cvt16(h + k - 16, f + k - 16);
    else for (; i < k; i++) f[i] = _cvtsh_ss(h[i]);
}

INLINE wblock_t block_weights(const int kind, const uint8_t *c, const float *d, const float *m)
{
    wblock_t w;
    const __m512 vd = _mm512_set1_ps(*d);
    if (kind == 4) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
        const __m512 vm = _mm512_set1_ps(*m);
        w.lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xF))), vd, vm);
        w.hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), vd, vm);
    } else {
        const __m128i *s = (const __m128i *)c;
        w.lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(s))), vd);
        w.hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(s + 1))), vd);
    }
    return w;
}

/* acc[l] = fma(w[l], x[l], acc[l]) then acc[l] = fma(w[16 + l], x[16 + l], acc[l]); xb = x + 32b */
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

#elif defined(__AVX2__)

typedef struct { __m256 a, b; } acc_t; /* lanes 0..7, 8..15 */
typedef struct { __m256 w0, w1, w2, w3; } wblock_t; /* w[32b + 8k .. 32b + 8k + 7], k = 0..3 */
INLINE acc_t acc_zero(void) { acc_t a = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return a; }

/* As the AVX-512 one, 8 at a time. */
INLINE void cvt8(const uint16_t *h, float *f) { _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h))); }
INLINE void halves_to_floats(const uint16_t *h, float *f, int64_t k)
{
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) cvt8(h + i, f + i);
    if (i < k && k >= 8) cvt8(h + k - 8, f + k - 8);
    else for (; i < k; i++) f[i] = _cvtsh_ss(h[i]);
}

INLINE __m256i load8_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
INLINE __m256i load8_i8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

INLINE wblock_t block_weights(const int kind, const uint8_t *c, const float *d, const float *m)
{
    wblock_t w;
    const __m256 vd = _mm256_set1_ps(*d);
    if (kind == 4) {
        const __m256i q0 = load8_u8(c), q1 = load8_u8(c + 8), mask = _mm256_set1_epi32(0xF);
        const __m256 vm = _mm256_set1_ps(*m);
        w.w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, mask)), vd, vm);
        w.w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, mask)), vd, vm);
        w.w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), vd, vm);
        w.w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), vd, vm);
    } else {
        w.w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(load8_i8(c)), vd);
        w.w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(load8_i8(c + 8)), vd);
        w.w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(load8_i8(c + 16)), vd);
        w.w3 = _mm256_mul_ps(_mm256_cvtepi32_ps(load8_i8(c + 24)), vd);
    }
    return w;
}

/* Lanes 0..7 (a): w[0..7] x[0..7], then w[16..23] x[16..23]; lanes 8..15 (b): w[8..15], then w[24..31]. */
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

#else /* scalar */

typedef struct { float v[16]; } acc_t;
typedef struct { float v[32]; } wblock_t;
INLINE acc_t acc_zero(void) { acc_t a; for (int l = 0; l < 16; l++) a.v[l] = 0.0f; return a; }

INLINE void halves_to_floats(const uint16_t *h, float *f, int64_t k)
{
    for (int64_t i = 0; i < k; i++) f[i] = half_to_float(h[i]);
}

INLINE wblock_t block_weights(const int kind, const uint8_t *c, const float *d, const float *m)
{
    wblock_t w;
    const float vd = *d;
    if (kind == 4) {
        const float vm = *m;
        for (int i = 0; i < 16; i++) {
            w.v[i] = (float)(c[i] & 0xF) * vd + vm; /* q * vd is exact: the same float as an fma */
            w.v[16 + i] = (float)(c[i] >> 4) * vd + vm;
        }
    } else {
        const int8_t *s = (const int8_t *)c;
        for (int i = 0; i < 32; i++) w.v[i] = (float)s[i] * vd;
    }
    return w;
}

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

#endif

/* ---- the tile and the driver (shared by all builds) -------------------------------------------- */
/* Below, kind, RR (rows per tile) and T (outputs per tile) are constants wherever the functions are
 * called: the driver names them literally, and always_inline propagates them. */

/* R rows x T outputs o .. o + T - 1: y[r, o + t] = dot(x[r], w[o + t]) (+ bias[o + t]). Every x load
 * of a block feeds T dot products. c[t]: output o + t's codes; d[t], m[t]: its nb scales as float32;
 * x, y: this tile's first row. */
INLINE void tile(const int kind, const int R, const int T, const float *x, int64_t I, const uint8_t *const *c,
                 const float *const *d, const float *const *m, int64_t nb, const float *bias, float *y,
                 int64_t O, int64_t o)
{
    const int64_t block_bytes = kind == 4 ? 16 : 32;
    acc_t acc[MAX_ROWS * MAX_OUTS];
#pragma GCC unroll 16
    for (int i = 0; i < MAX_ROWS * MAX_OUTS; i++) acc[i] = acc_zero(); /* unused ones are optimised out */
    for (int64_t b = 0; b < nb; b++) {
        wblock_t w[MAX_OUTS];
#pragma GCC unroll 2
        for (int t = 0; t < T; t++) w[t] = block_weights(kind, c[t] + block_bytes * b, d[t] + b, m[t] + b);
        const float *xb = x + 32 * b;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
#pragma GCC unroll 2
            for (int t = 0; t < T; t++) acc_block(&acc[r * T + t], &w[t], xb + r * I);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
#pragma GCC unroll 2
        for (int t = 0; t < T; t++) {
            const float s = acc_reduce(acc[r * T + t]);
            y[r * O + o + t] = bias ? s + bias[o + t] : s;
        }
    }
}

/* One case per row count so each tile is compiled with R a constant (its accumulators in registers).
 * rows is 1..RR: cases above RR are never taken, and saying so lets the compiler drop them. */
#define ROW_CASE(k, CALL) case k: if ((k) <= RR) { CALL(k); } else { __builtin_unreachable(); } break;
#define ROW_CASES(CALL)                                                                              \
    switch (rows) {                                                                                  \
    ROW_CASE(1, CALL) ROW_CASE(2, CALL) ROW_CASE(3, CALL) ROW_CASE(4, CALL)                          \
    ROW_CASE(5, CALL) ROW_CASE(6, CALL) ROW_CASE(7, CALL)                                            \
    default: CALL(RR); break;                                                                        \
    }

/* Scales of output group p (outputs T p .. T p + T - 1) as float32: buf = [d of each | m of each]. */
INLINE void group_scales(const int kind, const int T, const uint16_t *d, const uint16_t *m, int64_t p, int64_t nb,
                         float *buf)
{
    const int64_t o = T * p;
    halves_to_floats(d + o * nb, buf, T * nb); /* a group's scale rows are contiguous */
    if (kind == 4) halves_to_floats(m + o * nb, buf + T * nb, T * nb);
}

/* Row tile r0 (rows r0 .. r0 + RR - 1, fewer at the end) of output group p, its scales in buf. */
INLINE void group_tile(const int kind, const int RR, const int T, const float *x, int64_t n, int64_t I, int64_t O,
                       const uint8_t *codes, const float *buf, const float *bias, float *y, int64_t p, int64_t nb,
                       int64_t r0)
{
    const int64_t o = T * p, row_bytes = kind == 4 ? I / 2 : I;
    const uint8_t *c[MAX_OUTS];
    const float *dt[MAX_OUTS], *mt[MAX_OUTS];
    for (int t = 0; t < T; t++) {
        c[t] = codes + (o + t) * row_bytes;
        dt[t] = buf + t * nb;
        mt[t] = buf + (T + t) * nb; /* not read for kind 8 */
    }
    const int rows = n - r0 < RR ? (int)(n - r0) : RR;
#define CALL(R) tile(kind, R, T, x + r0 * I, I, c, dt, mt, nb, bias, y + r0 * O, O, o)
    ROW_CASES(CALL)
#undef CALL
}

/* Output groups are taken CHUNK_GROUPS at a time, and within a chunk row tile by row tile: a row
 * tile of x then stays in L1 across the chunk's outputs instead of all n rows streaming through L1
 * for every output (wide batches of long rows: AVX2 down_proj at n = 16, -30%). */
#ifndef CHUNK_GROUPS
#define CHUNK_GROUPS 8
#endif

/* Scales of groups [pa, pb) as float32 into buf: `slot` floats per group, [d of each | m of each]. */
INLINE void chunk_scales(const int kind, const int T, const uint16_t *d, const uint16_t *m, int64_t pa, int64_t pb,
                         int64_t nb, float *buf, int64_t slot)
{
    for (int64_t p = pa; p < pb; p++) group_scales(kind, T, d, m, p, nb, buf + (p - pa) * slot);
}

/* One thread's share: output groups [p0, p1). It converts the next chunk's scales to float32 before
 * computing the current chunk, so the block loop broadcasts each scale from memory written well
 * before (converting per block cost ~5% more). buf: two chunk slots of CHUNK_GROUPS x 2 T nb floats. */
INLINE void thread_part(const int kind, const int RR, const int T, const float *x, int64_t n, int64_t I, int64_t O,
                        const uint8_t *codes, const uint16_t *d, const uint16_t *m, const float *bias, float *y,
                        int64_t p0, int64_t p1, float *buf)
{
    const int64_t nb = I / 32, slot = 2 * (int64_t)T * nb, chunk = CHUNK_GROUPS;
    float *bufs[2] = {buf, buf + chunk * slot};
    chunk_scales(kind, T, d, m, p0, p0 + chunk < p1 ? p0 + chunk : p1, nb, bufs[0], slot);
    for (int64_t pc = p0, i = 0; pc < p1; pc += chunk, i ^= 1) {
        const int64_t pe = pc + chunk < p1 ? pc + chunk : p1;
        if (pe < p1) chunk_scales(kind, T, d, m, pe, pe + chunk < p1 ? pe + chunk : p1, nb, bufs[i ^ 1], slot);
        for (int64_t r0 = 0; r0 < n; r0 += RR)
            for (int64_t p = pc; p < pe; p++)
                group_tile(kind, RR, T, x, n, I, O, codes, bufs[i] + (p - pc) * slot, bias, y, p, nb, r0);
    }
}

/* Whether a batch of n rows takes kind's narrow plan, and the outputs per tile it then uses. */
static int narrow(int kind, int64_t n) { return n <= (kind == 4 ? NARROW_ROWS_Q4 : NARROW_ROWS_Q8); }
static int plan_outs(int kind, int64_t n)
{
    if (kind == 4) return narrow(4, n) ? NARROW_OUTS_Q4 : OUTS_Q4;
    return narrow(8, n) ? NARROW_OUTS_Q8 : OUTS_Q8;
}

/* Which build this is ("avx512", "avx2", "scalar"): the loader checks it got the one it asked for. */
const char *trserve_qlinear_isa(void) { return ISA_NAME; }

/* The largest number of outputs a tile takes: O must be a multiple of it (the loader checks). */
int trserve_qlinear_outs_multiple(void) { return MAX_OUTS; }

/* x: [n, I] row-major, I % 32 == 0; O % MAX_OUTS == 0; codes per output row (I/2 or I bytes);
 * d, m: [O, I/32] float16 bits (m only for kind 4); bias: [O] or NULL; y: [n, O].
 * Returns 0, or -1 when the scale buffers could not be allocated (y then incomplete). */
int trserve_qlinear(int kind, const float *x, int64_t n, int64_t I, int64_t O, const uint8_t *codes,
                    const uint16_t *d, const uint16_t *m, const float *bias, float *y, int threads)
{
    const int nar = narrow(kind, n), T = plan_outs(kind, n);
    const int64_t groups = O / T, chunk_floats = CHUNK_GROUPS * 2 * (int64_t)T * (I / 32);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t p0 = groups * id / nt, p1 = groups * (id + 1) / nt;
        float *buf = p1 > p0 ? malloc(2 * chunk_floats * sizeof(float)) : NULL; /* two chunks: current, next */
        if (p1 > p0 && !buf) failed = 1;
        /* literal plans: the region is outlined before inlining, so this is what makes the kind and
         * the tile shape constants inside */
#define PART(K, RR, TT) thread_part(K, RR, TT, x, n, I, O, codes, d, m, bias, y, p0, p1, buf)
        if (buf) {
            if (kind == 4 && nar) PART(4, NARROW_TILE_ROWS_Q4, NARROW_OUTS_Q4);
            else if (kind == 4) PART(4, ROWS_Q4, OUTS_Q4);
            else if (nar) PART(8, NARROW_TILE_ROWS_Q8, NARROW_OUTS_Q8);
            else PART(8, ROWS_Q8, OUTS_Q8);
            free(buf);
        }
#undef PART
    }
    return failed ? -1 : 0;
}
