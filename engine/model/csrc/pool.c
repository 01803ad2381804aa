/* The kernels' own thread pool: one set of worker threads per library, whichever thread calls in.
 *
 * Why not OpenMP: libgomp keeps a separate team of workers for every thread that opens a parallel
 * region, and once a process holds more of its threads than CPUs (two calling threads on 2 cores:
 * e.g. a serial decoder in the main thread and the batching engine in its own) it "throttles": a
 * waiting thread spins ~100 times, then sleeps in the kernel, at every barrier. A forward has ~180
 * barriers, so each one then paid a futex wake-up: measured here, plain decoding in the main thread
 * fell from 178 to 78 tokens/s as soon as an (idle) engine thread had run one step.
 *
 * Here: pool_run(fn, ctx, nt) runs fn(ctx, id, nt) on the caller (id 0) and nt - 1 workers, and
 * returns when every worker has finished (each takes every run, running fn only when id < nt, so no
 * worker can read the next run's parameters while the current one is still open); one run at a
 * time (a mutex). pool_barrier(nt) inside fn waits for
 * all nt. Waiting spins (with pause) while work is near: at a barrier always (yielding the CPU after
 * BARRIER_SPIN_NS, in case a thread was preempted), between runs for IDLE_SPIN_NS (a decode loop's
 * next step comes within a millisecond or so), after which a worker sleeps on a condition variable
 * and costs nothing while the service idles. Which thread computes what depends only on (id, nt),
 * as it did with OpenMP, so results are unchanged. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "pool.h"

#define IDLE_SPIN_NS 2000000LL  /* a worker spins this long after a run before it sleeps */
#define BARRIER_SPIN_NS 200000LL /* then a barrier wait yields between checks */

static struct {
    pthread_mutex_t run;         /* one pool_run at a time */
    pthread_mutex_t m;           /* with cv: sleeping workers */
    pthread_cond_t cv;
    int workers;                 /* started (ids 1..workers) */
    atomic_llong gen;            /* run number: a worker runs each one it sees once */
    atomic_int done;             /* workers finished with the current run (all of them take part) */
    atomic_int sleepers;
    atomic_int bar_count, bar_sense;
    pool_fn fn;
    void *ctx;
    int64_t nt;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

INLINE void pool_pause(void) { __builtin_ia32_pause(); }

/* One step of a spin wait: a pause, and every 256 steps a look at the clock. Returns 1 once the wait
 * has lasted `limit_ns` since its first look (then on every look; zero the struct to start over). */
typedef struct {
    unsigned spins;
    int64_t t0;
} spin_t;

static int spin_over(spin_t *s, int64_t limit_ns)
{
    pool_pause();
    if ((++s->spins & 255) != 0) return 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const int64_t t = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    if (!s->t0) s->t0 = t;
    return t - s->t0 >= limit_ns;
}

/* All nt threads of the current run meet here (sense-reversing: reusable back to back). */
void pool_barrier(int64_t nt)
{
    if (nt <= 1) return;
    const int sense = atomic_load(&pool.bar_sense);
    if (atomic_fetch_add(&pool.bar_count, 1) == nt - 1) {
        atomic_store(&pool.bar_count, 0);
        atomic_store(&pool.bar_sense, !sense);
        return;
    }
    spin_t w = {0, 0};
    while (atomic_load(&pool.bar_sense) == sense)
        if (spin_over(&w, BARRIER_SPIN_NS)) sched_yield();
}

typedef struct {
    int64_t id;
    long long gen; /* the run number when it was started: it takes the runs after it */
} pool_start_t;

static void *pool_worker(void *arg)
{
    const pool_start_t start = *(pool_start_t *)arg;
    free(arg);
    const int64_t id = start.id;
    long long seen = start.gen;
    for (;;) {
        long long g;
        spin_t w = {0, 0};
        while ((g = atomic_load(&pool.gen)) == seen) {
            if (!spin_over(&w, IDLE_SPIN_NS)) continue;
            pthread_mutex_lock(&pool.m);
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.cv, &pool.m);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.m);
            w = (spin_t){0, 0};
        }
        seen = g; /* runs are never skipped: the next one waits for this worker's done */
        if (id < pool.nt) pool.fn(pool.ctx, id, pool.nt);
        atomic_fetch_add(&pool.done, 1);
    }
    return NULL;
}

static void pool_after_fork(void) /* a forked child has none of the workers: start again */
{
    pthread_mutex_init(&pool.run, NULL);
    pthread_mutex_init(&pool.m, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pool.workers = 0;
    atomic_store(&pool.sleepers, 0);
}

/* fn(ctx, id, nt) for id 0 .. nt - 1 (id 0 on this thread); returns when all have returned.
 * Fewer threads than asked when workers cannot be started (fn only ever sees the nt it runs with). */
void pool_run(pool_fn fn, void *ctx, int64_t nt)
{
    static int atfork_set;
    if (nt > POOL_MAX) nt = POOL_MAX;
    if (nt <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.run);
    if (!atfork_set) atfork_set = !pthread_atfork(NULL, NULL, pool_after_fork);
    while (pool.workers < nt - 1) {
        pool_start_t *start = malloc(sizeof *start);
        if (!start) break;
        start->id = pool.workers + 1, start->gen = atomic_load(&pool.gen);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, pool_worker, start);
        pthread_attr_destroy(&attr);
        if (rc) {
            free(start);
            break;
        }
        pool.workers++;
    }
    if (nt > pool.workers + 1) nt = pool.workers + 1;
    pool.fn = fn, pool.ctx = ctx, pool.nt = nt;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.bar_count, 0);
    atomic_fetch_add(&pool.gen, 1);
    if (atomic_load(&pool.sleepers)) {
        pthread_mutex_lock(&pool.m);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.m);
    }
    fn(ctx, 0, nt);
    spin_t w = {0, 0};
    while (atomic_load(&pool.done) < pool.workers)
        if (spin_over(&w, BARRIER_SPIN_NS)) sched_yield();
    pthread_mutex_unlock(&pool.run);
}
