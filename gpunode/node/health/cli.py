"""`gpunode health clear`: an operator declares a held GPU (or MIG device) fit again.

A fatal XID holds its GPU Unhealthy until the agent sees evidence of a reset
(see gpunode.node.health.evidence). When the GPU was repaired in a way the
agent cannot see, an operator clears it: the command writes a request naming
the device, who clears it and why into the agent's state directory
(<stateDir>/health/clear/), and waits until the agent has applied it (at its
next probe round). The agent logs the clear and, on Kubernetes, posts a Node
Event `GpuHealthCleared` naming who and why. On Kubernetes run it inside the
agent's pod: `kubectl exec -n gpunode ds/gpunode -- gpunode health clear ...`.
"""

from __future__ import annotations

import argparse
import getpass
import os
import time
from pathlib import Path

from gpunode.config import agent as config_mod
from gpunode.errors import HealthStateError
from gpunode.node.health.holds import request_clear

POLL_S = 0.1


def register_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the `health` command group (for now: `health clear`); its defaults carry func=run_cli."""
    health = subparsers.add_parser(
        "health",
        help="clear a GPU that a fatal XID holds unhealthy",
        description="Operator actions on the agent's device health.",
    )
    health.set_defaults(func=run_cli)
    actions = health.add_subparsers(dest="health_command", required=True, metavar="ACTION")
    p = actions.add_parser(
        "clear",
        help="declare a held GPU or MIG device healthy again (after a repair the agent cannot see)",
        description="Clear a GPU or MIG device: its faults and holds are forgotten; a problem the probes "
        "still see marks it again.",
    )
    p.add_argument("--gpu", required=True, metavar="UUID", help="the GPU (or MIG device) UUID")
    p.add_argument("--reason", required=True, help="why it is fit again (logged and posted as an Event)")
    p.add_argument(
        "--by", default=None, help="who clears it (default: $SUDO_USER, else the user running this)"
    )
    p.add_argument("--config", type=Path, help="the agent's configuration file (for gpunode.stateDir)")
    p.add_argument("--state-dir", type=Path, help="the agent's state directory (default: from the config)")
    p.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the agent to apply it (default 60)"
    )
    p.add_argument("--no-wait", action="store_true", help="write the request and return at once")
    return health


def _operator() -> str:
    who = os.environ.get("SUDO_USER")
    if who:
        return who
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def run_cli(args: argparse.Namespace) -> int:
    """Run `gpunode health clear`; 0 once the agent applied the request, HealthStateError otherwise."""
    cfg = config_mod.load(config_path=args.config, overrides={"state_dir": args.state_dir})
    directory = cfg.state_dir / "health"
    path = request_clear(directory, args.gpu, by=args.by or _operator(), reason=args.reason)
    if args.no_wait:
        print(f"clear of {args.gpu} requested ({path}); the agent applies it at its next probe round")
        return 0
    deadline = time.monotonic() + max(args.timeout, 0.0)
    while path.exists():
        if time.monotonic() >= deadline:
            raise HealthStateError(
                f"the agent did not take the clear request {path} within {args.timeout:g} s",
                hint="check that the agent runs with this state directory (--state-dir / gpunode.stateDir); "
                "the request stays and is applied when it next probes",
            )
        time.sleep(POLL_S)
    print(f"cleared {args.gpu}: the agent applied it (its log and the Node's Events name who and why)")
    return 0
