/*
 * relink.c: the loads the dl* entry points perform themselves, because
 * glibc's own answer would bypass the hooks.
 *
 * RTLD_DEEPBIND: an object loaded with it binds its references in its own
 * dependency scope first, so a library linked against libcuda would reach
 * the driver's cuMemAlloc directly. The load is done here, then every object
 * it added has its GOT entries (JUMP_SLOT, GLOB_DAT, absolute 64-bit) that
 * name a hooked symbol pointed at our hook, RELRO pages made writable for
 * the store and read-only again. The flags are not changed (RTLD_LAZY slots
 * are rewritten before their first call).
 *
 * dlmopen into another link-map namespace: LD_PRELOAD objects exist only in
 * the base namespace, so a driver loaded there would be uncapped. Such a
 * load is done here and undone (NULL, with a dlerror message) if the
 * namespace then holds libcuda.so.1 or libnvidia-ml.so.1.
 *
 * Loading from here makes glibc see this library as the caller, so the
 * caller's rules are applied first: its namespace, $ORIGIN, and for a bare
 * file name its RUNPATH (after LD_LIBRARY_PATH) or RPATH.
 *
 * Must not: run for ordinary dlopen calls (they never leave the entry point).
 */
#define _GNU_SOURCE
#include "preload.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__)
#define GN_R_JUMP_SLOT R_X86_64_JUMP_SLOT
#define GN_R_GLOB_DAT R_X86_64_GLOB_DAT
#define GN_R_ABS64 R_X86_64_64
#elif defined(__aarch64__)
#define GN_R_JUMP_SLOT R_AARCH64_JUMP_SLOT
#define GN_R_GLOB_DAT R_AARCH64_GLOB_DAT
#define GN_R_ABS64 R_AARCH64_ABS64
#endif

static const char *const gn_driver_sonames[] = {"libcuda.so.1", "libnvidia-ml.so.1"};

/* ---- the caller's search rules ---- */

static void gn_origin(const struct link_map *lm, char *out, size_t len)
{
    const char *name = lm && lm->l_name && lm->l_name[0] ? lm->l_name : NULL;
    char exe[PATH_MAX];
    if (!name) {
        ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
        exe[n > 0 ? n : 0] = '\0';
        name = exe;
    }
    snprintf(out, len, "%s", name);
    char *slash = strrchr(out, '/');
    if (slash)
        *(slash == out ? slash + 1 : slash) = '\0';
}

/* `in` with $ORIGIN and ${ORIGIN} replaced; 0 if it has another token or is too long. */
static int gn_expand(const char *in, size_t n, const char *origin, char *out, size_t len)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        const char *add = NULL;
        size_t skip = 0;
        if (strncmp(in + i, "$ORIGIN", 7) == 0)
            add = origin, skip = 7;
        else if (strncmp(in + i, "${ORIGIN}", 9) == 0)
            add = origin, skip = 9;
        else if (in[i] == '$')
            return 0;
        size_t m = add ? strlen(add) : 1;
        if (o + m + 1 > len)
            return 0;
        memcpy(out + o, add ? add : in + i, m);
        o += m;
        i += add ? skip : 1;
    }
    out[o] = '\0';
    return 1;
}

/* The first directory of a ':' list holding `file`: 1 and its path in out. */
static int gn_search_list(const char *list, const char *file, const char *origin, char *out, size_t len)
{
    while (list && *list) {
        const char *end = strchr(list, ':');
        size_t n = end ? (size_t)(end - list) : strlen(list);
        char dir[PATH_MAX];
        if (n && gn_expand(list, n, origin, dir, sizeof(dir)) &&
            snprintf(out, len, "%s/%s", dir, file) < (int)len && access(out, F_OK) == 0)
            return 1;
        list = end ? end + 1 : NULL;
    }
    return 0;
}

