/* Exact dequantise-on-the-fly linear layers for x86-64 CPUs (trserve, engine/model/kernels/).
 *
 * y[n, O] = x[n, I] @ W^T (+ bias) where W is stored compressed and rebuilt exactly in registers:
 *   q4: W[o, 32b + j] = q * d[o, b] + m[o, b], q in 0..15
 *   q5: W[o, 32b + j] = q * d[o, b] + m[o, b], q in 0..31 (kind 12: Q5_1; Q5_0 with m = -16 d)
 *   q8: W[o, 32b + j] = q * d[o, b],           q in -128..127
 * d and m are float16 values (stored as IEEE half bits, converted exactly to float32 here). q * d is
 * exact in float32 for these ranges (8 bits x 11 bits), so q * d + m has a single rounding and the
 * rebuilt weight equals the stored float32 weight bit for bit (engine/model/kernels/recover.py checks
 * this at load). A GGUF file's K-quant kinds (qlinear.h: 6, 10, 18) hold the file's two-level scales:
 * d[o, b] = d16 * sc, the product of a super-block's float16 scale and a sub-block's 6- or 8-bit one,
 * formed in registers per panel-block (exact in float32), and m[o, b] = -(dmin16 * mn) likewise; q8
 * codes with a min (kind 10, and kind 9's float32 d and m: W = q * d + m) or with a scale per 16
 * inputs (kind 18: inputs 32b + j, j < 16, take the block's first scale, the rest its second); q * d
 * stays exact (at most 24 bits), so each weight is ggml's value bit for bit
 * (engine/model/kernels/kquants.py checks it at load). Kinds 5 and 17 hold the same products as float32
 * (the two-level kinds' reference in the tests; one row and one panel at a time).
 *
 * Layout: outputs in panels of 16 (O padded to a multiple of 16 with zero weights). Panel p, block b:
 *   q4 codes, "bytes" (avx512, scalar builds): 16 x 16 bytes, byte [j][l] = q[16p + l, 32b + 2j] |
 *             q[16p + l, 32b + 2j + 1] << 4
 *   q4 codes, "lanes" (avx2 build): 4 x 16 little-endian uint32, word [g][l] = sum over k < 8 of
 *             q[16p + l, 32b + 8g + k] << 4k
 *   q5 codes (kind 12): the q4 layout's 256 bytes of the codes' low nibbles, then a 64-byte plane of
 *             their high bits (bit 4), laid out for the build's q4 layout:
 *             "bytes": 32 little-endian uint16, word [i] bit l = q[16p + l, 32b + i] >> 4 (AVX-512: one
 *                      kmovw per input, a masked or into the 16 lanes)
 *             "lanes": 16 little-endian uint32, word [l] bit i = q[16p + l, 32b + i] >> 4 (AVX2: lane
 *                      l's word shifted to bit 4 and masked per input)
 *             so a panel-block is 320 contiguous bytes
 *   q6 codes (kind 20): the q4 layout's 256 bytes of the low nibbles, then kind 12's plane of bit 4,
 *             then a plane of bit 5 in the same layout: a panel-block is 384 contiguous bytes; each
 *             weight is q * d + (-32 d) with its half's scale (q in 0..63), an fma of exact terms
 *   q8 codes: 32 x 16 bytes, byte [j][l] = q[16p + l, 32b + j]
 *   d, m:     16 halves, [l] = d[16p + l, b] (kinds 5, 9: 16 floats; kind 17: 32 floats, two per output)
 *   two-level kinds (6, 10, 18): per panel super-block (8 blocks), a record of the 16 outputs' float16
 *             super-block scale, then their sub-block scales as bytes, 16 per sub-block (qlinear.h)
 * so one load gives one, two or eight inputs' weights for 16 outputs, one vector lane per output.
 * Both q4 layouts hold the same codes in the same 256 bytes; the loader packs the one its library
 * reports (trserve_qlinear_q4_layout). "lanes" exists because on AVX2 the byte layout's widening
 * shuffles (vpmovzxbd, two per 16 weights) bound the weight rebuild: the lanes layout rebuilds with a
 * shift and a mask per 8 weights, no shuffle (measured on a Zen 3: n = 1 GEMV 3.2 -> 4.4 MAC/cycle).
 *
 * The arithmetic of every output element, the same in all builds, whatever n is and wherever the
 * row sits in a batch (tree verification with n nodes and plain decoding with n = 1 get identical
 * numbers; AVX-512, AVX2 and scalar give identical bits):
 *   acc = 0;  for i = 0 .. I - 1 in order: acc = fma(W[o, i], x[i], acc);  y = acc (+ bias[o])
 * One dependent chain per output: the lanes of a vector are 16 different outputs, so no reduction
 * across lanes exists whose order an ISA could change. Weights are rebuilt in registers per tile of
 * rows x panels and feed every row of the tile.
 *
 * Three builds, one per ISA variant (isa.h: their flags; engine/model/kernels/build.py picks the one
 * the CPU runs). The entry points are declared in qlinear.h; forward.c calls qmat_rows itself.
 */
#include "qlinear.h"
#include "pool.h"
#include "vec.h"

