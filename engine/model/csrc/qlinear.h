/* The exact compressed linear layers (qlinear.c): the matrix they read, the share of one thread that
 * forward.c's layers call, and the library's linear entry points (engine/model/kernels/build.py
 * loads them with ctypes; the layout of codes and scales: qlinear.c's top comment).
 */
#ifndef TRSERVE_QLINEAR_H
#define TRSERVE_QLINEAR_H

#include <stdint.h>

#include "isa.h"
#include "vec.h"

#define PANEL 16 /* outputs per panel of the packed layout */

/* Kinds of compressed matrix: the codes' width, the scales' form and block, whether a min is added.
 *   4  q4 codes, float16 d and m per block of 32 (Q4_1; Q4_0 with m = -8 d, or m NULL: v_min_of)
 *   12 q5 codes (0..31): kind 4's nibbles plus a plane of their high bits, float16 d and m per block
 *      of 32 (Q5_1; Q5_0 with m NULL, -16 d implied: v_min_of): a panel-block is kind 4's 256 bytes then the 64-byte plane
 *      (qlinear.c's and qlinear_i8.c's layout comments)
 *   8  q8 codes, float16 d per block of 32 (Q8_0; Q5_0 as codes q - 16 where recovered from floats)
 *   6  q4 codes, a GGUF file's two-level scales (Q4_K): d = d16 * sc, m = -(dmin16 * mn) per block of 32
 *   10 q8 codes, the same two-level scales and mins (Q5_K)
 *   22 q5 codes (0..31) as kind 12 holds them (nibbles + a plane of bit 4) with kind 10's two-level scales
 *      and mins: Q5_K at 5.625 bits per weight (kind 10: 8.625), kind 10's weights and outputs bit for bit
 *   18 q8 codes, two-level scales per 16 inputs, two per block: d = d16 * sc, sc signed (Q6_K)
 *   20 q6 codes (0..63): kind 4's nibbles plus two planes (bits 4 and 5: kind 12's plane twice), Q6_K's
 *      two-level scales per 16 inputs as kind 18, and its offset as an implied min per half, -32 d
 *      (v_off6: exact), so W = q * d - 32 d = (q - 32) * d, kind 18's weight bit for bit (6.56 bits per
 *      weight, the file's; kind 18 8.56): a panel-block is kind 4's 256 bytes then the two 64-byte planes
 *   9  q8 codes, float32 d and m per block of 32 (Q5_1: float16 values)
 *   5, 17: kinds 6 and 18 with each product held as float32 (5: d and m per 32; 17: d per 16), the
 *      compact kinds' reference (tests: the same bits); compiled for one row and one panel at a time
 * The two-level kinds (KTWO) hold the file's own scales: a record per panel super-block (16 outputs x
 * 256 inputs: 8 blocks; in % 256 == 0), KREC_BYTES(kind) bytes, panel super-block ps = pb / 8 at
 * ps KREC_BYTES(kind) of the stream:
 *   bytes [0, 32):   the 16 outputs' float16 super-block scale (d; dmin in the min's stream), [l] output l
 *   then 16 bytes per sub-block: [16 k + l] output l's scale of sub-block k (uint8 sc and mn, 6-bit
 *   values, k = block 0..7; kind 18: int8 sc, k = 2 block + half 0..15)
 * d16 * sc is exact in float32 (11 x 8 bits), as is dmin16 * mn: the float32 kinds' very values, formed
 * in registers. Every product code * d is exact in float32 for these ranges, so W = code * d (+ m) has
 * at most one rounding: ggml's own dequantized value. */
#define KQ5(k) ((k) == 12 || (k) == 22)                                     /* nibbles + high-bit plane */
#define KQ6(k) ((k) == 20)                                                  /* nibbles + two bit planes */
#define KQ4(k) ((k) == 4 || (k) == 5 || (k) == 6 || KQ5(k) || KQ6(k))         /* nibble codes (else 8-bit) */
#define KMIN(k) ((k) == 4 || (k) == 5 || (k) == 6 || (k) == 9 || (k) == 10 || KQ5(k)) /* a min per block */
#define KF16(k) ((k) == 4 || (k) == 8 || (k) == 12)                           /* float16 scales per block */
#define KTWO(k) ((k) == 6 || (k) == 10 || (k) == 18 || KQ6(k) || (k) == 22)  /* two-level scale records */
#define KH16(k) ((k) == 17 || (k) == 18 || KQ6(k))                            /* a scale per 16 inputs */
#define KREF(k) ((k) == 5 || (k) == 17)                                       /* reference kinds: one row */
#define KNOWN_KIND(k) ((k) == 4 || (k) == 8 || (k) == 6 || (k) == 10 || (k) == 18 || (k) == 9 || KQ5(k) || KQ6(k) || KREF(k))
#define SUPER 8                                               /* blocks of 32 per super-block */
#define KREC_BYTES(k) (2 * PANEL + PANEL * (KH16(k) ? 16 : 8)) /* a panel super-block's scale record */

