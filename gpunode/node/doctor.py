"""`gpunode doctor`: diagnose a node, one check at a time, each with a hint when it fails.

checks() returns Check records; nothing here changes the node (it opens the
backend once and builds the inventory read-only, looks at sockets and
directories, and asks a running agent's metrics endpoint for /health). A failed
check never stops the others, and a backend that cannot be opened is reported
once: the checks that need it say they were skipped.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpunode.config.agent import Config
from gpunode.errors import GpunodeError, ProfileError

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    """The outcome of one doctor check: status "ok", "warn" or "fail", what it found, and a hint to fix it."""

    name: str
    status: str  # ok | warn | fail
    detail: str
    hint: str = ""

    @property
    def ok(self) -> bool:
        """Whether the check did not fail (a warning counts as ok)."""
        return self.status != FAIL


def _check_python() -> Check:
    v = sys.version_info
    if v < (3, 11):
        return Check("python", FAIL, f"Python {v.major}.{v.minor}", "gpunode needs Python 3.11 or newer")
    return Check("python", OK, f"Python {v.major}.{v.minor}.{v.micro} at {sys.executable}")


class _Node:
    """What several checks share: the GPUs, read once (None when the backend failed), and the inventory."""

    def __init__(self) -> None:
        self.gpus: list[Any] | None = None
        self.inventory: Any = None


def _check_backend(cfg: Config, node: _Node) -> Check:
    from gpunode.node.devices.select import detect_backend

    try:
        backend = detect_backend(cfg.backend, cfg.sim_profile if cfg.backend == "sim" else None)
    except ProfileError as exc:
        where = cfg.origin("sim_profile", "gpunode.simProfile")
        return Check("gpu backend", FAIL, f"{where}: {exc}", exc.hint)
    except GpunodeError as exc:
        if cfg.backend == "auto":  # an agent running here may use a backend auto does not pick (sim)
            running = _agent_backend(cfg)
            if running is not None:
                return _check_agent_backend(running, node, exc)
        return Check("gpu backend", FAIL, str(exc), exc.hint)
    return _describe_backend(backend, node)


def _describe_backend(backend: Any, node: _Node, *, source: str = "") -> Check:
    """The backend's GPUs and driver as the check's detail (`source` says whose backend it is)."""
    try:
        gpus = backend.gpus()
        driver = backend.driver_version() or "unknown"
        models = sorted({g.model for g in gpus})
        mig = sum(1 for g in gpus if g.mig_enabled)
        detail = f"{backend.name}{source}: {len(gpus)} GPU(s) {', '.join(models)}; driver {driver}"
        if mig:
            detail += f"; {mig} with MIG enabled"
        node.gpus = list(gpus)
        return Check("gpu backend", OK, detail)
    except GpunodeError as exc:
        return Check("gpu backend", FAIL, str(exc), exc.hint)
    finally:
        backend.close()


def _check_agent_backend(running: tuple[str, str], node: _Node, auto_failed: GpunodeError) -> Check:
    """The backend of the agent answering here, when `--backend auto` finds none (the agent runs on the
    simulated node): doctor opens the same one, so the other checks look at the GPUs the agent serves."""
    from gpunode.node.devices.select import detect_backend

    name, url = running
    source = f" (the backend of the agent at {url})"
    if name.startswith("sim:"):
        profile = name.removeprefix("sim:")
        try:
            backend = detect_backend("sim", profile)
        except GpunodeError as exc:
            return Check(
                "gpu backend",
                WARN,
                f"the agent at {url} runs on {name}, which doctor cannot open: {exc}",
                "run doctor with the agent's settings: gpunode doctor --backend sim --sim-profile FILE",
            )
        return _describe_backend(backend, node, source=source)
    return Check(
        "gpu backend",
        FAIL,
        f"the agent at {url} uses {name}, but here {auto_failed}",
        auto_failed.hint or "run doctor where the agent runs, with its settings",
    )


SKIPPED = "not checked: the gpu backend failed (above)"


def _check_inventory(cfg: Config, node: _Node) -> Check:
    from gpunode.node.inventory import build_inventory

    if node.gpus is None:
        return Check("advertised devices", WARN, SKIPPED, "fix the gpu backend first")
    try:
        inventory = node.inventory = build_inventory(node.gpus, cfg)
    except GpunodeError as exc:
        return Check("advertised devices", FAIL, str(exc), exc.hint)
    parts = [f"{len(inventory.by_resource(r))} x {r}" for r in inventory.resources()]
    if inventory.warnings:
        return Check(
            "advertised devices", WARN, "; ".join(parts + list(inventory.warnings)), "see `gpunode devices`"
        )
    return Check("advertised devices", OK, "; ".join(parts) or "nothing")


def _socket_answers(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(str(path))
        return True
    except OSError:
        return False


def _check_kubelet(cfg: Config) -> Check:
    sock = cfg.kubelet_socket
    if not cfg.kubelet_dir.is_dir():
        return Check(
            "kubelet",
            WARN,
            f"{cfg.kubelet_dir} does not exist",
            "on a bare-metal node without a kubelet this is expected",
        )
    if not os.access(cfg.kubelet_dir, os.W_OK):
        return Check(
            "kubelet",
            FAIL,
            f"{cfg.kubelet_dir} is not writable",
            "run the agent as root or mount it read-write",
        )
    if not sock.exists():
        return Check("kubelet", WARN, f"no {sock}", "the agent registers as soon as the kubelet creates it")
    if not _socket_answers(sock):
        return Check("kubelet", FAIL, f"{sock} does not accept connections", "is the kubelet running?")
    return Check("kubelet", OK, f"{sock} answers")


def _check_plugins(cfg: Config, node: _Node) -> Check:
    """The agent's device-plugin sockets in the kubelet's directory: one per advertised resource, each
    accepting connections (the kubelet reaches the plugins through them)."""
    from gpunode.node.kubelet.deviceplugin import socket_name

    name = "device plugins"
    if node.inventory is None:
        return Check(name, WARN, "not checked: the advertised devices are not known (above)")
    expected = {socket_name(r): r for r in node.inventory.resources()}
    if not expected:
        return Check(name, OK, "nothing to advertise, so no plugin sockets")
    present = {p.name for p in cfg.kubelet_dir.glob("gpunode-*.sock")} if cfg.kubelet_dir.is_dir() else set()
    missing = sorted(n for n in expected if n not in present)
    dead = sorted(n for n in expected if n in present and not _socket_answers(cfg.kubelet_dir / n))
    stale = sorted(present - set(expected))
    if len(missing) == len(expected):
        return Check(
            name,
            WARN,
            f"no agent plugin socket in {cfg.kubelet_dir} (expected {', '.join(sorted(expected))})",
            "start the agent (`gpunode agent`, or its DaemonSet pod on this node)",
        )
    problems = [f"{n} missing" for n in missing] + [f"{n} does not accept connections" for n in dead]
    if problems:
        return Check(
            name,
            FAIL,
            f"{len(expected) - len(missing) - len(dead)} of {len(expected)} plugin sockets answer; "
            + "; ".join(problems),
            "the agent serves one socket per resource; restart it and read its log",
        )
    detail = f"{len(expected)} plugin socket(s) answer in {cfg.kubelet_dir}: {', '.join(sorted(expected))}"
    if stale:
        return Check(
            name,
            WARN,
            f"{detail}; also {', '.join(stale)}, for resources this configuration does not advertise",
            "an agent with another configuration left them, or runs beside this one",
        )
    return Check(name, OK, detail)


# How long the agent's metrics endpoint has to answer /health.
AGENT_TIMEOUT_S = 3.0


def _agent_host(cfg: Config) -> str:
    """Where doctor reaches the agent's metrics endpoint: its listen address, loopback for a wildcard."""
    host = cfg.metrics.listen_address.host
    return host if host not in ("", "0.0.0.0", "::") else "127.0.0.1"


