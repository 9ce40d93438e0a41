"""The `gpunode` command: pick the subcommand, import only what it needs, call one function.

Every failure the user can fix comes out as `gpunode: <message>` and a `HINT: <hint>`
line, with the error's exit code (2 for configuration errors, 1 otherwise); no
traceback for expected errors.

The parser is built in two steps so that starting the agent never imports the
extender, the simulator or numpy: COMMANDS names every subcommand with its one-line
help (all `gpunode --help` needs), and only the subcommand named on the command line
has its module imported to register its flags and the function that runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import select
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeAlias

from gpunode import __version__
from gpunode.config import agent as config_mod
from gpunode.contract.names import GIB
from gpunode.errors import GpunodeError, MissingExtra

log = logging.getLogger("gpunode")


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", type=Path, help="configuration file (NVIDIA device-plugin v1 + gpunode section)"
    )
    p.add_argument("--backend", choices=config_mod.BACKENDS, help="where GPUs come from (default: auto)")
    p.add_argument(
        "--sim-profile", help="simulated node: a bundled profile name or a YAML file (default: dgx-h100)"
    )
    p.add_argument("--kubelet-dir", type=Path, help="the kubelet's device-plugins directory")
    p.add_argument(
        "--state-dir", type=Path, help="where the agent keeps its checkpoint and memory-cap regions"
    )
    p.add_argument("--mig-strategy", choices=config_mod.MIG_STRATEGIES, help="none, single or mixed")
    p.add_argument("--node-name", help="this node's Kubernetes name (default: $NODE_NAME)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


def _load_config(args: argparse.Namespace) -> config_mod.Config:
    overrides = {
        "backend": args.backend,
        "sim_profile": args.sim_profile,
        "kubelet_dir": args.kubelet_dir,
        "state_dir": args.state_dir,
        "mig_strategy": args.mig_strategy,
        "node_name": args.node_name,
        "log_level": args.log_level,
        "sim_control_socket": getattr(args, "sim_control_socket", None),
    }
    cfg = config_mod.load(config_path=args.config, overrides=overrides)
    web_config = getattr(args, "web_config_file", None)
    if web_config is not None:  # the flag wins over gpunode.metrics.webConfigFile
        cfg = replace(cfg, metrics=replace(cfg.metrics, web_config_file=str(web_config.absolute())))
    if cfg.metrics.enabled and cfg.metrics.web_config_file:
        from gpunode.config.webconfig import load_web_config
        from gpunode.infra.webauth import WebGuard

        WebGuard(
            load_web_config(cfg.metrics.web_config_file)
        )  # an unusable file stops us before anything starts
    return cfg


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_agent(args: argparse.Namespace) -> int:
    """Run the node agent until it is stopped, printing a summary once it is ready; returns 0."""
    from gpunode.node.agent import Agent

    cfg = _load_config(args)
    _setup_logging(cfg.log_level)
    agent = Agent(cfg, config_loader=lambda: _load_config(args))
    from gpunode.node.supervise import ProcessControl

    # SIGTERM/SIGINT always end the process within the grace period, even with a part stuck.
    process = ProcessControl(
        stop=agent.request_stop, reload=agent.request_reload, cleanup=agent.stuck_cleanup
    )
    process.install()

    async def main() -> None:
        event = asyncio.Event()
        task = asyncio.create_task(agent.run(ready=event, process=process))
        waiter = asyncio.create_task(event.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if event.is_set():
            try:
                _print_ready(agent)
            except BrokenPipeError:  # nobody reads stdout any more: the agent keeps running
                _discard_stdout()
        waiter.cancel()
        await task

    asyncio.run(main())
    return 0


def _print_ready(agent: Any) -> None:
    from gpunode.node.agent import summarize

    snap = agent.state.snapshot()
    lines = [f"gpunode agent ready: backend {agent.backend.name}, {len(snap.inventory.gpus)} GPU(s)"]
    for s in summarize(snap.inventory, agent.config):
        lines.append(f"  {s.resource:<32} {s.count:>4} device(s)  socket {s.socket}")
    kubelet = agent.config.kubelet_socket
    if not kubelet.exists():
        lines.append(f"  waiting for the kubelet at {kubelet}; plugins register as soon as it appears")
    if agent.metrics_endpoint is not None:
        lines.append(f"  metrics: {agent.metrics_endpoint.url} (DCGM-compatible)")  # the bound port
    if agent.config.sim_control_socket:
        lines.append(
            f"  inject faults: gpunode sim xid --socket {agent.config.sim_control_socket} --gpu 0 --code 79"
        )
    print("\n".join(lines), flush=True)


def device_rows(cfg: config_mod.Config) -> tuple[list[dict[str, Any]], Any]:
    """Open the backend and return one row per advertised device, plus the inventory."""
    from gpunode.node.agent import Agent

    agent = Agent(cfg)
    inventory = agent.open()
    rows = []
    for d in inventory.devices:
        gpu = inventory.gpu(d.gpu_uuid)
        rows.append(
            {
                "resource": d.resource,
                "id": d.id,
                "kind": d.kind,
                "gpu_index": gpu.index if gpu else None,
                "gpu_uuid": d.gpu_uuid,
                "mig_uuid": d.mig_uuid,
                "numa_node": d.numa_node,
                "memory_cap_bytes": d.memory_cap_bytes,
                "reason": d.reason,
            }
        )
    return rows, inventory


def cmd_devices(args: argparse.Namespace) -> int:
    """Print the advertised devices (as a table or JSON); returns 0."""
    cfg = _load_config(args)
    _setup_logging("warning")
    rows, inventory = device_rows(cfg)
    from gpunode.node.status import pending_lines

    pending = pending_lines(cfg.state_dir)  # what a running agent holds back until its holders are gone
    if args.json:
        print(
            json.dumps(
                {
                    "devices": rows,
                    "modes": dict(inventory.modes),
                    "warnings": list(inventory.warnings),
                    "pending": pending,
                },
                indent=2,
            )
        )
        return 0
    header = ("RESOURCE", "DEVICE ID", "GPU", "KIND", "NUMA", "CAP", "WHY")
    table = [header]
    for r in rows:
        cap = f"{r['memory_cap_bytes'] / GIB:.1f}Gi" if r["memory_cap_bytes"] else "-"
        numa = "-" if r["numa_node"] is None else str(r["numa_node"])
        table.append((r["resource"], r["id"], str(r["gpu_index"]), r["kind"], numa, cap, r["reason"]))
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    for w in inventory.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for line in pending:
        print(f"pending: {line}", file=sys.stderr)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Run the doctor checks and print them; returns 0 if all pass, else 1."""
    from gpunode.node import doctor

    cfg = _load_config(args)
    _setup_logging("error")
    results = doctor.checks(cfg)
    print(doctor.render(results, as_json=args.json))
    return 0 if all(c.ok for c in results) else 1


