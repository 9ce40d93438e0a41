"""A Python client of the CUDA driver and NVML through ctypes, run by the tests
under the interposer (LD_PRELOAD) against the fake driver.

ctypes finds functions with dlopen + dlsym, as Python CUDA bindings do; the
"procaddr" scenario goes through cuGetProcAddress_v2 like CUDA 12 runtimes;
"nvml" uses the nvidia-ml-py package (pynvml) the way monitoring tools and
nvidia-smi read memory. Prints "ok <scenario>" or exits with "FAIL ...".

Usage: ctypes_client.py cap LIMIT | procaddr LIMIT | nvml LIMIT
"""

from __future__ import annotations

import ctypes
import sys

OOM = 2
cuda = ctypes.CDLL("libcuda.so.1")
cuda.fake_cuda_calls.restype = ctypes.c_ulonglong
cuda.fake_cuda_calls.argtypes = [ctypes.c_char_p]


def fail(message: str) -> None:
    raise SystemExit(f"FAIL {message}")


def check(rc: int, what: str) -> None:
    if rc != 0:
        fail(f"{what} returned {rc}")


def start() -> None:
    ctx = ctypes.c_void_p()
    check(cuda.cuInit(0), "cuInit")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def mem_info() -> tuple[int, int]:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
    return free.value, total.value


ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t)
FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong)


def exercise(alloc: ctypes._CFuncPtr, free: ctypes._CFuncPtr, limit: int, label: str) -> None:
    half = limit // 2
    a, b, c = ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.c_ulonglong()
    check(alloc(ctypes.byref(a), half), f"{label} alloc 1")
    check(alloc(ctypes.byref(b), limit - half), f"{label} alloc 2")
    before = cuda.fake_cuda_calls(b"cuMemAlloc_v2")
    rc = alloc(ctypes.byref(c), 1)
    if rc != OOM:
        fail(f"{label}: an allocation past the cap returned {rc}")
    if cuda.fake_cuda_calls(b"cuMemAlloc_v2") != before:
        fail(f"{label}: the refused allocation reached the driver")
    free_bytes, total = mem_info()
    if (free_bytes, total) != (0, limit):
        fail(f"{label}: cuMemGetInfo says free={free_bytes} total={total} at the cap of {limit}")
    check(free(a.value), f"{label} free 1")
    check(free(b.value), f"{label} free 2")
    if mem_info() != (limit, limit):
        fail(f"{label}: cuMemGetInfo says {mem_info()} after freeing everything")


def scenario_cap(limit: int) -> None:
    start()
    exercise(ALLOC(("cuMemAlloc_v2", cuda)), FREE(("cuMemFree_v2", cuda)), limit, "dlsym")


def scenario_procaddr(limit: int) -> None:
    start()
    get_proc = ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_ulonglong,
        ctypes.POINTER(ctypes.c_int),
    )(("cuGetProcAddress_v2", cuda))

    def lookup(name: bytes) -> int:
        fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
        check(get_proc(name, ctypes.byref(fn), 12040, 0, ctypes.byref(status)), f"cuGetProcAddress({name!r})")
        if status.value != 0 or not fn.value:
            fail(f"cuGetProcAddress({name!r}) status {status.value}")
        return int(fn.value)

    exercise(ALLOC(lookup(b"cuMemAlloc")), FREE(lookup(b"cuMemFree")), limit, "cuGetProcAddress")


def scenario_nvml(limit: int) -> None:
    import pynvml

    start()
    held = ctypes.c_ulonglong()
    used = limit // 4
    check(cuda.cuMemAlloc_v2(ctypes.byref(held), ctypes.c_size_t(used)), "cuMemAlloc_v2")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
    if (v1.total, v1.used, v1.free) != (limit, used, limit - used):
        fail(
            f"nvmlDeviceGetMemoryInfo: total={v1.total} used={v1.used} free={v1.free}, cap {limit} used {used}"
        )
    v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    if (v2.total, v2.used, v2.free, v2.reserved) != (limit, used, limit - used, 0):
        fail(
            f"nvmlDeviceGetMemoryInfo_v2: total={v2.total} used={v2.used} free={v2.free} reserved={v2.reserved}"
        )
    pynvml.nvmlShutdown()
    check(cuda.cuMemFree_v2(held), "cuMemFree_v2")


SCENARIOS = {"cap": scenario_cap, "procaddr": scenario_procaddr, "nvml": scenario_nvml}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in SCENARIOS:
        raise SystemExit(__doc__)
    SCENARIOS[sys.argv[1]](int(sys.argv[2]))
    print(f"ok {sys.argv[1]}")