static const char *gn_dyn_string(const struct link_map *lm, ElfW(Sxword) tag)
{
    const char *strtab = NULL;
    ElfW(Addr) off = 0;
    int found = 0;
    for (const ElfW(Dyn) *d = lm->l_ld; d && d->d_tag != DT_NULL; d++) {
        if (d->d_tag == DT_STRTAB)
            strtab = (const char *)gn_dyn_ptr(lm, d->d_un.d_ptr);
        else if (d->d_tag == tag)
            off = d->d_un.d_val, found = 1;
    }
    return found && strtab ? strtab + off : NULL;
}

/* The file name glibc would have resolved for the caller. */
static const char *gn_search_as(const struct link_map *caller, Lmid_t lmid, const char *file, char *out,
                                size_t len)
{
    if (!file || !caller)
        return file;
    char origin[PATH_MAX];
    gn_origin(caller, origin, sizeof(origin));
    if (strchr(file, '/'))
        return strchr(file, '$') && gn_expand(file, strlen(file), origin, out, len) ? out : file;
    void *loaded = gn_real_dlmopen(lmid, file, RTLD_LAZY | RTLD_NOLOAD);
    if (loaded) {
        dlclose(loaded);
        return file;
    }
    const char *runpath = gn_dyn_string(caller, DT_RUNPATH);
    if (runpath) {
        if (gn_search_list(getenv("LD_LIBRARY_PATH"), file, origin, out, len))
            return file;
        return gn_search_list(runpath, file, origin, out, len) ? out : file;
    }
    return gn_search_list(gn_dyn_string(caller, DT_RPATH), file, origin, out, len) ? out : file;
}

/* ---- rewriting the GOT of newly loaded objects ---- */

struct gn_seen {
    const void **phdrs;
    size_t count, cap;
};

static int gn_collect(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    struct gn_seen *seen = arg;
    if (seen->count == seen->cap) {
        size_t cap = seen->cap ? seen->cap * 2 : 256;
        const void **p = realloc(seen->phdrs, cap * sizeof(*p));
        if (!p)
            return 1;
        seen->phdrs = p;
        seen->cap = cap;
    }
    seen->phdrs[seen->count++] = info->dlpi_phdr;
    return 0;
}

static void gn_store_slot(struct dl_phdr_info *info, uintptr_t slot, uintptr_t value)
{
    uintptr_t relro_lo = 0, relro_hi = 0;
    int writable = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr, hi = lo + ph->p_memsz;
        if (ph->p_type == PT_GNU_RELRO)
            relro_lo = lo, relro_hi = hi;
        else if (ph->p_type == PT_LOAD && slot >= lo && slot + sizeof(uintptr_t) <= hi && (ph->p_flags & PF_W))
            writable = 1;
    }
    int in_relro = slot >= relro_lo && slot < relro_hi;
    if (!writable && !in_relro)
        return; /* a text relocation: leave it */
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    void *start = (void *)(slot & ~(page - 1));
    if (in_relro && mprotect(start, page, PROT_READ | PROT_WRITE) != 0) {
        gn_log(GN_LOG_ERROR, "cannot make the GOT of %s writable to redirect a driver call to the memory cap",
               info->dlpi_name);
        return;
    }
    atomic_store_explicit((_Atomic uintptr_t *)slot, value, memory_order_relaxed);
    if (in_relro)
        mprotect(start, page, PROT_READ);
}

static unsigned gn_patch_relocs(struct dl_phdr_info *info, const ElfW(Rela) *rela, size_t bytes,
                                const ElfW(Sym) *symtab, const char *strtab)
{
    unsigned patched = 0;
    for (size_t i = 0; rela && i < bytes / sizeof(*rela); i++) {
        unsigned long type = ELF64_R_TYPE(rela[i].r_info);
        if (type != GN_R_JUMP_SLOT && type != GN_R_GLOB_DAT && type != GN_R_ABS64)
            continue;
        const ElfW(Sym) *s = &symtab[ELF64_R_SYM(rela[i].r_info)];
        if (s->st_shndx != SHN_UNDEF)
            continue;
        int id = gn_find_hook(strtab + s->st_name);
        if (id < 0)
            continue;
        uintptr_t slot = info->dlpi_addr + rela[i].r_offset;
        uintptr_t value = (uintptr_t)gn_hooks[id].hook + (type == GN_R_ABS64 ? (uintptr_t)rela[i].r_addend : 0);
        if (*(const uintptr_t *)slot != value) {
            gn_store_slot(info, slot, value);
            patched++;
        }
    }
    return patched;
}

