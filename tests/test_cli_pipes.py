"""The `gpunode` command when its output pipe closes early, and when an optional extra is not installed.

Each test runs the real command in a child process. A closed pipe is made deterministic by closing the
read end before the child starts, so its very first write meets a pipe without a reader (what `| head -1`
does to a longer output). A missing extra is simulated by a wrapper that blocks the module's import
(sys.modules[name] = None makes `import name` raise ModuleNotFoundError, as an absent package does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpunode.cli import CLOSED_STDOUT_STATUS
from gpunode.config.agent import environment_variables
from tests.cluster.test_simulator import write_trace

TIMEOUT_S = 120


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for names in environment_variables().values():
        for name in names:
            env.pop(name, None)
    return env


def _wrapper(blocked: tuple[str, ...]) -> list[str]:
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
        + "from gpunode.cli import main\nsys.exit(main())\n"
    )
    return [sys.executable, "-c", code]


def run_into_closed_pipe(
    argv: list[str], *, blocked: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Run `gpunode argv` with stdout a pipe whose reader is already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [*_wrapper(blocked), *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            timeout=TIMEOUT_S,
            check=False,
        )
    finally:
        os.close(write_end)


def run(argv: list[str], *, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_wrapper(blocked), *argv],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=TIMEOUT_S,
        check=False,
    )


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trace(tmp_path_factory.mktemp("openb"), nodes=12, pods=60)


def _simulate(trace: Path, out: Path, progress: str) -> list[str]:
    return [
        "simulate", "--trace-dir", str(trace), "--policies", "bestfit", "--seeds", "1",
        "--jobs", "1", "--out", str(out), "--progress", progress,
    ]  # fmt: skip


DEVICES = ["devices", "--backend", "sim", "--sim-profile", "dgx-h100"]


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["table", "json"])
def test_devices_into_a_closed_pipe_ends_quietly(extra: list[str]) -> None:
    done = run_into_closed_pipe([*DEVICES, *extra])
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode == CLOSED_STDOUT_STATUS == 141


def test_devices_piped_into_a_reader_of_one_line() -> None:
    """What `gpunode devices --json | head -1` does: the reader takes one line and closes its end."""
    proc = subprocess.Popen(
        [*_wrapper(()), *DEVICES, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env()
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    status = proc.wait(timeout=TIMEOUT_S)
    assert first.strip() == b"{"
    assert "Traceback" not in err and "Exception ignored" not in err, err
    # The whole output may have fit in the pipe before the reader closed it: then the command succeeded.
    assert status in (0, CLOSED_STDOUT_STATUS)


def test_help_into_a_closed_pipe_ends_quietly() -> None:
    done = run_into_closed_pipe(["--help"])
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode in (0, CLOSED_STDOUT_STATUS)  # argparse itself ignores a failed write of help


def test_simulate_into_a_closed_pipe_ends_quietly(trace_dir: Path, tmp_path: Path) -> None:
    done = run_into_closed_pipe(_simulate(trace_dir, tmp_path / "out", "off"))
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode == CLOSED_STDOUT_STATUS
    assert (tmp_path / "out" / "default.csv").is_file()  # the work was done; only the printing stopped


def test_simulate_without_tqdm_runs_with_progress_off(trace_dir: Path, tmp_path: Path) -> None:
    done = run(_simulate(trace_dir, tmp_path / "out", "off"), blocked=("tqdm",))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    files = json.loads(done.stdout)["files"]
    assert Path(files["csv"]).is_file() and Path(files["png"]).is_file()


def test_simulate_without_tqdm_asking_for_progress_names_the_extra(trace_dir: Path, tmp_path: Path) -> None:
    done = run(_simulate(trace_dir, tmp_path / "out", "on"), blocked=("tqdm",))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("gpunode: ") and "'tqdm'" in lines[0], done.stderr
    assert lines[1] == "HINT: install the 'plot' extra: pip install 'gpunode[plot]'"
    assert done.stdout == ""


def test_simulate_without_the_plot_extra_writes_everything_but_the_png(
    trace_dir: Path, tmp_path: Path
) -> None:
    done = run(_simulate(trace_dir, tmp_path / "out", "off"), blocked=("tqdm", "matplotlib"))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "pip install 'gpunode[plot]'" in done.stderr
    files = json.loads(done.stdout)["files"]
    assert "png" not in files and Path(files["csv"]).is_file() and Path(files["summary"]).is_file()
    assert not (tmp_path / "out" / "default.png").exists()


def test_a_missing_extra_anywhere_is_one_line_naming_it(tmp_path: Path) -> None:
    """The safety net in main(): a ModuleNotFoundError for an extra's module becomes MissingExtra."""
    code = (
        "import sys\nfrom gpunode import cli\n"
        "def boom(args):\n    import tqdm  # noqa\n"
        "cli.cmd_doctor = boom\n"
        "sys.modules['tqdm'] = None\nsys.exit(cli.main(['doctor', '--backend', 'sim']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        "gpunode: `gpunode doctor` needs the Python package 'tqdm', which is not installed",
        "HINT: install the 'plot' extra: pip install 'gpunode[plot]'",
    ]
