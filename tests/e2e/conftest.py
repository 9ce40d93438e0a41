"""Fixtures for the end-to-end tier: one real control plane for the session.

Without the binaries (scripts/get-kube.sh could not build them: no Go module proxy, no Go new enough
and none to start one with, not linux-amd64) every test here is skipped with the reason. Binaries that exist but do not start fail the tests.
When a test fails, the end of every component's log is added to its report; the full logs stay in
the control plane's directory under pytest's basetemp (the last three runs are kept).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e import chart
from tests.e2e.controlplane import ControlPlane, StartError, User, missing_reason, service_account_user
from tests.e2e.jobset import JOBSET_USER, JOBSET_USER_KEY, JobSetController, jobset_controller_for
from tests.e2e.jobset import missing_reason as jobset_missing_reason
from tests.e2e.node import node_user

# The chart's service accounts for its release in tests.e2e.chart (the tests check the names against the
# rendered chart): the API server must know these users before it starts.
REAL_NODE = "e2e-node-1"  # the Node a real kubelet registers (tests/e2e/node.py)
E2E_USERS: dict[str, User] = {
    "extender": service_account_user(chart.NAMESPACE, f"{chart.RELEASE}-gpunode-extender"),
    "agent": service_account_user(chart.NAMESPACE, f"{chart.RELEASE}-gpunode-agent"),
    "queue": service_account_user(chart.NAMESPACE, f"{chart.RELEASE}-gpunode-queue"),
    "nobody": User("e2e-nobody"),
    "node": node_user(REAL_NODE),
    JOBSET_USER_KEY: JOBSET_USER,  # the JobSet controller (tests/e2e/jobset.py)
}


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver, started once for the session (kube-scheduler: start_scheduler per test)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    cp = ControlPlane(tmp_path_factory.mktemp("kube"), users=E2E_USERS)
    try:
        cp.start()
    except StartError as exc:
        pytest.fail(f"the control plane did not start (logs in {cp.logs}): {exc}")
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def jobset_controller(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[JobSetController]:
    """The JobSet controller with its CRD and webhooks on the session's control plane (tests/e2e/jobset.py),
    started on first use; skipped with the reason when `scripts/get-kube.sh --jobset` has not built it."""
    reason = jobset_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        yield from jobset_controller_for(control_plane, tmp_path_factory.mktemp("jobset"))
    except StartError as exc:
        pytest.fail(f"the JobSet controller did not start (logs in {control_plane.logs}): {exc}")


_PLANES: list[ControlPlane] = []


@pytest.fixture(autouse=True)
def _remember_plane(request: pytest.FixtureRequest) -> None:
    if "control_plane" in request.fixturenames:
        plane = request.getfixturevalue("control_plane")
        if plane not in _PLANES:
            _PLANES.append(plane)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Add the components' logs to the report of a failed test."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and _PLANES:
        for plane in _PLANES:
            report.sections.append((f"control plane logs ({plane.logs})", plane.logs_tail()))
