"""How `gpunode devices` and `gpunode agent` refuse a bad configuration: the real command in a child process,
exit status 2, one message line naming the file (or flag, or variable) and the key, and a hint that fits
the problem (the generic "fix the named key" hint only where a key is to blame). No traceback.

The reported cases: the generic hint under YAML syntax errors and variable errors; a simProfile typo in a
file that named neither the file nor the key; `--sim-profile /etc/passwd` copying the whole file into the
message; an empty configuration file accepted silently; `unit: 1GB` accepted as 10^9 bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode.errors import ConfigError

GENERIC_HINT = ConfigError.default_hint
CLEAN_ENV = {
    k: v for k, v in os.environ.items() if not k.startswith("GPUNODE_") and k not in ("CONFIG_FILE",)
}
for _name in ("MIG_STRATEGY", "NODE_NAME", "FAIL_ON_INIT_ERROR", "NVIDIA_DRIVER_ROOT"):
    CLEAN_ENV.pop(_name, None)


def gpunode(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `python -m gpunode.cli ARGV` (node commands get directories of their own); (status, line, hint)."""
    dirs = ["--kubelet-dir", str(tmp_path / "device-plugins"), "--state-dir", str(tmp_path / "state")]
    proc = subprocess.run(
        [sys.executable, "-m", "gpunode.cli", *argv, *dirs],
        capture_output=True,
        text=True,
        timeout=120,
        env={**CLEAN_ENV, **(env or {})},
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("gpunode: ") and lines[1].startswith("HINT: "), proc.stderr
    return proc.returncode, lines[0].removeprefix("gpunode: "), lines[1].removeprefix("HINT: ")


def config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("command", ["devices", "agent"])
def test_a_yaml_syntax_error_gets_a_syntax_hint(tmp_path: Path, command: str) -> None:
    path = config(tmp_path, 'version: v1\nflags:\n  migStrategy: "mixed\n')
    status, line, hint = gpunode(tmp_path, command, "--backend", "sim", "--config", str(path))
    assert status == 2
    assert line.startswith(f"{path}: not valid YAML at line 4, column 1: ")
    assert hint.startswith("fix the YAML syntax at that line") and hint != GENERIC_HINT


def test_a_key_given_twice_gets_its_own_hint(tmp_path: Path) -> None:
    path = config(tmp_path, "gpunode:\n  backend: sim\n  backend: nvml\n")
    status, line, hint = gpunode(tmp_path, "devices", "--config", str(path))
    assert status == 2 and "the key 'backend' is given twice" in line
    assert hint.startswith("give each key once")


@pytest.mark.parametrize(
    ("how", "origin"),
    [
        pytest.param("file", "{path}: gpunode.simProfile", id="file"),
        pytest.param("flag", "command line --sim-profile", id="flag"),
        pytest.param("variable", "environment variable GPUNODE_SIM_PROFILE", id="variable"),
    ],
)
@pytest.mark.parametrize("command", ["devices", "agent"])
def test_a_sim_profile_typo_names_where_it_was_given(
    tmp_path: Path, command: str, how: str, origin: str
) -> None:
    path = config(
        tmp_path, "version: v1\ngpunode:\n  backend: sim\n" + ("  simProfile: dgx-h10\n" * (how == "file"))
    )
    argv = [command, "--config", str(path)] + (["--sim-profile", "dgx-h10"] if how == "flag" else [])
    env = {"GPUNODE_SIM_PROFILE": "dgx-h10"} if how == "variable" else None
    status, line, hint = gpunode(tmp_path, *argv, env=env)
    assert status == 2
    assert line.startswith(f"{origin.format(path=path)}: no bundled simulated-node profile named 'dgx-h10'")
    assert line.endswith("did you mean dgx-h100?") and "bundled names" in hint


PASSWD_LIKE = "".join(
    f"user{i}:x:{1000 + i}:{1000 + i}:User {i}:/home/user{i}:/bin/bash\n" for i in range(200)
)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--backend", "sim", "--sim-profile", "{path}"], id="sim-profile"),
        pytest.param(["--backend", "sim", "--config", "{path}"], id="config"),
    ],
)
def test_a_file_that_is_not_yaml_mapping_is_quoted_only_in_part(tmp_path: Path, argv: list[str]) -> None:
    path = tmp_path / "passwd"
    path.write_text(PASSWD_LIKE + "secret-tail:x:0:0::/root:/bin/sh\n")
    status, line, hint = gpunode(tmp_path, "devices", *(a.format(path=path) for a in argv))
    assert status == 2 and f"{path}: expected a mapping, got str 'user0:x:1000" in line
    assert "secret-tail" not in line and "user5:" not in line and line.endswith("...")
    assert len(line) < 300 and hint


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="zero-bytes"),
        pytest.param("\n  \n", id="blank"),
        pytest.param("# all\n# comments\n", id="comments"),
    ],
)
@pytest.mark.parametrize("command", ["devices", "agent"])
def test_an_empty_configuration_file_is_refused(tmp_path: Path, command: str, text: str) -> None:
    path = config(tmp_path, text)
    status, line, hint = gpunode(tmp_path, command, "--backend", "sim", "--config", str(path))
    assert (
        status == 2
        and line == f"{path}: the configuration file is empty (no settings, not even `version: v1`)"
    )
    assert "`version: v1`" in hint and "--config" in hint


def test_an_empty_file_named_by_the_variable_says_so(tmp_path: Path) -> None:
    path = config(tmp_path, "")
    status, line, hint = gpunode(tmp_path, "devices", "--backend", "sim", env={"GPUNODE_CONFIG": str(path)})
    assert status == 2 and "is empty" in line and "environment variable GPUNODE_CONFIG" in hint


@pytest.mark.parametrize(
    ("unit", "binary", "gib"),
    [
        pytest.param("1GB", "1Gi", "0.931", id="1GB"),
        pytest.param("1G", "1Gi", "0.931", id="1G"),
        pytest.param("512mb", "512Mi", "0.477", id="512mb"),
    ],
)
def test_a_decimal_memory_unit_is_refused_with_its_binary_spelling(
    tmp_path: Path, unit: str, binary: str, gib: str
) -> None:
    path = config(tmp_path, f"gpunode:\n  backend: sim\n  fractional:\n    devices: all\n    unit: {unit}\n")
    status, line, hint = gpunode(tmp_path, "devices", "--config", str(path))
    assert status == 2
    assert line.startswith(f"{path}: gpunode.fractional.unit: {unit} is a decimal size (")
    assert f"units of {gib} GiB" in line and hint.startswith(f"write {binary} ")


def test_a_bad_variable_gets_a_hint_about_the_variable(tmp_path: Path) -> None:
    status, line, hint = gpunode(tmp_path, "devices", env={"GPUNODE_BACKEND": "bogus"})
    assert (
        status == 2
        and line == "environment variable GPUNODE_BACKEND: expected one of auto, nvml, sim, got 'bogus'"
    )
    assert hint == "set GPUNODE_BACKEND to one of auto, nvml, sim, or unset it"


def test_a_flag_is_bounded_like_the_key_in_the_file(tmp_path: Path) -> None:
    status, line, hint = gpunode(tmp_path, "devices", "--backend", "sim", "--node-name", "n" * 300)
    assert (
        status == 2
        and line
        == "command line --node-name: expected 0..253 characters without NUL bytes, got 300 characters"
    )
    assert "--node-name" in hint and hint != GENERIC_HINT
