"""Build the preload library libgpunode-preload.so from native/src.

One place knows the sources and flags, so setup.py (the installed library),
the tests (a fresh copy, and an AddressSanitizer copy) and bench/interposer.py
all build the same thing. Plain C, linked against libc only; the exported
symbols are exactly the hooks, through a version script expanded by the C
preprocessor from native/src/hooks.def.

This module only runs the C toolchain; it must not import gpunode (setup.py
runs it before the package exists).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = NATIVE_DIR / "include"
SRC_DIR = NATIVE_DIR / "src"
REGION_SOURCE = SRC_DIR / "region.c"
PRELOAD_SOURCES = (
    "region.c",
    "log.c",
    "state.c",
    "locate.c",
    "resolve.c",
    "dlhooks.c",
    "relink.c",
    "hooks_mem.c",
    "hooks_array.c",
    "hooks_info.c",
    "hooks_launch.c",
    "compute.c",
)
LIBRARY_NAME = "libgpunode-preload.so"
CFLAGS = (
    "-std=gnu11",
    "-fPIC",
    "-fvisibility=hidden",
    "-pthread",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wshadow",
    "-Wstrict-prototypes",
)
LDFLAGS = (
    "-shared",
    "-Wl,-z,nodelete",
    "-Wl,-z,now",
    "-Wl,-z,relro",
    "-Wl,-Bsymbolic-functions",
    "-Wl,--as-needed",
)
LIBS = ("-ldl", "-lpthread")


class NativeBuildError(RuntimeError):
    """The C toolchain failed; the message carries the command and its output."""


def compiler() -> list[str]:
    """The C compiler command: $CC or cc."""
    return shlex.split(os.environ.get("CC", "cc"))


def run_tool(cmd: Sequence[str | os.PathLike[str]]) -> None:
    """Run a toolchain command, raising NativeBuildError with its output on failure."""
    argv = [os.fspath(c) for c in cmd]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NativeBuildError(f"{shlex.join(argv)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")


def write_version_script(path: Path) -> Path:
    """Expand exports.map.in (hooks.def) into a linker version script at path."""
    cmd = [*compiler(), "-E", "-P", "-x", "c", f"-I{SRC_DIR}", str(SRC_DIR / "exports.map.in")]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NativeBuildError(f"{shlex.join(cmd)} failed:\n{proc.stderr}")
    path.write_text(proc.stdout)
    return path


def build_preload(
    output: Path,
    *,
    optimize: str = "-O2",
    extra_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
) -> Path:
    """Compile and link the preload library to output (written atomically)."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpunode-preload-") as tmp:
        tmpdir = Path(tmp)
        script = write_version_script(tmpdir / "exports.map")
        staged = tmpdir / LIBRARY_NAME
        run_tool(
            [
                *compiler(),
                optimize,
                *CFLAGS,
                *extra_cflags,
                f"-I{INCLUDE_DIR}",
                f"-I{SRC_DIR}",
                *(SRC_DIR / s for s in PRELOAD_SOURCES),
                *LDFLAGS,
                f"-Wl,--version-script={script}",
                *extra_ldflags,
                "-o",
                staged,
                *LIBS,
            ]
        )
        install_file(staged, output)
    return output


def install_file(src: Path, dst: Path) -> None:
    """Copy src next to dst, then rename over dst, so readers never see half a library."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.write_bytes(src.read_bytes())
    tmp.chmod(0o755)
    os.replace(tmp, dst)


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd() / LIBRARY_NAME
    print(build_preload(target))
