/*
 * fake_nvml.c: a stand-in for libnvidia-ml.so.1 with just what nvidia-smi
 * style memory queries need: init/shutdown, device count and handles, UUIDs
 * and nvmlDeviceGetMemoryInfo(_v2). It reads the same environment as the
 * fake libcuda (fake_common.h), so both agree on the devices and, through
 * FAKE_CUDA_STATE, on the memory in use.
 *
 * Test infrastructure only; never part of gpunode.
 */
#define _GNU_SOURCE
#include "fake_common.h"

#include <pthread.h>

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