/* Plans, per ISA, chosen by measurement on the bundled model's shapes (-D overrides exist only to
 * measure): register tiles of R rows x T panels, the weights rebuilt in registers once per tile and
 * used by all its rows. One row takes ONE_PANELS panels (more chains in flight); n <= NARROW_ROWS
 * rows (NARROW8_ROWS for q8 matrices) one tile of n rows x NARROW_PANELS (NARROW8_PANELS) panels;
 * wider batches tiles of WIDE_ROWS rows (the last one ragged) x WIDE_PANELS panels. Plans only
 * change which independent chains run side by side, never the arithmetic of one.
 * Measured on 2 cores (bench/qlinear_isa.py, us per call): q4 tiles cost ~29 us + ~6 us per row on
 * gate/up shapes whatever the narrow plan; the q8 LM head at 4 rows takes 1250 us as 4 x 4, 1870 us
 * as 8 x 1 (Intel Xeon); wide tiles 8 x 2 are ~10% faster than 8 x 1 (Xeon), larger ones spill. */
#if defined(__AVX512F__)
#define DEFAULT_ONE_PANELS 4
#define DEFAULT_NARROW_ROWS 2 /* 2 x 4 panels: 8 accumulators, 8 weight vectors */
#define DEFAULT_NARROW_PANELS 4
#define DEFAULT_NARROW8_ROWS 4 /* 4 x 4: 16 accumulators */
#define DEFAULT_NARROW8_PANELS 4
#define DEFAULT_WIDE_ROWS 8 /* 8 x 2: 16 accumulators; ~220 GFLOP/s on 2 cores at n >= 16 */
#define DEFAULT_WIDE_PANELS 2
#elif defined(__AVX2__)
#define DEFAULT_ONE_PANELS 1 /* lanes layout, Zen 3: 1 panel 8.5 ms a forward's linears, 2: 9.4, 4: 10.2 */
#define DEFAULT_NARROW_ROWS 2
#define DEFAULT_NARROW_PANELS 1
#define DEFAULT_NARROW8_ROWS 2
#define DEFAULT_NARROW8_PANELS 1
#define DEFAULT_WIDE_ROWS 6 /* 6 x 1 panel x 2 ymm = 12 of 16 ymm */
#define DEFAULT_WIDE_PANELS 1
#else
#define DEFAULT_ONE_PANELS 1
#define DEFAULT_NARROW_ROWS 1
#define DEFAULT_NARROW_PANELS 1
#define DEFAULT_NARROW8_ROWS 1
#define DEFAULT_NARROW8_PANELS 1
#define DEFAULT_WIDE_ROWS 4
#define DEFAULT_WIDE_PANELS 1
#endif
#ifndef ONE_PANELS
#define ONE_PANELS DEFAULT_ONE_PANELS
#endif
#ifndef NARROW_ROWS
#define NARROW_ROWS DEFAULT_NARROW_ROWS
#endif
#ifndef NARROW_PANELS
#define NARROW_PANELS DEFAULT_NARROW_PANELS
#endif
#ifndef NARROW8_ROWS
#define NARROW8_ROWS DEFAULT_NARROW8_ROWS
#endif
#ifndef NARROW8_PANELS
#define NARROW8_PANELS DEFAULT_NARROW8_PANELS
#endif
#ifndef WIDE_ROWS
#define WIDE_ROWS DEFAULT_WIDE_ROWS
#endif
#ifndef WIDE_PANELS
#define WIDE_PANELS DEFAULT_WIDE_PANELS
#endif
/* Batches of at least DEQ_MIN_ROWS rows (prefill chunks, large batches): each group of DEQ_PANELS
 * panels is rebuilt once into a float buffer, then register tiles of DEQ_ROWS rows read the weights
 * from it (two loads per input instead of the rebuild's ~7 ops per 16 weights for every row tile). */
#if defined(__AVX512F__)
#define DEFAULT_DEQ_ROWS 12 /* 12 x 2: 24 accumulators + 2 weight vectors */
#define DEFAULT_DEQ_PANELS 2
#elif defined(__AVX2__)
#define DEFAULT_DEQ_ROWS 6
#define DEFAULT_DEQ_PANELS 1
#else
#define DEFAULT_DEQ_ROWS 4
#define DEFAULT_DEQ_PANELS 1
#endif
#ifndef DEQ_ROWS
#define DEQ_ROWS DEFAULT_DEQ_ROWS
#endif
#ifndef DEQ_PANELS
#define DEQ_PANELS DEFAULT_DEQ_PANELS
#endif
#ifndef DEQ_MIN_ROWS
#define DEQ_MIN_ROWS 80 /* measured on AVX-512: 5-13% faster from 80 rows, slower below ~48 */
#endif
/* Software prefetch of the weight stream, PREFETCH_BLOCKS panel-blocks ahead of each panel's reads
 * (into L2): the rebuild outruns the hardware prefetcher. Measured on the bundled model (Intel Xeon,
 * 2 threads, native forward): -14% at 1 token, -21% at 4, -13% at 8, -7% at 16; 4 blocks ahead is as
 * good, 6 and 12 worse, the non-temporal hint far worse. */
#ifndef Q4_UNROLL_TILE
#define Q4_UNROLL_TILE 2 /* q4 tiles of at most this many rows x panels unroll their 16 input pairs */
#endif
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif
#if NARROW_ROWS < 1 || NARROW_ROWS > MAX_ROWS || NARROW8_ROWS < 1 || NARROW8_ROWS > MAX_ROWS || WIDE_ROWS < 1 \
    || WIDE_ROWS > MAX_ROWS
#error "tile rows must be 1..16"
#endif
#if ONE_PANELS < 1 || ONE_PANELS > MAX_PANELS || NARROW_PANELS < 1 || NARROW_PANELS > MAX_PANELS || WIDE_PANELS < 1 \
    || WIDE_PANELS > MAX_PANELS || NARROW8_PANELS < 1 || NARROW8_PANELS > MAX_PANELS
