"""`gpunode sim ...`: drive a running simulated node over its control socket (see control.py).

call_control() is the client: one JSON request over HTTP on the Unix socket,
made with aiohttp's UnixConnector; errors come back as SimControlError or, for
an unknown GPU, DeviceNotFound. register_cli()/run_cli() are the commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import aiohttp

from gpunode.errors import DeviceNotFound, SimControlError

# -- client ------------------------------------------------------------------------------------


async def request_control(
    socket_path: str, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Send one request to a simulated node's control socket; the JSON answer, or SimControlError."""
    try:
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=socket_path),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as session,
            session.request(method, f"http://localhost{path}", json=body) as response,
        ):
            status, raw = response.status, await response.read()
    except aiohttp.ClientConnectorError as e:
        if isinstance(e.os_error, FileNotFoundError | ConnectionRefusedError):
            raise SimControlError(f"no simulated node listens on {socket_path}") from None
        why = e.os_error.strerror or e.os_error
        raise SimControlError(f"cannot talk to the control socket {socket_path}: {why}") from None
    except TimeoutError:
        raise SimControlError(f"the control socket {socket_path} did not answer in {timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        raise SimControlError(f"the control socket {socket_path} answered badly: {e!r}") from None
    try:
        answer = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SimControlError(
            f"the control socket {socket_path} answered HTTP {status} without JSON"
        ) from None
    if status != 200:
        error = answer.get("error", answer) if isinstance(answer, dict) else answer
        if status == 404 and isinstance(answer, dict) and answer.get("unknown_device"):
            raise DeviceNotFound(f"simulated node: {error}", hint="list the GPUs with `gpunode sim list`")
        raise SimControlError(f"the simulated node refused the request (HTTP {status}): {error}")
    if not isinstance(answer, dict):
        raise SimControlError(f"the control socket {socket_path} answered with {type(answer).__name__}")
    return answer


def call_control(
    socket_path: str, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = 10.0
) -> dict[str, Any]:
    """request_control() for code that is not asynchronous (it runs an event loop of its own)."""
    return asyncio.run(request_control(socket_path, method, path, body, timeout_s=timeout_s))


# -- commands ----------------------------------------------------------------------------------


def register_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the `sim` command group (fault injection into a running simulated node) to a CLI.

    The parsed arguments carry func=run_cli and sim_command (the action).
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--socket", required=True, metavar="PATH", help="control socket of the simulated node"
    )
    common.add_argument("--json", action="store_true", help="print the raw JSON answer")
    gpu = argparse.ArgumentParser(add_help=False)
    gpu.add_argument("--gpu", required=True, metavar="UUID|INDEX", help="the GPU, by UUID or index")

    sim = subparsers.add_parser(
        "sim",
        help="inject faults into a running simulated node",
        description="Drive the fault injection of an agent running with --backend sim, over its control socket.",
    )
    sim.set_defaults(func=run_cli)
    actions = sim.add_subparsers(dest="sim_command", required=True, metavar="ACTION")
    actions.add_parser("list", parents=[common], help="list the GPUs and their fault state")
    p = actions.add_parser("xid", parents=[common, gpu], help="report an XID error")
    p.add_argument("--code", required=True, type=int, help="the XID, e.g. 79 (fell off the bus) or 48 (DBE)")
    p.add_argument("--mig", metavar="MIG-UUID", help="the MIG device the error concerns")
    p = actions.add_parser("ecc", parents=[common, gpu], help="report ECC errors")
    p.add_argument("--double", action="store_true", help="double-bit (uncorrected) instead of single-bit")
    p.add_argument("--count", type=int, default=1, help="number of errors (default 1)")
    actions.add_parser("lose", parents=[common, gpu], help="the GPU falls off the bus")
    actions.add_parser(
        "reset", parents=[common, gpu], help="reset the GPU (clears lost state and volatile ECC)"
    )
    actions.add_parser("remove", parents=[common, gpu], help="hot-unplug the GPU")
    p = actions.add_parser("add", parents=[common], help="hot-plug a new GPU")
    p.add_argument("--index", type=int, help="the index (slot) to fill; default the first free one")
    p.add_argument("--model", help="a model key or name of the profile; default the slot's model")
    p = actions.add_parser("row-remap", parents=[common, gpu], help="set the row-remapper state")
    p.add_argument("--pending", action=argparse.BooleanOptionalAction, default=None, help="remap pending")
    p.add_argument("--failure", action=argparse.BooleanOptionalAction, default=None, help="remap failure")
    p = actions.add_parser("probe-delay", parents=[common, gpu], help="make health probes of the GPU hang")
    p.add_argument("--seconds", type=float, required=True, help="how long each probe takes (0 to stop)")
    return sim