# What each subcommand's register function adds its parser to.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _register_agent(sub: Subparsers) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser("agent", help=COMMANDS["agent"].help)
    _add_node_flags(p)
    p.add_argument(
        "--sim-control-socket", type=Path, help="serve fault injection for the simulated node here"
    )
    p.add_argument(
        "--web-config-file",
        type=Path,
        help="TLS and basic auth for the metrics endpoint: an exporter-toolkit web configuration file",
    )
    p.set_defaults(func=cmd_agent)
    return p


def _register_devices(sub: Subparsers) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser("devices", help=COMMANDS["devices"].help)
    _add_node_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_devices)
    return p


def _register_doctor(sub: Subparsers) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser("doctor", help=COMMANDS["doctor"].help)
    _add_node_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)
    return p


def _register_sim(sub: Subparsers) -> argparse.ArgumentParser:
    from gpunode.node.devices.simnode.cli import register_cli

    return register_cli(sub)


def _register_health(sub: Subparsers) -> argparse.ArgumentParser:
    from gpunode.node.health.cli import register_cli

    return register_cli(sub)


def _register_extender(sub: Subparsers) -> argparse.ArgumentParser:
    from gpunode.cluster.extender.cli import register_extender_cli, run_extender_cli

    p = register_extender_cli(sub)
    p.set_defaults(func=run_extender_cli)
    return p


