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
 * COMPUTE_CLIENT_THREADS=N (default 1): N threads do the launching at once.
 * COMPUTE_CLIENT_UNMAP_AFTER_MS=N: an attack. N ms after "ready", the process
 * takes its usage file away from the interposer: every shared writable mapping
 * of a file named "usage" is replaced in place by private zeroed memory, so
 * the interposer goes on with a region nobody else sees.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
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

struct worker {
    void *fn;
    const char *kind;
    uint64_t kernel_ns;
    long per_sync;
    double seconds;
    CUresult (*sync)(void);
    CUresult (*set)(CUcontext);
    CUcontext ctx;
    unsigned long long launches;
    int failed;
};

static void *work(void *arg)
{
    struct worker *w = arg;
    const char *kind = w->kind;
    void *fn = w->fn;
    uint64_t kernel_ns = w->kernel_ns;
    void *params[] = {&kernel_ns};
    CUlaunchConfig config = {1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0};
    if (w->set(w->ctx)) {
        printf("FAIL context in a thread\n");
        w->failed = 1;
        return NULL;
    }
    double end = now_s() + w->seconds;
    while (w->seconds <= 0 || now_s() < end) {
        for (long i = 0; i < w->per_sync; i++) {
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
                w->failed = 1;
                return NULL;
            }
            w->launches++;
        }
        if (w->sync()) {
            printf("FAIL synchronize\n");
            w->failed = 1;
            return NULL;
        }
    }
    return NULL;
}

static void *unmap_region(void *arg)
{
    usleep((useconds_t)(long)arg * 1000);
    FILE *maps = fopen("/proc/self/maps", "r");
    if (!maps)
        return NULL;
    char line[4096];
    int swapped = 0;
    while (fgets(line, sizeof line, maps)) {
        unsigned long lo, hi;
        char perms[8];
        const char *name = strrchr(line, '/');
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3 || !name || strcmp(name, "/usage\n") != 0 ||
            perms[3] != 's' || perms[1] != 'w')
            continue;
        if (mmap((void *)lo, hi - lo, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) !=
            MAP_FAILED)
            swapped++;
    }
    fclose(maps);
    fprintf(stderr, "unmapped %d usage mapping(s)\n", swapped);
    return NULL;
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
    struct worker w = {fn, kind, kernel_ns, per_sync, seconds, sync, set, ctx, 0, 0};
    const char *t = getenv("COMPUTE_CLIENT_THREADS");
    int threads = t && atoi(t) > 0 ? atoi(t) : 1;
    if (threads > 64)
        threads = 64;
    struct worker workers[64];
    pthread_t ids[64];
    printf("ready\n");
    fflush(stdout);
    const char *unmap_after = getenv("COMPUTE_CLIENT_UNMAP_AFTER_MS");
    if (unmap_after) {
        pthread_t attacker;
        pthread_create(&attacker, NULL, unmap_region, (void *)strtol(unmap_after, NULL, 10));
        pthread_detach(attacker);
    }
    for (int i = 0; i < threads; i++) {
        workers[i] = w;
        pthread_create(&ids[i], NULL, work, &workers[i]);
    }
    unsigned long long launches = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(ids[i], NULL);
        if (workers[i].failed)
            return 1;
        launches += workers[i].launches;
    }
    printf("ok launches=%llu\n", launches);
    return 0;
}