#error "tile panels must be 1..4"
#endif

/* ---- the weights rebuilt from this build's code layout -----------------------------------------
 * deq4: a panel-block's q4 codes (blk) -> the weights of inputs 2j and 2j + 1, from this build's
 * layout (Q4_LAYOUT); deq8: 16 int8 codes -> one input's weights. */
#if defined(__AVX512F__)

#define Q4_LAYOUT 0 /* bytes */
INLINE void deq4(const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1)
{
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 * j)));
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xF))), d, m);
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
}
INLINE v16 deq8(const uint8_t *c, v16 d)
{
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))), d);
}
/* deq4 of a q5 panel-block: each input's plane word is a mask of the lanes whose code has bit 4. */
INLINE void deq5(const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1)
{
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 * j))), b4 = _mm512_set1_epi32(0x10);
    uint16_t k0, k1;
    memcpy(&k0, blk + 256 + 4 * j, 2), memcpy(&k1, blk + 256 + 4 * j + 2, 2);
    const __m512i q0 = _mm512_and_si512(q, _mm512_set1_epi32(0xF)), q1 = _mm512_srli_epi32(q, 4);
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mask_or_epi32(q0, (__mmask16)k0, q0, b4)), d, m);
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mask_or_epi32(q1, (__mmask16)k1, q1, b4)), d, m);
}
/* deq5 with a second plane (bit 5) 64 bytes after the first. */
INLINE void deq6(const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1)
{
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 * j)));
    const __m512i b4 = _mm512_set1_epi32(0x10), b5 = _mm512_set1_epi32(0x20);
    uint16_t k0, k1, k2, k3;
    memcpy(&k0, blk + 256 + 4 * j, 2), memcpy(&k1, blk + 256 + 4 * j + 2, 2);
    memcpy(&k2, blk + 320 + 4 * j, 2), memcpy(&k3, blk + 320 + 4 * j + 2, 2);
    __m512i q0 = _mm512_and_si512(q, _mm512_set1_epi32(0xF)), q1 = _mm512_srli_epi32(q, 4);
    q0 = _mm512_mask_or_epi32(q0, (__mmask16)k0, q0, b4), q1 = _mm512_mask_or_epi32(q1, (__mmask16)k1, q1, b4);
    q0 = _mm512_mask_or_epi32(q0, (__mmask16)k2, q0, b5), q1 = _mm512_mask_or_epi32(q1, (__mmask16)k3, q1, b5);
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), d, m);
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d, m);
}

#elif defined(__AVX2__)

#define Q4_LAYOUT 1 /* lanes: inputs 2j, 2j + 1 sit at bits 8 (j % 4) and 8 (j % 4) + 4 of group j / 4's words */
INLINE void deq4(const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1)
{
    const __m256i *g = (const __m256i *)(blk + 64 * (j >> 2)), mask = _mm256_set1_epi32(0xF);
    const __m256i la = _mm256_loadu_si256(g), lb = _mm256_loadu_si256(g + 1);
    const int s = 8 * (j & 3); /* a constant wherever j is (the callers unroll j) */
    w0->a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(la, s), mask)), d.a, m.a);
    w0->b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lb, s), mask)), d.b, m.b);
    w1->a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(la, s + 4), mask)), d.a, m.a);
    w1->b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lb, s + 4), mask)), d.b, m.b);
}
/* Lane l's plane word p shifted so that input i's bit lands on bit `at` (4, or 5 for q6's second plane),
 * masked (i a constant where j is). */
INLINE __m256i hbit(__m256i p, const int i, const int at)
{
    const __m256i s = i >= at ? _mm256_srli_epi32(p, i - at) : _mm256_slli_epi32(p, at - i);
    return _mm256_and_si256(s, _mm256_set1_epi32(1 << at));
}
/* deq4 of a q5 (six 0) or q6 (six 1) panel-block: the plane's words (16 uint32 after the 256 nibble
 * bytes) give bit 4, and q6's second plane's (16 more) bit 5. */
INLINE void deq56(const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1, const int six)
{
    const __m256i *g = (const __m256i *)(blk + 64 * (j >> 2)), mask = _mm256_set1_epi32(0xF);
    const __m256i la = _mm256_loadu_si256(g), lb = _mm256_loadu_si256(g + 1);
    const __m256i pa = _mm256_loadu_si256((const __m256i *)(blk + 256)), pb = _mm256_loadu_si256((const __m256i *)(blk + 288));
    const __m256i ra = six ? _mm256_loadu_si256((const __m256i *)(blk + 320)) : _mm256_setzero_si256();
    const __m256i rb = six ? _mm256_loadu_si256((const __m256i *)(blk + 352)) : _mm256_setzero_si256();
    const int s = 8 * (j & 3);
#define QL(l, p, r, sh, i) _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(l, sh), mask), \
                                                           hbit(p, i, 4)), six ? hbit(r, i, 5) : _mm256_setzero_si256())
    w0->a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QL(la, pa, ra, s, 2 * j)), d.a, m.a);
    w0->b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QL(lb, pb, rb, s, 2 * j)), d.b, m.b);
    w1->a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QL(la, pa, ra, s + 4, 2 * j + 1)), d.a, m.a);
    w1->b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(QL(lb, pb, rb, s + 4, 2 * j + 1)), d.b, m.b);