def _register_queue(sub: Subparsers) -> argparse.ArgumentParser:
    from gpunode.cluster.queuectl.cli import register_queue_cli

    return register_queue_cli(sub)


def _register_simulate(sub: Subparsers) -> argparse.ArgumentParser:
    from gpunode.cluster.tracesim.simulate import register_simulate_cli

    p = register_simulate_cli(sub)
    p.set_defaults(func=_run_simulate)
    return p


def _run_simulate(args: argparse.Namespace) -> int:
    """`gpunode simulate`: the placement replay (--mode place) or the queueing replay (--mode time)."""
    if args.mode == "time":
        from gpunode.cluster.timesim.cli import run_time_cli

        return run_time_cli(args)
    from gpunode.cluster.tracesim.simulate import run_simulate_cli

    return run_simulate_cli(args)


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, and the function that imports its module and adds its parser.

    `register` adds a parser named like the COMMANDS key, with the same help, whose defaults
    carry func (the function that runs the subcommand with the parsed arguments).
    """

    help: str
    register: Callable[[Subparsers], argparse.ArgumentParser]


COMMANDS: dict[str, Command] = {
    "agent": Command("run the node agent (device plugins, health, metrics)", _register_agent),
    "devices": Command(
        "show every resource and device ID that would be advertised, and why", _register_devices
    ),
    "doctor": Command(
        "diagnose this node: driver, GPUs, configuration, kubelet, native parts", _register_doctor
    ),
    "sim": Command("inject faults into a running simulated node", _register_sim),
    "health": Command("clear a GPU that a fatal XID holds unhealthy", _register_health),
    "extender": Command(
        "run the kube-scheduler extender (filter, prioritize, bind, preempt) for GPU placement",
        _register_extender,
    ),
    "queue": Command("run the queue controller: admission, gangs, preemption with notice", _register_queue),
    "simulate": Command(
        "replay an openb trace through the placement policies (FGD paper protocol)", _register_simulate
    ),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser listing every subcommand, with the flags of `command` only.

    Only `command`'s module is imported; the other subcommands appear by name and help,
    which is all `gpunode --help` shows. With None (or an unknown name) no module is
    imported and parsing stops at the subcommand with argparse's usage error.
    """
    parser = argparse.ArgumentParser(
        prog="gpunode", description="GPU sharing and telemetry agent for GPU nodes"
    )
    parser.add_argument("--version", action="version", version=f"gpunode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, entry in COMMANDS.items():
        if name == command:
            entry.register(sub)
        else:
            sub.add_parser(name, help=entry.help)
    return parser


def command_in(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` names: its first word that is not an option (top-level options take no value)."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a full command line; only the named subcommand's module gets imported."""
    return build_parser(command_in(argv)).parse_args(argv)


# Modules of the optional extras (pyproject.toml, [project.optional-dependencies]) -> the extra.
EXTRA_MODULES = {"tqdm": "plot", "matplotlib": "plot", "systemd": "systemd"}

# The status of a command whose output pipe was closed (`gpunode devices | head -1`): what a shell reports
# for a process that SIGPIPE ended, 128 + 13.
CLOSED_STDOUT_STATUS = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (sys.argv by default) and return the exit status.

    A closed stdout (the reader of a pipe went away) ends the command quietly with CLOSED_STDOUT_STATUS;
    a missing package of an optional extra is one line naming the extra to install.
    """
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        try:
            status = int(args.func(args))
        except ModuleNotFoundError as exc:
            module = (exc.name or "").partition(".")[0]
            if module not in EXTRA_MODULES:
                raise
            raise MissingExtra(module, EXTRA_MODULES[module], f"`gpunode {args.command}`") from None
        sys.stdout.flush()  # a closed pipe shows here rather than as a warning at exit
        return status
    except GpunodeError as exc:
        print(f"gpunode: {exc}\nHINT: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a pipe other than stdout: a real failure, shown as one
        _discard_stdout()
        return CLOSED_STDOUT_STATUS


def _stdout_closed() -> bool:
    """Whether stdout's reader went away (poll reports an error on it); True when stdout has no descriptor."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush of what is left cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
