"""A small synchronous JSON client for the test's own calls to the real API server (set-up and checks).

It is independent of gpunode.infra.kube on purpose: the code under test uses that client, the test
harness does not. Bearer token, TLS verified against the control plane's CA.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


class ApiError(RuntimeError):
    """The API server answered with an error status."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        """Keep the status and body for the test to look at."""
        super().__init__(f"{method} {path}: {status} {body[:500]}")
        self.status = status
        self.body = body


class Api:
    """JSON requests to one API server as one user."""

    def __init__(self, server: str, token: str, ca_file: Path, timeout_s: float = 30.0) -> None:
        """The server URL (https://127.0.0.1:port), a bearer token and the CA that signed its certificate."""
        self.server = server.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._tls = ssl.create_default_context(cafile=str(ca_file))

    def request(
        self, method: str, path: str, body: Any = None, *, content_type: str = "application/json"
    ) -> Any:
        """One request; the decoded JSON answer, or ApiError for a status of 400 or more."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._tls) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            raise ApiError(method, path, exc.code, exc.read().decode(errors="replace")) from None
        return json.loads(text) if text else None

    def get(self, path: str) -> Any:
        """GET a path."""
        return self.request("GET", path)

    def create(self, path: str, body: Mapping[str, Any]) -> Any:
        """POST an object to a collection."""
        return self.request("POST", path, body)

    def apply(self, path: str, body: Mapping[str, Any]) -> Any:
        """Create the object at collection `path`, or replace the one of that name."""
        try:
            return self.create(path, body)
        except ApiError as exc:
            if exc.status != 409:
                raise
        name = body["metadata"]["name"]
        current = self.get(f"{path}/{name}")
        replaced = {
            **body,
            "metadata": {**body["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]},
        }
        return self.request("PUT", f"{path}/{name}", replaced)

    def patch(self, path: str, body: Mapping[str, Any], *, content_type: str = MERGE) -> Any:
        """PATCH with a merge patch (or the content type given)."""
        return self.request("PATCH", path, body, content_type=content_type)

    def delete(self, path: str) -> Any:
        """DELETE; a missing object is not an error."""
        try:
            return self.request("DELETE", path)
        except ApiError as exc:
            if exc.status != 404:
                raise
            return None

    def ok(self, path: str) -> bool:
        """Whether GET path answers 200 (health endpoints)."""
        req = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=5, context=self._tls) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False


def eventually(check: Callable[[], T | None], *, timeout_s: float, what: str, interval_s: float = 0.5) -> T:
    """Poll `check` until it returns something other than None or False; AssertionError after timeout_s.

    Timeouts here are generous limits against hangs, not measurements.
    """
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while True:
        try:
            value = check()
            if value is not None and value is not False:
                return value
        except (ApiError, OSError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not {what} after {timeout_s:.0f}s" + (f" (last error: {last})" if last else "")
            )
        time.sleep(interval_s)
