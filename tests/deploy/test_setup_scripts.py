"""scripts/common.sh, which scripts/run-agent.sh and scripts/test.sh source: the install decisions.

The real functions run in bash against stand-ins: a virtualenv whose `python` records how it was called
(so no package is installed and nothing is downloaded), and `dpkg-query`, `apt-get` and `fuser` on PATH
that report a missing package and a held dpkg lock and record what apt-get was asked. The hashes are over
the checkout's real pyproject.toml, setup.py and native/.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "scripts" / "common.sh"


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A stand-in virtualenv: bin/python logs its arguments, bin/gpunode exists."""
    v = tmp_path / "venv"
    (v / "bin").mkdir(parents=True)
    _executable(
        v / "bin" / "python",
        '#!/bin/sh\necho "$*" >>"$CALLS"\n[ "$1" = --version ] && echo "Python 3.11.9"\nexit 0\n',
    )
    _executable(v / "bin" / "gpunode", "#!/bin/sh\nexit 0\n")
    return v


def source_and_run(snippet: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f'source "{COMMON}"\n{snippet}'],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_second_start_does_not_reinstall(venv: Path, tmp_path: Path) -> None:
    if not (ROOT / "gpunode" / "lib" / "libgpunode-preload.so").is_file():
        pytest.skip("the native parts are not built in this checkout")
    calls = tmp_path / "calls"
    env = {**os.environ, "GPUNODE_VENV": str(venv), "PYTHON": sys.executable, "CALLS": str(calls)}

    def installs() -> list[str]:
        lines = calls.read_text().splitlines() if calls.exists() else []
        return [line for line in lines if line.startswith("-m pip install -q -e")]

    first = source_and_run('ensure_venv "[systemd]"', env)
    assert first.returncode == 0, first.stderr
    assert installs() == [f"-m pip install -q -e {ROOT}[systemd]"]
    assert ">> installing gpunode[systemd]" in first.stdout

    second = source_and_run('ensure_venv "[systemd]"', env)
    assert second.returncode == 0, second.stderr
    assert installs() == [f"-m pip install -q -e {ROOT}[systemd]"]  # no second install
    assert "is up to date" in second.stdout
    assert calls.read_text().count("--upgrade pip") == 1  # pip itself is left alone too

    # Other extras are another install (and their own stamp); the first stays current.
    third = source_and_run('ensure_venv "[test,systemd]"', env)
    assert third.returncode == 0, third.stderr
    assert len(installs()) == 2
    assert "is up to date" in source_and_run('ensure_venv "[systemd]"', env).stdout

    # A stamp from other sources (pyproject.toml, setup.py or native/ changed) means a new install.
    for stamp in venv.glob(".gpunode-install-stamp*"):
        stamp.write_text("0" * 64 + "\n")
    fourth = source_and_run('ensure_venv "[systemd]"', env)
    assert fourth.returncode == 0, fourth.stderr
    assert len(installs()) == 3


def test_a_failed_install_leaves_no_stamp(venv: Path, tmp_path: Path) -> None:
    _executable(
        venv / "bin" / "python",
        '#!/bin/sh\n[ "$1" = --version ] && { echo "Python 3.11.9"; exit 0; }\n'
        'case "$*" in *"-e "*) exit 1;; esac\nexit 0\n',
    )
    env = {**os.environ, "GPUNODE_VENV": str(venv), "PYTHON": sys.executable}
    done = source_and_run('ensure_venv "[systemd]"', env)
    assert done.returncode != 0
    assert not list(venv.glob(".gpunode-install-stamp*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="as_root goes through sudo, which resets PATH")
def test_apt_waits_for_a_held_lock_and_says_so(tmp_path: Path) -> None:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    log = tmp_path / "apt-calls"
    _executable(stubs / "dpkg-query", "#!/bin/sh\nexit 1\n")  # every package is missing
    _executable(stubs / "fuser", "#!/bin/sh\necho 1234\nexit 0\n")  # a process holds a lock
    _executable(stubs / "apt-get", f'#!/bin/sh\necho "$*" >>"{log}"\nexit 0\n')
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "GPUNODE_APT_LOCK_TIMEOUT": "900"}
    done = source_and_run("ensure_apt_packages gcc", env)
    assert done.returncode == 0, done.stderr
    assert "another apt or dpkg is running" in done.stdout and "900s" in done.stdout
    assert log.read_text().splitlines() == [
        "-o DPkg::Lock::Timeout=900 update -qq",
        "-o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends gcc",
    ]
