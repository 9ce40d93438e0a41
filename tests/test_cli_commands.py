"""The `gpunode` command: every subcommand reaches the function that runs it, only its own modules
get imported, and a GpunodeError comes out as a message line, a HINT line and the error's exit code."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from gpunode import cli
from gpunode.errors import ConfigError, GpunodeError, MemcapError
from tests.ports import free_port


@pytest.mark.parametrize(
    "command", ["agent", "devices", "doctor", "sim", "health", "extender", "queue", "simulate"]
)
def test_every_subcommand_has_a_runner(command: str) -> None:
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command")
    assert command in sub.choices  # type: ignore[operator]
    assert callable(sub.choices[command].get_default("func")), command  # type: ignore[index]
    # `gpunode --help` shows the help of the static table; the subcommand's own module must agree with it
    listed = {a.dest: a.help for a in sub._choices_actions}  # type: ignore[attr-defined]
    assert listed[command] == cli.COMMANDS[command].help


def test_the_table_names_every_subcommand() -> None:
    assert list(cli.COMMANDS) == [
        "agent",
        "devices",
        "doctor",
        "sim",
        "health",
        "extender",
        "queue",
        "simulate",
    ]


# Runs the CLI in a fresh interpreter and reports what it printed and which modules it imported.
PROBE = """
import contextlib, io, json, sys
from gpunode import cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        code = cli.main(sys.argv[1:])
    except SystemExit as exit:
        code = exit.code
print(json.dumps({"code": code, "out": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def probe(*argv: str) -> tuple[str, set[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(proc.stdout)
    assert result["code"] == 0, proc.stderr
    return result["out"], set(result["modules"])


def imported(modules: set[str], package: str) -> list[str]:
    return sorted(m for m in modules if m == package or m.startswith(package + "."))


@pytest.mark.parametrize("command", ["agent", "devices", "doctor"])
def test_node_commands_import_neither_the_cluster_side_nor_numpy(command: str) -> None:
    out, modules = probe(command, "--help")
    assert "--config" in out and "--backend" in out and "--sim-profile" in out
    for package in ("gpunode.cluster", "numpy", "orjson"):
        assert not imported(modules, package), f"`gpunode {command} --help` imported {package}"


def test_agent_help_shows_its_flags() -> None:
    out, _ = probe("agent", "--help")
    assert "--sim-control-socket" in out and "--kubelet-dir" in out


def test_top_level_help_lists_every_subcommand_and_imports_none() -> None:
    out, modules = probe("--help")
    for name, entry in cli.COMMANDS.items():
        assert name in out
        assert " ".join(entry.help.split()[:4]) in " ".join(out.split()), name
    for package in ("gpunode.cluster", "gpunode.node", "numpy", "orjson"):
        assert not imported(modules, package), f"`gpunode --help` imported {package}"


def test_extender_help_lists_its_flags() -> None:
    out, modules = probe("extender", "--help")
    for flag in ("--listen", "--policy", "--path-prefix", "--memory-unit", "--kube-api", "--node-refresh"):
        assert flag in out, flag
    assert imported(modules, "gpunode.cluster.extender")
    assert not imported(modules, "gpunode.node"), "the extender imported the node side"


def test_sim_and_simulate_help_list_their_flags() -> None:
    out, modules = probe("sim", "--help")
    assert "xid" in out and "lose" in out
    assert not imported(modules, "gpunode.cluster")
    out, modules = probe("simulate", "--help")
    assert "--trace-dir" in out and "--policies" in out
    assert not imported(modules, "gpunode.node")


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConfigError("gpunode.metrics.listen: expected host:port", hint="write it as :9400"), 2),
        (MemcapError("the region /x is corrupt", hint="delete /x"), 1),
        (GpunodeError("something failed"), 1),
    ],
)
def test_errors_print_the_message_then_the_hint_and_exit_with_their_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: GpunodeError, code: int
) -> None:
    def fail(args: object) -> int:
        raise error

    monkeypatch.setattr(cli, "cmd_doctor", fail)
    assert cli.main(["doctor"]) == code == error.exit_code
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"gpunode: {error}\nHINT: {error.hint}\n"
    assert err.splitlines()[1] != "HINT: "


def test_extender_serves_until_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpunode.cli", "extender", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -signal.SIGTERM)
