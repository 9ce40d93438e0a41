"""scripts/get-kube.sh and its wrapper modules (scripts/kube/mod/): what they pin, and the script's checks run
for real with nothing downloaded or built (GOPROXY=off, an empty module cache, stand-ins for apt-get): an
offline build, a machine whose Go is too old with no Debian Go to start a newer one, and a tampered
cached binary."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.controlplane import ROOT

SCRIPT = ROOT / "scripts" / "get-kube.sh"
MODS = ROOT / "scripts" / "kube" / "mod"
COMPONENTS = {
    "kubernetes": "k8s.io/kubernetes",
    "etcd": "go.etcd.io/etcd/server/v3",
    "containerd": "github.com/containerd/containerd/v2",
    "runc": "github.com/opencontainers/runc",
    "cni": "github.com/containernetworking/plugins",
}
IMAGE_REF = "gpunode.local/pause-busybox:1"


def _go() -> str | None:
    found = shutil.which("go")
    if found is None and os.access("/usr/local/go/bin/go", os.X_OK):
        found = "/usr/local/go/bin/go"
    return found


def _go_new_enough() -> bool:
    go = _go()
    if go is None:
        return False
    need = max((_go_directive(c) for c in COMPONENTS), key=_version_key)
    have = subprocess.run(
        [go, "env", "GOVERSION"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "GOTOOLCHAIN": "local"},
    ).stdout.strip()
    return _version_key(have.removeprefix("go")) >= _version_key(need)


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def _go_directive(component: str) -> str:
    text = (MODS / component / "go.mod").read_text()
    return re.search(r"^go (\S+)$", text, re.M).group(1)  # type: ignore[union-attr]


def _required(component: str) -> str:
    text = (MODS / component / "go.mod").read_text()
    found = re.search(rf"^\s*(?:require\s+)?{re.escape(COMPONENTS[component])} (v\S+)", text, re.M)
    assert found, f"{component}'s go.mod requires no {COMPONENTS[component]}"
    return found.group(1)


needs_go = pytest.mark.skipif(
    not _go_new_enough(), reason="no Go as new as the wrapper modules' go directive"
)


def test_each_component_has_its_own_pinned_module() -> None:
    for component, path in COMPONENTS.items():
        version = _required(component)
        go_sum = (MODS / component / "go.sum").read_text()
        # go.sum holds the main module's checksum (and every other one's): the pin.
        assert re.search(rf"^{re.escape(path)} {re.escape(version)} h1:", go_sum, re.M), component
        tools = (MODS / component / "tools.go").read_text()
        assert tools.startswith("//go:build tools\n") and f'"{path}' in tools, component
    assert _required("kubernetes").startswith("v1.36."), "the e2e cluster is Kubernetes 1.36"
    assert _required("etcd").startswith("v3.6.") and _required("containerd").startswith("v2.2.")
    assert _required("runc").startswith("v1.4.")


def test_every_staging_module_is_replaced_by_its_release(tmp_path: Path) -> None:
    # The list of staging modules comes from k8s.io/kubernetes's own go.mod (scripts/kube/update-mods.sh):
    # read it from the module cache, as a build left it, or skip.
    version = _required("kubernetes")
    go = _go()
    if go is None:
        pytest.skip("no go to find k8s.io/kubernetes's go.mod with")
    proc = subprocess.run(
        [go, "mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "GOPROXY": "off", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"},
        check=False,
    )
    gomod = json.loads(proc.stdout or "{}").get("GoMod")
    if proc.returncode != 0 or not gomod:
        pytest.skip(f"k8s.io/kubernetes@{version} is not in the module cache (run scripts/get-kube.sh)")
    upstream = Path(gomod).read_text()
    staging = set(re.findall(r"^\s*(k8s\.io/\S+) => \./staging/src/", upstream, re.M))
    assert {"k8s.io/api", "k8s.io/client-go", "k8s.io/streaming", "k8s.io/cri-streaming"} <= staging
    ours = dict(
        re.findall(
            r"^\s*(k8s\.io/\S+) => k8s\.io/\S+ (v\S+)$", (MODS / "kubernetes" / "go.mod").read_text(), re.M
        )
    )
    assert set(ours) == staging
    assert set(ours.values()) == {"v0." + version.removeprefix("v1.")}


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    """Nothing reaches a network: GOPROXY=off, an empty module cache, apt-get failing its update."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    apt = "#!/bin/sh\nfor a; do [ \"$a\" = update ] && { echo 'E: Could not resolve deb.debian.org' >&2; exit 100; }; done\nexit 0\n"
    (bindir / "apt-get").write_text(apt)
    (bindir / "apt-get").chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "GOPROXY": "off",
        "GOMODCACHE": str(tmp / "modcache"),
        "GOCACHE": str(tmp / "gocache"),
        "GPUNODE_KUBE_CACHE": str(tmp / "cache"),
        "GPUNODE_KUBE_LINK": str(tmp / "link"),
        **extra,
    }


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def _one_line_and_hint(stderr: str) -> tuple[str, str]:
    lines = [line for line in stderr.splitlines() if line.startswith(("get-kube.sh:", "HINT:"))]
    assert len(lines) >= 2 and lines[0].startswith("get-kube.sh: ") and lines[1].startswith("HINT: "), stderr
    assert "Traceback" not in stderr
    return lines[0], lines[1]


