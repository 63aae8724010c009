"""The gateway's exception hierarchy.

Every error a client can see maps to one OpenAI-style error body (``{"error": {"message", "type", "param",
"code"}}``) with the HTTP status given by the class::

    GatewayError                      base of everything the gateway raises on purpose
    ├── ConfigError                   bad YAML / bad admin payload: names the key and the reason
    ├── RequestError (400)            the client's request is wrong
    │   ├── InvalidJSONError          body is not JSON, or not a JSON object
    │   ├── InvalidFieldError         a field has the wrong type or value (``param`` names it)
    │   ├── BodyTooLargeError (413)   body over ``limits.max_body_bytes``
    │   ├── UnknownModelError (404)   no worker serves the requested model
    │   ├── MethodNotAllowedError (405)  a route called with a method it does not take
    │   └── UpstreamRefusedError (4xx)   a worker refused a leg built from the request (its status and fields)
    ├── AuthError (401)               admin call without the right bearer token
    ├── NotFoundError (404)           admin call naming an unknown worker or session
    ├── OverloadedError (429)         admission queue full or queue wait timed out (carries ``retry_after_s``)
    ├── NoWorkerError (503)           no healthy worker can take the request (carries the reason and
    │                                 ``retry_after_s``)
    └── UpstreamError (502)           every attempt failed before the first byte
        └── UpstreamTimeoutError (504)  connect or first-byte timeout on the last attempt

Third-party errors (aiohttp, msgspec) are translated at the boundary with ``raise X(...) from exc``.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base class. ``status`` is the HTTP status and ``error_type`` the OpenAI ``error.type`` string."""

    status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ConfigError(GatewayError, ValueError):
    """A configuration value is wrong; the message names the key (``workers[1].url``) and the reason."""

    status = 400
    error_type = "invalid_request_error"


class RequestError(GatewayError):
    """The client's request is malformed."""

    status = 400
    error_type = "invalid_request_error"


class InvalidJSONError(RequestError):
    """The body is not valid JSON or not a JSON object."""


class InvalidFieldError(RequestError):
    """A field is missing, has the wrong type, or an invalid value."""


class BodyTooLargeError(RequestError):
    """The body exceeds the configured limit."""

    status = 413


class BodyTimeoutError(RequestError):
    """The body did not arrive within the configured time."""

    status = 408


class UnknownModelError(RequestError):
    """No configured worker serves the model."""

    status = 404
    error_type = "not_found_error"


class MethodNotAllowedError(RequestError):
    """The path exists but does not take the request's method."""

    status = 405


class UpstreamRefusedError(RequestError):
    """A worker refused, with a 4xx, a leg the gateway built from the client's request and never relays itself
    (``router.pd``'s prefill leg): the fault is the request's, so the client gets the worker's status and its
    OpenAI error fields, as the aggregated path relays a worker's 4xx.

    Attributes:
        worker_id: the worker that refused.
    """

    def __init__(
        self, message: str, *, status: int, error_type: str, param: str | None, code: str | None, worker_id: str
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.status = status
        self.error_type = error_type
        self.worker_id = worker_id


class AuthError(GatewayError):
    """Missing or wrong admin bearer token."""

    status = 401
    error_type = "authentication_error"


class NotFoundError(GatewayError):
    """An admin call names something that does not exist."""

    status = 404
    error_type = "not_found_error"


class OverloadedError(GatewayError):
    """Admission refused: the queue is full or the wait timed out."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, code="overloaded")
        self.retry_after_s = retry_after_s


class NoWorkerError(GatewayError):
    """No healthy, undrained worker can take the request (``retry_after_s``: the ``Retry-After`` it suggests)."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, code=reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class UpstreamError(GatewayError):
    """The upstream worker failed before the response started, on every attempt."""

    status = 502
    error_type = "upstream_error"

    def __init__(self, message: str, *, worker_id: str | None = None, endpoint: str | None = None) -> None:
        super().__init__(message, code="upstream_error")
        self.worker_id = worker_id
        self.endpoint = endpoint


class UpstreamTimeoutError(UpstreamError):
    """Connect or first-byte timeout on the last attempt."""

    status = 504


class TransportError(GatewayError):
    """The transport could not complete an exchange with a worker (internal; the proxy maps it).

    Attributes:
        worker_id: the worker.
        endpoint: the URL.
        is_before_first_byte: True when nothing of the response was received (safe to retry elsewhere).
    """

    status = 502
    error_type = "upstream_error"

    def __init__(self, message: str, *, worker_id: str, endpoint: str, is_before_first_byte: bool) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.is_before_first_byte = is_before_first_byte


class TransportConnectError(TransportError):
    """Connection refused, reset or closed before the response headers."""


class TransportUnreachedError(TransportConnectError):
    """No connection could be made (refused, no route, DNS): the worker never saw the request (aiohttp's
    ``ClientConnectorError``), so whatever the request would have consumed on it (a disaggregated request's parked
    KV) is still there."""


class TransportTimeoutError(TransportError):
    """Connect, first-byte or total timeout."""

    status = 504


def unreadable_body_error(exc: Exception) -> InvalidJSONError:
    """The 400 for a request body aiohttp could not read (``web.RequestPayloadError``: e.g. a ``gzip`` body that
    is not gzip), naming the cause aiohttp gave (its ``HttpProcessingError`` message) rather than its status line."""
    cause = exc.__cause__
    detail = getattr(cause, "message", None) if cause is not None else None
    return InvalidJSONError(f"the request body could not be read: {detail if isinstance(detail, str) else exc}")
