/*
 * interposer_pairs.c: time cuMemAlloc_v2 + cuMemFree_v2 pairs against the
 * driver it is linked with (the fake libcuda in bench/interposer.py), with
 * or without the preload library in front of it.
 *
 * usage: interposer_pairs PAIRS THREADS LIVE SIZE [WINDOW]
 *   PAIRS    alloc+free pairs per thread (timed)
 *   THREADS  threads doing pairs at once
 *   LIVE     allocations kept live during the run (the free path's table)
 *   SIZE     bytes per allocation
 *   WINDOW   each thread frees the allocation it made WINDOW pairs earlier
 *            (default 1: free what was just allocated); a larger window
 *            churns many different addresses through the free path
 * Prints one JSON object: nanoseconds per pair as each thread saw it (mean
 * and worst thread), and wall time over all pairs of all threads (aggregate).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, int);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);

static long pairs;
static long window = 1;
static size_t size;
static CUcontext ctx;
static pthread_barrier_t barrier;

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static void die(const char *what, CUresult rc)
{
    fprintf(stderr, "%s failed: %d\n", what, rc);
    exit(1);
}

static void *worker(void *arg)
{
    double *result = arg;
    CUresult rc = cuCtxSetCurrent(ctx);
    if (rc)
        die("cuCtxSetCurrent", rc);
    CUdeviceptr *ring = calloc((size_t)window, sizeof(*ring));
    for (long i = 0; i < window; i++)
        if ((rc = cuMemAlloc_v2(&ring[i], size)))
            die("fill", rc);
    for (long i = 0; i < 1000; i++) { /* warm up: first-use paths, caches */
        long k = i % window;
        if ((rc = cuMemFree_v2(ring[k])) || (rc = cuMemAlloc_v2(&ring[k], size)))
            die("warm-up", rc);
    }
    pthread_barrier_wait(&barrier);
    double start = now_ns();
    for (long i = 0; i < pairs; i++) {
        long k = window == 1 ? 0 : i % window;
        if ((rc = cuMemFree_v2(ring[k])))
            die("cuMemFree_v2", rc);
        if ((rc = cuMemAlloc_v2(&ring[k], size)))
            die("cuMemAlloc_v2", rc);
    }
    *result = (now_ns() - start) / (double)pairs;
    for (long i = 0; i < window; i++)
        cuMemFree_v2(ring[i]);
    free(ring);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 5 && argc != 6) {
        fprintf(stderr, "usage: %s PAIRS THREADS LIVE SIZE [WINDOW]\n", argv[0]);
        return 2;
    }
    if (argc == 6)
        window = atol(argv[5]);
    pairs = atol(argv[1]);
    int threads = atoi(argv[2]);
    long live = atol(argv[3]);
    size = (size_t)atoll(argv[4]);
    if (pairs < 1 || threads < 1 || threads > 256 || live < 0 || size < 1 || window < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    CUresult rc;
    if ((rc = cuInit(0)) || (rc = cuDevicePrimaryCtxRetain(&ctx, 0)) || (rc = cuCtxSetCurrent(ctx)))
        die("setup", rc);
    CUdeviceptr *held = calloc((size_t)live + 1, sizeof(*held));
    for (long i = 0; i < live; i++)
        if ((rc = cuMemAlloc_v2(&held[i], size)))
            die("live allocation", rc);
    pthread_t tids[256];
    double results[256];
    pthread_barrier_init(&barrier, NULL, (unsigned)threads + 1);
    for (int t = 0; t < threads; t++)
        pthread_create(&tids[t], NULL, worker, &results[t]);
    pthread_barrier_wait(&barrier);
    double start = now_ns();
    double sum = 0, worst = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tids[t], NULL);
        sum += results[t];
        worst = results[t] > worst ? results[t] : worst;
    }
    double aggregate = (now_ns() - start) / ((double)pairs * threads);
    for (long i = 0; i < live; i++)
        cuMemFree_v2(held[i]);
    free(held);
    printf("{\"pairs\": %ld, \"threads\": %d, \"live\": %ld, \"window\": %ld, \"size\": %zu, \"ns_per_pair\": %.2f, "
           "\"worst_thread_ns_per_pair\": %.2f, \"aggregate_ns_per_pair\": %.2f}\n",
           pairs, threads, live, window, size, sum / threads, worst, aggregate);
    return 0;
}
