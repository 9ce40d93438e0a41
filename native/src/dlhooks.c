/*
 * dlhooks.c: the dynamic loader's lookup entry points, so that no ordinary
 * way of finding the driver skips the hooks: dlsym, dlvsym, dlopen, dlmopen.
 *
 * Each entry point is a few instructions of assembly around a C router. The
 * router either answers (our hook for a hooked name, the result of a load it
 * performed) or names the glibc function to continue in; the entry point
 * then jumps there with the caller's arguments and return address intact,
 * so every caller-relative rule (RTLD_NEXT, the caller's namespace, RPATH,
 * RUNPATH and $ORIGIN) stays exactly glibc's.
 *
 * glibc's own functions are found in libc.so.6 (libdl.so.2 before glibc
 * 2.34) by reading its dynamic symbol table, never by a symbol lookup: our
 * unversioned definitions would satisfy any lookup of dlsym@GLIBC_x,
 * including our own.
 *
 * Must not: call anything a sanitizer instruments before the router knows
 * the answer (sanitizer runtimes call dlsym while they start), or take a lock.
 */
#define _GNU_SOURCE
#include "preload.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <string.h>

#define GN_NO_SAN __attribute__((no_sanitize("address", "undefined")))

enum { GN_DL_DLSYM, GN_DL_DLVSYM, GN_DL_DLOPEN, GN_DL_DLMOPEN, GN_DL_COUNT };
static const char *const gn_dl_names[GN_DL_COUNT] = {"dlsym", "dlvsym", "dlopen", "dlmopen"};
static _Atomic(void *) gn_dl_real[GN_DL_COUNT];

GN_NO_SAN static int gn_streq(const char *a, const char *b)
{
    while (*a && *a == *b)
        a++, b++;
    return *a == *b;
}

/* A pointer from a dynamic entry: glibc relocates most of them in place;
 * an unrelocated one is smaller than the load address. */
GN_NO_SAN uintptr_t gn_dyn_ptr(const struct link_map *lm, ElfW(Addr) p)
{
    return p < lm->l_addr ? lm->l_addr + p : p;
}

/* The address of `name` as defined by the object lm, from its hash table. */
GN_NO_SAN void *gn_elf_lookup(const struct link_map *lm, const char *name)
{
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const uint32_t *gnu = NULL;
    const ElfW(Word) *sysv = NULL;
    for (const ElfW(Dyn) *d = lm->l_ld; d && d->d_tag != DT_NULL; d++) {
        if (d->d_tag == DT_SYMTAB)
            symtab = (const ElfW(Sym) *)gn_dyn_ptr(lm, d->d_un.d_ptr);
        else if (d->d_tag == DT_STRTAB)
            strtab = (const char *)gn_dyn_ptr(lm, d->d_un.d_ptr);
        else if (d->d_tag == DT_GNU_HASH)
            gnu = (const uint32_t *)gn_dyn_ptr(lm, d->d_un.d_ptr);
        else if (d->d_tag == DT_HASH)
            sysv = (const ElfW(Word) *)gn_dyn_ptr(lm, d->d_un.d_ptr);
    }
    if (!symtab || !strtab)
        return NULL;
    if (gnu) {
        uint32_t h = 5381;
        for (const unsigned char *c = (const unsigned char *)name; *c; c++)
            h = h * 33 + *c;
        uint32_t nbuckets = gnu[0], symoffset = gnu[1], bloom_words = gnu[2];
        const uint32_t *buckets = gnu + 4 + bloom_words * (sizeof(ElfW(Addr)) / 4);
        const uint32_t *chain = buckets + nbuckets;
        for (uint32_t i = nbuckets ? buckets[h % nbuckets] : 0; i >= symoffset && i; i++) {
            uint32_t h2 = chain[i - symoffset];
            const ElfW(Sym) *s = &symtab[i];
            if ((h | 1) == (h2 | 1) && s->st_shndx != SHN_UNDEF && s->st_value &&
                gn_streq(strtab + s->st_name, name))
                return (void *)(lm->l_addr + s->st_value);
            if (h2 & 1)
                break;
        }
        return NULL;
    }
    if (sysv) {
        uint32_t h = 0;
        for (const unsigned char *c = (const unsigned char *)name; *c; c++) {
            h = (h << 4) + *c;
            uint32_t g = h & 0xf0000000u;
            h ^= g >> 24;
            h &= ~g;
        }
        ElfW(Word) nbucket = sysv[0];
        const ElfW(Word) *bucket = sysv + 2, *chain = bucket + nbucket;
        for (ElfW(Word) i = nbucket ? bucket[h % nbucket] : 0; i != STN_UNDEF; i = chain[i]) {
            const ElfW(Sym) *s = &symtab[i];
            if (s->st_shndx != SHN_UNDEF && s->st_value && gn_streq(strtab + s->st_name, name))
                return (void *)(lm->l_addr + s->st_value);
        }
    }
    return NULL;
}

