"""`gpunode extender`: flags, building the Extender and its API client, running the server until a signal."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

from gpunode.cluster.extender.binding import DEFAULT_SCHEDULER
from gpunode.cluster.extender.claims import ClaimView
from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.drasteer import read_claim
from gpunode.cluster.extender.ha import HighAvailability
from gpunode.cluster.extender.kubeapi import (
    KubeApi,
    check_reservations_periodically,
    refresh_nodes_once,
    refresh_nodes_periodically,
)
from gpunode.cluster.extender.nodes import DEFAULT_MAX_NODES, NodeCache
from gpunode.cluster.extender.promfeed import PromFeed
from gpunode.cluster.extender.queued import HOLD_ERROR, HOLD_MODES, QueueNamespaces, warn_unsigned_once
from gpunode.cluster.extender.reservations import DEFAULT_PROVISIONAL_PER_NAMESPACE
from gpunode.cluster.extender.server import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_REQUEST_MEMORY_BYTES,
    serve_extender,
)
from gpunode.cluster.extender.workload import WorkloadTracker
from gpunode.cluster.queuemark import load_mark_key
from gpunode.contract.dra import DEFAULT_DRIVER
from gpunode.contract.names import EXTENDER_ROLE_LABEL, GIB, NODE_SERIES_LABEL
from gpunode.contract.reader import parse_bytes, parse_duration
from gpunode.errors import ConfigError, GpunodeError, PlacementError
from gpunode.infra.kube import SERVICE_ACCOUNT_DIR, ElectionConfig, candidate_identity
from gpunode.placement import POLICIES

log = logging.getLogger(__name__)
DEFAULT_NODE_STATE_MAX_AGE = "3m"
DEFAULT_NODE_STATE_MAX_SKEW = "65s"
DEFAULT_NODE_CACHE_TTL = "1h"
PENDING_READ_S = 2.0  # the pod read before a provisional reservation: filter and prioritize wait for it


def register_extender_cli(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add `extender` to a subparsers object; run it with run_extender_cli(args)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "extender",
        help="run the kube-scheduler extender (filter, prioritize, bind, preempt) for GPU placement",
    )
    p.add_argument("--listen", default="127.0.0.1:8888", help="host:port to serve on")
    p.add_argument("--policy", default="gpunode", choices=sorted(POLICIES), help="placement policy")
    p.add_argument("--path-prefix", default="", help="URL path prefix before the verbs, e.g. /gpunode")
    p.add_argument("--memory-unit", default="1Gi", help="bytes per unit of gpunode.io/gpu-memory")
    p.add_argument(
        "--reservation-ttl",
        default="60s",
        help="how long a provisional (filter/prioritize) reservation lasts",
    )
    p.add_argument(
        "--bound-reservation-max-age",
        default="15m",
        help="safety bound on a bound pod's reservation while its node's annotation does not list it "
        "(it ends earlier when the annotation lists the pod or the pod is gone)",
    )
    p.add_argument(
        "--no-provisional", action="store_true", help="reserve at bind only, not at filter or prioritize"
    )
    p.add_argument(
        "--provisional-per-namespace",
        type=int,
        default=DEFAULT_PROVISIONAL_PER_NAMESPACE,
        help="most provisional reservations the pods of one namespace hold at once (a newer one ends the "
        "oldest); they are made only for pods the API server has pending (needs --kube-api)",
    )
    p.add_argument(
        "--node-state-max-age",
        default=DEFAULT_NODE_STATE_MAX_AGE,
        help="a node whose gpunode.io/gpu-state annotation was published longer ago is failed as stale "
        "(default: 3 x the agent's default republish interval of 60s; 0 = never)",
    )
    p.add_argument(
        "--node-state-max-skew",
        default=DEFAULT_NODE_STATE_MAX_SKEW,
        help="a node whose gpunode.io/gpu-state annotation says it was published further in the future is "
        "failed (default: the agent's default republish interval of 60s and 5s; 0 = never)",
    )
    p.add_argument(
        "--node-cache-ttl",
        default=DEFAULT_NODE_CACHE_TTL,
        help="forget a node not seen in a request or a refresh for this long (0 = never)",
    )
    p.add_argument(
        "--node-cache-max-nodes",
        type=int,
        default=DEFAULT_MAX_NODES,
        help="most nodes whose GPU state the extender keeps (the least recently seen go first); keep it "
        "above the cluster's node count",
    )
    p.add_argument("--workload-csv", type=Path, help="openb-format pod list to seed the target workload")
    p.add_argument(
        "--kube-api",
        help="API server URL, for --bind and node refresh (in-cluster: https://kubernetes.default.svc)",
    )
    p.add_argument(
        "--bind",
        action="store_true",
        help="serve the bind verb (needs --kube-api, and TLS with --client-ca-file unless "
        "--insecure-bind-without-tls)",
    )
    p.add_argument(
        "--scheduler-name",
        action="append",
        dest="scheduler_names",
        metavar="NAME",
        help=f"bind only pods whose spec.schedulerName is this (repeatable; default {DEFAULT_SCHEDULER})",
    )
    p.add_argument("--tls-cert-file", type=Path, help="serve HTTPS with this certificate (PEM, with chain)")
    p.add_argument("--tls-key-file", type=Path, help="the private key of --tls-cert-file (PEM)")
    p.add_argument(
        "--client-ca-file",
        type=Path,
        help="require client certificates signed by these CAs (kube-scheduler's tlsConfig certFile/keyFile)",
    )
    p.add_argument(
        "--allowed-client-names",
        default="",
        help="comma-separated subject CN or DNS names a client certificate must carry one of",
    )
    p.add_argument(
        "--insecure-bind-without-tls",
        action="store_true",
        help="serve --bind without client certificates: anyone reaching the port can bind pods",
    )
    p.add_argument(
        "--max-request-bytes",
        default=f"{DEFAULT_MAX_BODY_BYTES // 2**20}Mi",
        help="largest request body accepted (413 beyond); full NodeLists need ~4 KB per node",
    )
    p.add_argument(
        "--request-memory",
        default=f"{DEFAULT_REQUEST_MEMORY_BYTES // 2**20}Mi",
        help="memory request bodies may take at once, received and decoded (413 for a body that never fits, "
        "503 after a short wait for one that does not fit now); keep it under half the memory limit",
    )
    p.add_argument(
        "--health-listen", help="host:port of a plain-HTTP server for /healthz and /readyz only (probes)"
    )
    p.add_argument(
        "--kube-token-file", type=Path, help=f"bearer token file (default {SERVICE_ACCOUNT_DIR}/token)"
    )
    p.add_argument("--kube-ca-file", type=Path, help=f"CA bundle (default {SERVICE_ACCOUNT_DIR}/ca.crt)")
    p.add_argument("--node-refresh", default="0s", help="list nodes this often for NodeNames mode (0 = off)")
    p.add_argument(
        "--dra-driver",
        default=DEFAULT_DRIVER,
        help="with --kube-api, watch ResourceClaims and count what this DRA driver's claims hold of GPUs "
        "served through DRA ('' = off)",
    )
    p.add_argument(
        "--leader-elect",
        action="store_true",
        help="high availability: only the replica holding a Lease answers (docs/scheduler.md); needs --kube-api",
    )
    p.add_argument(
        "--leader-elect-namespace",
        default=os.environ.get("POD_NAMESPACE", ""),
        help="namespace of the Lease and of this pod (default $POD_NAMESPACE)",
    )
    p.add_argument("--leader-elect-lease-name", default="gpunode-extender", help="name of the Lease")
    p.add_argument(
        "--leader-elect-identity",
        default="",
        help="this replica's name in the Lease (default <pod>_<random>)",
    )
    p.add_argument(
        "--leader-elect-pod",
        default=os.environ.get("POD_NAME", ""),
        help=f"pod labelled {EXTENDER_ROLE_LABEL}=leader while this replica leads (default $POD_NAME)",
    )
    p.add_argument("--leader-elect-lease-duration", default="15s", help="how long standbys wait for renewals")
    p.add_argument(
        "--leader-elect-renew-deadline", default="10s", help="leader steps down unrenewed after this"
    )
    p.add_argument("--leader-elect-retry-period", default="2s", help="time between renewals and attempts")
    p.add_argument(
        "--prometheus-url",
        default="",
        help="Prometheus scraping the agents (e.g. http://prometheus.monitoring:9090): prioritize adds an "
        "energy and a load term from their power, utilisation and memory series (default: off)",
    )
    p.add_argument("--prometheus-refresh", default="15s", help="how often the figures are queried")
    p.add_argument("--prometheus-timeout", default="5s", help="bound on each query, answer read in full")
    p.add_argument(
        "--prometheus-max-age",
        default="1m",
        help="figures older than this are stale: prioritize scores without the terms (and counts it)",
    )
    p.add_argument(
        "--prometheus-node-label", default=NODE_SERIES_LABEL, help="the series' label naming the node"
    )
    p.add_argument(
        "--energy-weight",
        type=float,
        default=0.5,
        help="weight (0..100, policy 1) of preferring nodes already drawing power, so idle ones stay idle",
    )
    p.add_argument(
        "--load-weight",
        type=float,
        default=0.2,
        help="weight (0..100, policy 1) of preferring nodes with low GPU utilisation and memory used",
    )
    p.add_argument(
        "--queue-config",
        type=Path,
        help="the queue controller's configuration file: GPU pods of its `namespaces:` are held until "
        "admitted (pods labelled gpunode.io/queue are held without it); re-read when it changes",
    )
    p.add_argument(
        "--queue-hold",
        default=HOLD_ERROR,
        choices=HOLD_MODES,
        help="how filter holds a queued pod not yet admitted: error (an Error with the queue's reason: "
        "kube-scheduler never preempts for it) or unschedulable (failed nodes, also unresolvable: "
        "kube-scheduler neither preempts nor nominates on them); never error with ignorable: true",
    )
    p.add_argument(
        "--admission-key-file",
        type=Path,
        help="file of the secret key (at least 32 bytes) the queue controller signs its admission marks with "
        "(its own --admission-key-file): a queued pod passes only with a mark signed by it; without it, any "
        "mark naming the pod's UID counts, and a tenant able to patch its pods can admit itself",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="info shows the start-up line; debug adds one line per request",
    )
    return p


def _listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{flag}: expected host:port such as 127.0.0.1:8888, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


_BIND_HINT = (
    "serve HTTPS with --tls-cert-file, --tls-key-file and --client-ca-file and give kube-scheduler a client "
    "certificate (tlsConfig certFile/keyFile/caFile), or accept the risk with --insecure-bind-without-tls"
)


def check_security_flags(args: argparse.Namespace) -> None:
    """ConfigError for TLS and bind flags that do not go together, or that would leave /bind open."""
    cert, key, ca = args.tls_cert_file, args.tls_key_file, args.client_ca_file
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert-file and --tls-key-file go together", hint="give both, or neither")
    if ca is not None and cert is None:
        raise ConfigError(
            "--client-ca-file needs --tls-cert-file and --tls-key-file",
            hint="client certificates are only asked for over HTTPS",
        )
    if args.allowed_client_names and ca is None:
        raise ConfigError("--allowed-client-names needs --client-ca-file", hint=_BIND_HINT)
    if getattr(args, "leader_elect", False) and not args.kube_api:
        raise ConfigError("--leader-elect needs --kube-api to hold the Lease with", hint="add --kube-api URL")
    if args.bind and not args.kube_api:
        raise ConfigError("--bind needs --kube-api to create Bindings with", hint="add --kube-api URL")
    if args.bind and ca is None and not args.insecure_bind_without_tls:
        raise ConfigError(
            "--bind without client certificates would let anyone who reaches the port bind any pod",
            hint=_BIND_HINT,
        )


def request_memory(args: argparse.Namespace) -> int:
    """--request-memory in bytes; ConfigError below 1Mi or below --max-request-bytes."""
    size = parse_bytes(args.request_memory, where="--request-memory")
    largest = parse_bytes(args.max_request_bytes, where="--max-request-bytes") or DEFAULT_MAX_BODY_BYTES
    if size < max(2**20, largest):
        raise ConfigError(
            f"--request-memory {args.request_memory} is less than one body of --max-request-bytes "
            f"{args.max_request_bytes} (and 1Mi)",
            hint="raise --request-memory or lower --max-request-bytes",
        )
    return size


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """ExtenderServer's options from the flags: TLS context (files read here), client names, limits."""
    from gpunode.infra.http import server_tls_context

    options: dict[str, Any] = {
        "max_body_bytes": parse_bytes(args.max_request_bytes, where="--max-request-bytes")
        or DEFAULT_MAX_BODY_BYTES,
        "request_memory_bytes": request_memory(args),
        "allowed_client_names": [n.strip() for n in args.allowed_client_names.split(",") if n.strip()],
    }
    if args.tls_cert_file is not None:
        options["ssl_context"] = server_tls_context(
            args.tls_cert_file, args.tls_key_file, client_ca_file=args.client_ca_file
        )
    if args.health_listen:
        options["health_host"], options["health_port"] = _listen(args.health_listen, "--health-listen")
    return options


