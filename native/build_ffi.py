"""CFFI build script for gpunode._memcap (out-of-line API mode).

The declarations are the block between the "cffi" markers of
native/include/gpunode_memcap.h, and the implementation is native/src/region.c,
the same file compiled into the preload library: the agent and the container
share one implementation of the region layout. The agent's SIGBUS-proof
wrappers (native/src/guard.h, the same marker convention) and their source
native/src/guard.c are compiled into this module only. setup.py registers this
module with ``cffi_modules=["native/build_ffi.py:ffibuilder"]``.

Must not: declare anything by hand here; the headers are the contract.
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

NATIVE_DIR = Path(__file__).resolve().parent
HEADER = NATIVE_DIR / "include" / "gpunode_memcap.h"
REGION_SOURCE = NATIVE_DIR / "src" / "region.c"
GUARD_HEADER = NATIVE_DIR / "src" / "guard.h"
GUARD_SOURCE = NATIVE_DIR / "src" / "guard.c"
BEGIN_MARKER = "/* >>> cffi */"
END_MARKER = "/* <<< cffi */"


def read_cdef(header_text: str, header: Path = HEADER) -> str:
    """The CFFI declarations: the header's text between the two markers."""
    try:
        start = header_text.index(BEGIN_MARKER) + len(BEGIN_MARKER)
        end = header_text.index(END_MARKER, start)
    except ValueError as exc:
        raise RuntimeError(f"{header}: the {BEGIN_MARKER} ... {END_MARKER} block is missing") from exc
    return header_text[start:end]


def _relative(path: Path) -> str:
    # setuptools prefers source paths relative to the project root (the cwd of setup.py).
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


ffibuilder = FFI()
ffibuilder.cdef(read_cdef(HEADER.read_text()))
ffibuilder.cdef(read_cdef(GUARD_HEADER.read_text(), GUARD_HEADER))
ffibuilder.set_source(
    "gpunode._memcap",
    '#include "gpunode_memcap.h"\n#include "guard.h"',
    sources=[_relative(REGION_SOURCE), _relative(GUARD_SOURCE)],
    include_dirs=[_relative(NATIVE_DIR / "include"), _relative(NATIVE_DIR / "src")],
    extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-pthread"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
