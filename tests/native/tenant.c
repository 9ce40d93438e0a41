/*
 * tenant.c: a program that looks the driver up the ways a tenant could use
 * to get past the interposer's hooks. Each mode takes the cap in bytes,
 * allocates one byte over it (which must be refused with
 * CUDA_ERROR_OUT_OF_MEMORY) and then exactly the cap (which must succeed),
 * and prints "ok MODE" or "FAIL ...".
 *
 *   dlvsym-dlsym LIMIT            glibc's dlsym from dlvsym(RTLD_NEXT, "dlsym",
 *                                 "GLIBC_2.34"), then used on the libcuda handle
 *   dlvsym LIMIT VERSION          dlvsym(libcuda, "cuMemAlloc_v2", VERSION)
 *   deepbind LIMIT LIB now|lazy   LIB dlopened with RTLD_DEEPBIND (PLT call,
 *                                 address taken in code, pointer in data)
 *   dlmopen LIB                   dlmopen(LM_ID_NEWLM) of the driver and of LIB
 *                                 must be refused; of libm must work
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef void *(*dlsym_fn)(void *, const char *);

#define OOM 2
#define FAIL(...)                                                                                                  \
    do {                                                                                                           \
        printf("FAIL ");                                                                                           \
        printf(__VA_ARGS__);                                                                                       \
        printf("\n");                                                                                              \
        exit(1);                                                                                                   \
    } while (0)

static const char *where(void *p)
{
    Dl_info info;
    return p && dladdr(p, &info) && info.dli_fname ? info.dli_fname : "?";
}

static void start(dlsym_fn lookup, void *h)
{
    CUresult (*init)(unsigned int) = (CUresult(*)(unsigned int))lookup(h, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))lookup(h, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))lookup(h, "cuCtxSetCurrent");
    CUcontext ctx;
    if (!init || !retain || !set || init(0) || retain(&ctx, 0) || set(ctx))
        FAIL("cannot start a context");
}

static void over_and_at(alloc_fn alloc, free_fn release, unsigned long long limit, const char *how)
{
    CUdeviceptr p = 0;
    CUresult r = alloc(&p, limit + 1);
    if (r != OOM)
        FAIL("%s: one byte over the cap returned %d (allocation from %s), expected %d", how, r, where((void *)alloc),
             OOM);
    r = alloc(&p, limit);
    if (r != 0)
        FAIL("%s: exactly the cap returned %d", how, r);
    if (release && release(p) != 0)
        FAIL("%s: free failed", how);
}

static void *driver(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        FAIL("dlopen libcuda.so.1: %s", dlerror());
    return h;
}

static int mode_dlvsym_dlsym(unsigned long long limit)
{
    dlsym_fn real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real)
        real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (!real)
        FAIL("no dlsym through dlvsym");
    void *h = driver();
    start(real, h);
    over_and_at((alloc_fn)real(h, "cuMemAlloc_v2"), (free_fn)real(h, "cuMemFree_v2"), limit, "dlvsym'd dlsym");
    printf("ok dlvsym-dlsym (dlsym from %s)\n", where((void *)real));
    return 0;
}

static int mode_dlvsym(unsigned long long limit, const char *version)
{
    void *h = driver();
    start(dlsym, h);
    alloc_fn alloc = (alloc_fn)dlvsym(h, "cuMemAlloc_v2", version);
    if (!alloc)
        FAIL("dlvsym(libcuda, cuMemAlloc_v2, %s) found nothing: %s", version, dlerror());
    over_and_at(alloc, (free_fn)dlvsym(h, "cuMemFree_v2", version), limit, "dlvsym");
    printf("ok dlvsym\n");
    return 0;
}

static int mode_deepbind(unsigned long long limit, const char *lib, const char *bind)
{
    int flags = (strcmp(bind, "lazy") == 0 ? RTLD_LAZY : RTLD_NOW) | RTLD_DEEPBIND | RTLD_LOCAL;
    void *h = dlopen(lib, flags);
    if (!h)
        FAIL("dlopen %s: %s", lib, dlerror());
    int (*setup)(void) = (int (*)(void))dlsym(h, "deep_setup");
    int (*alloc)(unsigned long long, CUdeviceptr *) = (int (*)(unsigned long long, CUdeviceptr *))dlsym(h, "deep_alloc");
    int (*release)(CUdeviceptr) = (int (*)(CUdeviceptr))dlsym(h, "deep_free");
    alloc_fn (*address)(void) = (alloc_fn(*)(void))dlsym(h, "deep_alloc_address");
    alloc_fn (*table)(void) = (alloc_fn(*)(void))dlsym(h, "deep_alloc_table");
    if (!setup || !alloc || !release || !address || !table)
        FAIL("%s lacks its functions", lib);
    if (setup() != 0)
        FAIL("deep_setup failed");
    CUdeviceptr p = 0;
    int r = alloc(limit + 1, &p);
    if (r != OOM)
        FAIL("PLT call: one byte over the cap returned %d, expected %d", r, OOM);
    if ((r = alloc(limit, &p)) != 0 || release(p) != 0)
        FAIL("PLT call: exactly the cap returned %d", r);
    over_and_at(address(), (free_fn)release, limit, "address taken in code");
    over_and_at(table(), (free_fn)release, limit, "pointer in data");
    printf("ok deepbind %s\n", bind);
    return 0;
}

static int mode_dlmopen(const char *lib)
{
    const char *names[] = {"libcuda.so.1", lib};
    for (int i = 0; i < 2; i++) {
        void *h = dlmopen(LM_ID_NEWLM, names[i], RTLD_NOW);
        if (h)
            FAIL("dlmopen(LM_ID_NEWLM, %s) was allowed", names[i]);
        const char *err = dlerror();
        if (!err || !strstr(err, "gpunode-memcap"))
            FAIL("dlmopen(LM_ID_NEWLM, %s) failed without saying why: %s", names[i], err ? err : "(none)");
    }
    if (!dlmopen(LM_ID_NEWLM, "libm.so.6", RTLD_NOW))
        FAIL("dlmopen(LM_ID_NEWLM, libm.so.6) failed: %s", dlerror());
    printf("ok dlmopen\n");
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 3 && strcmp(argv[1], "dlvsym-dlsym") == 0)
        return mode_dlvsym_dlsym(strtoull(argv[2], NULL, 0));
    if (argc == 4 && strcmp(argv[1], "dlvsym") == 0)
        return mode_dlvsym(strtoull(argv[2], NULL, 0), argv[3]);
    if (argc == 5 && strcmp(argv[1], "deepbind") == 0)
        return mode_deepbind(strtoull(argv[2], NULL, 0), argv[3], argv[4]);
    if (argc == 3 && strcmp(argv[1], "dlmopen") == 0)
        return mode_dlmopen(argv[2]);
    fprintf(stderr, "usage: tenant dlvsym-dlsym LIMIT | dlvsym LIMIT VERSION | deepbind LIMIT LIB now|lazy | "
                    "dlmopen LIB\n");
    return 2;
}
