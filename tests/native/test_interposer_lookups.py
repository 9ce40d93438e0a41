"""Lookups that would bypass the hooks, performed for real against the fake driver:
glibc's dlsym fetched with dlvsym, dlvsym on the driver's handle, a library linked
against libcuda loaded with RTLD_DEEPBIND, and the driver loaded into a new link-map
namespace. Each must leave the cap in force (or be refused)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from gpunode.node import memcap
from tests.native.conftest import CAP_BYTES
from tests.native.harness import interposer_env, run
from tests.native.toolchain import FAKE_CFLAGS, TESTS_NATIVE, NativeBuild, build_fake_driver, build_native

DRIVER_VERSION = "FAKECUDA_1.0"


@dataclass(frozen=True)
class Lookups:
    tenant: Path
    deep_lib: Path
    versioned_driver: Path


@pytest.fixture(scope="module")
def lookups(native_build: NativeBuild, tmp_path_factory: pytest.TempPathFactory) -> Lookups:
    """tenant.c, deep_lib.c (linked against the fake libcuda), and a fake libcuda with versioned symbols."""
    root = tmp_path_factory.mktemp("lookups")
    deep_dir = root / "deep"
    deep_dir.mkdir()
    deep_lib = deep_dir / "libgndeep.so"
    cc = build_native.compiler()
    build_native.run_tool(
        [*cc, "-O2", *FAKE_CFLAGS, "-shared", "-Wl,-soname,libgndeep.so", TESTS_NATIVE / "deep_lib.c",
         "-o", deep_lib, f"-L{native_build.driver_dir}", "-lcuda"]
    )  # fmt: skip
    tenant = root / "tenant"
    build_native.run_tool(
        [*cc, "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", TESTS_NATIVE / "tenant.c", "-o", tenant,
         f"-Wl,-rpath,{deep_dir}", "-ldl"]
    )  # fmt: skip
    script = root / "driver.map"
    script.write_text(f"{DRIVER_VERSION} {{ global: *; }};\n")
    versioned = build_fake_driver(root / "versioned", (f"-Wl,--version-script={script}",))
    return Lookups(tenant, deep_lib, versioned)


def _run(native_build: NativeBuild, region: memcap.Region, *args: object, driver: Path | None = None) -> None:
    env = interposer_env(native_build, region.path)
    if driver is not None:
        env["LD_LIBRARY_PATH"] = str(driver)
    result = run([str(a) for a in args], env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok"), result.stdout


def test_real_dlsym_fetched_through_dlvsym_still_finds_the_hooks(
    native_build: NativeBuild, region: memcap.Region, lookups: Lookups
) -> None:
    _run(native_build, region, lookups.tenant, "dlvsym-dlsym", CAP_BYTES)


def test_dlvsym_of_a_driver_symbol_returns_the_hook(
    native_build: NativeBuild, region: memcap.Region, lookups: Lookups
) -> None:
    _run(
        native_build,
        region,
        lookups.tenant,
        "dlvsym",
        CAP_BYTES,
        DRIVER_VERSION,
        driver=lookups.versioned_driver,
    )


@pytest.mark.parametrize("bind", ["now", "lazy"])
def test_library_loaded_with_deepbind_is_capped(
    native_build: NativeBuild, region: memcap.Region, lookups: Lookups, bind: str
) -> None:
    _run(native_build, region, lookups.tenant, "deepbind", CAP_BYTES, lookups.deep_lib, bind)


def test_deepbind_by_bare_name_keeps_the_callers_runpath(
    native_build: NativeBuild, region: memcap.Region, lookups: Lookups
) -> None:
    """The load is done on the caller's behalf: its RUNPATH (the tenant's, not ours) still finds the library."""
    _run(native_build, region, lookups.tenant, "deepbind", CAP_BYTES, lookups.deep_lib.name, "now")


def test_driver_in_a_new_link_map_namespace_is_refused(
    native_build: NativeBuild, region: memcap.Region, lookups: Lookups
) -> None:
    _run(native_build, region, lookups.tenant, "dlmopen", lookups.deep_lib)


def test_the_attacks_do_succeed_without_the_interposer(native_build: NativeBuild, lookups: Lookups) -> None:
    """The same programs without the library: the over-cap allocation goes through, so the tests above can fail."""
    env = interposer_env(native_build, None, preload=False)
    for args in (("dlvsym-dlsym", CAP_BYTES), ("deepbind", CAP_BYTES, lookups.deep_lib, "now")):
        result = run([lookups.tenant, *map(str, args)], env)
        assert result.returncode == 1 and "one byte over the cap returned 0" in result.stdout, result.stdout
