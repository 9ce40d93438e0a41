"""scripts/get-kube.sh's checks, run for real against stand-ins for apt-get and dpkg-query on PATH (nothing is
downloaded or built): a mirror serving files that do not match the pinned checksums, a mirror that is
unreachable, and a tampered cached binary."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.controlplane import ROOT

SCRIPT = ROOT / "scripts" / "get-kube.sh"
IMAGE_REF = "gpunode.local/pause-busybox:1"


def _bookworm() -> bool:
    try:
        return "VERSION_CODENAME=bookworm" in Path("/etc/os-release").read_text()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _bookworm(), reason="get-kube.sh pins Debian 12 (bookworm) packages")


def _pinned_names() -> list[str]:
    text = SCRIPT.read_text()
    pins = text.split('PINS="', 1)[1].split('"', 1)[0]
    return [line.split()[1] for line in pins.strip().splitlines()]


def _standins(tmp: Path, *, update_fails: bool) -> dict[str, str]:
    """PATH with an apt-get that writes junk under each pinned file name, and a dpkg-query that says every
    package is installed."""
    bindir = tmp / "bin"
    bindir.mkdir()
    names = " ".join(f"'{n}'" for n in _pinned_names())
    apt = f"""#!/bin/bash
for a in "$@"; do
  case "$a" in
    update) {"echo 'E: Could not resolve deb.debian.org' >&2; exit 100" if update_fails else "exit 0"} ;;
    source|download) for n in {names}; do echo tampered >"$n"; done; exit 0 ;;
  esac
done
exit 0
"""
    for name, text in (("apt-get", apt), ("dpkg-query", "#!/bin/sh\necho 'install ok installed'\n")):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "GPUNODE_KUBE_CACHE": str(tmp / "cache")}


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def test_downloads_that_do_not_match_the_pins_are_refused(tmp_path: Path) -> None:
    proc = _run(_standins(tmp_path, update_fails=False))
    assert proc.returncode == 1
    assert "does not have its pinned sha256; nothing was built" in proc.stderr, proc.stderr
    assert re.search(r"^HINT: ", proc.stderr, re.M)
    assert not list((tmp_path / "cache").glob("kube-v*")), "something was built from tampered files"


def test_unreachable_mirror_is_one_line_with_the_fix(tmp_path: Path) -> None:
    proc = _run(_standins(tmp_path, update_fails=True))
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("get-kube.sh:", "HINT:"))]
    assert lines[0].startswith("get-kube.sh: apt-get update") and "Could not resolve" in lines[0], proc.stderr
    assert lines[1].startswith("HINT: check that this machine reaches Debian's mirror")
    assert "Traceback" not in proc.stderr


def test_a_tampered_cached_binary_is_not_used(tmp_path: Path) -> None:
    # A cache that looks complete, but one of whose binaries was replaced after its digests were recorded:
    # the script must not link it, and goes on to rebuild (here up to the mirror, which is unreachable).
    env = {**_standins(tmp_path, update_fails=True), "GPUNODE_KUBE_LINK": str(tmp_path / "link")}
    printed = subprocess.run(
        ["bash", str(SCRIPT), "--print-cache-dir"], capture_output=True, text=True, env=env, check=True
    )
    cached = Path(printed.stdout.strip())
    assert cached.parent == tmp_path / "cache"
    (cached / "bin").mkdir(parents=True)
    (cached / "image").mkdir()
    bins = ["kube-apiserver", "kube-scheduler", "kubelet", "etcd", "etcdctl"]
    for b in bins:
        (cached / "bin" / b).write_text(f"#!/bin/sh\necho {b}\n")
        (cached / "bin" / b).chmod(0o755)
    sums = subprocess.run(
        ["sha256sum", *bins], cwd=cached / "bin", capture_output=True, text=True, check=True
    )
    (cached / "bin" / "SHA256SUMS").write_text(sums.stdout)
    sources = b"".join((ROOT / "scripts" / "kube" / f).read_bytes() for f in ("pause.c", "mkimage.py"))
    (cached / "image" / "STAMP").write_text(f"{hashlib.sha256(sources).hexdigest()[:16]} {IMAGE_REF}\n")
    (cached / "image" / "pause-busybox.tar").write_text("image")

    # As recorded, the cache is used: nothing is fetched, and the link points at it.
    reused = _run(env)
    assert reused.returncode == 0, reused.stderr
    assert (tmp_path / "link").resolve() == cached.resolve()
    (tmp_path / "link").unlink()

    (cached / "bin" / "kubelet").write_text("#!/bin/sh\necho tampered\n")
    proc = _run(env)
    assert proc.returncode == 1
    assert "apt-get update" in proc.stderr, proc.stderr  # it tried to rebuild rather than reuse
    assert not (tmp_path / "link").exists(), "the tampered cache was linked"
