"""The exception tree: every class renders a one-line message, carries a hint and knows its exit code."""

from __future__ import annotations

import ast
import builtins
import inspect
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunode import errors
from gpunode.errors import GpunodeError

PACKAGE = Path(errors.__file__).resolve().parent

# class -> (how to build one, the exit code `gpunode` must end with)
CASES: dict[type[GpunodeError], tuple[Callable[[str], GpunodeError], int]] = {
    errors.GpunodeError: (errors.GpunodeError, 1),
    errors.ConfigError: (errors.ConfigError, 2),
    errors.ProfileError: (errors.ProfileError, 2),
    errors.BackendError: (errors.BackendError, 1),
    errors.BackendUnavailable: (errors.BackendUnavailable, 1),
    errors.GpuLostError: (lambda m: errors.GpuLostError("GPU-1", m), 1),
    errors.DeviceNotFound: (errors.DeviceNotFound, 1),
    errors.SimFaultError: (errors.SimFaultError, 1),
    errors.SimControlError: (errors.SimControlError, 1),
    errors.AllocationError: (errors.AllocationError, 1),
    errors.MemcapError: (errors.MemcapError, 1),
    errors.MetricsServerError: (errors.MetricsServerError, 1),
    errors.ListenError: (errors.ListenError, 1),
    errors.KubeError: (errors.KubeError, 1),
    errors.KubeApiError: (lambda m: errors.KubeApiError(m, status=500), 1),
    errors.KubeNotFound: (lambda m: errors.KubeNotFound(m, status=404), 1),
    errors.KubeConflict: (lambda m: errors.KubeConflict(m, status=409), 1),
    errors.EvictionBlocked: (lambda m: errors.EvictionBlocked(m, retry_after_s=5.0), 1),
    errors.KubeUnreachable: (errors.KubeUnreachable, 1),
    errors.NodeStateError: (errors.NodeStateError, 1),
    errors.PlacementError: (errors.PlacementError, 1),
    errors.InvalidRequest: (errors.InvalidRequest, 1),
    errors.InvalidState: (errors.InvalidState, 1),
    errors.Unsatisfiable: (errors.Unsatisfiable, 1),
    errors.BadRequest: (errors.BadRequest, 1),
    errors.TraceError: (errors.TraceError, 1),
    errors.MetricsFeedError: (errors.MetricsFeedError, 1),
    errors.QueueConfigError: (errors.QueueConfigError, 2),
    errors.QueueUsageRefused: (errors.QueueUsageRefused, 1),
    errors.SimRulesError: (errors.SimRulesError, 2),
    errors.AdmissionKeyError: (errors.AdmissionKeyError, 2),
    errors.AgentPartFailed: (errors.AgentPartFailed, 1),
    errors.HealthStateError: (errors.HealthStateError, 1),
    errors.KubeletDirError: (errors.KubeletDirError, 2),
    errors.StateDirError: (errors.StateDirError, 2),
    errors.TlsConfigError: (errors.TlsConfigError, 2),
    errors.WebConfigError: (errors.WebConfigError, 2),
    errors.NotLeader: (errors.NotLeader, 1),
    errors.RegionDamaged: (lambda m: errors.RegionDamaged(m, key="k", reason="truncated"), 1),
    errors.BodyRefused: (lambda m: errors.BodyRefused(m, status=413), 1),
    errors.ClaimRefused: (errors.ClaimRefused, 1),
    errors.InvalidComputeShare: (errors.InvalidComputeShare, 2),
    errors.QuantityError: (errors.QuantityError, 1),
}

# classes whose message is built from their arguments (tested one by one below)
SPECIAL: set[type[GpunodeError]] = {errors.MissingExtra}


def defined_in_errors() -> set[type]:
    return {
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == errors.__name__
    }


def test_the_table_covers_every_class() -> None:
    assert set(CASES) | SPECIAL == defined_in_errors()


def test_a_missing_extra_names_the_extra_to_install() -> None:
    exc = errors.MissingExtra("tqdm", "plot", "`gpunode simulate --progress on`")
    assert (
        str(exc) == "`gpunode simulate --progress on` needs the Python package 'tqdm', which is not installed"
    )
    assert exc.hint == "install the 'plot' extra: pip install 'gpunode[plot]'"
    assert exc.exit_code == 1 and (exc.module, exc.extra) == ("tqdm", "plot")


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_message_hint_and_exit_code(cls: type[GpunodeError]) -> None:
    build, exit_code = CASES[cls]
    exc = build("node.yaml: flags.migStrategy: expected none, single or mixed")
    assert type(exc) is cls and isinstance(exc, GpunodeError)
    text = str(exc)
    assert text == "node.yaml: flags.migStrategy: expected none, single or mixed"
    assert "\n" not in text and "HINT" not in text
    assert exc.hint and "\n" not in exc.hint and exc.hint == cls.default_hint
    assert exc.exit_code == cls.exit_code == exit_code
    assert not hasattr(exc, "message")  # str(exc) is the one way to get the message


def test_a_lost_gpu_names_itself_without_a_message() -> None:
    exc = errors.GpuLostError("GPU-1")
    assert str(exc) == "GPU GPU-1 is lost" and exc.uuid == "GPU-1"


def test_a_hint_given_at_the_raise_replaces_the_default() -> None:
    exc = errors.ConfigError("bad value", hint="write it as 1Gi")
    assert exc.hint == "write it as 1Gi" and str(exc) == "bad value"
    api = errors.KubeApiError("forbidden", status=403, reason="Forbidden", hint="grant the verb")
    assert (api.status, api.reason, api.hint) == (403, "Forbidden", "grant the verb")


def test_text_spanning_lines_becomes_one_line() -> None:
    """YAML and HTTP errors quoted into a message may span lines; log lines must not."""
    exc = errors.ConfigError('while parsing a block mapping\n  in "f.yaml", line 1\n\nexpected <block end>')
    assert str(exc) == 'while parsing a block mapping in "f.yaml", line 1 expected <block end>'
    assert errors.MemcapError("x", hint="first\nsecond").hint == "first second"


def test_placement_errors_are_also_value_errors() -> None:
    assert issubclass(errors.PlacementError, ValueError)
    assert issubclass(errors.InvalidRequest, errors.PlacementError)
    assert issubclass(errors.ProfileError, errors.ConfigError)


def exception_classes_outside_errors() -> list[str]:
    """Public exception classes defined anywhere in gpunode but errors.py (private ones stay local)."""
    known = {name for name in dir(errors) if isinstance(getattr(errors, name), type)}
    known |= {name for name in dir(builtins) if name.endswith(("Error", "Exception"))}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py" or "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
            if bases & known:
                found.append(f"{path.relative_to(PACKAGE.parent)}: {node.name}")
    return found


def test_every_public_exception_lives_in_errors() -> None:
    assert exception_classes_outside_errors() == []
