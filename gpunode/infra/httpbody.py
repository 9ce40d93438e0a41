"""Request bodies for gpunode.infra.http: read in full before the handler runs, within two bounds.

Each body is bounded by the server's max_body_bytes; together, the bodies a
server is receiving or holding are bounded by its body budget
(max_inflight_body_bytes). A request takes its share of the budget before its
body is read (its whole Content-Length at once; a chunked body chunk by chunk,
as it arrives) and gives it back when its response is sent or its connection
dies (BodyHold.release()).
"""

from __future__ import annotations

from aiohttp import streams, web

from gpunode.errors import BodyRefused


class BodyBudget:
    """The bytes of request bodies one server is receiving or holding, against `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def hold(self) -> BodyHold:
        """An empty share for one request."""
        return BodyHold(self)


class BodyHold:
    """What one request has taken from a BodyBudget; release() gives all of it back."""

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.size = 0

    def take(self, n: int) -> bool:
        """Take `n` more bytes if the budget has them left (False, taking nothing, if not)."""
        budget = self._budget
        if budget.used + n > budget.limit:
            return False
        budget.used += n
        self.size += n
        return True

    def release(self) -> None:
        """Give back everything taken (harmless when called again)."""
        self._budget.used -= self.size
        self.size = 0


async def read_body(
    payload: streams.StreamReader, hold: BodyHold, limit: int, announced: int | None
) -> bytes:
    """The whole body from `payload`, each chunk counted against `limit` and, unless its `announced`
    length was taken already, taken from the budget as it arrives; BodyRefused when either runs out."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await payload.readany():
        size += len(chunk)
        if size > limit:
            raise BodyRefused(f"the body is over {limit} bytes", status=413)
        if announced is None and not hold.take(len(chunk)):
            raise BodyRefused("no room for another body in flight", status=503)
        chunks.append(chunk)
    body = b"".join(chunks)
    chunks.clear()
    return body


class BodyRequest(web.Request):
    """A web.Request whose body the HTTP layer has read already: read() (and text(), json()) return it."""

    ATTRS = web.Request.ATTRS | frozenset(["_held_body"])
    _held_body: bytes | None = None

    def hold_body(self, body: bytes) -> None:
        """Keep `body` as what read() returns."""
        self._held_body = body

    async def read(self) -> bytes:
        """The body the HTTP layer read (or, before it did, aiohttp's own reading)."""
        if self._held_body is not None:
            return self._held_body
        return await super().read()
