/*
 * log.c: the interposer's only output: one line per event on stderr,
 * prefixed "[gpunode-memcap]", filtered by GPUNODE_MEMCAP_LOG_LEVEL
 * (off|error|warn|info|debug; default warn).
 *
 * Must not: allocate, take locks, or be called on the allocation fast path
 * except behind the GN_LOG level check.
 */
#define _GNU_SOURCE
#include "preload.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

int gn_log_level = GN_LOG_WARN;

static const char *const level_names[] = {"off", "error", "warn", "info", "debug"};

void gn_log_setup(void)
{
    static const struct {
        const char *name;
        int level;
    } names[] = {
        {"off", GN_LOG_OFF},   {"none", GN_LOG_OFF}, {"error", GN_LOG_ERROR}, {"warn", GN_LOG_WARN},
        {"warning", GN_LOG_WARN}, {"info", GN_LOG_INFO}, {"debug", GN_LOG_DEBUG},
    };
    const char *value = getenv(GPUNODE_MEMCAP_ENV_LOG_LEVEL);
    if (!value || !*value)
        return;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (strcasecmp(value, names[i].name) == 0) {
            gn_log_level = names[i].level;
            return;
        }
    }
    gn_log_level = GN_LOG_WARN;
    gn_log(GN_LOG_WARN, "%s=%s is not one of off, error, warn, info, debug; using warn",
           GPUNODE_MEMCAP_ENV_LOG_LEVEL, value);
}

void gn_log(int level, const char *fmt, ...)
{
    int saved_errno = errno;
    char line[768];
    if (level < GN_LOG_ERROR || level > GN_LOG_DEBUG)
        level = GN_LOG_ERROR;
    int n = snprintf(line, sizeof(line), "[gpunode-memcap] %s: pid %d: ", level_names[level], (int)getpid());
    if (n < 0)
        n = 0;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof(line) - 2)
        len = sizeof(line) - 2;
    line[len++] = '\n';
    const char *p = line;
    while (len > 0) {
        ssize_t w = write(STDERR_FILENO, p, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        p += w;
        len -= (size_t)w;
    }
    errno = saved_errno;
}

const char *gn_format_bytes(char *buf, size_t len, uint64_t bytes)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double value = (double)bytes;
    unsigned unit = 0;
    while (value >= 1024.0 && unit + 1 < sizeof(units) / sizeof(units[0])) {
        value /= 1024.0;
        unit++;
    }
    if (unit == 0)
        snprintf(buf, len, "%llu B", (unsigned long long)bytes);
    else
        snprintf(buf, len, "%.2f %s (%llu bytes)", value, units[unit], (unsigned long long)bytes);
    return buf;
}
