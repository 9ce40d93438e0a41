"""A real node for the end-to-end tests: containerd 2 (CRI, runc, loopback-only CNI, CDI) and a kubelet,
all as scripts/get-kube.sh builds them (.tools/kube/bin, .tools/kube/cni).

The kubelet registers with the ControlPlane's API server as system:node:<name> (NodeRestriction holds
it to its own Node) and runs pods from the local pause+busybox image that scripts/get-kube.sh builds
(there is no registry: imagePullPolicy Never; containerd pins it as the sandbox image). Settings this
machine needs: containerd's restrict_oom_score_adj (no CAP_SYS_RESOURCE), the kubelet's
failCgroupV1: false (the machine mounts cgroup v1, which kubelet 1.35+ refuses otherwise), the cgroupfs
driver with cgroupsPerQOS and node-allocatable enforcement off, no swap check. containerd reads CDI
specs from the node's own directory (cdi_dir).

The kubelet serves device-plugin registration at /var/lib/kubelet/device-plugins/kubelet.sock whatever
its --root-dir (still so in 1.36), and links container logs in /var/log/containers, so it runs in a
private mount namespace (unshare -m) in which the test's own directories are bind-mounted there; a
device plugin outside (the agent) uses device_plugins as its --kubelet-dir. Pod logs follow podLogsDir.
The node is ready for pods once it is Ready and kube-controller-manager's node lifecycle controller has
removed the node.kubernetes.io/not-ready taint the kubelet registered it with.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import yaml

from tests.e2e.api import ApiError, eventually
from tests.e2e.controlplane import FEATURE_GATES, ControlPlane, User, kube_dir
from tests.e2e.objects import NOT_READY_TAINT
from tests.e2e.procs import Proc
from tests.ports import free_port

NODE_BINARIES = ("kubelet", "containerd", "containerd-shim-runc-v2", "runc", "ctr")
KUBELET_DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
CONTAINER_LOGS = Path("/var/log/containers")  # fixed in kubelet 1.36 (pod logs follow podLogsDir)
CNI_PLUGINS = "cni"
IMAGE_REF_FILE = "image/REF"
IMAGE_TAR = "image/pause-busybox.tar"
NODE_WAIT_S = 180.0


def node_user(name: str) -> User:
    """The identity a kubelet has for the Node authorizer."""
    return User(f"system:node:{name}", ("system:nodes",))


def node_missing_reason() -> str | None:
    """Why a real node cannot run here, or None."""
    if os.geteuid() != 0:
        return "a real kubelet and containerd need root"
    needed = [f"bin/{b}" for b in NODE_BINARIES] + [f"{CNI_PLUGINS}/loopback", IMAGE_TAR, IMAGE_REF_FILE]
    missing = [n for n in needed if not (kube_dir() / n).is_file()]
    if missing:
        return f"no {', '.join(missing)} in {kube_dir()}: run scripts/get-kube.sh (it builds them)"
    if shutil.which("unshare") is None:
        return "no unshare (util-linux): install it with apt-get"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"cannot make a mount namespace (unshare -m): {probe.stderr.strip()}"
    return None


class RealNode:
    """containerd + kubelet for one Node named `name`, in `workdir` (see the module docstring)."""

    def __init__(self, control_plane: ControlPlane, name: str, workdir: Path, *, user: str = "node") -> None:
        """Plan the node; `user` is the control plane's user key for node_user(name)."""
        self.cp = control_plane
        self.name = name
        self.workdir = workdir
        self.user = user
        self.device_plugins = workdir / "device-plugins"
        self.cdi_dir = workdir / "cdi"  # containerd's CDI spec directory
        self.root_dir = workdir / "kubelet"
        self.sock = workdir / "containerd.sock"
        self.pod_logs = workdir / "pod-logs"
        self.bin = kube_dir() / "bin"
        self.image = (kube_dir() / IMAGE_REF_FILE).read_text().strip()
        self.containerd: Proc | None = None
        self.kubelet: Proc | None = None

    @property
    def pod_resources_socket(self) -> Path:
        """The kubelet's pod-resources socket (this one follows --root-dir)."""
        return self.root_dir / "pod-resources" / "kubelet.sock"

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        """What a container of a pod on this node has written so far ("" before it has)."""
        found = sorted(self.pod_logs.glob(f"{namespace}_{pod}_*/{container}/*.log"))
        return "".join(p.read_text(errors="replace") for p in found)

    def start(self) -> RealNode:
        """Start containerd, load the image, start the kubelet; wait until the Node is Ready and the node
        lifecycle controller has removed its not-ready taint."""
        for d in (
            self.device_plugins,
            self.cdi_dir,
            self.root_dir,
            self.workdir / "cni",
            self.pod_logs,
            self.workdir / "container-logs",
        ):
            d.mkdir(parents=True, exist_ok=True)
        self._start_containerd()
        self._start_kubelet()
        admin = self.cp.api()

        def ready() -> bool:
            node = admin.get(f"/api/v1/nodes/{self.name}")
            conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
            taints = {t.get("key") for t in node.get("spec", {}).get("taints") or []}
            return conditions.get("Ready") == "True" and NOT_READY_TAINT not in taints

        eventually(
            ready, timeout_s=NODE_WAIT_S, what=f"node {self.name} Ready and without the not-ready taint"
        )
        return self

    def _start_containerd(self) -> None:
        (self.workdir / "cni" / "10-loopback.conflist").write_text(
            json.dumps({"cniVersion": "1.0.0", "name": "loopback", "plugins": [{"type": "loopback"}]})
        )
        runtime = 'plugins."io.containerd.cri.v1.runtime"'
        config = f"""version = 3
root = "{self.workdir / "containerd" / "root"}"
state = "{self.workdir / "containerd" / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.erofs"]
[grpc]
  address = "{self.sock}"
[{runtime}]
  restrict_oom_score_adj = true
  enable_selinux = false
  enable_cdi = true
  cdi_spec_dirs = ["{self.cdi_dir}"]
[{runtime}.containerd]
  default_runtime_name = "runc"
[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{runtime}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  BinaryName = "{self.bin / "runc"}"
[{runtime}.cni]
  bin_dirs = ["{kube_dir() / CNI_PLUGINS}"]
  conf_dir = "{self.workdir / "cni"}"
[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{self.image}"
"""
        path = self.workdir / "containerd.toml"
        path.write_text(config)
        # The shim is found on PATH (containerd runs containerd-shim-runc-v2 by name).
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        argv = [str(self.bin / "containerd"), "--config", str(path)]
        self.containerd = Proc("containerd", argv, self.cp.logs, env=env).start()
        self.cp.procs.append(self.containerd)
        self.containerd.wait_until(self.sock.exists, timeout_s=NODE_WAIT_S, what="containerd socket")
        self.import_image(kube_dir() / IMAGE_TAR)

    def import_image(self, tarball: Path) -> None:
        """Load a `docker save` tarball (scripts/kube/mkimage.py) into containerd's k8s.io namespace."""
        subprocess.run(
            [
                str(self.bin / "ctr"),
                "--address",
                str(self.sock),
                "-n",
                "k8s.io",
                "images",
                "import",
                str(tarball),
            ],
            check=True,
            capture_output=True,
            timeout=NODE_WAIT_S,
        )

    def restart_kubelet(self) -> None:
        """Stop the kubelet (SIGTERM) and start it again with the same settings; containerd and the
        containers keep running. Waits until the new kubelet is healthy."""
        if self.kubelet is not None:
            self.kubelet.stop()
            self.cp.procs.remove(self.kubelet)
        self._start_kubelet()

    def _start_kubelet(self) -> None:
        healthz = free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{self.sock}",
            "podLogsDir": str(self.pod_logs),
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "failCgroupV1": False,  # this machine mounts cgroup v1: kubelet 1.35+ refuses it otherwise
            "featureGates": dict(FEATURE_GATES),
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "volumeStatsAggPeriod": "0s",
            "resolvConf": "",
        }
        path = self.workdir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        kubelet = [
            str(kube_dir() / "bin" / "kubelet"),
            f"--config={path}",
            f"--kubeconfig={self.cp.kubeconfig(self.user)}",
            f"--root-dir={self.root_dir}",
            f"--cert-dir={self.workdir / 'kubelet-pki'}",
            f"--hostname-override={self.name}",
            "--v=2",
        ]
        binds = {
            self.device_plugins: KUBELET_DEVICE_PLUGINS,
            self.workdir / "container-logs": CONTAINER_LOGS,
        }
        self.kubelet = Proc("kubelet", _private_mounts(binds, kubelet), self.cp.logs).start()
        self.cp.procs.append(self.kubelet)
        self.kubelet.wait_until(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{healthz}/healthz", timeout=5).status == 200,
            timeout_s=NODE_WAIT_S,
            what="healthy kubelet",
        )

    def stop(self) -> None:
        """Stop the kubelet, remove what containerd runs, stop containerd."""
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.containerd is not None and self.containerd.running():
            _remove_all_pods(self.bin / "ctr", self.sock)
            self.containerd.stop()
        # The shims outlive containerd by design (own sessions): end the ones of this node's tasks.
        _kill_shims(self.workdir)
        # containerd 2 mounts each sandbox's /dev/shm under its state directory; with the sandboxes
        # removed behind its back, nobody else unmounts them.
        _unmount_under(self.workdir)
        # Leave no Node behind for later tests' schedulers to count.
        with contextlib.suppress(ApiError, OSError):
            self.cp.api().delete(f"/api/v1/nodes/{self.name}")