/* One compressed matrix, [out, in] as y = x W^T (+ bias) takes it. */
typedef struct {
    int kind;
    int64_t in, out, nb; /* in = 32 nb */
    const uint8_t *codes;
    const uint16_t *d, *m; /* float16, (cast) float32 values, or (cast) KTWO records, as kind says; m only where KMIN(kind), NULL for kinds 4 and 12 whose min is -8 d or -16 d (v_min_of) */
    const float *bias;     /* [out] or NULL */
    int64_t n_kept;        /* int8 arithmetic: inputs kept in float32 (qact_t.kept), 0..MAX_KEPT */
    const float *kept_w;   /* [n_kept, out]: W[:, those inputs], added after the integer part */
} qmat_t;

#define MAX_ROWS 16  /* register tiles: rows x panels at most */
#define MAX_PANELS 4

/* A two-level kind's record of panel-block pb (its super-block's), and the block's sub-block scales in it
 * (h: which half of the block, kind 18 only). */
INLINE const uint8_t *k_record(const uint16_t *s, const int kind, int64_t pb)
{
    return (const uint8_t *)s + KREC_BYTES(kind) * (pb >> 3);
}
INLINE const uint8_t *k_sub(const uint16_t *s, const int kind, int64_t pb, int h)
{
    return k_record(s, kind, pb) + 2 * PANEL + PANEL * (KH16(kind) ? 2 * (pb & 7) + h : (pb & 7));
}

/* The scales of panel-block pb (16 outputs side by side; h: which half of the block, kinds 17 and 18)
 * as floats: float16 values converted exactly, float32 ones as they are, or a two-level kind's
 * d16 * sc (exact). For a min's stream, v_min. */
INLINE v16 v_scale(const uint16_t *s, const int kind, int64_t pb, int h)
{
    if (KF16(kind)) return v_half(s + PANEL * pb);
    if (KTWO(kind)) {
        const uint8_t *sc = k_sub(s, kind, pb, h);
        return v_mulv(v_half((const uint16_t *)k_record(s, kind, pb)), KH16(kind) ? v_i8(sc) : v_u8(sc));
    }
    if (KH16(kind)) return v_load((const float *)s + PANEL * (2 * pb + h));
    return v_load((const float *)s + PANEL * pb);
}
/* The mins of panel-block pb: as v_scale, a two-level kind's as -(dmin16 * mn). */
INLINE v16 v_min(const uint16_t *m, const int kind, int64_t pb)
{
    return KTWO(kind) ? v_neg(v_scale(m, kind, pb, 0)) : v_scale(m, kind, pb, 0);
}
/* The min of panel-block pb of w where w holds one (v_min), else the min its scale implies (m NULL: a
 * GGUF file's Q4_0 and Q5_0 blocks, (q - 8) d and (q - 16) d, held without a min stream): -8 d or -16 d,
 * exact in float32 (a power of two times a float16 value), so the bits are those of the min held. */
INLINE v16 v_min_of(const uint16_t *m, const int kind, int64_t pb, v16 vd)
{
    static const float q4_0 = -8.0f, q5_0 = -16.0f;
    return m ? v_min(m, kind, pb) : v_mul(vd, KQ5(kind) ? &q5_0 : &q4_0);
}
/* Kind 20's implied min of a half whose scale is vd: -32 d (exact in float32: a power of two). */
INLINE v16 v_off6(v16 vd)
{
    static const float q6 = -32.0f;
    return v_mul(vd, &q6);
}

/* Where panel-block pb's scales lie (prefetches; a two-level kind's: the block's sub-block scales). */
INLINE const void *scale_at(const uint16_t *s, const int kind, int64_t pb)
{
    if (KF16(kind)) return s + PANEL * pb;
    if (KTWO(kind)) return k_sub(s, kind, pb, 0);
    return (const float *)s + PANEL * (KH16(kind) ? 2 * pb : pb);
}