GN_NO_SAN static int gn_is_lib(const char *path, const char *prefix)
{
    const char *base = path;
    for (const char *c = path; *c; c++)
        if (*c == '/')
            base = c + 1;
    while (*prefix && *base == *prefix)
        base++, prefix++;
    return *prefix == '\0';
}

/* glibc's function `which`, from libc.so.6 (or libdl.so.2 before 2.34). */
GN_NO_SAN void *gn_dl_real_fn(int which)
{
    void *p = atomic_load_explicit(&gn_dl_real[which], memory_order_acquire);
    if (GN_LIKELY(p))
        return p;
    static const char *const libs[] = {"libc.so.", "libdl.so."};
    for (size_t l = 0; l < sizeof(libs) / sizeof(libs[0]) && !p; l++)
        for (const struct link_map *lm = _r_debug.r_map; lm && !p; lm = lm->l_next)
            if (lm->l_name && gn_is_lib(lm->l_name, libs[l]))
                p = gn_elf_lookup(lm, gn_dl_names[which]);
    if (p)
        atomic_store_explicit(&gn_dl_real[which], p, memory_order_release);
    return p;
}

void *gn_real_dlsym(void *handle, const char *name)
{
    void *(*f)(void *, const char *) = (void *(*)(void *, const char *))gn_dl_real_fn(GN_DL_DLSYM);
    return f ? f(handle, name) : NULL;
}

void *gn_real_dlopen(const char *file, int flags)
{
    void *(*f)(const char *, int) = (void *(*)(const char *, int))gn_dl_real_fn(GN_DL_DLOPEN);
    return f ? f(file, flags) : NULL;
}

void *gn_real_dlmopen(Lmid_t lmid, const char *file, int flags)
{
    void *(*f)(Lmid_t, const char *, int) = (void *(*)(Lmid_t, const char *, int))gn_dl_real_fn(GN_DL_DLMOPEN);
    return f ? f(lmid, file, flags) : NULL;
}

static void *gn_real_dlvsym(void *handle, const char *name, const char *version)
{
    void *(*f)(void *, const char *, const char *) =
        (void *(*)(void *, const char *, const char *))gn_dl_real_fn(GN_DL_DLVSYM);
    return f ? f(handle, name, version) : NULL;
}

/* What a router tells its entry point: the answer, or where to continue. */
struct gn_route {
    void *value;
    void *jump;
};

static void *const gn_dl_hooks[GN_DL_COUNT] = {(void *)&dlsym, (void *)&dlvsym, (void *)&dlopen,
                                               (void *)&dlmopen};

int gn_is_dl_hook(const void *p)
{
    for (int i = 0; i < GN_DL_COUNT; i++)
        if (gn_dl_hooks[i] == p)
            return 1;
    return 0;
}

/* Names answered with our hooks in any handle: the lookup functions
 * themselves always, hooked driver names for RTLD_NEXT and RTLD_DEFAULT. */
GN_NO_SAN static void *gn_override(void *handle, const char *name)
{
    if (!name)
        return NULL;
    if (name[0] == 'd' && name[1] == 'l') {
        for (int i = 0; i < GN_DL_COUNT; i++)
            if (gn_streq(name, gn_dl_names[i]))
                return gn_dl_hooks[i];
        return NULL;
    }
    if ((handle == RTLD_NEXT || handle == RTLD_DEFAULT) && (name[0] == 'c' || name[0] == 'n'))
        for (int id = 0; id < GN_ID_COUNT; id++)
            if (gn_hooks[id].hook && gn_streq(gn_hooks[id].name, name))
                return gn_hooks[id].hook;
    return NULL;
}

