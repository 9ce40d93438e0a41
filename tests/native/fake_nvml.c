/*
 * fake_nvml.c: a stand-in for libnvidia-ml.so.1 with just what nvidia-smi
 * style memory queries need: init/shutdown, device count and handles, UUIDs
 * and nvmlDeviceGetMemoryInfo(_v2). It reads the same environment as the
 * fake libcuda (fake_common.h), so both agree on the devices and, through
 * FAKE_CUDA_STATE, on the memory in use. Also what gpunode's NVML backend
 * needs to discover the devices (PCI info, minor numbers) and, for device 0, the per-process
 * utilisation of nvmlDeviceGetProcessUtilization, from the fake libcuda's
 * shared device timeline (FAKE_CUDA_TIMELINE, fake_timeline.c).
 *
 * Test infrastructure only; never part of gpunode.
 */
#define _GNU_SOURCE
#include "fake_common.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

#define NVML_MEMORY_V2_VERSION ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
#define RESERVED_BYTES (64ULL << 20)

static struct fake_state local_state;
static struct fake_state *state = &local_state;
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;
static int init_count;
static int device_count;
static uint64_t total_bytes;
static unsigned char uuids[MAX_DEVICES][16];
static char uuid_strings[MAX_DEVICES][48];
static struct nvmlDevice_st {
    int index;
} devices[MAX_DEVICES];

static void setup(void)
{
    total_bytes = read_total_bytes();
    device_count = read_device_count();
    read_uuids(uuids, uuid_strings);
    for (int d = 0; d < MAX_DEVICES; d++)
        devices[d].index = d;
    state = map_state(&local_state);
}

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    pthread_once(&setup_once, setup);
    init_count++;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

API nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

API nvmlReturn_t nvmlShutdown(void)
{
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    init_count--;
    return NVML_SUCCESS;
}

API const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS:
        return "Success";
    case NVML_ERROR_UNINITIALIZED:
        return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
        return "Invalid Argument";
    default:
        return "Unknown Error";
    }
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    snprintf(version, length, "550.00.fake");
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    *count = (unsigned int)device_count;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!init_count)
        return NVML_ERROR_UNINITIALIZED;
    if (index >= (unsigned int)device_count || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

static int device_index(nvmlDevice_t device)
{
    if (!init_count || device < &devices[0] || device >= &devices[device_count])
        return -1;
    return device->index;
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    int d = device_index(device);
    if (d < 0 || !uuid)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (length < strlen(uuid_strings[d]) + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(uuid, uuid_strings[d]);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    int d = device_index(device);
    if (d < 0 || !name)
        return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(name, length, "gpunode fake GPU %d", d);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    int d = device_index(device);
    if (d < 0 || !memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t used = atomic_load(&state->used[d]) + RESERVED_BYTES;
    memory->total = total_bytes;
    memory->used = used > total_bytes ? total_bytes : used;
    memory->free = total_bytes - memory->used;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    int d = device_index(device);
    if (d < 0 || !memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    uint64_t used = atomic_load(&state->used[d]);
    memory->total = total_bytes;
    memory->reserved = RESERVED_BYTES;
    memory->used = used;
    memory->free = used + RESERVED_BYTES >= total_bytes ? 0 : total_bytes - used - RESERVED_BYTES;
    return NVML_SUCCESS;
}

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    int d = device_index(device);
    if (d < 0 || !pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof(*pci));
    unsigned int bus = ((unsigned int)d + 1) & 0xff;
    pci->bus = bus;
    snprintf(pci->busId, sizeof(pci->busId), "00000000:%02X:00.0", bus);
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "0000:%02X:00.0", bus);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    int d = device_index(device);
    if (d < 0 || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minor = (unsigned int)d;
    return NVML_SUCCESS;
}

/* Per-process utilisation. A sample is taken on a call at most every SAMPLE_US: for each process on the
 * timeline, the device time it received since the previous sample over the wall time between them. The
 * timeline runs one context at a time, so processes sharing the device read what they got, not what they
 * asked for: the time-slicing deflation real NVML shows. Samples are kept in a ring, as NVML's buffer. */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp; /* microseconds since the epoch */
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

#define TL_HEADER_BYTES 152 /* the layout tests/native/fake_timeline.py reads too */
#define TL_PROCS 64
#define TL_PROC_BYTES (40 + 16 * 2048 + 32 * 4096)
#define SAMPLE_US 20000
#define RING 1024

static pthread_mutex_t util_lock = PTHREAD_MUTEX_INITIALIZER;
static nvmlProcessUtilizationSample_t ring[RING];
static unsigned ring_next, ring_used;
static int32_t prev_pid[TL_PROCS];
static uint64_t prev_busy[TL_PROCS], prev_us;

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void take_sample(void)
{
    const char *path = getenv("FAKE_CUDA_TIMELINE");
    uint64_t now = now_us();
    if (!path || (prev_us && now - prev_us < SAMPLE_US))
        return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    for (int i = 0; i < TL_PROCS; i++) {
        struct {
            int32_t pid, reserved;
            uint64_t busy;
        } head;
        if (pread(fd, &head, sizeof(head), TL_HEADER_BYTES + (off_t)i * TL_PROC_BYTES) != (ssize_t)sizeof(head))
            head.pid = 0;
        if (head.pid > 0 && kill(head.pid, 0) != 0 && errno == ESRCH)
            head.pid = 0; /* ended: the driver no longer reports it */
        if (prev_us && head.pid > 0 && head.pid == prev_pid[i] && now > prev_us) {
            uint64_t got = head.busy > prev_busy[i] ? head.busy - prev_busy[i] : 0;
            uint64_t pct = got / 10u / (now - prev_us); /* ns over us, as a percentage */
            nvmlProcessUtilizationSample_t *s = &ring[ring_next];
            memset(s, 0, sizeof(*s));
            s->pid = (unsigned int)head.pid;
            s->timeStamp = now;
            s->smUtil = pct > 100 ? 100 : (unsigned int)pct;
            ring_next = (ring_next + 1) % RING;
            if (ring_used < RING)
                ring_used++;
        }
        prev_pid[i] = head.pid;
        prev_busy[i] = head.busy;
    }
    close(fd);
    prev_us = now;
}

API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                 unsigned int *count, unsigned long long lastSeenTimeStamp)
{
    int d = device_index(device);
    if (d < 0 || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d != 0)
        return NVML_ERROR_NOT_FOUND; /* the timeline models device 0 */
    pthread_mutex_lock(&util_lock);
    if (!utilization)
        take_sample(); /* the size query takes the sample; the call that fills the buffer returns it */
    unsigned n = 0;
    for (unsigned k = 0; k < ring_used; k++) {
        const nvmlProcessUtilizationSample_t *s = &ring[(ring_next + RING - ring_used + k) % RING];
        if (s->timeStamp > lastSeenTimeStamp) {
            if (utilization && n < *count)
                utilization[n] = *s;
            n++;
        }
    }
    nvmlReturn_t rc = NVML_SUCCESS;
    if (n == 0)
        rc = NVML_ERROR_NOT_FOUND;
    else if (!utilization || n > *count)
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    *count = n;
    pthread_mutex_unlock(&util_lock);
    return rc;
}
