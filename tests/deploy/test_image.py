"""The container image: Containerfile built for real, its own entrypoint run on the simulated node.

scripts/build-image.sh builds ./Containerfile with buildah (RUN steps in buildah's chroot isolation:
no OCI runtime is needed, which this kind of machine cannot run). This machine reaches Debian's
mirror and PyPI but no container registry, so the FROM is scripts/image-base.sh's debian:bookworm-slim
stand-in, debootstrapped from Debian's packages (GPUNODE_BASE_IMAGE names another base). Base and
layers are cached (~/.cache/gpunode and buildah's storage): a cold run takes about two minutes on two
cores, a later one about 15 seconds (the wheel layer is rebuilt when gpunode/ changed).

The built image's root filesystem (`buildah mount`) is then run the way a container runtime runs the
chart's pods: in its own mount namespace, read-only, with /proc, /dev, a tmpfs /tmp and the host
directories of the chart's hostPath volumes bound at their paths, chrooted, with the image's Env,
User, Entrypoint and Cmd as the image's configuration records them. The agent serves the device
plugins to a kubelet stand-in through the bound socket directory, its metrics are scraped over
loopback, Allocate hands out the interposer it staged into the bound state directory, and SIGTERM
stops it. The extender runs from the same image as nobody (65534), as the chart runs it.
Needs root (buildah, mount, chroot); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from gpunode.node.memcap.gc import staged_library_dir
from tests.fakes.kubelet import KubeletStandIn

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "Containerfile"
TAG = "localhost/gpunode:test"
SITE = "opt/gpunode/lib/python3.11/site-packages"
PRELOAD = f"{SITE}/gpunode/lib/libgpunode-preload.so"
GPU = "nvidia.com/gpu"
MEM = "gpunode.io/gpu-memory"
WAIT_S = 120.0  # generous: two shared cores
T = TypeVar("T")


def containerfile_instruction(name: str) -> list[str]:
    """The JSON (exec) form of the last stage's ENTRYPOINT or CMD, as the Containerfile writes it."""
    found = re.findall(rf"^{name}\s+(\[.*\])\s*$", CONTAINERFILE.read_text(), re.M)
    assert found, f"no {name} in exec form in {CONTAINERFILE}"
    return list(json.loads(found[-1]))