# Each command: the HTTP method, the endpoint and the argparse fields that make up its body.
_COMMANDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "list": ("GET", "/gpus", ()),
    "xid": ("POST", "/faults/xid", ("gpu", "code", "mig")),
    "ecc": ("POST", "/faults/ecc", ("gpu", "double", "count")),
    "lose": ("POST", "/faults/lost", ("gpu",)),
    "reset": ("POST", "/faults/reset", ("gpu",)),
    "remove": ("POST", "/gpus/remove", ("gpu",)),
    "add": ("POST", "/gpus/add", ("index", "model")),
    "row-remap": ("POST", "/faults/row-remap", ("gpu", "pending", "failure")),
    "probe-delay": ("POST", "/faults/probe-delay", ("gpu", "seconds")),
}


def run_cli(args: argparse.Namespace) -> int:
    """Run one `gpunode sim` command; raises SimControlError/DeviceNotFound when it fails."""
    command = args.sim_command
    if command not in _COMMANDS:
        raise SimControlError(f"unknown sim command {command!r}", hint="see `gpunode sim --help`")
    method, path, fields = _COMMANDS[command]
    values = vars(args)
    body: dict[str, Any] | None = None
    if method == "POST":
        body = {f: values[f] for f in fields if values.get(f) is not None}
        if isinstance(body.get("gpu"), str) and body["gpu"].isdigit():
            body["gpu"] = int(body["gpu"])
    answer = call_control(args.socket, method, path, body)
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(_describe(command, answer))
    sys.stdout.flush()
    return 0


def _describe(command: str, answer: dict[str, Any]) -> str:
    if command == "list":
        return _format_table(answer)
    if "event" in answer:
        e = answer["event"]
        what = {
            "xid": f"XID {e['xid']}",
            "ecc_sbe": f"{e['count']} single-bit ECC error(s)",
            "ecc_dbe": f"{e['count']} double-bit ECC error(s)",
            "gpu_lost": "GPU lost",
            "gpu_removed": "GPU removed",
        }.get(e["kind"], e["kind"])
        where = e["gpu_uuid"] + (f" ({e['mig_uuid']})" if e.get("mig_uuid") else "")
        return f"{what}: {where}"
    if command == "add":
        g = answer["gpu"]
        return f"GPU added: index {g['index']} {g['uuid']} {g['model']} at {g['pci_bus_id']}"
    if command == "reset":
        return f"GPU reset: {answer['reset']}"
    if command == "row-remap":
        return f"row remap of {answer['gpu']}: pending={answer['pending']} failure={answer['failure']}"
    return f"probes of {answer['gpu']} now take {answer['seconds']:g} s"


def _format_table(answer: dict[str, Any]) -> str:
    header = ("INDEX", "UUID", "MODEL", "PCI BUS ID", "NUMA", "STATE", "ECC SBE/DBE", "MIG")
    rows = [header]
    for state in answer["gpus"]:
        g = state["gpu"]
        mig = ",".join(m["profile"] for m in g["mig_devices"]) if g["mig_enabled"] else "-"
        flags = ["lost" if state["lost"] else "ok"]
        if state["row_remap_pending"]:
            flags.append("remap-pending")
        if state["row_remap_failure"]:
            flags.append("remap-failure")
        if state["retired_pages_pending"]:
            flags.append("pages-pending")
        if state["probe_delay_s"]:
            flags.append(f"probe-delay={state['probe_delay_s']:g}s")
        rows.append(
            (
                str(g["index"]),
                g["uuid"],
                g["model"],
                g["pci_bus_id"],
                "-" if g["numa_node"] is None else str(g["numa_node"]),
                ",".join(flags),
                f"{state['ecc_sbe_volatile']}/{state['ecc_dbe_volatile']}",
                mig or "(none)",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"{answer['backend']} (driver {answer['driver_version']})"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)
