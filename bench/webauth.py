"""Basic auth on the metrics endpoint: the timing of a wrong password for a known user and for an unknown one.

Serves the metrics endpoint with one user whose hash has bcrypt cost 12
(Python's default) and measures, over --tries requests each (one fresh address
per request pair so the failure limit does not answer early), the time of a
401 for a known user with a wrong password and for an unknown user. Prints
JSON: the two medians and ranges in milliseconds. The two should be within
noise (the unknown user is checked against a dummy hash of the same cost).

    .venv/bin/python bench/webauth.py [--tries 40] [--cost 12]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path

import bcrypt
import yaml

from gpunode.config.webconfig import load_web_config
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.metrics import MetricsCollector, MetricsServer


def _time_401(port: int, user: str, source: str) -> float:
    auth = "Basic " + base64.b64encode(f"{user}:wrong password".encode()).decode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    try:
        start = time.perf_counter()
        conn.request("GET", "/metrics", headers={"Authorization": auth})
        r = conn.getresponse()
        r.read()
        elapsed = time.perf_counter() - start
        assert r.status == 401, r.status
        return elapsed
    finally:
        conn.close()


async def measure(tries: int, cost: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "web-config.yml"
        hashed = bcrypt.hashpw(b"the password", bcrypt.gensalt(cost)).decode()
        path.write_text(yaml.safe_dump({"basic_auth_users": {"prometheus": hashed}}))
        collector = MetricsCollector(backend=SimBackend.from_profile("t4"), hostname="bench")
        await collector.collect_once()
        server = MetricsServer(collector, "127.0.0.1:0", web_config=load_web_config(path))
        await server.start()
        try:
            known, unknown = [], []
            for i in range(tries):  # interleaved, each pair from an address of its own
                source = f"127.0.{1 + i // 250}.{1 + i % 250}"
                known.append(await asyncio.to_thread(_time_401, server.port, "prometheus", source))
                unknown.append(await asyncio.to_thread(_time_401, server.port, "nobody", source))
        finally:
            await server.stop()

    def ms(values: list[float]) -> dict[str, float]:
        return {
            "median": round(statistics.median(values) * 1e3, 2),
            "min": round(min(values) * 1e3, 2),
            "max": round(max(values) * 1e3, 2),
        }

    return {
        "bcrypt_cost": cost,
        "tries": tries,
        "known_user_wrong_password_ms": ms(known),
        "unknown_user_ms": ms(unknown),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=40)
    parser.add_argument("--cost", type=int, default=12)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.tries, args.cost)), indent=2))


if __name__ == "__main__":
    main()
