"""How many KV event rank streams one process can follow, and why no more.

Each followed (worker, dp_rank) stream of ``events.subscriber.KVEventSubscriber`` holds three ZMQ sockets (its SUB,
the ``PAIR`` that ``zmq_socket_monitor`` makes inside libzmq, and the ``PAIR`` reading it) and four file
descriptors (each socket's mailbox, an ``eventfd``, and the SUB's TCP connection). Two limits bound them::

    ZMQ_MAX_SOCKETS of the context    libzmq's default is 1,023: 1,023 // 3 = 341 streams, the old ceiling; the
                                      subscriber's own context raises it to ZMQ_SOCKET_LIMIT (65,535 here)
    RLIMIT_NOFILE (soft)              4 descriptors a stream, after NUM_RESERVED_FDS for HTTP clients, Redis and
                                      replay DEALERs; ``raise_open_files_limit`` lifts the soft limit to the hard
                                      one at start-up (as servers commonly do); above that only the operator can
                                      raise it (``ulimit -n``, a container's ``nofile``)

The gateway checks its configured workers against ``rank_stream_capacity`` at start-up and refuses to start, naming
the limit, instead of failing with ``EMFILE`` part-way through; a worker added later through the admin API that
passes the limit is refused with ZMQ's own error (``router.gateway.Gateway.add_worker``).
"""

from __future__ import annotations

import resource

import msgspec

SOCKETS_PER_RANK_STREAM = 3
"""ZMQ sockets one followed rank stream holds (SUB, libzmq's monitor PAIR, the reading PAIR)."""
FDS_PER_RANK_STREAM = 4
"""File descriptors one followed rank stream holds (three socket mailboxes and one TCP connection)."""
NUM_RESERVED_FDS = 512
"""Descriptors kept for everything else: listeners, client and worker connections, Redis, replay DEALERs."""
NUM_RESERVED_SOCKETS = 16
"""ZMQ sockets kept for the bound SUB, its monitor and replay DEALERs."""


class StreamCapacity(msgspec.Struct, frozen=True, gc=False):
    """The most rank streams a subscriber can follow.

    Attributes:
        num_streams: that number (>= 0).
        limit: which limit sets it: ``"max_sockets"`` (the ZMQ context) or ``"open_files"`` (RLIMIT_NOFILE).
        reason: a sentence naming the limit's value and how to raise it.
    """

    num_streams: int
    limit: str
    reason: str


def rank_stream_capacity(max_sockets: int, max_open_files: int) -> StreamCapacity:
    """The rank streams that ``max_sockets`` ZMQ sockets and ``max_open_files`` descriptors allow (module doc)."""
    by_sockets = max(0, (max_sockets - NUM_RESERVED_SOCKETS) // SOCKETS_PER_RANK_STREAM)
    by_files = max(0, (max_open_files - NUM_RESERVED_FDS) // FDS_PER_RANK_STREAM)
    if by_sockets < by_files:
        return StreamCapacity(by_sockets, "max_sockets", (
            f"the ZMQ context allows {max_sockets} sockets ({SOCKETS_PER_RANK_STREAM} a rank stream, "
            f"{NUM_RESERVED_SOCKETS} reserved): {by_sockets} rank streams"))
    return StreamCapacity(by_files, "open_files", (
        f"the open-files limit (RLIMIT_NOFILE) is {max_open_files} ({FDS_PER_RANK_STREAM} descriptors a rank "
        f"stream, {NUM_RESERVED_FDS} reserved): {by_files} rank streams; raise it with `ulimit -n` or the "
        f"container's nofile limit"))


def raise_open_files_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit (a process may, unprivileged); returns the soft limit now.

    Raises:
        OSError: never in practice (setrlimit to the hard limit is allowed); propagated as is.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def open_files_limit() -> int:
    """The soft RLIMIT_NOFILE (``RLIM_INFINITY`` read as 2**31 - 1)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 2**31 - 1