def node_cache(args: argparse.Namespace, max_age_s: float) -> NodeCache:
    """The node cache the --node-state-* and --node-cache-* flags describe; ConfigError for a bad one."""
    skew_s = parse_duration(args.node_state_max_skew, where="--node-state-max-skew")
    ttl_s = parse_duration(args.node_cache_ttl, where="--node-cache-ttl")
    if args.node_cache_max_nodes < 1:
        raise ConfigError(
            f"--node-cache-max-nodes must be 1 or more, got {args.node_cache_max_nodes}",
            hint=f"keep it above the cluster's node count (default {DEFAULT_MAX_NODES})",
        )
    return NodeCache(
        max_age_s=max_age_s or None,
        max_skew_s=skew_s or None,
        ttl_s=ttl_s or None,
        max_nodes=args.node_cache_max_nodes,
    )


def build_extender(args: argparse.Namespace) -> tuple[Extender, KubeApi | None]:
    """The Extender (and API client) the CLI flags describe; ConfigError for a bad flag."""
    check_security_flags(args)
    try:
        config = ExtenderConfig(
            policy=args.policy,
            memory_unit_bytes=parse_bytes(args.memory_unit, where="--memory-unit") or GIB,
            reservation_ttl_s=parse_duration(args.reservation_ttl, where="--reservation-ttl"),
            provisional_reservations=not args.no_provisional,
            scheduler_names=frozenset(args.scheduler_names or [DEFAULT_SCHEDULER]),
            bound_reservation_max_age_s=parse_duration(
                args.bound_reservation_max_age, where="--bound-reservation-max-age"
            ),
            energy_weight=args.energy_weight,
            load_weight=args.load_weight,
            queue_hold=args.queue_hold,
            max_provisional_per_namespace=args.provisional_per_namespace,
        )
    except PlacementError as exc:
        raise ConfigError(str(exc)) from exc
    feed = None
    if args.prometheus_url:  # started by run_extender_cli, not here
        feed = PromFeed(
            args.prometheus_url,
            node_label=args.prometheus_node_label,
            refresh_s=parse_duration(args.prometheus_refresh, where="--prometheus-refresh"),
            timeout_s=parse_duration(args.prometheus_timeout, where="--prometheus-timeout"),
            max_age_s=parse_duration(args.prometheus_max_age, where="--prometheus-max-age"),
        )
    max_age_s = parse_duration(args.node_state_max_age, where="--node-state-max-age")
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
    binder = api if args.bind else None  # the API client serves node refresh without binding
    refreshing = api is not None and parse_duration(args.node_refresh, where="--node-refresh") > 0
    extender = Extender(
        config=config,
        nodes=node_cache(args, max_age_s),
        workload=WorkloadTracker(seed=seed),
        binder=binder,
        # names-only mode: a node created since the last refresh is listed at once, not failed
        node_lister=api.list_nodes if refreshing and api is not None else None,
        load_feed=feed,
        queue_namespaces=QueueNamespaces(args.queue_config).get if args.queue_config else dict,
        mark_key=load_mark_key(args.admission_key_file) if args.admission_key_file is not None else None,
        # provisional reservations only for pods the API server has pending (read with a short timeout:
        # filter and prioritize wait for it)
        pod_reader=(
            (lambda namespace, name: api.read_pod(namespace=namespace, name=name, timeout_s=PENDING_READ_S))
            if api is not None
            else None
        ),
    )
    if extender.mark_key is None and args.queue_config is not None:  # serving a queue controller's pods
        warn_unsigned_once()  # else at the first queued pod (queued.queue_hold)
    return extender, api


