/* The exact compressed linear layers (qlinear.c): the matrix they read, the share of one thread that
 * forward.c's layers call, and the library's linear entry points (engine/model/kernels/build.py
 * loads them with ctypes; the layout of codes and scales: qlinear.c's top comment).
 */
#ifndef TRSERVE_QLINEAR_H
#define TRSERVE_QLINEAR_H

#include <stdint.h>

#include "isa.h"

#define PANEL 16 /* outputs per panel of the packed layout */

/* One compressed matrix, [out, in] as y = x W^T (+ bias) takes it. */
typedef struct {
    int kind;
    int64_t in, out, nb; /* in = 32 nb */
    const uint8_t *codes;
    const uint16_t *d, *m; /* m only for kind 4 */
    const float *bias;     /* [out] or NULL */
} qmat_t;

/* This thread's share (id of nt) of y[n, out] = x W^T (+ bias): panels [p0, p1), outputs [*o0, *o1). */
HIDDEN void qmat_rows(const qmat_t *w, const float *x, int64_t n, float *y, int64_t id, int64_t nt, int64_t *o0,
                      int64_t *o1);

/* Which build this is ("avx512", "avx2", "scalar"). */
const char *trserve_qlinear_isa(void);
/* Outputs per panel (PANEL). */
int trserve_qlinear_panel(void);
/* The q4 code layout this build reads: 0 "bytes", 1 "lanes". */
int trserve_qlinear_q4_layout(void);
/* y[n, O] = x[n, I] W^T (+ bias) on `threads` threads of the pool (pool.h); returns 0. */
int trserve_qlinear(int kind, const float *x, int64_t n, int64_t I, int64_t O, const uint8_t *codes,
                    const uint16_t *d, const uint16_t *m, const float *bias, float *y, int threads);

#endif
