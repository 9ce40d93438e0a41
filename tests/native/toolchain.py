"""Builds what the interposer tests and bench/interposer.py run: the fake driver
(libcuda.so.1 and libnvidia-ml.so.1 from fake_cuda.c and fake_nvml.c), C client
programs, and a copy of the preload library built by native/build_native.py
(the same sources and flags the package build uses).

Test infrastructure: nothing here is installed or imported by gpunode.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

TESTS_NATIVE = Path(__file__).resolve().parent
REPO = TESTS_NATIVE.parents[1]
SRC_HOOKS = REPO / "native" / "src" / "hooks.def"
FAKE_CFLAGS = ("-std=gnu11", "-fPIC", "-fvisibility=hidden", "-pthread", "-Wall", "-Wextra", "-Werror")


def load_build_native() -> ModuleType:
    """native/build_native.py as a module (native/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpunode_build_native", REPO / "native" / "build_native.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_native = load_build_native()


@dataclass(frozen=True)
class NativeBuild:
    """Paths of one build (plain, or with a sanitizer)."""

    root: Path
    preload: Path
    driver_dir: Path  # holds libcuda.so.1, libcuda.so and libnvidia-ml.so.1
    snippet_linked: Path
    snippet_dlopen: Path

    def env(self, **extra: str) -> dict[str, str]:
        """A minimal environment that finds the fake driver (no preload)."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LD_LIBRARY_PATH": str(self.driver_dir),
            "HOME": os.environ.get("HOME", "/tmp"),
        }
        env.update(extra)
        return env


def build_shared(sources: Sequence[Path], output: Path, soname: str, cflags: Sequence[str] = ()) -> Path:
    build_native.run_tool(
        [
            *build_native.compiler(),
            "-O2",
            *FAKE_CFLAGS,
            *cflags,
            "-shared",
            "-Wl,-Bsymbolic-functions",
            f"-Wl,-soname,{soname}",
            *sources,
            "-o",
            output,
        ]
    )
    return output


def build_fake_driver(out_dir: Path, cflags: Sequence[str] = ()) -> Path:
    """libcuda.so.1 (+ libcuda.so for -lcuda) and libnvidia-ml.so.1 in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_shared(
        [TESTS_NATIVE / "fake_cuda.c", TESTS_NATIVE / "fake_timeline.c"],
        out_dir / "libcuda.so.1",
        "libcuda.so.1",
        cflags,
    )
    build_shared([TESTS_NATIVE / "fake_nvml.c"], out_dir / "libnvidia-ml.so.1", "libnvidia-ml.so.1", cflags)
    link = out_dir / "libcuda.so"
    if not link.exists():
        link.symlink_to("libcuda.so.1")
    return out_dir


def build_program(
    source: Path,
    output: Path,
    *,
    link_cuda_dir: Path | None = None,
    cflags: Sequence[str] = (),
    optimize: str = "-O2",
) -> Path:
    """A C program; linked against the fake libcuda (and built with -DLINKED) when link_cuda_dir is given."""
    linked = link_cuda_dir is not None
    build_native.run_tool(
        [
            *build_native.compiler(),
            optimize,
            "-std=gnu11",
            "-pthread",
            "-Wall",
            "-Wextra",
            "-Werror",
            *(["-DLINKED"] if linked else []),
            *cflags,
            source,
            "-o",
            output,
            *([f"-L{link_cuda_dir}", "-lcuda"] if linked else []),
            "-ldl",
        ]
    )
    return output


def build_all(root: Path, cflags: Sequence[str] = (), preload_ldflags: Sequence[str] = ()) -> NativeBuild:
    """The preload library, the fake driver and both snippet programs, into root."""
    root.mkdir(parents=True, exist_ok=True)
    preload = build_native.build_preload(
        root / build_native.LIBRARY_NAME, extra_cflags=cflags, extra_ldflags=preload_ldflags
    )
    driver_dir = build_fake_driver(root / "driver", cflags)
    source = TESTS_NATIVE / "snippet.c"
    linked = build_program(source, root / "snippet_linked", link_cuda_dir=driver_dir, cflags=cflags)
    dlopen = build_program(source, root / "snippet_dlopen", cflags=cflags)
    return NativeBuild(root, preload, driver_dir, linked, dlopen)


def asan_runtime() -> Path | None:
    """The AddressSanitizer runtime the compiler links against, or None without ASan support."""
    proc = subprocess.run(
        [*build_native.compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
    )
    path = Path(proc.stdout.strip())
    if proc.returncode != 0 or not path.is_absolute() or not path.exists():
        return None
    return path.resolve()
