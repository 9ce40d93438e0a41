"""HTTP for the extender: the server, a small Kubernetes API client for binding and node lists, the CLI.

- ExtenderServer: a ThreadingHTTPServer (HTTP/1.1, keep-alive) routing POST
  <prefix>/filter, /prioritize, /bind and GET /healthz to an Extender. Malformed
  JSON and wrong shapes get 400 with {"Error": "..."}; an oversized body 413; an
  unknown path 404; a wrong method 405. Only a defect in our code gives 500, and
  the server keeps serving.
- KubeApi: the three calls the extender needs (annotate a pod with its GPUs,
  create its Binding, list nodes), over urllib with a bearer token and CA file.
- register_extender_cli()/run_extender_cli(): `gpunode extender`.

Errors from the API server become KubeError at this edge.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson

from gpunode.configutil import parse_bytes, parse_duration
from gpunode.errors import ConfigError, GpunodeError, KubeError
from gpunode.extender import BadRequest, Extender, ExtenderConfig, serve_extender
from gpunode.extender_state import GIB, WorkloadTracker
from gpunode.placement import POLICIES, PlacementError

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 256 * 2**20
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ASSIGNMENT_ANNOTATION = "gpunode.io/gpu-assigned"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; without TCP_NODELAY the second one waits for the
    # client's delayed ACK (~40 ms on Linux) on every keep-alive request.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, payload: object) -> None:
        body = orjson.dumps(payload)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _verb(self) -> str | None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        prefix = self.server.path_prefix
        if prefix and not path.startswith(prefix + "/"):
            return None
        return path[len(prefix) :].lstrip("/")

    def do_GET(self) -> None:
        verb = self._verb()
        if verb in ("healthz", "readyz"):
            self._send(200, {"status": "ok", "nodes": len(self.server.extender.nodes)})
        elif verb in ("filter", "prioritize", "bind"):
            self._send(405, {"Error": f"{verb} takes POST"})
        else:
            self._send(404, {"Error": f"no such path {self.path}"})

    def do_POST(self) -> None:
        verb = self._verb()
        handlers = {
            "filter": self.server.extender.filter,
            "prioritize": self.server.extender.prioritize,
            "bind": self.server.extender.bind,
        }
        if verb not in handlers:
            self._drain()
            self._send(404, {"Error": f"no such verb {self.path}; use filter, prioritize or bind"})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            self._send(
                411 if "Content-Length" not in self.headers else 400, {"Error": "need a valid Content-Length"}
            )
            return
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(413, {"Error": f"body of {length} bytes is over the {MAX_BODY_BYTES} accepted"})
            return
        raw = self.rfile.read(length)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:  # also bad UTF-8 and nesting over 1,024 levels
            self._send(400, {"Error": f"malformed JSON: {exc}"})
            return
        try:
            result = handlers[verb](body)
        except (BadRequest, PlacementError) as exc:
            self._send(400, {"Error": exc.message})
            return
        except Exception as exc:  # a defect of ours: answer, log, keep serving
            log.exception("extender %s failed", verb)
            self._send(500, {"Error": f"internal error in {verb}: {type(exc).__name__}: {exc}"})
            return
        self._send(200, result)

    def _drain(self) -> None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = 0
        if 0 < length <= MAX_BODY_BYTES:
            self.rfile.read(length)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], extender: Extender, path_prefix: str) -> None:
        super().__init__(address, _Handler)
        self.extender = extender
        self.path_prefix = path_prefix.rstrip("/")


class ExtenderServer:
    """The extender's HTTP server on a thread: start(), .port, stop()."""

    def __init__(
        self, extender: Extender, *, host: str = "127.0.0.1", port: int = 0, path_prefix: str = ""
    ) -> None:
        try:
            self._server = _Server((host, port), extender, path_prefix)
        except OSError as exc:
            raise ConfigError(f"--listen {host}:{port}: cannot listen: {exc}") from exc
        self._thread = threading.Thread(
            target=lambda: self._server.serve_forever(poll_interval=0.05), name="extender-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class KubeApi:
    """A minimal Kubernetes API client: patch a pod's annotations, bind it, list nodes."""

    def __init__(
        self, base_url: str, *, token: str | None = None, ca_file: Path | None = None, timeout_s: float = 10.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._timeout = timeout_s
        self._context: ssl.SSLContext | None = None
        if self.base_url.startswith("https://"):
            try:
                self._context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"--kube-ca-file {ca_file}: cannot load: {exc}") from exc

    def _call(
        self, method: str, path: str, body: object = None, content_type: str = "application/json"
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        if self._token:
            req.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(req, timeout=self._timeout, context=self._context) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise KubeError(f"{method} {path}: HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise KubeError(f"{method} {path}: {exc}") from exc
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError as exc:
            raise KubeError(f"{method} {path}: the API server answered something that is not JSON") from exc

    def bind(self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]) -> None:
        ns, pod = urllib.parse.quote(namespace, safe=""), urllib.parse.quote(name, safe="")
        if gpu_uuids:
            patch = {"metadata": {"annotations": {ASSIGNMENT_ANNOTATION: ",".join(gpu_uuids)}}}
            self._call("PATCH", f"/api/v1/namespaces/{ns}/pods/{pod}", patch, "application/merge-patch+json")
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, **({"uid": uid} if "/" not in uid else {})},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        self._call("POST", f"/api/v1/namespaces/{ns}/pods/{pod}/binding", binding)

    def list_nodes(self) -> list[Any]:
        result = self._call("GET", "/api/v1/nodes")
        items = result.get("items") if isinstance(result, dict) else None
        if not isinstance(items, list):
            raise KubeError("GET /api/v1/nodes: the answer has no items list")
        return items


async def refresh_nodes_periodically(
    *, api: KubeApi, extender: Extender, interval_s: float, ready: asyncio.Event | None = None
) -> None:
    """Feed the extender's node cache from the API server every interval (for NodeNames mode)."""
    while True:
        try:
            nodes = await asyncio.to_thread(api.list_nodes)
            extender.refresh_nodes(nodes)
        except KubeError as exc:
            log.warning("node refresh failed: %s", exc)
        if ready is not None and not ready.is_set():
            ready.set()
        await asyncio.sleep(interval_s)


def register_extender_cli(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add `extender` to a subparsers object; run it with run_extender_cli(args)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "extender", help="run the kube-scheduler extender (filter, prioritize, bind) for GPU placement"
    )
    p.add_argument("--listen", default="127.0.0.1:8888", help="host:port to serve on")
    p.add_argument("--policy", default="gpunode", choices=sorted(POLICIES), help="placement policy")
    p.add_argument("--path-prefix", default="", help="URL path prefix before the verbs, e.g. /gpunode")
    p.add_argument("--memory-unit", default="1Gi", help="bytes per unit of gpunode.io/gpu-memory")
    p.add_argument("--reservation-ttl", default="60s", help="how long a reservation waits for the annotation")
    p.add_argument("--no-provisional", action="store_true", help="reserve at bind only, not at prioritize")
    p.add_argument("--workload-csv", type=Path, help="openb-format pod list to seed the target workload")
    p.add_argument(
        "--kube-api",
        help="API server URL; enables bind and node refresh (in-cluster: https://kubernetes.default.svc)",
    )
    p.add_argument(
        "--kube-token-file", type=Path, help=f"bearer token file (default {SERVICE_ACCOUNT}/token)"
    )
    p.add_argument("--kube-ca-file", type=Path, help=f"CA bundle (default {SERVICE_ACCOUNT}/ca.crt)")
    p.add_argument("--node-refresh", default="0s", help="list nodes this often for NodeNames mode (0 = off)")
    return p


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen: expected host:port such as 127.0.0.1:8888, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def build_extender(args: argparse.Namespace) -> tuple[Extender, KubeApi | None]:
    """The Extender (and API client) the CLI flags describe; ConfigError for a bad flag."""
    try:
        config = ExtenderConfig(
            policy=args.policy,
            memory_unit_bytes=parse_bytes(args.memory_unit, where="--memory-unit") or GIB,
            reservation_ttl_s=parse_duration(args.reservation_ttl, where="--reservation-ttl"),
            provisional_reservations=not args.no_provisional,
        )
    except PlacementError as exc:
        raise ConfigError(exc.message) from exc
    seed = None
    if args.workload_csv is not None:
        from gpunode.sim_trace import load_pods, target_workload

        seed = target_workload(load_pods(args.workload_csv))
    api = None
    if args.kube_api:
        token_file = args.kube_token_file or SERVICE_ACCOUNT / "token"
        ca_file = args.kube_ca_file or (
            SERVICE_ACCOUNT / "ca.crt" if args.kube_api.startswith("https") else None
        )
        token = token_file.read_text().strip() if token_file.is_file() else None
        api = KubeApi(args.kube_api, token=token, ca_file=ca_file if ca_file and ca_file.is_file() else None)
    extender = Extender(config=config, workload=WorkloadTracker(seed=seed), binder=api)
    return extender, api


def run_extender_cli(args: argparse.Namespace) -> int:
    """Run `gpunode extender` until SIGINT/SIGTERM; returns the exit code."""
    host, port = _listen(args.listen)
    extender, api = build_extender(args)
    refresh_s = parse_duration(args.node_refresh, where="--node-refresh")
    if refresh_s and api is None:
        raise ConfigError("--node-refresh needs --kube-api to list nodes from")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        bound: list[int] = []
        tasks = [
            asyncio.create_task(
                serve_extender(
                    extender=extender, host=host, port=port, path_prefix=args.path_prefix, bound=bound
                )
            )
        ]
        if refresh_s and api is not None:
            tasks.append(
                asyncio.create_task(
                    refresh_nodes_periodically(api=api, extender=extender, interval_s=refresh_s)
                )
            )
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    log.info("gpunode extender on %s:%d, policy %s", host, port, args.policy)
    try:
        asyncio.run(main())
    except GpunodeError:
        raise
    return 0
