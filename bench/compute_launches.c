/*
 * compute_launches.c: time cuLaunchKernel calls against the driver it is
 * linked with (the fake libcuda in bench/compute_share.py), with or without
 * the preload library in front of it. The kernels take no device time, so
 * what is timed is the launch call itself.
 *
 * usage: compute_launches LAUNCHES PER_SYNC
 * Prints one JSON object: ns per launch (mean, p50, p99) and launches per second.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, int);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s LAUNCHES PER_SYNC\n", argv[0]);
        return 2;
    }
    long launches = strtol(argv[1], NULL, 10), per_sync = strtol(argv[2], NULL, 10);
    CUcontext ctx;
    if (cuInit(0) || cuDevicePrimaryCtxRetain(&ctx, 0) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "no context\n");
        return 1;
    }
    uint64_t zero = 0;
    void *params[] = {&zero};
    uint64_t *lat = malloc(sizeof(uint64_t) * (size_t)launches);
    if (!lat)
        return 1;
    uint64_t begin = now_ns();
    for (long i = 0; i < launches; i++) {
        uint64_t t0 = now_ns();
        if (cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL))
            return 1;
        lat[i] = now_ns() - t0;
        if ((i + 1) % per_sync == 0)
            cuCtxSynchronize();
    }
    uint64_t total = now_ns() - begin;
    qsort(lat, (size_t)launches, sizeof(uint64_t), cmp);
    double sum = 0;
    for (long i = 0; i < launches; i++)
        sum += (double)lat[i];
    printf("{\"ns_mean\": %.1f, \"ns_p50\": %llu, \"ns_p99\": %llu, \"launches_per_s\": %.0f}\n", sum / launches,
           (unsigned long long)lat[launches / 2], (unsigned long long)lat[launches * 99 / 100],
           launches / (total / 1e9));
    free(lat);
    return 0;
}
