/*
 * resolve.c: finding the driver's real functions, and handing out our hooks
 * wherever a program looks the driver up at run time: dlsym (a program or
 * runtime that dlopens libcuda) and cuGetProcAddress (CUDA 11.3+ runtimes
 * and PyTorch resolve every driver call through it).
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

static _Atomic(gn_dlsym_fn) gn_dlsym_real;

/* Not instrumented by sanitizers: their runtimes call dlsym(RTLD_NEXT, ...)
 * while they start, before instrumented code may run. */
__attribute__((no_sanitize("address", "undefined"))) gn_dlsym_fn gn_real_dlsym(void)
{
    gn_dlsym_fn f = atomic_load_explicit(&gn_dlsym_real, memory_order_acquire);
    if (GN_LIKELY(f))
        return f;
    /* glibc 2.34+ exports dlsym from libc at GLIBC_2.34; older and other
     * architectures' base versions follow. dlvsym is not hooked. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof(versions) / sizeof(versions[0]) && !f; i++)
        f = (gn_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (f)
        atomic_store_explicit(&gn_dlsym_real, f, memory_order_release);
    return f;
}

int gn_is_hook_address(const void *p)
{
    for (int id = 0; id < GN_ID_COUNT; id++)
        if (gn_hooks[id].hook && gn_hooks[id].hook == p)
            return 1;
    return p == (const void *)&dlsym;
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
    gn_dlsym_fn real_dlsym = gn_real_dlsym();
    if (!real_dlsym)
        return NULL;
    const char *soname = library == GN_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1";
    void *p = NULL;
    void *handle = dlopen(soname, RTLD_LAZY | RTLD_NOLOAD);
    if (handle) {
        p = real_dlsym(handle, name);
        dlclose(handle);
    }
    if (!p)
        p = real_dlsym(RTLD_NEXT, name);
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

/* dlsym(handle, name) for a handle from dlopen: the driver's own functions
 * are swapped for our hooks (the runtime dlopens libcuda and looks it up). */
__attribute__((used)) void *gn_dlsym_handle(void *handle, const char *name);
__attribute__((used)) void *gn_dlsym_handle(void *handle, const char *name)
{
    gn_dlsym_fn real_dlsym = gn_real_dlsym();
    if (GN_UNLIKELY(!real_dlsym))
        return NULL;
    void *p = real_dlsym(handle, name);
    if (!p || gn_is_hook_address(p))
        return p;
    int id = gn_find_hook(name);
    if (id < 0)
        return p;
    if (!gn_real_fn(id)) {
        void *expected = NULL;
        atomic_compare_exchange_strong(&gn_real[id], &expected, p);
    }
    return gn_hooks[id].hook;
}

/*
 * dlsym itself. RTLD_NEXT and RTLD_DEFAULT lookups depend on the caller (the
 * real dlsym reads its own return address), so they jump straight into the
 * real dlsym with the caller's return address intact: glibc's answer is
 * exact, and it already finds our hooks first for hooked names. Lookups in
 * an explicit handle go through gn_dlsym_handle.
 */
#if defined(__x86_64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        "dlsym:\n"
        "    endbr64\n"
        "    cmpq $-1, %rdi\n" /* RTLD_NEXT */
        "    je 1f\n"
        "    testq %rdi, %rdi\n" /* RTLD_DEFAULT */
        "    je 1f\n"
        "    jmp gn_dlsym_handle\n"
        "1:  pushq %rdi\n"
        "    pushq %rsi\n"
        "    subq $8, %rsp\n"
        "    call gn_real_dlsym\n"
        "    addq $8, %rsp\n"
        "    popq %rsi\n"
        "    popq %rdi\n"
        "    testq %rax, %rax\n"
        "    je 2f\n"
        "    jmp *%rax\n"
        "2:  ret\n"
        ".size dlsym, .-dlsym\n");
#elif defined(__aarch64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, %function\n"
        ".p2align 2\n"
        "dlsym:\n"
        "    cmn x0, #1\n" /* RTLD_NEXT */
        "    b.eq 1f\n"
        "    cbz x0, 1f\n" /* RTLD_DEFAULT */
        "    b gn_dlsym_handle\n"
        "1:  stp x29, x30, [sp, #-32]!\n"
        "    mov x29, sp\n"
        "    stp x0, x1, [sp, #16]\n"
        "    bl gn_real_dlsym\n"
        "    mov x16, x0\n"
        "    ldp x0, x1, [sp, #16]\n"
        "    ldp x29, x30, [sp], #32\n"
        "    cbz x16, 2f\n"
        "    br x16\n"
        "2:  mov x0, #0\n"
        "    ret\n"
        ".size dlsym, .-dlsym\n");
#else
#error "dlsym interposition needs a tail call into the real dlsym; add this architecture"
#endif

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
