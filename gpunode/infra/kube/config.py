"""Where the client's address and credentials come from, made into one configured HTTP connection pool.

Three sources, as kubectl knows them: an explicit address (tests, `kubectl
proxy`, the extender's --kube-api), the in-cluster service account (the pod's
projected token, re-read when it rotates, and the cluster CA), or a kubeconfig
(its current or a named context; tokens, token files, client certificates and
exec plugins). lightkube parses kubeconfigs and provides the authentication;
everything it raises is translated into KubeError or ConfigError here.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Mapping
from pathlib import Path

import httpx2
import msgspec
import yaml
from lightkube import ConfigError as LightkubeConfigError
from lightkube import KubeConfig, SingleConfig
from lightkube.config.client_adapter import AsyncClient, ConnectionParams
from lightkube.config.models import Cluster, User

from gpunode.errors import ConfigError, KubeError

DEFAULT_REQUEST_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = "~/.kube/config"
CREDENTIALS_HINT = (
    "run the agent in a pod with a service account, or set gpunode.remediation.kubeconfig; "
    "or set gpunode.remediation.mode to baremetal or off"
)


def explicit(
    host: str, *, token: str | None = None, token_file: Path | None = None, ca_file: Path | None = None
) -> SingleConfig:
    """An explicit API server address, with an optional bearer token (or token file) and CA bundle."""
    user = User(token=token, token_file=str(token_file) if token_file else None)
    cluster = Cluster(server=host.rstrip("/"), certificate_auth=str(ca_file) if ca_file else None)
    return _single(KubeConfig.from_one(cluster=cluster, user=user))


def in_cluster(service_account_dir: Path, environ: Mapping[str, str]) -> SingleConfig:
    """The pod's service account; LookupError saying what is missing when this is not a pod."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise LookupError("KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")
    token, ca = service_account_dir / "token", service_account_dir / "ca.crt"
    for path in (token, ca):
        if not path.is_file():
            raise LookupError(f"no {path.name} file in {service_account_dir}")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    cluster = Cluster(server=f"https://{host}:{port}", certificate_auth=str(ca))
    return _single(KubeConfig.from_one(cluster=cluster, user=User(token_file=str(token))))


def kubeconfig_path(kubeconfig: str | None, environ: Mapping[str, str]) -> str:
    """The kubeconfig named, else the first of $KUBECONFIG, else ~/.kube/config."""
    first = environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return os.path.expanduser(kubeconfig or first or DEFAULT_KUBECONFIG)


def from_kubeconfig(path: str, context: str | None) -> SingleConfig:
    """One context of a kubeconfig file; ValueError naming what is wrong with it."""
    try:
        return _single(KubeConfig.from_file(path), context)
    except (
        LightkubeConfigError,
        KeyError,
        OSError,
        TypeError,
        yaml.YAMLError,
        msgspec.ValidationError,
    ) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None


def from_environment(
    *,
    kubeconfig: str | None,
    context: str | None,
    service_account_dir: Path,
    environ: Mapping[str, str],
) -> SingleConfig:
    """In-cluster when no kubeconfig is named and a service account is mounted, else a kubeconfig.

    Raises KubeError naming every source tried and why each failed.
    """
    in_cluster_error: str | None = None
    if kubeconfig is None:
        try:
            return in_cluster(service_account_dir, environ)
        except LookupError as exc:
            in_cluster_error = str(exc)
    where = kubeconfig_path(kubeconfig, environ)
    try:
        return from_kubeconfig(where, context)
    except ValueError as exc:
        tried = f"in-cluster service account ({in_cluster_error}); " if in_cluster_error else ""
        raise KubeError(
            f"no Kubernetes credentials: tried {tried}kubeconfig {where} ({exc})", hint=CREDENTIALS_HINT
        ) from None


def http_pool(config: SingleConfig, *, request_timeout_s: float, user_agent: str) -> httpx2.AsyncClient:
    """The connection pool for one API server: its base URL, TLS verification and authentication."""
    timeout = httpx2.Timeout(request_timeout_s, connect=min(request_timeout_s, CONNECT_TIMEOUT_S))
    try:
        pool = AsyncClient(config, ConnectionParams(timeout=timeout))
    except (OSError, ssl.SSLError, LightkubeConfigError) as exc:
        raise ConfigError(
            f"Kubernetes API server {config.cluster.server}: cannot set up TLS or credentials: {exc}",
            hint="check the CA bundle and client certificate the kubeconfig or the flags name",
        ) from None
    pool.headers["User-Agent"] = user_agent
    # The HTTP library logs every request at INFO; the agent logs what goes wrong, and that only.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    return pool


def _single(config: KubeConfig, context: str | None = None) -> SingleConfig:
    single = config.get(context)
    if single is None:
        raise LightkubeConfigError("the kubeconfig selects no context")
    # A context without a user is anonymous access; the connection pool needs a (blank) user to say so.
    return single if single.user is not None else single._replace(user=User())