def build_ha(args: argparse.Namespace, extender: Extender, api: KubeApi | None) -> HighAvailability | None:
    """The leader election the --leader-elect flags describe (None without it); ConfigError for a bad flag."""
    if not args.leader_elect:
        return None
    if api is None:
        raise ConfigError("--leader-elect needs --kube-api to hold the Lease with", hint="add --kube-api URL")
    config = ElectionConfig.from_flags(
        args, candidate_identity(args.leader_elect_identity, args.leader_elect_pod)
    )
    return HighAvailability(extender, api, config, pod_name=args.leader_elect_pod)


async def _warn_unreserved(serving: asyncio.Event) -> None:
    """Once serving: say that no GPUs are reserved before bind (no API access to check pods with)."""
    await serving.wait()
    log.warning(
        "extender: no reservations at filter and prioritize (GPUs are reserved at bind only): they are made "
        "only for pods the API server has pending, and this extender has no API access (--kube-api)"
    )
    await asyncio.get_running_loop().create_future()  # a task that ends by itself is taken as a failure


def run_extender_cli(args: argparse.Namespace) -> int:
    """Run `gpunode extender` until SIGINT/SIGTERM; returns the exit code."""
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "info")).upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    host, port = _listen(args.listen)
    extender, api = build_extender(args)
    ha = build_ha(args, extender, api)
    options = server_options(args)
    if ha is not None:
        options["gate"] = ha.leadership
    if args.bind and args.insecure_bind_without_tls and args.client_ca_file is None:
        log.warning("extender: serving bind WITHOUT client authentication (--insecure-bind-without-tls)")
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
        if refresh_s and api is not None:
            # Names-only mode: know the nodes before the first filter (a pod every node failed as
            # unknown would wait for kube-scheduler's backoff retry).
            await refresh_nodes_once(api=api, extender=extender)
        bound: list[int] = []
        serving = asyncio.Event()
        tasks = [
            asyncio.create_task(
                serve_extender(
                    extender=extender,
                    host=host,
                    port=port,
                    path_prefix=args.path_prefix,
                    bound=bound,
                    ready=serving,
                    **options,
                )
            )
        ]
        if extender.pending is None:
            tasks.append(asyncio.create_task(_warn_unreserved(serving)))
        if ha is not None:
            tasks.append(asyncio.create_task(ha.run()))
        if api is not None:  # bound pods' reservations end when their pods are gone
            tasks.append(asyncio.create_task(check_reservations_periodically(api=api, extender=extender)))
        if refresh_s and api is not None:
            tasks.append(
                asyncio.create_task(
                    refresh_nodes_periodically(api=api, extender=extender, interval_s=refresh_s)
                )
            )
        if api is not None and args.dra_driver:  # what DRA claims hold of the `dra` GPUs
            extender.nodes.dra = ClaimView(args.dra_driver, reader=read_claim(args.dra_driver))
            tasks.append(asyncio.create_task(extender.nodes.dra.run(api.client)))
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
    feed = extender.load_feed if isinstance(extender.load_feed, PromFeed) else None
    if feed is not None:
        feed.start()
    try:
        asyncio.run(main())
    except GpunodeError:
        raise
    finally:
        if feed is not None:
            feed.stop()
    return 0