static int gn_patch_new(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    const struct gn_seen *seen = arg;
    for (size_t i = 0; i < seen->count; i++)
        if (seen->phdrs[i] == info->dlpi_phdr)
            return 0;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    if (!dyn)
        return 0;
    struct link_map lm = {.l_addr = info->dlpi_addr, .l_ld = (ElfW(Dyn) *)dyn};
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *rela = NULL, *jmprel = NULL;
    size_t rela_size = 0, jmprel_size = 0;
    for (const ElfW(Dyn) *d = dyn; d->d_tag != DT_NULL; d++) {
        switch (d->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)gn_dyn_ptr(&lm, d->d_un.d_ptr); break;
        case DT_STRTAB: strtab = (const char *)gn_dyn_ptr(&lm, d->d_un.d_ptr); break;
        case DT_RELA: rela = (const ElfW(Rela) *)gn_dyn_ptr(&lm, d->d_un.d_ptr); break;
        case DT_RELASZ: rela_size = d->d_un.d_val; break;
        case DT_JMPREL: jmprel = (const ElfW(Rela) *)gn_dyn_ptr(&lm, d->d_un.d_ptr); break;
        case DT_PLTRELSZ: jmprel_size = d->d_un.d_val; break;
        default: break;
        }
    }
    if (!symtab || !strtab)
        return 0;
    unsigned n = gn_patch_relocs(info, rela, rela_size, symtab, strtab) +
                 gn_patch_relocs(info, jmprel, jmprel_size, symtab, strtab);
    if (n)
        GN_LOG(GN_LOG_INFO, "%s was loaded with RTLD_DEEPBIND: %u driver reference(s) redirected to the memory cap",
               info->dlpi_name, n);
    return 0;
}

/* ---- namespaces ---- */

static int gn_namespace_has_driver(void *handle)
{
    Lmid_t ns = LM_ID_BASE;
    if (dlinfo(handle, RTLD_DI_LMID, &ns) != 0 || ns == LM_ID_BASE)
        return 0;
    for (size_t i = 0; i < sizeof(gn_driver_sonames) / sizeof(gn_driver_sonames[0]); i++) {
        void *h = gn_real_dlmopen(ns, gn_driver_sonames[i], RTLD_LAZY | RTLD_NOLOAD);
        if (h) {
            dlclose(h);
            return 1;
        }
    }
    return 0;
}

void *gn_load_on_behalf(Lmid_t lmid, int explicit_ns, const char *file, int flags, void *caller)
{
    Dl_info info;
    struct link_map *caller_map = NULL;
    if (!dladdr1(caller, &info, (void **)&caller_map, RTLD_DL_LINKMAP))
        caller_map = NULL;
    if (!explicit_ns && (!caller_map || dlinfo(caller_map, RTLD_DI_LMID, &lmid) != 0))
        lmid = LM_ID_BASE;
    char path[PATH_MAX];
    const char *use = gn_search_as(caller_map, lmid, file, path, sizeof(path));
    if (lmid != LM_ID_BASE) {
        void *handle = gn_real_dlmopen(lmid, use, flags);
        if (handle && gn_namespace_has_driver(handle)) {
            dlclose(handle);
            gn_log(GN_LOG_ERROR, "refused to load %s: it brings the GPU driver into a separate link-map namespace, "
                   "outside the memory cap", file ? file : "(null)");
            gn_real_dlopen("/dev/null/gpunode-memcap: the GPU driver may not be loaded into a new link-map "
                           "namespace", RTLD_LAZY);
            return NULL;
        }
        return handle;
    }
    struct gn_seen seen = {NULL, 0, 0};
    dl_iterate_phdr(gn_collect, &seen);
    void *handle = gn_real_dlmopen(LM_ID_BASE, use, flags);
    if (handle && (flags & RTLD_DEEPBIND))
        dl_iterate_phdr(gn_patch_new, &seen);
    free(seen.phdrs);
    return handle;
}
