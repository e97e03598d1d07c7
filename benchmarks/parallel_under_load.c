/* What a little foreign CPU costs two threads that meet at a barrier, and what a job pool wins back.

       gcc -O3 -march=native -fopenmp benchmarks/parallel_under_load.c -o /tmp/parallel_under_load
       /tmp/parallel_under_load [steps] [spin_us] [sleep_us]

   A "step" is 200 parallel regions of 64 chunks (each chunk ~3 µs of AVX-512 FMAs over 64 KiB), about
   the shape of a 16-row decode step of SmolLM2 on two cores (~200 regions, ~22 ms). Three ways to run
   a step on two threads:
   - static: `omp parallel for schedule(static)` per region, as the native kernels do: a thread that
     loses its core stops the other at the region's barrier;
   - pool: one omp region per step; thread 0 posts each region as a job, each thread takes chunks from
     its own half and then from the other's, and a job ends when its chunks are done, not when both
     threads have arrived: a thread that comes back late finds its chunks taken;
   - spmd: the same, but both threads walk the regions and either moves on once a job is done (no
     thread posts jobs: thread 0 losing its core does not hold thread 1 up).
   Each runs alone, then beside a process that spins `spin_us` and sleeps `sleep_us` in turn (100 /
   1100 by default: 4.2 % of two cores, at ~830 wake-ups a second, the HTTP work's pattern beside a
   served engine). With perfect packing the step would grow by that share; it prints each way's step
   time alone and loaded (medians of alternated rounds) and the growth. */
#include <omp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>

#define REGIONS 200
#define CHUNKS 64
#define CHUNK_FLOATS (16 * 1024)
#define SOURCES 8 /* regions read different buffers in turn: 32 MiB in all */
#define ROUNDS 5

static float *buf;
static float sink[CHUNKS];

static void chunk_work(int region, int c) {
    const float *p = buf + ((size_t)(region % SOURCES) * CHUNKS + c) * CHUNK_FLOATS;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m512 f = _mm512_set1_ps(1.0001f);
    for (int rep = 0; rep < 4; rep++)
        for (int i = 0; i < CHUNK_FLOATS; i += 64) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i), a0, f);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i + 16), a1, f);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i + 32), a2, f);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(p + i + 48), a3, f);
        }
    sink[c] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void step_static(void) {
    for (int r = 0; r < REGIONS; r++) {
#pragma omp parallel for schedule(static) num_threads(2)
        for (int c = 0; c < CHUNKS; c++) chunk_work(r, c);
    }
}

/* Chunks are claimed from cumulative counters, one per half, by compare-and-swap so a counter never
 * passes its job's end (the next job's chunks start there); `done` counts finished chunks over all
 * jobs. A thread knows each job's bounds from the job's index alone. */
static _Alignas(64) atomic_long claimed[2];
static _Alignas(64) atomic_long done;
static _Alignas(64) atomic_long posted; /* pool: jobs thread 0 has opened */

static int claim(atomic_long *counter, long end, long *got) {
    long v = atomic_load_explicit(counter, memory_order_relaxed);
    while (v < end)
        if (atomic_compare_exchange_weak_explicit(counter, &v, v + 1, memory_order_acq_rel, memory_order_relaxed)) {
            *got = v;
            return 1;
        }
    return 0;
}

static void run_job(int me, int r) { /* own half first, then the other's */
    const long half = CHUNKS / 2;
    for (int k = 0; k < 2; k++) {
        const int h = (me + k) & 1;
        const long start = (long)r * half; /* half h of job r: [start, start + half) on counter h */
        long got;
        while (claim(&claimed[h], start + half, &got)) {
            chunk_work(r, (int)(got - start + h * half));
            atomic_fetch_add_explicit(&done, 1, memory_order_release);
        }
    }
}

static void wait_done(int r) {
    while (atomic_load_explicit(&done, memory_order_acquire) < (long)(r + 1) * CHUNKS) _mm_pause();
}

static void reset(void) {
    atomic_store(&claimed[0], 0), atomic_store(&claimed[1], 0), atomic_store(&done, 0), atomic_store(&posted, 0);
}

static void step_pool(void) {
    reset();
#pragma omp parallel num_threads(2)
    {
        const int me = omp_get_thread_num();
        for (int r = 0; r < REGIONS; r++) {
            if (me == 0) atomic_store_explicit(&posted, r + 1, memory_order_release);
            else
                while (atomic_load_explicit(&posted, memory_order_acquire) <= r) _mm_pause();
            run_job(me, r);
            if (me == 0) wait_done(r);
        }
    }
}

static void step_spmd(void) {
    reset();
#pragma omp parallel num_threads(2)
    {
        const int me = omp_get_thread_num();
        for (int r = 0; r < REGIONS; r++) {
            run_job(me, r);
            wait_done(r);
        }
    }
}

static double time_steps(void (*step)(void), int steps) {
    const double t = now();
    for (int i = 0; i < steps; i++) step();
    return (now() - t) / steps * 1e3;
}

static pid_t start_load(double spin_us, int sleep_us) {
    const pid_t pid = fork();
    if (pid == 0)
        for (;;) {
            const double end = now() + spin_us * 1e-6;
            while (now() < end) {
            }
            usleep(sleep_us);
        }
    usleep(200000);
    return pid;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, n, sizeof *v, by_value);
    return v[n / 2];
}

int main(int argc, char **argv) {
    const int steps = argc > 1 ? atoi(argv[1]) : 60;
    const double spin_us = argc > 2 ? atof(argv[2]) : 100;
    const int sleep_us = argc > 3 ? atoi(argv[3]) : 1100;
    static void (*const ways[3])(void) = {step_static, step_pool, step_spmd};
    static const char *const names[3] = {"static", "pool", "spmd"};
    buf = aligned_alloc(64, sizeof(float) * SOURCES * CHUNKS * CHUNK_FLOATS);
    for (size_t i = 0; i < (size_t)SOURCES * CHUNKS * CHUNK_FLOATS; i++) buf[i] = 1.0f / (i % 7 + 1);
    for (int w = 0; w < 3; w++) time_steps(ways[w], 5); /* warm: threads, pages */
    double alone[3][ROUNDS], loaded[3][ROUNDS];
    for (int round = 0; round < ROUNDS; round++) {
        for (int w = 0; w < 3; w++) alone[w][round] = time_steps(ways[w], steps);
        const pid_t load = start_load(spin_us, sleep_us);
        for (int w = 0; w < 3; w++) loaded[w][round] = time_steps(ways[w], steps);
        kill(load, SIGKILL);
        waitpid(load, 0, 0);
    }
    const double share = spin_us / (spin_us + sleep_us) / 2;
    printf("load: %.0f us spinning, %d us asleep: %.1f %% of two cores\n", spin_us, sleep_us, 100 * share);
    printf("%-8s %12s %13s %8s\n", "way", "alone ms", "loaded ms", "growth");
    for (int w = 0; w < 3; w++) {
        const double a = median(alone[w], ROUNDS), l = median(loaded[w], ROUNDS);
        printf("%-8s %12.2f %13.2f %7.1f%%\n", names[w], a, l, 100 * (l / a - 1));
    }
    return sink[0] == 12345.0f; /* keep the work */
}