#undef QL
}
INLINE void deq5(const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1) { deq56(blk, j, d, m, w0, w1, 0); }
INLINE void deq6(const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1) { deq56(blk, j, d, m, w0, w1, 1); }
INLINE v16 deq8(const uint8_t *c, v16 d)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)c);
    v16 v = {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d.a),
             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))), d.b)};
    return v;
}

#else /* scalar */

#define Q4_LAYOUT 0 /* bytes */
INLINE void deq4(const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1)
{
    const uint8_t *c = blk + 16 * j;
    for (int l = 0; l < 16; l++) { /* q * d is exact: the same float as an fma */
        w0->v[l] = (float)(c[l] & 0xF) * d.v[l] + m.v[l];
        w1->v[l] = (float)(c[l] >> 4) * d.v[l] + m.v[l];
    }
}
INLINE void deq5(const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1)
{
    const uint8_t *c = blk + 16 * j, *h = blk + 256 + 4 * j; /* input 2j's plane word, then 2j + 1's */
    const unsigned h0 = h[0] | (unsigned)h[1] << 8, h1 = h[2] | (unsigned)h[3] << 8;
    for (int l = 0; l < 16; l++) {
        w0->v[l] = (float)((c[l] & 0xF) | ((h0 >> l) & 1) << 4) * d.v[l] + m.v[l];
        w1->v[l] = (float)((c[l] >> 4) | ((h1 >> l) & 1) << 4) * d.v[l] + m.v[l];
    }
}
INLINE void deq6(const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1)
{
    const uint8_t *c = blk + 16 * j, *h = blk + 256 + 4 * j, *g = blk + 320 + 4 * j; /* bit 4's words, bit 5's */
    const unsigned h0 = h[0] | (unsigned)h[1] << 8, h1 = h[2] | (unsigned)h[3] << 8;
    const unsigned g0 = g[0] | (unsigned)g[1] << 8, g1 = g[2] | (unsigned)g[3] << 8;
    for (int l = 0; l < 16; l++) { /* q * d and -32 d are exact, as is their sum: the same float as an fma */
        w0->v[l] = (float)((c[l] & 0xF) | ((h0 >> l) & 1) << 4 | ((g0 >> l) & 1) << 5) * d.v[l] + m.v[l];
        w1->v[l] = (float)((c[l] >> 4) | ((h1 >> l) & 1) << 4 | ((g1 >> l) & 1) << 5) * d.v[l] + m.v[l];
    }
}
INLINE v16 deq8(const uint8_t *c, v16 d)
{
    v16 v;
    const int8_t *s = (const int8_t *)c;
    for (int l = 0; l < 16; l++) v.v[l] = (float)s[l] * d.v[l];
    return v;
}

#endif

/* ---- tiles (shared by all builds) ------------------------------------------------------------
 * kind, R (rows) and T (panels) are constants wherever these are called (the drivers name them
 * literally and always_inline propagates them). A panel-block is 256 (q4), 320 (q5) or 512 (q8) code bytes. */
#define PANEL_BLOCK_BYTES(kind) (KQ6(kind) ? 384 : KQ5(kind) ? 320 : KQ4(kind) ? 256 : 512)

/* Inputs 2j and 2j + 1 of a nibble kind's panel-block: deq4, or deq5 / deq6 with the bit planes. */
INLINE void deqn(const int kind, const uint8_t *blk, const int j, v16 d, v16 m, v16 *w0, v16 *w1)
{
    if (KQ6(kind)) deq6(blk, j, d, m, w0, w1);
    else if (KQ5(kind)) deq5(blk, j, d, m, w0, w1);
    else deq4(blk, j, d, m, w0, w1);
}

/* Input j's weights of a q8 panel-block (c: its codes): code * d (+ m where the kind has a min; the
 * product is exact, so the sum rounds once, as an fma would). */
INLINE v16 deq8k(const int kind, const uint8_t *c, const int j, v16 d, v16 m)
{
    const v16 w = deq8(c + 16 * j, d);
    return KMIN(kind) ? v_add(w, m) : w;
}

/* Inputs 2j and 2j + 1 of a q4 block into a tile's accumulators: the weights of panels t from codes
 * c[t] and scales vd[t], vm[t]; xb: the block's packed rows (xb[i * R + r]). */
INLINE void tile_q4_pair(const int kind, const int R, const int T, const int j, const uint8_t *const c[MAX_PANELS],
                         const v16 vd[MAX_PANELS], const v16 vm[MAX_PANELS], const float *xb,
                         v16 acc[MAX_ROWS][MAX_PANELS])
{
    v16 w0[MAX_PANELS], w1[MAX_PANELS];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) deqn(kind, c[t], j, vd[t], vm[t], &w0[t], &w1[t]);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = v_fma(w0[t], xb + (2 * j) * R + r, acc[r][t]);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = v_fma(w1[t], xb + (2 * j + 1) * R + r, acc[r][t]);
    }
}

