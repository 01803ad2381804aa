/* The kernels' own thread pool (pool.c): whichever thread calls in, one run at a time; fn(ctx, id, nt)
 * runs on the caller (id 0) and nt - 1 workers. Shared by the linear layers (qlinear.c) and the
 * native forward (forward.c), which spans a whole forward in one run, pool_barrier between phases.
 */
#ifndef TRSERVE_POOL_H
#define TRSERVE_POOL_H

#include <stdint.h>

#include "isa.h"

#define POOL_MAX 256 /* threads at most in one run (more asked: this many) */

typedef void (*pool_fn)(void *ctx, int64_t id, int64_t nt);

/* fn(ctx, id, nt) for id 0 .. nt - 1 (id 0 on this thread); returns when all have returned. Fewer
 * threads than asked when workers cannot be started (fn only ever sees the nt it runs with). */
HIDDEN void pool_run(pool_fn fn, void *ctx, int64_t nt);

/* Inside fn: waits until all nt threads of the current run have reached it. */
HIDDEN void pool_barrier(int64_t nt);

#endif
