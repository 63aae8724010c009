"""Listening sockets bound before a server starts anything else, and one-line errors for addresses it cannot bind.

``kvgate serve`` and ``kvgate worker`` bind their HTTP port first (``bind_tcp``) and hand the sockets to aiohttp
(``web.SockSite``): a port another process holds then fails at once, before any KV event subscription, publisher
or background task exists, with one line that names the address and what to change::

    cannot listen on 127.0.0.1:28080: address already in use (another process holds it; pick another
    listen.port or --port)

ZMQ endpoints are bound by ``events`` (``KVEventPublisher``, ``KVEventSubscriber``), which raise
``EventsConfigError`` from the ``zmq.ZMQError``; ``zmq_bind_message`` words that error the same way.
"""

from __future__ import annotations

import errno
import socket

from common.errors import ListenError
from events.errors import EventsConfigError

BACKLOG = 1024
"""Pending connections the kernel queues per listening socket."""


def _address(host: str, port: int) -> str:
    """``127.0.0.1:8080``, or ``[::1]:8080`` for an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(code: int | None, strerror: str | None, *, port_names: str, host_names: str) -> str:
    """The reason part of a bind error: what happened and, where the user can fix it, how."""
    if code == errno.EADDRINUSE:
        return f"address already in use (another process holds it; pick another {port_names})"
    if code == errno.EACCES:
        return f"permission denied (ports below 1024 need privileges; pick another {port_names})"
    if code == errno.EADDRNOTAVAIL:
        return f"address not available (no interface of this machine has it; set another {host_names})"
    return (strerror or "unknown error").lower()


def bind_tcp(
    host: str, port: int, *, port_names: str, host_names: str, backlog: int = BACKLOG, reuse_port: bool = False,
) -> list[socket.socket]:
    """Bind and listen on ``host:port``: one socket per address ``host`` resolves to, as ``asyncio``'s
    ``create_server`` binds them (``SO_REUSEADDR``; IPv6 sockets are IPv6-only, so ``localhost`` can take both).

    Args:
        host: a name or an address; ``""`` means every interface.
        port: TCP port; 0 lets the kernel pick one per socket.
        port_names: the setting and flag that choose the port, for the error (``listen.port or --port``).
        host_names: the setting and flag that choose the host, for the error (``listen.host or --host``).
        backlog: pending connections queued per socket.
        reuse_port: set ``SO_REUSEPORT`` too, so several processes listen on the same port and the kernel spreads
            new connections over them (Linux 3.9+).

    Returns:
        Non-blocking listening sockets, for ``web.SockSite``; the caller closes them.

    Raises:
        ListenError: ``host`` does not resolve, or an address cannot be bound; the message names the address,
            the reason and what to change, e.g. ``cannot listen on 127.0.0.1:28080: address already in use
            (another process holds it; pick another listen.port or --port)``. Every socket already bound is
            closed first.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(
            f"cannot listen on {_address(host, port)}: cannot resolve {host!r} ({exc.strerror}; "
            f"set another {host_names})"
        ) from exc
    sockets: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, kind, proto, _canonname, sockaddr in infos:
            if (family, sockaddr) in seen:
                continue
            seen.add((family, sockaddr))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(sockaddr)
                sock.listen(backlog)
            except OSError as exc:
                reason = _reason(exc.errno, exc.strerror, port_names=port_names, host_names=host_names)
                raise ListenError(f"cannot listen on {_address(str(sockaddr[0]), port)}: {reason}") from exc
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def listen_address(sock: socket.socket) -> str:
    """The address a bound socket listens on, ``host:port`` (the port the kernel picked, for port 0)."""
    host, port = sock.getsockname()[:2]
    return _address(str(host), int(port))


def zmq_bind_message(exc: EventsConfigError, name: str) -> str:
    """One line for a ZMQ endpoint that could not be bound or connected.

    Args:
        exc: the error from ``events`` (its cause is the ``zmq.ZMQError``, its ``endpoint`` the address).
        name: the setting or flag that holds the endpoint (``--kv-events-endpoint``, ``events.bind_endpoint``).

    Returns:
        e.g. ``cannot bind --kv-events-endpoint tcp://*:25557: address already in use (another process holds it;
        pick another port in --kv-events-endpoint)``; the error's own text when it is not about an endpoint.
    """
    cause = exc.__cause__  # a zmq.ZMQError: errno and strerror as for an OSError
    code = getattr(cause, "errno", None)
    strerror = getattr(cause, "strerror", None)
    if exc.endpoint is None or not isinstance(code, int):
        return f"{name}: {exc}"
    verb = "connect" if str(exc).startswith("cannot connect") else "bind"
    reason = _reason(code, strerror if isinstance(strerror, str) else None,
                     port_names=f"port in {name}", host_names=f"address in {name}")
    return f"cannot {verb} {name} {exc.endpoint}: {reason}"