/* Rows [r0, r0 + R) x panels [p, p + T), weights rebuilt in registers. */
INLINE void tile_reg(const qmat_t *w, const int kind, const int R, const int T, const float *x, float *y, int64_t p,
                     int64_t r0)
{
    const int64_t I = w->in, nb = w->nb;
    v16 acc[MAX_ROWS][MAX_PANELS];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = v_zero();
    (void)I;
    for (int64_t b = 0; b < nb; b++) {
        v16 vd[MAX_PANELS], vm[MAX_PANELS], vd2[MAX_PANELS], vm2[MAX_PANELS];
        const uint8_t *c[MAX_PANELS];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const int64_t pb = (p + t) * nb + b;
            vd[t] = v_scale(w->d, kind, pb, 0);
            vd2[t] = KH16(kind) ? v_scale(w->d, kind, pb, 1) : vd[t];
            vm[t] = KMIN(kind) ? v_min_of(w->m, kind, pb, vd[t]) : KQ6(kind) ? v_off6(vd[t]) : v_zero();
            vm2[t] = KQ6(kind) ? v_off6(vd2[t]) : vm[t];
            c[t] = w->codes + PANEL_BLOCK_BYTES(kind) * pb;
#if PREFETCH_BLOCKS
            /* the stream PREFETCH_BLOCKS blocks ahead (into the next panels at a panel's end: the next tile's) */
            const uint8_t *pc = c[t] + PREFETCH_BLOCKS * PANEL_BLOCK_BYTES(kind);
            for (int l = 0; l < PANEL_BLOCK_BYTES(kind); l += 64) __builtin_prefetch(pc + l, 0, PREFETCH_LOCALITY);
            if ((b & 1) == 0) {
                __builtin_prefetch(scale_at(w->d, kind, pb + PREFETCH_BLOCKS), 0, PREFETCH_LOCALITY);
                if (KMIN(kind) && w->m) __builtin_prefetch(scale_at(w->m, kind, pb + PREFETCH_BLOCKS), 0, PREFETCH_LOCALITY);
            }
#endif
        }
        const float *xb = x + 32 * R * b; /* the tile's rows packed: xb[i * R + r] */
        if (KQ6(kind)) { /* input pairs 0..7: the block's first half (its scale and min), 8..15 its second */
            if (Q4_LAYOUT && R * T <= Q4_UNROLL_TILE) {
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++) tile_q4_pair(kind, R, T, j, c, j < 8 ? vd : vd2, j < 8 ? vm : vm2, xb, acc);
            } else {
                for (int j = 0; j < 8; j++) tile_q4_pair(kind, R, T, j, c, vd, vm, xb, acc);
                for (int j = 8; j < 16; j++) tile_q4_pair(kind, R, T, j, c, vd2, vm2, xb, acc);
            }
        } else if (KQ4(kind)) {
            if (Q4_LAYOUT && R * T <= Q4_UNROLL_TILE) { /* the lanes layout's shifts as immediates */
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++) tile_q4_pair(kind, R, T, j, c, vd, vm, xb, acc);
            } else { /* larger tiles stay rolled: unrolled, the allocator spilled (measured: 6 x 1 30% slower) */
                for (int j = 0; j < 16; j++) tile_q4_pair(kind, R, T, j, c, vd, vm, xb, acc);
            }
        } else {
            for (int h = 0; h < 2; h++) /* the block's halves: KH16 kinds' two scales */
                for (int j = 16 * h; j < 16 * h + 16; j++) {
                    v16 wj[MAX_PANELS];
#pragma GCC unroll 4
                    for (int t = 0; t < T; t++) wj[t] = deq8k(kind, c[t], j, h ? vd2[t] : vd[t], vm[t]);
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                        for (int t = 0; t < T; t++) acc[r][t] = v_fma(wj[t], xb + j * R + r, acc[r][t]);
                }
        }
    }
    store_tile(w, R, T, acc, y, p, r0);
}

/* Panels [p, p + T) rebuilt into wb[i][t][l] = W[16 (p + t) + l, i] (floats, i < I): the same
 * deq4/deq8 as tile_reg, so the same weights bit for bit. */
INLINE void rebuild_panels(const qmat_t *w, const int kind, const int T, int64_t p, float *wb)
{
    const int64_t nb = w->nb;
    for (int64_t b = 0; b < nb; b++)
        for (int t = 0; t < T; t++) {
            const int64_t pb = (p + t) * nb + b;
            const v16 vd = v_scale(w->d, kind, pb, 0);
            const v16 vm = KMIN(kind) ? v_min_of(w->m, kind, pb, vd) : KQ6(kind) ? v_off6(vd) : v_zero();
            const v16 vd2 = KH16(kind) ? v_scale(w->d, kind, pb, 1) : vd, vm2 = KQ6(kind) ? v_off6(vd2) : vm;
            const uint8_t *c = w->codes + PANEL_BLOCK_BYTES(kind) * pb;
            float *o = wb + (32 * b * T + t) * PANEL; /* input 32b, panel t */
            if (KQ4(kind)) {
#if Q4_LAYOUT
#pragma GCC unroll 16
#endif
                for (int j = 0; j < 16; j++) {
                    v16 w0, w1;
                    deqn(kind, c, j, KQ6(kind) && j >= 8 ? vd2 : vd, KQ6(kind) && j >= 8 ? vm2 : vm, &w0, &w1);
                    v_store(o + (2 * j) * T * PANEL, w0);
                    v_store(o + (2 * j + 1) * T * PANEL, w1);
                }
            } else {
                for (int j = 0; j < 32; j++) v_store(o + j * T * PANEL, deq8k(kind, c, j, j >= 16 ? vd2 : vd, vm));
            }
        }
}

/* Rows [r0, r0 + R) x panels [p, p + T) from rebuilt weights wb (rebuild_panels) and the tile's
 * packed rows x (x[i * R + r]); per output the same fma chain over i in order as tile_reg. */