def _agent_url(cfg: Config, path: str) -> str:
    host = _agent_host(cfg)
    return f"http://{f'[{host}]' if ':' in host else host}:{cfg.metrics.listen_address.port}{path}"


def _agent_backend(cfg: Config) -> tuple[str, str] | None:
    """(the backend the agent running here reads, its endpoint URL) from its /agent, or None when no
    agent answers there (metrics off, random port, credentials needed, nothing listening, not gpunode)."""
    metrics = cfg.metrics
    if not metrics.enabled or metrics.listen_address.port == 0 or metrics.web_config_file:
        return None
    conn = http.client.HTTPConnection(_agent_host(cfg), metrics.listen_address.port, timeout=AGENT_TIMEOUT_S)
    try:
        conn.request("GET", "/agent")
        response = conn.getresponse()
        body = response.read(4096)
        said = json.loads(body) if response.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()
    backend = said.get("backend") if isinstance(said, dict) else None
    if not isinstance(backend, str) or not backend:
        return None
    return backend[:200], _agent_url(cfg, "")


def _check_agent(cfg: Config) -> Check:
    """Whether an agent runs here: its metrics endpoint (from the configuration) answers /health."""
    name = "agent"
    metrics = cfg.metrics
    if not metrics.enabled:
        return Check(
            name, WARN, "not checked: gpunode.metrics.enabled is false, so the agent serves no /health"
        )
    address = metrics.listen_address
    if address.port == 0:
        return Check(
            name, WARN, f"not checked: the metrics endpoint listens on a random port ({metrics.listen})"
        )
    host, url = _agent_host(cfg), _agent_url(cfg, "/health")
    if metrics.web_config_file:
        return Check(
            name,
            WARN,
            f"not checked: the metrics endpoint needs the TLS and basic-auth settings of "
            f"{metrics.web_config_file}, and doctor has no credentials",
            f"check it with the credentials: curl -k -u USER https://{url.removeprefix('http://')}",
        )
    conn = http.client.HTTPConnection(host, address.port, timeout=AGENT_TIMEOUT_S)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        body = response.read(200).decode("utf-8", "replace").strip()
    except (ConnectionRefusedError, FileNotFoundError):
        return Check(
            name,
            WARN,
            f"no agent answers at {url} (connection refused)",
            "start the agent (`gpunode agent`, or its DaemonSet pod on this node); gpunode.metrics.listen "
            "says where it listens",
        )
    except (OSError, http.client.HTTPException) as exc:
        return Check(name, FAIL, f"{url} did not answer /health: {exc}", "is something else listening there?")
    finally:
        conn.close()
    said = body.splitlines()[0] if body else "(empty)"
    if response.status == 200:
        return Check(name, OK, f"running: {url} answers {said}")
    if response.status in (401, 403):
        return Check(
            name,
            WARN,
            f"not checked: {url} asks for credentials ({response.status})",
            "the endpoint is protected (--web-config-file); check it with curl and the credentials",
        )
    if response.status == 503:
        return Check(
            name,
            FAIL,
            f"{url} answers 503: {said}",
            "the agent's collector is stuck; read its log, and restart it if it stays so",
        )
    return Check(
        name, WARN, f"{url} answers {response.status}: {said}", "is it a gpunode agent listening there?"
    )


