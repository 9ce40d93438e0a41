"""The log lines of gpunode.infra.http: the access log at debug, and aiohttp's connection log without
tracebacks for the client's mistakes."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gpunode.errors import one_line


class AccessLog(web.AbstractAccessLogger):
    """One debug line per request: client, method, path, status, body bytes and time taken."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        """Log one request at debug."""
        self.logger.debug(
            '%s "%s %s" %d %d %.1fms',
            request.remote or "local",
            request.method,
            request.path_qs,
            response.status,
            response.body_length,
            time * 1000,
        )

    @property
    def enabled(self) -> bool:
        """Whether debug lines are wanted (aiohttp skips timing requests otherwise)."""
        return self.logger.isEnabledFor(logging.DEBUG)


class ProtocolLog(logging.LoggerAdapter):
    """aiohttp's connection-level log. A request aiohttp cannot parse was answered 400: that is the
    client's mistake, logged as one debug line without a traceback; anything else (a handler's defect)
    is logged as aiohttp logs it, with its traceback."""

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        """Log as aiohttp asks, except a parse error: one debug line."""
        if isinstance(exc_info, HttpProcessingError):
            super().log(logging.DEBUG, f"{msg}: %s", *args, one_line(str(exc_info.message)))
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)