INLINE void tile_mem(const qmat_t *w, const int R, const int T, const float *wb, const float *x, float *y,
                     int64_t p, int64_t r0)
{
    const int64_t I = w->in;
    v16 acc[MAX_ROWS][MAX_PANELS];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = v_zero();
    for (int64_t i = 0; i < I; i++) {
        v16 wi[MAX_PANELS];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) wi[t] = v_load(wb + (i * T + t) * PANEL);
        const float *xi = x + i * R;
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) acc[r][t] = v_fma(wi[t], xi + r, acc[r][t]);
    }
    store_tile(w, R, T, acc, y, p, r0);
}

#define MEM_FN(R, T)                                                                                           \
    static __attribute__((noinline)) void mem_##R##_##T(const qmat_t *w, const float *wb, const float *x, float *y, \
                                                        int64_t p, int64_t r0) { tile_mem(w, R, T, wb, x, y, p, r0); }
#define MEM_FNS(T) MEM_FN(1, T) MEM_FN(2, T) MEM_FN(3, T) MEM_FN(4, T) MEM_FN(5, T) MEM_FN(6, T) MEM_FN(7, T) \
    MEM_FN(8, T) MEM_FN(9, T) MEM_FN(10, T) MEM_FN(11, T) MEM_FN(12, T) MEM_FN(13, T) MEM_FN(14, T) MEM_FN(15, T) \
    MEM_FN(16, T)
MEM_FNS(1) MEM_FNS(2) MEM_FNS(3) MEM_FNS(4)
#undef MEM_FNS
#undef MEM_FN

INLINE void mem_call(const qmat_t *w, const int R, const int T, const float *wb, const float *x, float *y, int64_t p,
                     int64_t r0)
{
#define MC(RR, TT) if (R == RR && T == TT) { mem_##RR##_##TT(w, wb, x, y, p, r0); return; }
#define MCS(TT) MC(1, TT) MC(2, TT) MC(3, TT) MC(4, TT) MC(5, TT) MC(6, TT) MC(7, TT) MC(8, TT) MC(9, TT) MC(10, TT) \
    MC(11, TT) MC(12, TT) MC(13, TT) MC(14, TT) MC(15, TT) MC(16, TT)
    MCS(1) MCS(2) MCS(3) MCS(4)
#undef MCS
#undef MC
    __builtin_unreachable();
}

/* Each tile shape compiled as its own function: inlined into one driver, the allocator kept the
 * accumulators of the larger tiles on the stack (measured: 6 of 16 spilled per step of 2 inputs). */
#define TILE_FN(K, R, T) \
    static __attribute__((noinline)) void tile_##K##_##R##_##T(const qmat_t *w, const float *x, float *y, int64_t p, \
                                                             int64_t r0) { tile_reg(w, K, R, T, x, y, p, r0); }
#define TILE_FNS(K, T) TILE_FN(K, 1, T) TILE_FN(K, 2, T) TILE_FN(K, 3, T) TILE_FN(K, 4, T) TILE_FN(K, 5, T) \
    TILE_FN(K, 6, T) TILE_FN(K, 7, T) TILE_FN(K, 8, T) TILE_FN(K, 9, T) TILE_FN(K, 10, T) TILE_FN(K, 11, T) \
    TILE_FN(K, 12, T) TILE_FN(K, 13, T) TILE_FN(K, 14, T) TILE_FN(K, 15, T) TILE_FN(K, 16, T)
#define TILE_KIND(K) TILE_FNS(K, 1) TILE_FNS(K, 2) TILE_FNS(K, 3) TILE_FNS(K, 4)
TILE_KIND(4) TILE_KIND(8) TILE_KIND(6) TILE_KIND(10) TILE_KIND(18) TILE_KIND(9) TILE_KIND(12) TILE_KIND(20) TILE_KIND(22)
TILE_FN(5, 1, 1) TILE_FN(17, 1, 1) /* the reference kinds: one row, one panel */
#undef TILE_KIND
#undef TILE_FNS
#undef TILE_FN
/* tile_K_R_T for constant kind, R, T (every call site's are: all but one test folds away). */
INLINE void tile_call(const qmat_t *w, const int kind, const int R, const int T, const float *x, float *y, int64_t p,
                      int64_t r0)
{
#define TC(K, RR, TT) if (kind == K && R == RR && T == TT) { tile_##K##_##RR##_##TT(w, x, y, p, r0); return; }
#define TCS(K, TT) TC(K, 1, TT) TC(K, 2, TT) TC(K, 3, TT) TC(K, 4, TT) TC(K, 5, TT) TC(K, 6, TT) TC(K, 7, TT) \
    TC(K, 8, TT) TC(K, 9, TT) TC(K, 10, TT) TC(K, 11, TT) TC(K, 12, TT) TC(K, 13, TT) TC(K, 14, TT) TC(K, 15, TT) \
    TC(K, 16, TT)
#define TCK(K) TCS(K, 1) TCS(K, 2) TCS(K, 3) TCS(K, 4)
    TCK(4) TCK(8) TCK(6) TCK(10) TCK(18) TCK(9) TCK(12) TCK(20) TCK(22) TC(5, 1, 1) TC(17, 1, 1)
#undef TCK
#undef TCS
#undef TC
    __builtin_unreachable();
}


/* One case per row count so each tile compiles with R a constant (its accumulators in registers);
 * rows is 1..RR: cases above RR are never taken, and saying so lets the compiler drop them. */
