/* The program a capped container runs in tests/e2e/test_realnode_deviceplugin.py: linked against
 * libcuda.so.1 (the tests' fake driver), run under the interposer the kubelet mounted from Allocate's
 * answer. It allocates STEP bytes at a time until the driver API refuses, prints how much it got, what
 * cuMemGetInfo says, and the refusal's code, then holds the memory until SIGTERM.
 *
 * The fake driver reads FAKE_CUDA_UUIDS when it is loaded; the GPU's UUID arrives in
 * NVIDIA_VISIBLE_DEVICES from Allocate, so the program re-executes itself once with the one copied into
 * the other. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total);

#define MAX_STEPS 4096

static void on_term(int sig)
{
    (void)sig;
    _exit(0);
}

int main(int argc, char **argv)
{
    const char *visible = getenv("NVIDIA_VISIBLE_DEVICES");
    if (visible && *visible && !getenv("FAKE_CUDA_UUIDS")) {
        setenv("FAKE_CUDA_UUIDS", visible, 1);
        execv("/proc/self/exe", argv);
        perror("capprobe: execv");
        return 1;
    }
    signal(SIGTERM, on_term);
    size_t step = argc > 1 ? strtoull(argv[1], NULL, 0) : (size_t)256 << 20;
    CUdevice dev;
    CUcontext ctx;
    CUresult r = cuInit(0);
    if (!r)
        r = cuDeviceGet(&dev, 0);
    if (!r)
        r = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (!r)
        r = cuCtxSetCurrent(ctx);
    if (r) {
        printf("setup failed: %d\n", r);
        return 1;
    }
    size_t got = 0, free_bytes = 0, total = 0;
    CUdeviceptr p;
    for (int i = 0; i < MAX_STEPS; i++) {
        r = cuMemAlloc_v2(&p, step);
        if (r)
            break;
        got += step;
    }
    CUresult info = cuMemGetInfo_v2(&free_bytes, &total);
    printf("uuid=%s allocated=%zu refused_with=%d info=%d free=%zu total=%zu\n", visible ? visible : "",
           got, r, info, free_bytes, total);
    fflush(stdout);
    for (;;)
        pause();
}
