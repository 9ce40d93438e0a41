/*
 * resolve.c: finding the driver's real functions, and handing out our hooks
 * where a program asks the driver itself for them: cuGetProcAddress (CUDA
 * 11.3+ runtimes and PyTorch resolve every driver call through it). The
 * dynamic loader's lookups (dlsym, dlvsym, dlopen, dlmopen) are dlhooks.c.
 *
 * Must not: account memory, or take a lock (the dynamic loader may call in
 * while holding its own).
 */
#define _GNU_SOURCE
#include "preload.h"

#include <dlfcn.h>
#include <string.h>

const struct gn_hook_info gn_hooks[GN_ID_COUNT] = {
#define GN_HOOK(name, library, base, since, stream)                                                                \
    [GN_ID_##name] = {#name, #base, (void *)&name, GN_LIB_##library, since, GN_STREAM_##stream},
#define GN_CALL(name, library, base, since, stream)                                                                \
    [GN_ID_##name] = {#name, #base, NULL, GN_LIB_##library, since, GN_STREAM_##stream},
#include "hooks.def"
#undef GN_HOOK
#undef GN_CALL
};

_Atomic(void *) gn_real[GN_ID_COUNT];

int gn_is_hook_address(const void *p)
{
    for (int id = 0; id < GN_ID_COUNT; id++)
        if (gn_hooks[id].hook && gn_hooks[id].hook == p)
            return 1;
    return gn_is_dl_hook(p);
}

int gn_find_hook(const char *name)
{
    if (!name || (name[0] != 'c' && name[0] != 'n'))
        return -1;
    for (int id = 0; id < GN_ID_COUNT; id++)
        if (gn_hooks[id].hook && strcmp(gn_hooks[id].name, name) == 0)
            return id;
    return -1;
}

static void *gn_lookup_driver(int library, const char *name)
{
    const char *soname = library == GN_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1";
    void *p = NULL;
    void *handle = gn_real_dlopen(soname, RTLD_LAZY | RTLD_NOLOAD);
    if (handle) {
        p = gn_real_dlsym(handle, name);
        dlclose(handle);
    }
    if (!p)
        p = gn_real_dlsym(RTLD_NEXT, name);
    return p && !gn_is_hook_address(p) ? p : NULL;
}

void *gn_resolve_real(int id)
{
    void *p = gn_lookup_driver(gn_hooks[id].library, gn_hooks[id].name);
    if (!p)
        return NULL;
    void *expected = NULL;
    if (!atomic_compare_exchange_strong(&gn_real[id], &expected, p))
        return expected;
    return p;
}

/* The hook standing in for what the driver returned for `symbol`. The
 * driver's pointer identifies the variant when it is the exported one;
 * otherwise the variant follows the driver's rules: the highest `since` not
 * above cudaVersion, with the per-thread-stream variant when asked for. */
static int gn_proc_candidate(const struct gn_hook_info *h, const char *symbol)
{
    return h->hook && h->library == GN_LIB_CUDA && (strcmp(h->base, symbol) == 0 || strcmp(h->name, symbol) == 0);
}

static void *gn_substitute(const char *symbol, void *found, int cuda_version, cuuint64_t flags)
{
    if (!symbol || !found || gn_is_hook_address(found))
        return found;
    for (int id = 0; id < GN_ID_COUNT; id++)
        if (gn_proc_candidate(&gn_hooks[id], symbol) && gn_real_fn(id) == found)
            return gn_hooks[id].hook;
    int want_ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    int best = -1;
    for (int id = 0; id < GN_ID_COUNT; id++) {
        const struct gn_hook_info *h = &gn_hooks[id];
        if (!gn_proc_candidate(h, symbol))
            continue;
        if (strcmp(h->name, h->base) != 0 && strcmp(h->name, symbol) == 0) {
            best = id; /* asked for a variant by its own name */
            break;
        }
        if (h->since > cuda_version)
            continue;
        if ((h->stream == GN_STREAM_PTSZ && !want_ptsz) || (h->stream == GN_STREAM_LEGACY && want_ptsz))
            continue;
        if (best < 0 || gn_hooks[best].since < h->since)
            best = id;
    }
    if (best < 0)
        return found;
    void *expected = NULL;
    atomic_compare_exchange_strong(&gn_real[best], &expected, found);
    GN_LOG(GN_LOG_DEBUG, "cuGetProcAddress(%s, %d, %llu) -> %s", symbol, cuda_version, (unsigned long long)flags,
           gn_hooks[best].name);
    return gn_hooks[best].hook;
}

GN_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags)
{
    __typeof__(&cuGetProcAddress) real = GN_REAL(cuGetProcAddress);
    if (!real)
        return gn_missing(GN_ID_cuGetProcAddress);
    CUresult r = real(symbol, pfn, cuda_version, flags);
    if (r == CUDA_SUCCESS && pfn)
        *pfn = gn_substitute(symbol, *pfn, cuda_version, flags);
    return r;
}

GN_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *status)
{
    __typeof__(&cuGetProcAddress_v2) real = GN_REAL(cuGetProcAddress_v2);
    if (!real)
        return gn_missing(GN_ID_cuGetProcAddress_v2);
    CUresult r = real(symbol, pfn, cuda_version, flags, status);
    if (r == CUDA_SUCCESS && pfn && (!status || *status == CU_GET_PROC_ADDRESS_SUCCESS))
        *pfn = gn_substitute(symbol, *pfn, cuda_version, flags);
    return r;
}
