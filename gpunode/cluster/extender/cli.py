"""`gpunode extender`: flags, building the Extender and its API client, running the server until a signal."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.kubeapi import KubeApi, refresh_nodes_periodically
from gpunode.cluster.extender.server import serve_extender
from gpunode.cluster.extender.workload import WorkloadTracker
from gpunode.contract.names import GIB
from gpunode.contract.reader import parse_bytes, parse_duration
from gpunode.errors import ConfigError, GpunodeError, PlacementError
from gpunode.infra.kube import SERVICE_ACCOUNT_DIR
from gpunode.placement import POLICIES

log = logging.getLogger(__name__)


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
        "--kube-token-file", type=Path, help=f"bearer token file (default {SERVICE_ACCOUNT_DIR}/token)"
    )
    p.add_argument("--kube-ca-file", type=Path, help=f"CA bundle (default {SERVICE_ACCOUNT_DIR}/ca.crt)")
    p.add_argument("--node-refresh", default="0s", help="list nodes this often for NodeNames mode (0 = off)")
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="info shows the start-up line; debug adds one line per request",
    )
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
        raise ConfigError(str(exc)) from exc
    seed = None
    if args.workload_csv is not None:
        from gpunode.cluster.tracesim.trace import load_pods, target_workload

        seed = target_workload(load_pods(args.workload_csv))
    api = None
    if args.kube_api:
        token_file = args.kube_token_file or SERVICE_ACCOUNT_DIR / "token"
        ca_file = args.kube_ca_file or (
            SERVICE_ACCOUNT_DIR / "ca.crt" if args.kube_api.startswith("https") else None
        )
        api = KubeApi(
            args.kube_api,
            token_file=token_file if token_file.is_file() else None,
            ca_file=ca_file if ca_file and ca_file.is_file() else None,
        )
    extender = Extender(config=config, workload=WorkloadTracker(seed=seed), binder=api)
    return extender, api


def run_extender_cli(args: argparse.Namespace) -> int:
    """Run `gpunode extender` until SIGINT/SIGTERM; returns the exit code."""
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "info")).upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
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
        if api is not None:
            api.attach(loop)  # the loop the server runs on: its worker threads' binds are sent here
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
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in (stopping, *tasks):
            t.cancel()
        await asyncio.gather(stopping, *tasks, return_exceptions=True)
        if api is not None:
            await api.close()
        # A task that ended by itself failed (its address in use, ...): its error ends the command.
        for t in done:
            if t is not stopping and not t.cancelled() and (exc := t.exception()) is not None:
                raise exc

    log.debug("gpunode extender: policy %s, asked to listen on %s:%d", args.policy, host, port)
    try:
        asyncio.run(main())
    except GpunodeError:
        raise
    return 0