def project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_containerfile_chart_and_readme_agree() -> None:
    """One version, one image name, one entrypoint: Containerfile, package, chart and README."""
    chart = yaml.safe_load((ROOT / "helm/gpunode/Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "helm/gpunode/values.yaml").read_text())
    version = re.search(r"^ARG VERSION=(\S+)$", CONTAINERFILE.read_text(), re.M)
    assert version and version.group(1) == project_version() == chart["appVersion"]
    assert values["image"]["repository"] == "gpunode" and values["image"]["tag"] == ""
    assert (
        f"podman build -f Containerfile -t gpunode:{chart['appVersion']} ."
        in (ROOT / "README.md").read_text()
    )
    assert containerfile_instruction("ENTRYPOINT") == ["gpunode"]
    for template in ("agent-daemonset.yaml", "extender-deployment.yaml"):
        assert 'command: ["gpunode"]' in (ROOT / "helm/gpunode/templates" / template).read_text()


# --- the built image ---------------------------------------------------------------------------------


@dataclass
class Image:
    """The built image: its configuration and a mounted copy of its root filesystem."""

    config: dict[str, Any]
    rootfs: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(item.split("=", 1) for item in self.config.get("Env", []))
        return {**env, **extra}

    def argv(self) -> list[str]:
        return [*self.config["Entrypoint"], *self.config.get("Cmd", [])]


def _buildah(*args: str) -> str:
    return subprocess.run(["buildah", *args], check=True, capture_output=True, text=True, timeout=300).stdout


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    if os.geteuid() != 0:
        pytest.skip("building and running the image needs root (buildah, mount namespaces, chroot)")
    if shutil.which("buildah") is None and shutil.which("apt-get") is None:
        pytest.skip("needs Debian's buildah (scripts/build-image.sh installs it with apt-get)")
    log = tmp_path_factory.mktemp("image") / "build.log"
    env = {**os.environ, "GPUNODE_BASE_IMAGE": os.environ.get("GPUNODE_BASE_IMAGE", "local")}
    with log.open("w") as out:
        built = subprocess.run(
            ["bash", str(ROOT / "scripts/build-image.sh"), TAG],
            stdout=subprocess.PIPE, stderr=out, text=True, env=env, timeout=1500, check=False,
        )  # fmt: skip
    assert built.returncode == 0, f"the image build failed:\n{log.read_text()[-6000:]}"
    assert built.stdout.strip().splitlines()[-1] == TAG
    config = json.loads(_buildah("inspect", "--type", "image", TAG))["OCIv1"]["config"]
    container = _buildah("from", "--pull-never", TAG).strip()
    try:
        rootfs = Path(_buildah("mount", container).strip())
        # What a runtime creates for the pod's volume mounts.
        for d in (
            "var/lib/kubelet/device-plugins",
            "var/lib/kubelet/pod-resources",
            "var/lib/gpunode",
            "etc/gpunode",
        ):
            (rootfs / d).mkdir(parents=True, exist_ok=True)
        yield Image(config, rootfs)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, timeout=120, check=False)


# In a private mount namespace (unshare's default propagation): the image root bound read-only (the
# chart's readOnlyRootFilesystem), the pod's mounts on it, then chroot to the image's user and command.
_RUN_IN_ROOT = r"""
set -eu
root=$1; user=$2; shift 2
mount --bind "$root" "$root"
mount -o remount,bind,ro "$root"
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"
mount -t tmpfs -o size=16m,mode=1777 tmpfs "$root/tmp"
while [ "$1" != -- ]; do
  mount --bind "$1" "$root$2"
  if [ "$3" = ro ]; then mount -o remount,bind,ro "$root$2"; fi
  shift 3
done
shift
exec chroot --userspec="$user" "$root" "$@"
"""


def run_in_image(
    image: Image,
    argv: list[str],
    env: dict[str, str],
    binds: list[tuple[Path, str, str]],
    log: Path,
    user: str,
) -> subprocess.Popen[bytes]:
    """Start argv in the image root; the pid is the image's process itself (every step execs)."""
    bind_args = [part for host, path, mode in binds for part in (str(host), path, mode)]
    with log.open("wb") as out:
        return subprocess.Popen(
            ["unshare", "--mount", "--", "sh", "-c", _RUN_IN_ROOT, "sh", str(image.rootfs), user,
             *bind_args, "--", *argv],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **env}, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def wait_for_address(proc: subprocess.Popen[bytes], log: Path, server: str) -> str:
    """host:port from the server's start-up line ("<server>: serving HTTP on 127.0.0.1:NNNN")."""
    pattern = re.compile(rf"\b{re.escape(server)}: serving http on (127\.0\.0\.1:\d+)", re.I)
    return wait_until(
        proc, log, lambda text: m.group(1) if (m := pattern.search(text)) else None, f"{server} listening"
    )


def wait_until(proc: subprocess.Popen[bytes], log: Path, found: Callable[[str], T | None], what: str) -> T:
    """found(the process's output so far) once it is truthy; fails if the process exits or WAIT_S passes."""
    deadline = time.monotonic() + WAIT_S
    while True:
        text = log.read_text(errors="replace")
        result = found(text)
        if result:
            return result
        assert proc.poll() is None, f"the process exited ({proc.returncode}) before {what}:\n{text[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{text[-4000:]}"
        time.sleep(0.2)


def get(url: str) -> tuple[int, str]:
    """The status and body of a GET (an error status is returned, not raised)."""
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.timeout(1800)
def test_image_holds_the_wheel_and_its_runtime_only(image: Image) -> None:
    root = image.rootfs
    assert image.config["Entrypoint"] == containerfile_instruction("ENTRYPOINT") == ["gpunode"]
    assert image.config["Cmd"] == containerfile_instruction("CMD") == ["agent"]
    assert image.config["User"] == "0:0"
    labels = image.config["Labels"]
    assert labels["org.opencontainers.image.version"] == project_version()
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    # The wheel with its native parts, found where the agent stages the interposer from.
    assert (root / PRELOAD).read_bytes()[:4] == b"\x7fELF"
    assert list((root / SITE / "gpunode").glob("_memcap*.so"))
    assert (root / "opt/gpunode/bin/gpunode").is_file()
    # Nothing of the build: no compiler, headers, pip, wheels, sources or caches.
    for gone in (
        "usr/bin/gcc",
        "usr/bin/cc",
        "usr/include/python3.11",
        "opt/gpunode/bin/pip",
        "src",
        "root/.cache",
        "tmp/wheels",
        "opt/tools",
        "out",
    ):
        assert not (root / gone).exists(), f"/{gone} is in the runtime image"
    assert not list((root / SITE).glob("pip*")) and not list((root / SITE).glob("setuptools*"))
    assert not list((root / "var/lib/apt/lists").glob("*Packages*")), "apt's package lists are in the image"
    installed = (root / "var/lib/dpkg/status").read_text()
    for package in ("gcc", "libc6-dev", "python3-dev", "python3-venv"):
        assert f"\nPackage: {package}\n" not in installed, f"{package} is installed in the runtime image"


@pytest.mark.timeout(1800)
def test_agent_entrypoint_serves_the_simulated_node(
    image: Image, kubelet: KubeletStandIn, sockdir: Path
) -> None:
    state, etc = sockdir / "state", sockdir / "etc"
    state.mkdir()
    etc.mkdir()
    # The chart's configuration file, with the simulated node and a loopback port of the kernel's choosing.
    (etc / "config.yaml").write_text(
        yaml.safe_dump({
            "version": "v1",
            "flags": {"migStrategy": "none", "failOnInitError": True},
            "gpunode": {"backend": "sim", "simProfile": "t4", "metrics": {"listen": "127.0.0.1:0"},
                        "fractional": {"devices": [0], "unit": "1Gi"}},
        })
    )  # fmt: skip
    log = sockdir / "agent.log"
    argv = image.argv()
    assert argv == ["gpunode", "agent"], "the test runs the image's own ENTRYPOINT and CMD, unchanged"
    # The chart's volume mounts (the hostPaths at their own paths) and environment.
    binds = [(sockdir / "device-plugins", "/var/lib/kubelet/device-plugins", "rw"), (state, "/var/lib/gpunode", "rw"),
             (etc, "/etc/gpunode", "ro")]  # fmt: skip
    env = image.env(NODE_NAME="node-1", GPUNODE_CONFIG="/etc/gpunode/config.yaml")
    proc = run_in_image(image, argv, env, binds, log, user="0:0")
    try:
        address = wait_for_address(proc, log, "metrics")
        assert os.readlink(f"/proc/{proc.pid}/root") == str(image.rootfs), (
            "the agent must run in the image root"
        )
        exe = os.readlink(f"/proc/{proc.pid}/exe")
        assert exe == str(image.rootfs / "usr/bin/python3.11"), f"the image's own Python, not {exe}"
        kubelet.wait_for_resources([GPU, MEM], timeout=WAIT_S)
        assert len(kubelet.healthy(GPU)) == 3  # t4: four GPUs, GPU 0 sold in memory units

        wait_until(proc, log, lambda _: get(f"http://{address}/ready")[0] == 200 or None, "/ready")
        status, text = get(f"http://{address}/metrics")
        assert status == 200
        for series in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP"):
            gpus = set(re.findall(rf'^{series}\{{[^}}]*\bgpu="(\d+)"', text, re.M))
            assert gpus == {"0", "1", "2", "3"}, f"{series} for GPUs {sorted(gpus)}"

        # Allocate hands out the interposer the agent staged from the image into the host state directory.
        units = [i for i in kubelet.healthy(MEM) if "::mem" in i][:2]
        resp = kubelet.allocate(MEM, units)
        library = {m.container_path: m for m in resp.mounts}[resp.envs["LD_PRELOAD"]]
        # staged per region layout (stateDir/lib/layout-<N>/), never over an older agent's library
        staged = staged_library_dir(Path("/var/lib/gpunode")) / "libgpunode-preload.so"
        assert library.host_path == str(staged) and library.read_only
        assert (state / staged.relative_to("/var/lib/gpunode")).read_bytes() == (
            image.rootfs / PRELOAD
        ).read_bytes()

        assert stop(proc) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "gpunode agent ready" in log.read_text()
    assert not list((sockdir / "device-plugins").glob("gpunode-*.sock")), "sockets must be removed on SIGTERM"


@pytest.mark.timeout(1800)
def test_extender_runs_from_the_image_as_nobody(image: Image, tmp_path: Path) -> None:
    log = tmp_path / "extender.log"
    argv = [
        *image.config["Entrypoint"],
        "extender",
        "--listen",
        "127.0.0.1:0",
        "--health-listen",
        "127.0.0.1:0",
    ]
    proc = run_in_image(image, argv, image.env(), [], log, user="65534:65534")
    try:
        health = wait_for_address(proc, log, "extender health")
        assert get(f"http://{health}/healthz")[0] == 200
        status = (Path(f"/proc/{proc.pid}/status")).read_text()
        assert re.search(r"^Uid:\s+65534\s", status, re.M), "the extender runs as nobody"
        assert stop(proc) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
