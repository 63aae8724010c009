"""The gateway's HTTP server: aiohttp's, with a request its parser refuses answered as OpenAI-style JSON.

aiohttp's HTTP parser refuses a malformed request before any handler runs (``Content-Length`` together with
``Transfer-Encoding`` (RFC 9112 §6.1: a request smuggling vector), a ``Content-Encoding`` it cannot decode (``br``
without Brotli, ``zstd`` without ``backports.zstd``), a bad request line, an invalid header, a line too long...).
Its own answer is a plain-text ``400 Bad Request`` and an ERROR log line with a traceback
(``aiohttp.web_protocol.RequestHandler.handle_error``), for what is the client's mistake. ``GatewayAppRunner``
serves the app with a request handler whose ``handle_error`` answers instead::

    HTTP/1.0 400 Bad Request            (aiohttp answers a request it could not parse as HTTP/1.0)
    Content-Type: application/json

    {"error": {"message": "malformed HTTP request: <the parser's reason>", "type": "invalid_request_error",
               "param": null, "code": "malformed_http"}}

and logs one WARNING line without a traceback (``malformed HTTP request from <peer> refused (400): <reason>``; the
reason is the parser's first line, never the request's bytes, which may hold a credential);
non-HTTP bytes as a connection's first request (a TLS handshake, a port scanner) are logged at DEBUG, as aiohttp
does. The connection is closed after the answer (the parser cannot find where the next request would start).

A handler that raised (a 500 aiohttp answers for an exception nothing caught: a bug) keeps its traceback in the
log, at ERROR, and the client gets the JSON 500 (``internal_error``).

How it plugs in: aiohttp builds one ``web.RequestHandler`` per connection from the runner's ``web.Server``; the
runner's server is made a ``_JsonErrorServer`` whose handlers are ``_JsonErrorRequestHandler``s (subclasses that
add no state, so the handler aiohttp built is only given the subclass). Tests on loopback sockets
(``tests/robustness/test_malformed_http.py``) check the bytes on the wire, so an aiohttp upgrade that changes this
seam fails there.
"""

from __future__ import annotations

import logging
import re

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, ContentEncodingError, HttpProcessingError
from aiohttp.web_request import BaseRequest

from router.api import error_response
from router.errors import GatewayError, RequestError

logger = logging.getLogger(__name__)

_ENCODING_NAME = re.compile(r"\((\w+)\)")
"""The encoding's name in aiohttp's ``ContentEncodingError`` message (``... brotli (br). Please install ...``)."""


class MalformedHTTPError(RequestError):
    """A request aiohttp's HTTP parser refused (400, ``code: malformed_http``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="malformed_http")


def malformed_http_error(exc: BaseException | None, message: str | None) -> MalformedHTTPError:
    """The client's error for a request the parser refused with ``exc`` (its ``message``)."""
    if isinstance(exc, ContentEncodingError):
        found = _ENCODING_NAME.search(str(exc.message))
        name = found.group(1) if found is not None else "of the request"
        return MalformedHTTPError(f"the request body's Content-Encoding {name} is not supported by this gateway; "
                                  "send the body uncompressed, or as gzip or deflate")
    reason = str(exc.message) if isinstance(exc, HttpProcessingError) else message or ""
    # llhttp's reason is one line, then the offending bytes with a caret under them: only the line is kept (the
    # bytes may hold a credential, and the log line stays one line).
    first_line = reason.strip().partition("\n")[0].strip().rstrip(":")
    return MalformedHTTPError(f"malformed HTTP request: {first_line or type(exc).__name__}")


class _JsonErrorRequestHandler(web.RequestHandler):
    """aiohttp's per-connection handler, answering its parser's refusals as OpenAI-style JSON (module docstring)."""

    __slots__ = ()

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The answer to a request that failed before (4xx: the parser) or inside (500) the app's handler.

        Raises:
            ConnectionError: part of a response was already sent (as aiohttp's own ``handle_error``).
        """
        error: GatewayError
        if status >= 500:
            logger.error("unhandled error answering %s %s", request.method, request.path, exc_info=exc)
            error = GatewayError("internal error")
        else:
            error = malformed_http_error(exc, message)
            if isinstance(exc, BadHttpMethod) and self._request_count == 1:  # not HTTP at all: noise
                logger.debug("non-HTTP bytes from %s refused: %s", request.remote, error.message)
            else:
                logger.warning("malformed HTTP request from %s refused (%d): %s", request.remote, status,
                               error.message)
            error.status = status
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; no error answer can follow it")
        response = error_response(error)
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    """``web.Server`` whose connection handlers are ``_JsonErrorRequestHandler``."""

    def __call__(self) -> web.RequestHandler:
        handler = super().__call__()
        handler.__class__ = _JsonErrorRequestHandler  # same layout (no slot added): only ``handle_error`` differs
        return handler


class GatewayAppRunner(web.AppRunner):
    """``web.AppRunner`` whose server answers malformed requests as OpenAI-style JSON (module docstring)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # adds no state: only how connections' handlers are made
        return server