#define ROW_CASE(k, CALL) case k: if ((k) <= RR) { CALL(k); } else { __builtin_unreachable(); } break;
#define ROW_CASES(CALL)                                                                              \
    switch (rows) {                                                                                  \
    ROW_CASE(1, CALL) ROW_CASE(2, CALL) ROW_CASE(3, CALL) ROW_CASE(4, CALL)                          \
    ROW_CASE(5, CALL) ROW_CASE(6, CALL) ROW_CASE(7, CALL) ROW_CASE(8, CALL)                          \
    ROW_CASE(9, CALL) ROW_CASE(10, CALL) ROW_CASE(11, CALL) ROW_CASE(12, CALL)                       \
    ROW_CASE(13, CALL) ROW_CASE(14, CALL) ROW_CASE(15, CALL)                                         \
    default: CALL(RR); break;                                                                        \
    }

/* Panels [p0, p1) of y = x W^T: per T panels (then single panels at the end), row tiles of RR rows
 * (the last one ragged); a panel's codes stay in L1 while every row tile passes over them. */
INLINE void part(const qmat_t *w, const int kind, const int RR, const int T, const float *x, int64_t n, float *y,
                 int64_t p0, int64_t p1)
{
    int64_t p = p0;
    for (; p + T <= p1; p += T)
        for (int64_t r0 = 0; r0 < n; r0 += RR) {
            const int rows = n - r0 < RR ? (int)(n - r0) : RR;
#define CALL(R) tile_call(w, kind, R, T, x + r0 * w->in, y, p, r0)
            ROW_CASES(CALL)
#undef CALL
        }
    for (; p < p1; p++)
        for (int64_t r0 = 0; r0 < n; r0 += RR) {
            const int rows = n - r0 < RR ? (int)(n - r0) : RR;
#define CALL(R) tile_call(w, kind, R, 1, x + r0 * w->in, y, p, r0)
            ROW_CASES(CALL)
#undef CALL
        }
}

/* Each plan compiled as its own function: one function holding every plan's tiles got worse register
 * allocation (measured: wide tiles -30%). */
#define PLAN(name, kind, RR, T)                                                                                 \
    static __attribute__((noinline)) void name(const qmat_t *w, const float *x, int64_t n, float *y, int64_t p0, \
                                               int64_t p1)                                                      \
    {                                                                                                           \
        part(w, kind, RR, T, x, n, y, p0, p1);                                                                  \
    }
#define PLANS(K, NR, NP) PLAN(one_##K, K, 1, ONE_PANELS) PLAN(narrow_##K, K, NR, NP) PLAN(wide_##K, K, WIDE_ROWS, WIDE_PANELS)
PLANS(4, NARROW_ROWS, NARROW_PANELS) PLANS(6, NARROW_ROWS, NARROW_PANELS)
PLANS(8, NARROW8_ROWS, NARROW8_PANELS) PLANS(10, NARROW8_ROWS, NARROW8_PANELS) PLANS(18, NARROW8_ROWS, NARROW8_PANELS)
PLANS(9, NARROW8_ROWS, NARROW8_PANELS) PLANS(12, NARROW_ROWS, NARROW_PANELS) PLANS(20, NARROW_ROWS, NARROW_PANELS)
PLANS(22, NARROW_ROWS, NARROW_PANELS)
PLAN(one_5, 5, 1, 1) PLAN(one_17, 17, 1, 1) /* the reference kinds: qmat_rows gives them one row at a time */
#undef PLANS
#undef PLAN

/* *buf grown to at least `need` floats (this thread's scratch; kept for its next calls). 0, or -1
 * without memory. */
static int grow_buf(float **buf, int64_t *cap, int64_t need)
{
    if (need <= *cap) return 0;
    float *b = realloc(*buf, sizeof(float) * need);
    if (!b) return -1;
    *buf = b, *cap = need;
    return 0;
}

static __thread float *deq_buf; /* rebuilt panels of the dequantise-once plan */
static __thread int64_t deq_cap;

/* One group of T panels from p: rebuilt once, then every row tile of DEQ_ROWS rows over it. */
INLINE void deq_group(const qmat_t *w, const int kind, const int T, int64_t p, const float *x, int64_t n, float *y)
{
    rebuild_panels(w, kind, T, p, deq_buf);
    for (int64_t r0 = 0; r0 < n; r0 += DEQ_ROWS) {
        const int rows = n - r0 < DEQ_ROWS ? (int)(n - r0) : DEQ_ROWS;
        const int RR = DEQ_ROWS;
#define CALL(R) mem_call(w, R, T, deq_buf, x + r0 * w->in, y, p, r0)
        ROW_CASES(CALL)
#undef CALL
    }
}

/* The dequantise-once plan over panels [p0, p1): x packed in tiles of DEQ_ROWS rows, deq_buf grown
 * to w->in * DEQ_PANELS * PANEL floats. */
INLINE void deq_part(const qmat_t *w, const int kind, const float *x, int64_t n, float *y, int64_t p0, int64_t p1)
{
    int64_t p = p0;
    for (; p + DEQ_PANELS <= p1; p += DEQ_PANELS) deq_group(w, kind, DEQ_PANELS, p, x, n, y);
    for (; p < p1; p++) deq_group(w, kind, 1, p, x, n, y);
}
#define DEQ_PLAN(K)                                                                                              \
    static __attribute__((noinline)) void deq_##K(const qmat_t *w, const float *x, int64_t n, float *y, int64_t p0, \
                                                  int64_t p1) { deq_part(w, K, x, n, y, p0, p1); }
DEQ_PLAN(4) DEQ_PLAN(8) DEQ_PLAN(6) DEQ_PLAN(10) DEQ_PLAN(18) DEQ_PLAN(9) DEQ_PLAN(12) DEQ_PLAN(20) DEQ_PLAN(22)
#undef DEQ_PLAN

