/*
 * deep_lib.c: a library linked against libcuda.so.1 that reaches
 * cuMemAlloc_v2 through each kind of relocation (a PLT call, an address
 * taken in code, a function pointer in read-only data). The lookup tests
 * dlopen it with RTLD_DEEPBIND, which binds those references to the driver
 * ahead of the interposer unless the interposer redirects them.
 */
#include <stddef.h>

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);

CUresult cuInit(unsigned int flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);

static alloc_fn const table_alloc = cuMemAlloc_v2;

API int deep_setup(void)
{
    CUcontext ctx;
    CUresult r = cuInit(0);
    if (r == 0)
        r = cuDevicePrimaryCtxRetain(&ctx, 0);
    if (r == 0)
        r = cuCtxSetCurrent(ctx);
    return r;
}

API int deep_alloc(unsigned long long bytes, CUdeviceptr *p)
{
    return cuMemAlloc_v2(p, bytes);
}

API alloc_fn deep_alloc_address(void)
{
    return &cuMemAlloc_v2;
}

API alloc_fn deep_alloc_table(void)
{
    return table_alloc;
}

API int deep_free(CUdeviceptr p)
{
    return cuMemFree_v2(p);
}
