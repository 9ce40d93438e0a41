"""Hands gpunode's native parts to setuptools; pyproject.toml holds the metadata.

Two artifacts come out of every build (``pip install .`` and ``pip install -e .``):
the CFFI module gpunode._memcap (``cffi_modules``) and the preload library
gpunode/lib/libgpunode-preload.so (a step added to build_ext), both from native/.
The sdist carries native/ so that a wheel can be built from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "native"))

import build_native  # noqa: E402  (native/ is not a package; it must be on sys.path first)


class BuildExtWithPreload(build_ext):
    """build_ext that also compiles libgpunode-preload.so into gpunode/lib/."""

    def preload_target(self) -> Path:
        base = ROOT if self.inplace else Path(self.build_lib)
        return base / "gpunode" / "lib" / build_native.LIBRARY_NAME

    def run(self) -> None:
        super().run()
        target = self.preload_target()
        print(f"building {target}")
        build_native.build_preload(target)

    def get_outputs(self) -> list[str]:
        return [*super().get_outputs(), str(self.preload_target())]


class SdistWithNative(sdist):
    """sdist that carries native/ (sources, header, hook list, build scripts), so wheels build from it."""

    def make_distribution(self) -> None:
        for pattern in ("*.py", "include/*.h", "src/*.c", "src/*.h", "src/*.def", "src/*.in"):
            self.filelist.extend(str(p.relative_to(ROOT)) for p in sorted((ROOT / "native").glob(pattern)))
        self.filelist.remove_duplicates()
        super().make_distribution()


setup(
    cffi_modules=["native/build_ffi.py:ffibuilder"],
    cmdclass={"build_ext": BuildExtWithPreload, "sdist": SdistWithNative},
)