/* A kind's plans. */
typedef void (*plan_fn)(const qmat_t *, const float *, int64_t, float *, int64_t, int64_t);
typedef struct {
    plan_fn one, narrow, wide, deq;
} plans_t;
static plans_t plans_of(int kind)
{
#define PL(K) if (kind == K) { const plans_t p = {one_##K, narrow_##K, wide_##K, deq_##K}; return p; }
#define PL_REF(K) if (kind == K) { const plans_t p = {one_##K, one_##K, one_##K, one_##K}; return p; }
    PL(4) PL(6) PL(10) PL(18) PL(9) PL(12) PL(20) PL(22) PL_REF(5) PL_REF(17)
#undef PL_REF
#undef PL
    const plans_t p = {one_8, narrow_8, wide_8, deq_8};
    return p;
}

/* x[n, I] -> this thread's buffer, row tiles of RR rows (the last one ragged) one after another, each
 * tile input-major: tile at row r0 with R rows holds x[r0 + r, i] at [r0 * I + i * R + r]. One pointer
 * then addresses every row of a tile with constant offsets (no register per row). */
static __thread float *pack_buf;
static __thread int64_t pack_cap;
static const float *pack_rows(const float *x, int64_t n, int64_t I, int64_t RR)
{
    if (grow_buf(&pack_buf, &pack_cap, n * I)) return NULL;
    for (int64_t r0 = 0; r0 < n; r0 += RR) {
        const int64_t R = n - r0 < RR ? n - r0 : RR;
        float *t = pack_buf + r0 * I;
        for (int64_t i = 0; i < I; i++)
            for (int64_t r = 0; r < R; r++) t[i * R + r] = x[(r0 + r) * I + i];
    }
    return pack_buf;
}

/* This thread's share (id of nt) of y[n, out] = x W^T (+ bias): panels [p0, p1), outputs [*o0, *o1). */
void qmat_rows(const qmat_t *w, const float *x, int64_t n, float *y, int64_t id, int64_t nt, int64_t *o0,
                      int64_t *o1)
{
    const int64_t panels = (w->out + PANEL - 1) / PANEL, p0 = panels * id / nt, p1 = panels * (id + 1) / nt;
    *o0 = PANEL * p0 < w->out ? PANEL * p0 : w->out;
    *o1 = PANEL * p1 < w->out ? PANEL * p1 : w->out;
    if (p1 <= p0 || n <= 0) return;
    const plans_t pl = plans_of(w->kind);
    if (n == 1) {
        pl.one(w, x, n, y, p0, p1);
        return;
    }
    if (KREF(w->kind)) { /* the reference kinds: row by row (the same bits as any plan) */
        for (int64_t r = 0; r < n; r++) pl.one(w, x + r * w->in, 1, y + r * w->out, p0, p1);
        return;
    }
    const int narrow = n <= (KQ4(w->kind) ? NARROW_ROWS : NARROW8_ROWS);
    /* without memory for the rebuilt panels, the wide plan (same bits) */
    const int deq = n >= DEQ_MIN_ROWS && !grow_buf(&deq_buf, &deq_cap, w->in * DEQ_PANELS * PANEL);
    const float *xp = pack_rows(x, n, w->in, narrow ? n : deq ? DEQ_ROWS : WIDE_ROWS);
    if (!xp) { /* no memory for the packed copy: row by row (a row alone is its own packed layout; same bits) */
        for (int64_t r = 0; r < n; r++) pl.one(w, x + r * w->in, 1, y + r * w->out, p0, p1);
        return;
    }
    if (deq) pl.deq(w, xp, n, y, p0, p1);
    else if (narrow) pl.narrow(w, xp, n, y, p0, p1);
    else pl.wide(w, xp, n, y, p0, p1);
}

/* Which build this is ("avx512", "avx2", "scalar"): the loader checks it got the one it asked for. */
const char *trserve_qlinear_isa(void) { return ISA_NAME; }

/* Outputs per panel: the packed layout pads O to a multiple of it (the loader packs to match). */
int trserve_qlinear_panel(void) { return PANEL; }

/* The q4 code layout this build reads: 0 "bytes", 1 "lanes" (the layout comment at the top). */
int trserve_qlinear_q4_layout(void) { return Q4_LAYOUT; }

typedef struct {
    const qmat_t *w;
    const float *x;
    int64_t n;
    float *y;
} qlinear_job_t;

static void qlinear_job(void *arg, int64_t id, int64_t nt)
{
    const qlinear_job_t *j = arg;
    int64_t o0, o1;
    qmat_rows(j->w, j->x, j->n, j->y, id, nt, &o0, &o1);
}

/* x: [n, I] row-major, I % 32 == 0 (two-level kinds: I % 256 == 0); codes, d, m: the panel layout above
 * for ceil(O / 16) panels (m only where the kind has a min); bias: [O] or NULL; y: [n, O]. Returns 0, or
 * -3 for an unknown kind (or a two-level kind's I not a multiple of 256). */
int trserve_qlinear(int kind, const float *x, int64_t n, int64_t I, int64_t O, const uint8_t *codes,
                    const uint16_t *d, const uint16_t *m, const float *bias, float *y, int threads)
{
    if (!KNOWN_KIND(kind) || (KTWO(kind) && I % 256)) return -3;
    const qmat_t w = {kind, I, O, I / 32, codes, d, m, bias};
    qlinear_job_t job = {&w, x, n, y};
    pool_run(qlinear_job, &job, threads);
    return 0;
}
