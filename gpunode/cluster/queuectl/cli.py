"""`gpunode queue`: flags, the API client, leader election, the metrics server, and the controller's run."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

from gpunode.cluster.queuectl.controller import QueueController
from gpunode.cluster.queuectl.core import QueueCore
from gpunode.cluster.queuectl.usagestore import UsageStore
from gpunode.cluster.queuectl.webhook import AdmissionWebhook
from gpunode.cluster.queueing.config import load_queue_config
from gpunode.cluster.queuemark import UNSIGNED_WARNING, load_mark_key
from gpunode.config.dra import check_driver_name
from gpunode.contract.dra import DEFAULT_DRIVER
from gpunode.contract.names import GIB
from gpunode.contract.reader import parse_bytes, parse_duration
from gpunode.errors import ConfigError
from gpunode.infra.kube import ElectionConfig, KubeClient, LeaderElector, LeaseLock, candidate_identity

log = logging.getLogger(__name__)
USER_AGENT = "gpunode-queue"


def register_queue_cli(sub: Any) -> argparse.ArgumentParser:
    """Add `gpunode queue` and its flags."""
    p: argparse.ArgumentParser = sub.add_parser(
        "queue", help="run the queue controller: admission, gangs, preemption with notice"
    )
    p.add_argument(
        "--config", type=Path, required=True, help="queue configuration file (a mounted ConfigMap)"
    )
    p.add_argument("--config-reload", default="10s", help="how often the file is checked for changes")
    p.add_argument(
        "--memory-unit", default="1Gi", help="bytes per unit of gpunode.io/gpu-memory (as the extender)"
    )
    p.add_argument(
        "--dra-driver",
        default=DEFAULT_DRIVER,
        help="watch ResourceClaims and charge governed pods what this DRA driver's claims hold ('' = off)",
    )
    p.add_argument("--kube-api", default="", help="API server URL (default: in-cluster, else kubeconfig)")
    p.add_argument("--kube-token-file", type=Path, help="bearer token file for --kube-api")
    p.add_argument("--kube-ca-file", type=Path, help="CA bundle for --kube-api")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (without --kube-api)")
    p.add_argument("--resync", default="30s", help="reconcile at least this often")
    p.add_argument("--metrics-listen", default=":9403", help="host:port of /metrics and /healthz ('' = off)")
    p.add_argument("--leader-elect", action="store_true", help="only the replica holding the Lease acts")
    p.add_argument(
        "--leader-elect-namespace", default=os.environ.get("POD_NAMESPACE", ""), help="Lease namespace"
    )
    p.add_argument("--leader-elect-lease-name", default="gpunode-queue", help="name of the Lease")
    p.add_argument("--leader-elect-identity", default="", help="this replica's name (default <pod>_<random>)")
    p.add_argument("--leader-elect-lease-duration", default="15s", help="how long standbys wait for renewals")
    p.add_argument(
        "--leader-elect-renew-deadline", default="10s", help="leader steps down unrenewed after this"
    )
    p.add_argument("--leader-elect-retry-period", default="2s", help="time between renewals and attempts")
    p.add_argument(
        "--usage-configmap",
        default="gpunode-queue-usage",
        help="ConfigMap the leader saves the fair-share usage to, and a new leader loads it from ('' = off)",
    )
    p.add_argument(
        "--usage-namespace",
        default=os.environ.get("POD_NAMESPACE", ""),
        help="namespace of --usage-configmap (default: $POD_NAMESPACE, else --leader-elect-namespace)",
    )
    p.add_argument("--usage-save", default="30s", help="how often the leader saves the fair-share usage")
    p.add_argument(
        "--admission-key-file",
        type=Path,
        help="file of the secret key (at least 32 bytes) that signs the admission marks; give the extender "
        "the same file: without it, marks are unsigned and a tenant able to patch its pods can admit itself",
    )
    p.add_argument(
        "--webhook-listen",
        default="",
        help="host:port of the mutating admission webhook that adds the scheduling gate gpunode.io/admission "
        "to governed pods at creation (HTTPS; '' = off; docs/admission.md)",
    )
    p.add_argument("--webhook-tls-cert-file", type=Path, help="the webhook's certificate (PEM, with chain)")
    p.add_argument("--webhook-tls-key-file", type=Path, help="the private key of --webhook-tls-cert-file")
    p.set_defaults(func=run_queue_cli)
    return p


def _listen(text: str, flag: str = "--metrics-listen", example: str = ":9403") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{flag}: expected host:port such as {example}, got {text!r}")
    return host.strip("[]"), int(port)


def build_webhook(args: argparse.Namespace, ctl: QueueController) -> AdmissionWebhook | None:
    """The admission webhook the --webhook-* flags describe (certificate files read here), or None."""
    cert, key = args.webhook_tls_cert_file, args.webhook_tls_key_file
    if not args.webhook_listen:
        if cert is not None or key is not None:
            raise ConfigError(
                "--webhook-tls-cert-file and --webhook-tls-key-file are given without --webhook-listen",
                hint="give --webhook-listen host:port to serve the webhook, or drop the certificate flags",
            )
        return None
    host, port = _listen(args.webhook_listen, "--webhook-listen", ":9443")
    if cert is None or key is None:
        raise ConfigError(
            "--webhook-listen needs --webhook-tls-cert-file and --webhook-tls-key-file",
            hint="the API server calls admission webhooks over HTTPS only: give the certificate and its key",
        )
    return AdmissionWebhook(
        lambda: ctl.core.config.namespaces, host=host, port=port, cert_file=str(cert), key_file=str(key)
    )


def build_controller(args: argparse.Namespace) -> QueueController:
    """The controller the flags describe; ConfigError (or QueueConfigError) for a bad flag or file."""
    config = load_queue_config(args.config)
    unit = parse_bytes(args.memory_unit, where="--memory-unit") or GIB
    dra_driver = check_driver_name(args.dra_driver, "--dra-driver") if args.dra_driver else ""
    mark_key = load_mark_key(args.admission_key_file) if args.admission_key_file is not None else None
    if mark_key is None:
        log.warning("queue controller: %s", UNSIGNED_WARNING)
    if args.kube_api:
        client = KubeClient.for_host(
            args.kube_api, token_file=args.kube_token_file, ca_file=args.kube_ca_file, user_agent=USER_AGENT
        )
    else:
        client = KubeClient.from_environment(kubeconfig=args.kubeconfig, user_agent=USER_AGENT)
    identity = candidate_identity(args.leader_elect_identity, os.environ.get("POD_NAME"))
    elector = None
    if args.leader_elect:
        election = ElectionConfig.from_flags(args, identity)
        elector = LeaderElector(LeaseLock(client, election.namespace, election.name), election)
    usage = None
    namespace = args.usage_namespace or args.leader_elect_namespace
    if args.usage_configmap and namespace:
        usage = UsageStore(client, namespace, args.usage_configmap)
    elif args.usage_configmap:
        log.warning(
            "fair-share usage is not saved: no namespace for ConfigMap %s (hint: set --usage-namespace)",
            args.usage_configmap,
        )
    return QueueController(
        client,
        QueueCore(config, memory_unit_bytes=unit, mark_key=mark_key, dra_driver=dra_driver),
        config_path=args.config,
        elector=elector,
        resync_s=parse_duration(args.resync, where="--resync") or 30.0,
        reload_s=parse_duration(args.config_reload, where="--config-reload") or 10.0,
        identity=identity,
        usage=usage,
        usage_save_s=parse_duration(args.usage_save, where="--usage-save") or 30.0,
    )


def run_queue_cli(args: argparse.Namespace) -> int:
    """Run `gpunode queue` until SIGINT/SIGTERM; returns the exit code."""
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "info")).upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    listen = _listen(args.metrics_listen) if args.metrics_listen else None

    async def main() -> None:
        ctl = build_controller(args)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        server = ctl.metrics.server(*listen) if listen is not None else None
        webhook = build_webhook(args, ctl)
        if server is not None:
            await server.start()
        if webhook is not None:
            await webhook.start()
        run = asyncio.create_task(ctl.run())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([run, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (run, stopping):
                t.cancel()
            await asyncio.gather(run, stopping, return_exceptions=True)
            if webhook is not None:
                await webhook.stop()
            if server is not None:
                await server.stop()
            await ctl.client.close()
        if run.done() and not run.cancelled() and (exc := run.exception()) is not None:
            raise exc

    asyncio.run(main())
    return 0
