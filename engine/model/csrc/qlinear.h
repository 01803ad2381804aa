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

/* Kinds of compressed matrix: the codes' width, the scales' type and block, whether a min is added.
 *   4  q4 codes, float16 d and m per block of 32 (Q4_0, Q4_1)
 *   8  q8 codes, float16 d per block of 32 (Q8_0, Q5_0)
 *   5  q4 codes, float32 d and m per block of 32 (Q4_K: d = d_super * sc, m = -dmin_super * mn)
 *   9  q8 codes, float32 d and m per block of 32 (Q5_K, Q5_1)
 *   17 q8 codes, float32 d per 16 inputs, two per block (Q6_K: d = d_super * sc)
 * Every product code * d is exact in float32 for these ranges, so W = code * d (+ m) has at most one
 * rounding: ggml's own dequantized value. */
#define KQ4(k) ((k) == 4 || (k) == 5)                /* 4-bit codes (else 8-bit) */
#define KMIN(k) ((k) == 4 || (k) == 5 || (k) == 9)   /* a min per block */
#define KF16(k) ((k) == 4 || (k) == 8)               /* float16 scales (else float32) */
#define KNOWN_KIND(k) ((k) == 4 || (k) == 8 || (k) == 5 || (k) == 9 || (k) == 17)

/* One compressed matrix, [out, in] as y = x W^T (+ bias) takes it. */
typedef struct {
    int kind;
    int64_t in, out, nb; /* in = 32 nb */
    const uint8_t *codes;
    const uint16_t *d, *m; /* float16 or (cast) float32 values as kind says; m only where KMIN(kind) */
    const float *bias;     /* [out] or NULL */
    int64_t n_kept;        /* int8 arithmetic: inputs kept in float32 (qact_t.kept), 0..MAX_KEPT */
    const float *kept_w;   /* [n_kept, out]: W[:, those inputs], added after the integer part */
} qmat_t;

#define MAX_ROWS 16  /* register tiles: rows x panels at most */
#define MAX_PANELS 4

/* The scales of panel-block pb (16 outputs side by side; h: which half of the block, kind 17 only) as
 * floats: float16 values converted exactly, or float32 ones as they are. */
INLINE v16 v_scale(const uint16_t *s, const int kind, int64_t pb, int h)
{
    if (KF16(kind)) return v_half(s + PANEL * pb);
    if (kind == 17) return v_load((const float *)s + PANEL * (2 * pb + h));
    return v_load((const float *)s + PANEL * pb);
}
/* Where panel-block pb's scales lie (prefetches). */
INLINE const void *scale_at(const uint16_t *s, const int kind, int64_t pb)
{
    return KF16(kind) ? (const void *)(s + PANEL * pb) : (const void *)((const float *)s + PANEL * (kind == 17 ? 2 * pb : pb));
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
 * -128 x the sum of its first 16 codes c16[b n + r] (kind 17's halves; NULL where not wanted). */
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
