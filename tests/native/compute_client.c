/*
 * compute_client.c: a GPU program for the compute-share tests. It keeps the
 * (fake) device busy with kernels of a set duration for a set time:
 *
 *   compute_client LOOKUP KIND KERNEL_US PER_SYNC SECONDS
 *
 *   LOOKUP    dlsym | procaddr | procaddr-ptds: how the launch entry point
 *             is found (dlopen + dlsym, or cuGetProcAddress_v2, asking for
 *             the per-thread-default-stream variant)
 *   KIND      kernel | kernel-ex | cooperative | graph: which launch call
 *   KERNEL_US the device time of each kernel (the fake reads it from the
 *             first kernel parameter, or from the graph handle)
 *   PER_SYNC  kernels submitted between two synchronisations
 *   SECONDS   how long to keep going (wall time); 0: until killed
 *
 * It prints "ready" once its context is up, and "ok launches=N" at the end.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*coop_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            CUstream, void **);
typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*graph_fn)(CUgraphExec, CUstream);
typedef CUresult (*getproc_fn)(const char *, void **, int, unsigned long long, int *);

static void *driver;
static getproc_fn getproc;
static int ptds;

static void *find(const char *name)
{
    void *p = NULL;
    if (getproc) {
        int status = -1;
        if (getproc(name, &p, 12000, ptds ? 2 : 0, &status) != 0 || status != 0)
            p = NULL;
    } else {
        p = dlsym(driver, name);
    }
    if (!p) {
        printf("FAIL cannot find %s\n", name);
        exit(1);
    }
    return p;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: %s dlsym|procaddr|procaddr-ptds kernel|kernel-ex|cooperative|graph KERNEL_US"
                        " PER_SYNC SECONDS\n", argv[0]);
        return 2;
    }
    const char *lookup = argv[1], *kind = argv[2];
    uint64_t kernel_ns = strtoull(argv[3], NULL, 10) * 1000;
    long per_sync = strtol(argv[4], NULL, 10);
    double seconds = strtod(argv[5], NULL);
    driver = dlopen("libcuda.so.1", RTLD_NOW);
    if (!driver) {
        printf("FAIL dlopen: %s\n", dlerror());
        return 1;
    }
    if (strncmp(lookup, "procaddr", 8) == 0) {
        getproc = (getproc_fn)dlsym(driver, "cuGetProcAddress_v2");
        ptds = strcmp(lookup, "procaddr-ptds") == 0;
    }
    CUresult (*init)(unsigned) = find("cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = find("cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = find("cuCtxSetCurrent");
    CUresult (*sync)(void) = find("cuCtxSynchronize");
    CUcontext ctx;
    if (init(0) || retain(&ctx, 0) || set(ctx)) {
        printf("FAIL context\n");
        return 1;
    }
    void *fn = find(strcmp(kind, "kernel") == 0        ? "cuLaunchKernel"
                    : strcmp(kind, "kernel-ex") == 0   ? "cuLaunchKernelEx"
                    : strcmp(kind, "cooperative") == 0 ? "cuLaunchCooperativeKernel"
                                                       : "cuGraphLaunch");
    void *params[] = {&kernel_ns};
    CUlaunchConfig config = {1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0};
    printf("ready\n");
    fflush(stdout);
    unsigned long long launches = 0;
    double end = now_s() + seconds;
    while (seconds <= 0 || now_s() < end) {
        for (long i = 0; i < per_sync; i++) {
            CUresult r;
            if (strcmp(kind, "kernel") == 0)
                r = ((launch_fn)fn)(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
            else if (strcmp(kind, "kernel-ex") == 0)
                r = ((launch_ex_fn)fn)(&config, NULL, params, NULL);
            else if (strcmp(kind, "cooperative") == 0)
                r = ((coop_fn)fn)(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, params);
            else
                r = ((graph_fn)fn)((CUgraphExec)(void *)&kernel_ns, NULL);
            if (r != 0) {
                printf("FAIL launch returned %d\n", r);
                return 1;
            }
            launches++;
        }
        if (sync()) {
            printf("FAIL synchronize\n");
            return 1;
        }
    }
    printf("ok launches=%llu\n", launches);
    return 0;
}
