"""The claim reader's pieces on their own: UIDs, memory quantities, the opaque configuration."""

from __future__ import annotations

from typing import Any

import pytest

from gpunode.errors import ClaimRefused
from gpunode.node.dra.cdi import device_id, spec_path
from gpunode.node.dra.claims import check_uid, parse_memory, parse_opaque

GIB = 2**30
UID = "0f6ee5a2-6a43-4a6e-9e0c-51d6c1d5b7a0"


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4Gi", 4 * GIB),
        ("4294967296", 4 * GIB),
        ("1.5Gi", 3 * GIB // 2),
        ("4G", 4 * 10**9),
        ("4e9", 4 * 10**9),
        ("512Mi", 512 * 2**20),
        ("0.5", 1),  # a fraction of a byte is a whole byte, as the API server rounds up
        ("500m", 1),
    ],
)
def test_memory_quantities(text: str, size: int) -> None:
    assert parse_memory(text, "x") == size


@pytest.mark.parametrize("text", ["", "4 Gi", "-1", "4gi", "0", "1e99", "9" * 30, "4Gi\n", 4, None])
def test_memory_quantities_refused(text: Any) -> None:
    with pytest.raises(ClaimRefused):
        parse_memory(text, "x")


@pytest.mark.parametrize("uid", [UID.upper(), UID + "\n", "../" + UID, UID[:-1], f"{UID}/..", " " + UID])
def test_only_a_kubernetes_uid_names_anything(uid: str) -> None:
    with pytest.raises(ClaimRefused, match="is not a Kubernetes UID"):
        check_uid(uid)


def test_names_come_from_the_uid_only(tmp_path: Any) -> None:
    assert spec_path(tmp_path, "gpu.gpunode.io", UID) == tmp_path / f"gpu.gpunode.io-{UID}.json"
    assert device_id("gpu.gpunode.io", UID, 2) == f"gpu.gpunode.io/claim={UID}-2"


def test_opaque_configuration() -> None:
    base = {"apiVersion": "gpunode.io/v1alpha1", "kind": "GpuConfig"}
    assert parse_opaque(base, "c") is False
    assert parse_opaque({**base, "failOpen": True}, "c") is True
    deep: Any = {}
    for _ in range(50):
        deep = {"x": deep}
    with pytest.raises(ClaimRefused, match=r"c\.x: unknown field"):
        parse_opaque({**base, "x": deep}, "c")