/* A driver function found in a handle becomes our hook for it. */
static void *gn_substitute_found(void *p, const char *name)
{
    if (!p || gn_is_hook_address(p))
        return p;
    int id = gn_find_hook(name);
    if (id < 0)
        return p;
    if (!atomic_load_explicit(&gn_real[id], memory_order_acquire)) {
        void *expected = NULL;
        atomic_compare_exchange_strong(&gn_real[id], &expected, p);
    }
    return gn_hooks[id].hook;
}

GN_NO_SAN __attribute__((used)) struct gn_route gn_route_dlsym(void *handle, const char *name)
{
    struct gn_route r = {gn_override(handle, name), NULL};
    if (r.value)
        return r;
    if (handle == RTLD_NEXT || handle == RTLD_DEFAULT)
        r.jump = gn_dl_real_fn(GN_DL_DLSYM);
    else
        r.value = gn_substitute_found(gn_real_dlsym(handle, name), name);
    return r;
}

GN_NO_SAN __attribute__((used)) struct gn_route gn_route_dlvsym(void *handle, const char *name, const char *version)
{
    struct gn_route r = {gn_override(handle, name), NULL};
    if (r.value)
        return r;
    if (handle == RTLD_NEXT || handle == RTLD_DEFAULT)
        r.jump = gn_dl_real_fn(GN_DL_DLVSYM);
    else
        r.value = gn_substitute_found(gn_real_dlvsym(handle, name, version), name);
    return r;
}

__attribute__((used)) struct gn_route gn_route_dlopen(const char *file, int flags, void *unused, void *caller)
{
    (void)unused;
    struct gn_route r = {NULL, NULL};
    if (!(flags & RTLD_DEEPBIND))
        r.jump = gn_dl_real_fn(GN_DL_DLOPEN);
    else
        r.value = gn_load_on_behalf(LM_ID_BASE, 0, file, flags, caller);
    return r;
}

__attribute__((used)) struct gn_route gn_route_dlmopen(Lmid_t lmid, const char *file, int flags, void *caller)
{
    struct gn_route r = {NULL, NULL};
    if (lmid == LM_ID_BASE && !(flags & RTLD_DEEPBIND))
        r.jump = gn_dl_real_fn(GN_DL_DLMOPEN);
    else
        r.value = gn_load_on_behalf(lmid, 1, file, flags, caller);
    return r;
}

/* The entry points: save the arguments, ask the router (caller's return
 * address as the fourth argument), then return its answer or jump on. */
#if defined(__x86_64__)
#define GN_DL_ENTRY(name, router)                                                                                  \
    ".globl " #name "\n.type " #name ", @function\n" #name ":\n"                                               \
    "    endbr64\n"                                                                                                \
    "    movq (%rsp), %rcx\n"                                                                                      \
    "    pushq %rdi\n    pushq %rsi\n    pushq %rdx\n"                                                             \
    "    call " #router "\n"                                                                                       \
    "    movq %rdx, %r11\n"                                                                                        \
    "    popq %rdx\n    popq %rsi\n    popq %rdi\n"                                                                \
    "    testq %r11, %r11\n    je 1f\n    jmp *%r11\n"                                                             \
    "1:  ret\n"                                                                                                    \
    ".size " #name ", .-" #name "\n"
#elif defined(__aarch64__)
#define GN_DL_ENTRY(name, router)                                                                                  \
    ".globl " #name "\n.type " #name ", %function\n.p2align 2\n" #name ":\n"                                   \
    "    stp x29, x30, [sp, #-48]!\n    mov x29, sp\n"                                                             \
    "    stp x0, x1, [sp, #16]\n    str x2, [sp, #32]\n"                                                           \
    "    mov x3, x30\n"                                                                                            \
    "    bl " #router "\n"                                                                                         \
    "    mov x16, x1\n    mov x17, x0\n"                                                                           \
    "    ldp x0, x1, [sp, #16]\n    ldr x2, [sp, #32]\n"                                                           \
    "    ldp x29, x30, [sp], #48\n"                                                                                \
    "    cbz x16, 1f\n    br x16\n"                                                                                \
    "1:  mov x0, x17\n    ret\n"                                                                                   \
    ".size " #name ", .-" #name "\n"
#else
#error "the dl* entry points need a tail call into glibc; add this architecture"
#endif

__asm__(".text\n" GN_DL_ENTRY(dlsym, gn_route_dlsym) GN_DL_ENTRY(dlvsym, gn_route_dlvsym)
            GN_DL_ENTRY(dlopen, gn_route_dlopen) GN_DL_ENTRY(dlmopen, gn_route_dlmopen));