def _check_pod_resources(cfg: Config) -> Check:
    sock = cfg.pod_resources_socket
    if not sock.exists():
        return Check(
            "pod-resources",
            WARN,
            f"no {sock}",
            "pod attribution in metrics and eviction need the kubelet's pod-resources API",
        )
    ok = _socket_answers(sock)
    return Check("pod-resources", OK if ok else FAIL, f"{sock} {'answers' if ok else 'does not answer'}")


def _check_state_dir(cfg: Config) -> Check:
    d = cfg.state_dir
    if not d.exists():
        parent = next((p for p in d.parents if p.exists()), Path("/"))
        if not os.access(parent, os.W_OK):
            return Check(
                "state directory",
                FAIL,
                f"{d} does not exist, and {parent} is not writable to create it",
                "set --state-dir or GPUNODE_STATE_DIR to a writable path, or create it",
            )
        return Check(
            "state directory",
            WARN,
            f"{d} does not exist (the agent creates it when it starts; no agent has run with it yet)",
            "start the agent, or check --state-dir (gpunode.stateDir) if one is already running",
        )
    if not d.is_dir():
        return Check("state directory", FAIL, f"{d} is not a directory", "point --state-dir at a directory")
    if not os.access(d, os.W_OK):
        return Check(
            "state directory",
            FAIL,
            f"{d} is not writable",
            "set --state-dir or GPUNODE_STATE_DIR to a writable path",
        )
    return Check("state directory", OK, str(d))


def _check_memcap() -> Check:
    try:
        from gpunode.node import memcap  # type: ignore[attr-defined,unused-ignore]

        lib = memcap.preload_library_path()
    except (ImportError, GpunodeError, OSError) as exc:
        return Check(
            "memory caps",
            FAIL,
            f"native parts missing: {exc}",
            "reinstall gpunode (pip install .) with a C compiler present",
        )
    return Check("memory caps", OK, f"interposer {lib}")


def _not_root_only(path: Path) -> bool:
    try:
        return bool(path.lstat().st_mode & 0o077)
    except OSError:
        return False


