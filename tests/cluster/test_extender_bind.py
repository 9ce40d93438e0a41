"""Attacks on the extender's /bind, performed against a running extender and the API server stand-in.

Whoever reaches the extender's port can POST ExtenderBindingArgs. A bind is carried out only for a
pod that is pending, names a scheduler the extender serves and was filtered onto that node by it;
with TLS, only a client with a certificate from the configured CA gets an answer at all.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpunode.cluster.extender.cli import build_extender, server_options
from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.kubeapi import KubeApi
from gpunode.cluster.extender.server import ExtenderServer
from gpunode.errors import ConfigError
from gpunode.infra.http import server_tls_context
from tests.cluster.test_extender import gpu_state, node_list, parser, v1_node, v1_pod
from tests.fakes.apiserver import ApiServerStandIn

NODES = node_list(
    v1_node("n1", gpu_state("n1", [1000, 1000])),
    v1_node("n2", gpu_state("n2", [1000, 1000])),
    v1_node("full", gpu_state("full", [0, 0])),
)


def pending(name: str, *, uid: str, scheduler: str = "default-scheduler", gpus: str = "1") -> dict[str, Any]:
    pod = v1_pod(name, uid=uid, limits={"nvidia.com/gpu": gpus})
    pod["spec"]["schedulerName"] = scheduler
    return pod


def bind_args(pod: dict[str, Any], node: str, *, uid: str | None = None) -> dict[str, str]:
    meta = pod["metadata"]
    return {
        "PodName": meta["name"],
        "PodNamespace": meta["namespace"],
        "PodUID": uid or meta["uid"],
        "Node": node,
    }


class Caller:
    """POSTs to the extender over plain HTTP or, with `tls`, HTTPS with an optional client certificate."""

    def __init__(self, port: int, tls: ssl.SSLContext | None = None) -> None:
        self.port, self.tls = port, tls

    def post(self, verb: str, body: object) -> tuple[int, Any]:
        conn: http.client.HTTPConnection
        if self.tls is not None:
            conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=20, context=self.tls)
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        try:
            conn.request(
                "POST", f"/{verb}", body=json.dumps(body), headers={"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()


@dataclass
class Served:
    api: ApiServerStandIn
    extender: Extender
    server: ExtenderServer
    caller: Caller

    def bindings(self) -> list[Any]:
        return [r.body for r in self.api.requests("POST", r"/binding$")]

    def writes(self) -> list[Any]:
        """Every request that changed something on the API server (annotation PATCH, Binding POST)."""
        return [r for r in self.api.requests() if r.method != "GET"]


def serve(api: ApiServerStandIn, *, ssl_context: ssl.SSLContext | None = None, **options: Any) -> Served:
    extender = Extender(
        config=ExtenderConfig(scheduler_names=frozenset({"default-scheduler", "gpu-scheduler"})),
        binder=KubeApi(api.url),
    )
    server = ExtenderServer(extender, port=0, ssl_context=ssl_context, **options)
    server.start()
    assert isinstance(extender.binder, KubeApi)
    extender.binder.attach(server.loop)
    return Served(api, extender, server, Caller(server.port))


@pytest.fixture
def served() -> Iterator[Served]:
    with ApiServerStandIn() as api:
        s = serve(api)
        try:
            yield s
        finally:
            s.server.stop()


# ----- the checks, over plain HTTP ------------------------------------------------------------------------


def test_binding_a_running_system_pod_anywhere_is_refused(served: Served) -> None:
    served.api.add_pod("kube-system", "coredns-abc", node_name="cp-1")
    status, result = served.caller.post(
        "bind", {"PodName": "coredns-abc", "PodNamespace": "kube-system", "Node": "any"}
    )
    assert status == 200 and result["Error"].startswith("bind refused:")
    assert "already bound to node cp-1" in result["Error"]
    assert (
        served.writes() == [] and served.api.pod("kube-system", "coredns-abc")["spec"]["nodeName"] == "cp-1"
    )


def test_a_pending_pod_the_extender_never_filtered_is_refused(served: Served) -> None:
    pod = pending("coredns-new", uid="u-dns")
    pod["metadata"]["namespace"] = "kube-system"
    served.api.put_pod(pod)
    _, result = served.caller.post("bind", bind_args(pod, "n1"))
    assert "was not filtered by this extender" in result["Error"]
    assert served.writes() == []
    _, result = served.caller.post("bind", {"PodName": "ghost", "PodNamespace": "x", "Node": "n1"})
    assert "pod x/ghost does not exist" in result["Error"] and served.writes() == []


def test_bind_to_a_node_filter_did_not_pass_is_refused(served: Served) -> None:
    pod = pending("train-0", uid="u-0")
    served.api.put_pod(pod)
    _, result = served.caller.post("filter", {"Pod": pod, "Nodes": NODES})
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["n1", "n2"]
    for node in ("full", "elsewhere"):  # failed the filter; never sent to it
        _, result = served.caller.post("bind", bind_args(pod, node))
        assert f"filter did not pass node {node}" in result["Error"]
    assert served.writes() == [] and not served.api.pod("team-a", "train-0")["spec"].get("nodeName")


def test_a_pod_bound_since_it_was_filtered_is_refused(served: Served) -> None:
    pod = pending("train-0", uid="u-0")
    served.api.put_pod(pod)
    served.caller.post("filter", {"Pod": pod, "Nodes": NODES})
    pod["spec"]["nodeName"] = "n2"  # another scheduler (or a person) bound it meanwhile
    served.api.put_pod(pod)
    _, result = served.caller.post("bind", bind_args(pod, "n1"))
    assert "already bound to node n2" in result["Error"] and served.writes() == []


def test_another_schedulers_pod_is_refused(served: Served) -> None:
    pod = pending("batch-0", uid="u-b", scheduler="volcano")
    served.api.put_pod(pod)
    served.caller.post("filter", {"Pod": pod, "Nodes": NODES})
    _, result = served.caller.post("bind", bind_args(pod, "n1"))
    assert "names scheduler 'volcano'" in result["Error"] and served.writes() == []


def test_a_wrong_uid_or_a_made_up_filter_body_is_refused(served: Served) -> None:
    real = pending("train-0", uid="u-0", gpus="2")
    served.api.put_pod(real)
    served.caller.post("filter", {"Pod": real, "Nodes": NODES})
    _, result = served.caller.post("bind", bind_args(real, "n1", uid="u-other"))
    assert "has UID u-0, not u-other" in result["Error"]
    # A forged filter body with the real pod's UID but another request, to prepare a bind:
    forged = pending("train-0", uid="u-0", gpus="1")
    served.caller.post("filter", {"Pod": forged, "Nodes": NODES})
    _, result = served.caller.post("bind", bind_args(real, "n1"))
    assert "other resources than the pod filter was asked about" in result["Error"]
    assert served.writes() == []


def test_filter_then_bind_binds_once(served: Served) -> None:
    pod = pending("train-0", uid="u-0", scheduler="gpu-scheduler")
    served.api.put_pod(pod)
    _, result = served.caller.post("filter", {"Pod": pod, "Nodes": NODES})
    assert result["Nodes"]["items"]
    assert served.caller.post("bind", bind_args(pod, "n2")) == (200, {"Error": ""})
    stored = served.api.pod("team-a", "train-0")
    assert stored["spec"]["nodeName"] == "n2"
    assert stored["metadata"]["annotations"]["gpunode.io/gpu-assigned"].startswith("GPU-n2-")
    (binding,) = served.bindings()
    assert binding["metadata"]["uid"] == "u-0" and binding["target"]["name"] == "n2"
    # The same request again (a replay) is refused: the pod is bound now.
    _, result = served.caller.post("bind", bind_args(pod, "n1"))
    assert "already bound to node n2" in result["Error"] and len(served.bindings()) == 1


# ----- TLS and client certificates ------------------------------------------------------------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(
    subject: str | list[str],
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
    dns: tuple[str, ...] = (),
) -> x509.Certificate:
    """A certificate whose subject holds one commonName per name in `subject` (each its own RDN)."""
    now = datetime.datetime.now(datetime.UTC)
    cns = [subject] if isinstance(subject, str) else subject
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn) for cn in cns])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if dns:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False
        )
    if ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        path.with_suffix(".key").write_bytes(pem)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca (trusted), server (signed by ca), scheduler and intruder clients (ca), stranger (another CA)."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_key = _key(), _key()
    ca = _cert("gpunode test CA", ca_key, None, ca=True)
    other = _cert("someone else's CA", other_key, None, ca=True)
    _write(d / "ca", ca)
    for name, issuer, server in (
        ("server", (ca, ca_key), True),
        ("scheduler", (ca, ca_key), False),
        ("intruder", (ca, ca_key), False),
        ("stranger", (other, other_key), False),
    ):
        key = _key()
        cn = "kube-scheduler" if name == "scheduler" else name
        _write(d / name, _cert(cn, key, issuer, server=server), key)
    # Certificates from the trusted CA that name kube-scheduler beside another identity.
    for name, subject, dns in (
        ("two-cns", ["intruder", "kube-scheduler"], ()),
        ("two-cns-reversed", ["kube-scheduler", "intruder"], ()),
        ("dns-only", ["intruder"], ("kube-scheduler",)),
    ):
        key = _key()
        _write(d / name, _cert(subject, key, (ca, ca_key), dns=dns), key)
    return d


def client_context(pki: Path, who: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if who is not None:
        ctx.load_cert_chain(str(pki / f"{who}.crt"), str(pki / f"{who}.key"))
    return ctx


@pytest.fixture
def served_tls(pki: Path) -> Iterator[Served]:
    tls = server_tls_context(
        str(pki / "server.crt"), str(pki / "server.key"), client_ca_file=str(pki / "ca.crt")
    )
    with ApiServerStandIn() as api:
        s = serve(api, ssl_context=tls, allowed_client_names=["kube-scheduler"])
        try:
            yield s
        finally:
            s.server.stop()


@pytest.mark.parametrize("who", [None, "stranger"], ids=["no-certificate", "other-ca"])
def test_a_client_without_a_certificate_from_the_ca_gets_no_answer(
    served_tls: Served, pki: Path, who: str | None
) -> None:
    pod = pending("train-0", uid="u-0")
    served_tls.api.put_pod(pod)
    caller = Caller(served_tls.server.port, client_context(pki, who))
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        caller.post("filter", {"Pod": pod, "Nodes": NODES})
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        caller.post("bind", bind_args(pod, "n1"))
    assert len(served_tls.extender.filtered) == 0 and served_tls.writes() == []


def test_plain_http_to_the_tls_port_gets_no_extender_answer(served_tls: Served) -> None:
    with socket.create_connection(("127.0.0.1", served_tls.server.port), timeout=20) as sock:
        sock.sendall(b"POST /bind HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    assert b"ExtenderBindingArgs" not in reply and b'"Error"' not in reply
    assert served_tls.writes() == []


def test_a_certificate_with_another_name_is_answered_403(served_tls: Served, pki: Path) -> None:
    status, result = Caller(served_tls.server.port, client_context(pki, "intruder")).post("filter", {})
    assert status == 403 and "intruder" in result["Error"] and "--allowed-client-names" in result["Error"]


@pytest.mark.parametrize("who", ["two-cns", "two-cns-reversed", "dns-only"])
def test_a_certificate_naming_the_scheduler_beside_another_identity_is_refused(
    served_tls: Served, pki: Path, who: str
) -> None:
    # A real handshake with a certificate from the trusted CA whose subject carries two CNs, one of them
    # kube-scheduler (either order), or whose CN is another name and only a DNS name is kube-scheduler.
    pod = pending("train-0", uid="u-0")
    served_tls.api.put_pod(pod)
    caller = Caller(served_tls.server.port, client_context(pki, who))
    status, result = caller.post("filter", {"Pod": pod, "Nodes": NODES})
    assert status == 403 and "--allowed-client-names" in result["Error"]
    expected = "2 subject common names" if who.startswith("two-cns") else "CN 'intruder' is not an allowed"
    assert expected in result["Error"]
    assert caller.post("bind", bind_args(pod, "n1"))[0] == 403
    assert len(served_tls.extender.filtered) == 0 and served_tls.writes() == []


def test_the_schedulers_certificate_filters_and_binds(served_tls: Served, pki: Path) -> None:
    pod = pending("train-0", uid="u-0")
    served_tls.api.put_pod(pod)
    caller = Caller(served_tls.server.port, client_context(pki, "scheduler"))
    status, result = caller.post("filter", {"Pod": pod, "Nodes": NODES})
    assert status == 200 and result["Nodes"]["items"]
    assert caller.post("bind", bind_args(pod, "n1")) == (200, {"Error": ""})
    assert served_tls.api.pod("team-a", "train-0")["spec"]["nodeName"] == "n1"


# ----- the flags ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["--bind", "--kube-api", "http://127.0.0.1:1"], "would let anyone", id="bind-without-tls"
        ),
        pytest.param(["--bind"], "--bind needs --kube-api", id="bind-without-api"),
        pytest.param(["--tls-cert-file", "c.pem"], "go together", id="cert-without-key"),
        pytest.param(["--client-ca-file", "ca.pem"], "needs --tls-cert-file", id="ca-without-tls"),
        pytest.param(["--allowed-client-names", "x"], "needs --client-ca-file", id="names-without-ca"),
    ],
)
def test_unsafe_or_incomplete_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_extender(parser().parse_args(["extender", *argv]))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bind_flags_build_a_binding_extender_only_when_asked(pki: Path) -> None:
    api = "http://127.0.0.1:1"
    extender, client = build_extender(parser().parse_args(["extender", "--kube-api", api]))
    assert client is not None and extender.binder is None  # node refresh only: no bind verb
    tls = ["--tls-cert-file", str(pki / "server.crt"), "--tls-key-file", str(pki / "server.key")]
    argv = ["extender", "--kube-api", api, "--bind", *tls, "--client-ca-file", str(pki / "ca.crt")]
    args = parser().parse_args([*argv, "--scheduler-name", "gpu-scheduler", "--allowed-client-names", "a, b"])
    extender, client = build_extender(args)
    assert extender.binder is client and extender.config.scheduler_names == frozenset({"gpu-scheduler"})
    options = server_options(args)
    assert options["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    assert options["allowed_client_names"] == ["a", "b"]
    insecure = parser().parse_args(["extender", "--kube-api", api, "--bind", "--insecure-bind-without-tls"])
    assert build_extender(insecure)[0].binder is not None


def test_the_process_refuses_to_bind_without_tls_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpunode.cli", "extender", "--listen", "127.0.0.1:0", "--bind", "--kube-api",
         "http://127.0.0.1:1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("gpunode: --bind without client certificates") and lines[1].startswith("HINT:")