/* acc of rows [r0, r0 + R) and panels [p, p + T) -> y (outputs past `out` are padding: dropped). */
INLINE void store_tile(const qmat_t *w, const int R, const int T, v16 acc[MAX_ROWS][MAX_PANELS], float *y, int64_t p,
                       int64_t r0)
{
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const int64_t o = PANEL * (p + t);
            float *yr = y + (r0 + r) * w->out;
            if (o + PANEL <= w->out) {
                v_store(yr + o, w->bias ? v_add(acc[r][t], v_load(w->bias + o)) : acc[r][t]);
            } else {
                float tmp[PANEL];
                v_store(tmp, acc[r][t]);
                for (int64_t l = 0; o + l < w->out; l++) yr[o + l] = w->bias ? tmp[l] + w->bias[o + l] : tmp[l];
            }
        }
    }
}

/* This thread's share (id of nt) of y[n, out] = x W^T (+ bias): panels [p0, p1), outputs [*o0, *o1). */
HIDDEN void qmat_rows(const qmat_t *w, const float *x, int64_t n, float *y, int64_t id, int64_t nt, int64_t *o0,
                      int64_t *o1);

/* Activations quantized for the int8 arithmetic (qlinear_i8.c): n rows of I inputs, block-major:
 * row r's block b is q[(b n + r) 32 ..], its scale s[b n + r], xm m[b n + r], -128 x code sum c[b n + r],
 * -128 x the sum of its first 16 codes c16[b n + r] (KH16 kinds' halves; NULL where not wanted). */
typedef struct {
    int64_t n;
    int8_t *q;
    float *s, *m;
    int32_t *c;
    int32_t *c16;
    int64_t n_kept; /* inputs kept in float32 (quantized as zeros): kept[r n_kept + j] = x[r, dims[j]] */
    float *kept, *row; /* [n, MAX_KEPT], and a row's scratch [I] */
} qact_t;
#define MAX_KEPT 16

/* Buffers of a for n rows of I inputs (0, or -1 without memory; qact_free either way). */
HIDDEN int qact_alloc(qact_t *a, int64_t n, int64_t I);
HIDDEN void qact_free(qact_t *a);
/* x [n, I] (n = a->n) -> a, the inputs dims [n_dims] (n_dims <= MAX_KEPT) kept in float32 and quantized
 * as zeros. */
HIDDEN void quant_rows(const float *x, int64_t n, int64_t I, qact_t *a, const int32_t *dims, int64_t n_dims);
/* qmat_rows in the int8 arithmetic: w's codes in the int8 layout, activations a. */
HIDDEN void imat_rows(const qmat_t *w, const qact_t *a, float *y, int64_t id, int64_t nt, int64_t *o0, int64_t *o1);

/* Which build this is ("avx512", "avx2", "scalar"). */
const char *trserve_qlinear_isa(void);
/* Outputs per panel (PANEL). */
int trserve_qlinear_panel(void);
/* The q4 code layout this build reads: 0 "bytes", 1 "lanes". */
int trserve_qlinear_q4_layout(void);
/* y[n, O] = x[n, I] W^T (+ bias) on `threads` threads of the pool (pool.h); returns 0. */
int trserve_qlinear(int kind, const float *x, int64_t n, int64_t I, int64_t O, const uint8_t *codes,
                    const uint16_t *d, const uint16_t *m, const float *bias, float *y, int threads);

/* trserve_qlinear in the int8 arithmetic (qlinear_i8.c): 0, or -1 without memory. */
int trserve_qlinear_i8(int kind, const float *x, int64_t n, int64_t I, int64_t O, const uint8_t *codes,
                       const uint16_t *d, const uint16_t *m, const float *bias, float *y, int threads);
/* The same with the inputs dims [n_dims] kept in float32: y += x[:, dims] kept_w ([n_dims, O]) after
 * the integer part, in dims order (qlinear_i8.c). 0, -1 without memory, -2 when n_dims > 16. */
int trserve_qlinear_i8_kept(int kind, const float *x, int64_t n, int64_t I, int64_t O, const uint8_t *codes,
                            const uint16_t *d, const uint16_t *m, const float *bias, const int32_t *dims,
                            int64_t n_dims, const float *kept_w, float *y, int threads);
/* The int8 arithmetic's quantized activations of x [n, I] (tests). */
int trserve_quantize_rows(const float *x, int64_t n, int64_t I, int8_t *q, float *s, float *m, int32_t *c);

#endif