def _private_mounts(binds: dict[Path, Path], argv: list[str]) -> list[str]:
    """argv run in a private mount namespace in which each source directory is bind-mounted on its target."""
    steps = [f"mkdir -p {dst} && mount --bind {src} {dst}" for src, dst in binds.items()]
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        " && ".join(steps) + ' && exec "$@"',
        "sh",
        *argv,
    ]


def _remove_all_pods(ctr_bin: Path, sock: Path) -> None:
    ctr = [str(ctr_bin), "--address", str(sock), "-n", "k8s.io"]
    tasks = subprocess.run(
        [*ctr, "tasks", "ls", "-q"], capture_output=True, text=True, timeout=60, check=False
    )
    for task in tasks.stdout.split():
        subprocess.run(
            [*ctr, "tasks", "kill", "-s", "SIGKILL", task], capture_output=True, timeout=30, check=False
        )
        subprocess.run([*ctr, "tasks", "delete", "-f", task], capture_output=True, timeout=30, check=False)


def _kill_shims(workdir: Path) -> None:
    """SIGKILL containerd-shim-runc-v2 processes started for this node (their command line names its paths)."""
    marker = str(workdir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim-runc-v2" in cmdline and marker in cmdline:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


def _unmount_under(directory: Path) -> None:
    """Lazily unmount every mount point under `directory`, deepest first."""
    prefix = str(directory.resolve()) + "/"
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return
    # /proc/self/mounts escapes spaces and other characters as octal (\040): undo that.
    points = [
        p.encode().decode("unicode_escape")
        for p in (line.split()[1] for line in lines if len(line.split()) > 1)
    ]
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30, check=False)