def _check_memcap_regions(cfg: Config) -> Check:
    """The regions under state_dir/memcap: root-only on the host, and each one usable."""
    name = "memory-cap regions"
    root = cfg.state_dir / "memcap"
    if not root.is_dir():
        return Check(name, OK, f"none yet ({root} does not exist)")
    try:
        from gpunode.node import memcap  # type: ignore[attr-defined,unused-ignore]

        regions, problems = memcap.scan_regions(root)
    except (ImportError, GpunodeError) as exc:
        return Check(name, FAIL, f"cannot read {root}: {exc}", getattr(exc, "hint", ""))
    open_dirs = [
        p for p in (root, *(r.path for r in regions), *(q.path for q in problems)) if _not_root_only(p)
    ]
    details, hints = [], []
    if problems:
        listed = "; ".join(f"{q.key}: {q.message}" for q in problems)
        details.append(
            f"{len(problems)} of {len(regions) + len(problems)} region(s) unusable and skipped: {listed}"
        )
        hints.append(problems[0].hint)
    if open_dirs:
        details.append(f"{', '.join(str(p) for p in open_dirs)} may be reached by users other than root")
        hints.append(
            f"start the agent (it makes them root-only) or run chmod 700 on them; {root} must stay 0700"
        )
    if details:
        return Check(name, WARN, "; ".join(details), "; ".join(hints))
    return Check(name, OK, f"{len(regions)} region(s) in {root}, all usable, root-only")


def _since(at: object) -> str:
    import time

    if not isinstance(at, int | float) or isinstance(at, bool):
        return ""
    return f" for {max(0.0, time.time() - at):.0f} s"


def _check_cleanup(cfg: Config) -> Check:
    """What the running agent said of its memory-cap clean-up (state_dir/status/region-cleanup.json)."""
    from gpunode.node.status import CLEANUP, read_status

    name = "memory-cap clean-up"
    said = read_status(cfg.state_dir, CLEANUP)
    if said is None:
        return Check(name, OK, "running, or nothing to collect")
    return Check(
        name,
        WARN,
        f"regions of ended containers are not collected{_since(said.get('since'))}: {said.get('problem')}; "
        "each GPU keeps at most as many regions as it has units",
        str(said.get("hint") or "make the kubelet's pod-resources socket reachable from the agent"),
    )


def _check_sharing(cfg: Config) -> Check:
    """GPUs whose change of sharing mode (a reload) waits for their holders to end."""
    from gpunode.node.status import pending_lines

    name = "sharing changes"
    lines = pending_lines(cfg.state_dir)
    if not lines:
        return Check(name, OK, "none pending")
    return Check(
        name,
        WARN,
        f"{len(lines)} GPU(s) keep their old mode: " + "; ".join(lines),
        "the change applies by itself once the pods on these GPUs end (drain them to hurry it); while the "
        "kubelet's pod-resources API cannot be asked the agent cannot see them end: make it reachable",
    )


def checks(cfg: Config) -> list[Check]:
    """Run every check: Python, backend, advertised devices, memory caps and their regions, state dir,
    kubelet, the agent's plugin sockets, the agent's /health, pod-resources, and what the running agent
    said in its state directory (memory-cap clean-up blocked, sharing changes waiting for holders).

    A check that raises becomes a failed Check; it does not stop the others.
    """
    node = _Node()
    steps: list[Callable[[], Check]] = [
        _check_python,
        lambda: _check_backend(cfg, node),
        lambda: _check_inventory(cfg, node),
        _check_memcap,
        lambda: _check_memcap_regions(cfg),
        lambda: _check_state_dir(cfg),
        lambda: _check_kubelet(cfg),
        lambda: _check_plugins(cfg, node),
        lambda: _check_agent(cfg),
        lambda: _check_pod_resources(cfg),
        lambda: _check_cleanup(cfg),
        lambda: _check_sharing(cfg),
    ]
    out: list[Check] = []
    for step in steps:
        try:
            out.append(step())
        except Exception as exc:  # a broken check must not hide the others
            out.append(Check(getattr(step, "__name__", "check"), FAIL, f"check crashed: {exc!r}"))
    return out


def render(results: list[Check], *, as_json: bool = False) -> str:
    """The results as text (a line each, with a HINT line under a warning or failure), or as JSON."""
    if as_json:
        return json.dumps([asdict(c) for c in results], indent=2)
    mark = {OK: "[ ok ]", WARN: "[warn]", FAIL: "[FAIL]"}
    lines = []
    for c in results:
        lines.append(f"{mark[c.status]} {c.name}: {c.detail}")
        if c.hint and c.status != OK:
            lines.append(f"       HINT: {c.hint}")
    return "\n".join(lines)
