/*
 * locate.c: where this process's region is, and whether it may be trusted.
 *
 * In a capped container the agent bind-mounts the region at the fixed path
 * GPUNODE_MEMCAP_DEFAULT_DIR (limit file read-only, usage file read-write).
 * When anything exists at <fixed>/limit, that is the region, whatever the
 * environment says, and it is only used if the limit file lies on a
 * read-only mount: a tenant without CAP_SYS_ADMIN can neither create a
 * read-only mount nor remove or rename the agent's mount point, so a file it
 * wrote itself is refused. GPUNODE_MEMCAP_REGION is honoured only when the
 * fixed path holds nothing (hosts, tests, development): no tenant boundary.
 *
 * Test builds may move the fixed path with -DGN_FIXED_REGION_DIR="..."
 * (build_native.py); the installed library never reads it from anywhere.
 *
 * Must not: run on the allocation path (only when the region is loaded).
 */
#define _GNU_SOURCE
#include "preload.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#ifndef GN_FIXED_REGION_DIR
#define GN_FIXED_REGION_DIR GPUNODE_MEMCAP_DEFAULT_DIR
#endif

const char *gn_region_dir(int *fixed)
{
    const char *env = getenv(GPUNODE_MEMCAP_ENV_REGION);
    struct stat st;
    if (lstat(GN_FIXED_REGION_DIR "/" GPUNODE_MEMCAP_LIMIT_FILE, &st) == 0) {
        if (env && *env && strcmp(env, GN_FIXED_REGION_DIR) != 0)
            GN_LOG(GN_LOG_INFO, "ignoring %s=%s: the region mounted at %s is used", GPUNODE_MEMCAP_ENV_REGION, env,
                   GN_FIXED_REGION_DIR);
        *fixed = 1;
        return GN_FIXED_REGION_DIR;
    }
    *fixed = 0;
    return env && *env ? env : GN_FIXED_REGION_DIR;
}

/* The limit file at `dir` as it is now, if it lies on a read-only mount:
 * 1 and its bytes in *copy, or 0 and the reason in why. */
int gn_read_only_limit(const char *dir, struct gpunode_memcap_limit *copy, char *why, size_t len)
{
    char path[PATH_MAX];
    if (snprintf(path, sizeof(path), "%s/%s", dir, GPUNODE_MEMCAP_LIMIT_FILE) >= (int)sizeof(path)) {
        snprintf(why, len, "the path is too long");
        return 0;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        snprintf(why, len, "cannot open %s: %s", path, strerror(errno));
        return 0;
    }
    struct statvfs vfs;
    int ok = 0;
    if (fstatvfs(fd, &vfs) != 0) {
        snprintf(why, len, "cannot inspect the mount of %s: %s", path, strerror(errno));
    } else if (!(vfs.f_flag & ST_RDONLY)) {
        snprintf(why, len, "%s is not on a read-only mount, so the node agent did not mount it", path);
    } else {
        memset(copy, 0, sizeof(*copy));
        size_t done = 0;
        while (done < sizeof(*copy)) {
            ssize_t n = read(fd, (char *)copy + done, sizeof(*copy) - done);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                break;
            done += (size_t)n;
        }
        ok = 1; /* a short file is reported by the region's own checks */
    }
    close(fd);
    return ok;
}