@needs_go
def test_an_offline_build_is_one_line_with_the_fix(tmp_path: Path) -> None:
    proc = _run(_env(tmp_path))
    assert proc.returncode == 1
    problem, hint = _one_line_and_hint(proc.stderr)
    assert problem.startswith("get-kube.sh: building kubernetes failed:") and "GOPROXY=off" in problem, (
        problem
    )
    assert "Go module proxy" in hint, hint
    assert not (tmp_path / "link").exists()
    assert not list((tmp_path / "cache").glob("kube-v*")), "something was assembled from a failed build"


def test_too_old_a_go_with_no_debian_go_to_start_a_newer_is_one_line(tmp_path: Path) -> None:
    env = _env(tmp_path)
    fake_go = tmp_path / "bin" / "go"
    fake_go.write_text('#!/bin/sh\n[ "$1 $2" = "env GOVERSION" ] && { echo go1.19.8; exit 0; }\nexit 2\n')
    fake_go.chmod(0o755)
    proc = _run(env)
    assert proc.returncode == 1
    problem, hint = _one_line_and_hint(proc.stderr)
    assert "no Go on this machine is new enough" in problem and "Could not resolve" in problem, problem
    assert "Go >= 1.21" in hint, hint


@needs_go
def test_a_tampered_cached_binary_is_not_used(tmp_path: Path) -> None:
    # A cache that looks complete, but one of whose binaries was replaced after its digests were recorded:
    # the script must not link it, and goes on to rebuild (here offline, so it fails).
    env = _env(tmp_path)
    printed = _run(env, "--print-cache-dir")
    assert printed.returncode == 0, printed.stderr
    cached = Path(printed.stdout.strip())
    assert cached.parent == tmp_path / "cache" and cached.name.startswith(f"kube-{_required('kubernetes')}-")
    bins = [
        "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "etcd", "etcdctl",
        "containerd", "containerd-shim-runc-v2", "ctr", "runc",
    ]  # fmt: skip
    for sub, names in (("bin", bins), ("cni", ["loopback"])):
        (cached / sub).mkdir(parents=True)
        for b in names:
            (cached / sub / b).write_text(f"#!/bin/sh\necho {b}\n")
            (cached / sub / b).chmod(0o755)
        sums = subprocess.run(
            ["sha256sum", *names], cwd=cached / sub, capture_output=True, text=True, check=True
        )
        (cached / sub / "SHA256SUMS").write_text(sums.stdout)
    text = SCRIPT.read_text()
    busybox_sha = re.search(r'^BUSYBOX_SHA="(\w+)"', text, re.M).group(1)  # type: ignore[union-attr]
    sources = b"".join((ROOT / "scripts" / "kube" / f).read_bytes() for f in ("pause.c", "mkimage.py"))
    (cached / "image").mkdir()
    (cached / "image" / "STAMP").write_text(
        f"{hashlib.sha256(sources).hexdigest()[:16]} {IMAGE_REF} {busybox_sha}\n"
    )
    (cached / "image" / "pause-busybox.tar").write_text("image")

    # As recorded, the cache is used: nothing is built, and the link points at it.
    reused = _run(env)
    assert reused.returncode == 0, reused.stderr
    assert (tmp_path / "link").resolve() == cached.resolve()
    assert "building" not in reused.stdout, reused.stdout
    (tmp_path / "link").unlink()

    (cached / "bin" / "kubelet").write_text("#!/bin/sh\necho tampered\n")
    proc = _run(env)
    assert proc.returncode == 1
    problem, _ = _one_line_and_hint(proc.stderr)
    assert problem.startswith("get-kube.sh: building kubernetes failed"), problem  # a rebuild, not reuse
    assert not (tmp_path / "link").exists(), "the tampered cache was linked"


def test_a_go_older_than_the_modules_runs_the_pinned_toolchain_from_the_proxy(tmp_path: Path) -> None:
    # A Go >= 1.21 but older than the modules' go directive: every go command runs with GOTOOLCHAIN set to
    # the pinned release, which that go fetches from the module proxy (checked by GOSUMDB) and runs.
    env = _env(tmp_path)
    calls = tmp_path / "go-calls"
    fake_go = tmp_path / "bin" / "go"
    fake_go.write_text(
        "#!/bin/sh\n"
        f'echo "GOTOOLCHAIN=$GOTOOLCHAIN $*" >>{calls}\n'
        '[ "$1 $2" = "env GOVERSION" ] && { echo go1.22.0; exit 0; }\n'
        "echo 'go: module lookup disabled by GOPROXY=off' >&2; exit 1\n"
    )
    fake_go.chmod(0o755)
    proc = _run(env)
    assert proc.returncode == 1
    pinned = re.search(r"^GO_TOOLCHAIN=(\S+)", SCRIPT.read_text(), re.M).group(1)  # type: ignore[union-attr]
    assert (
        f"Go 1.22.0 is older than the modules' go {max(map(_go_directive, COMPONENTS), key=_version_key)}"
        in (proc.stdout)
    )
    assert f"using go{pinned} from the module proxy" in proc.stdout, proc.stdout
    made = calls.read_text().splitlines()
    assert made[0] == "GOTOOLCHAIN=local env GOVERSION", made  # the machine's own version, asked first
    builds = [c for c in made if " build " in c]
    assert builds and all(c.startswith(f"GOTOOLCHAIN=go{pinned} ") for c in made[1:]), made
    problem, _ = _one_line_and_hint(proc.stderr)
    assert problem.startswith("get-kube.sh: building kubernetes failed"), problem
