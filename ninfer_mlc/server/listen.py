"""Claim the listen ports before anything slow happens.

`ninfer serve` binds --port (and --stats-port) first, so a port another process holds is one
line naming the flag within milliseconds, not after a download, a compile or a model load. The
sockets are bound but not listening until uvicorn serves them: a client that connects early is
refused rather than left waiting in the backlog.
"""
from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from ..config import CLIError


@dataclass
class Listeners:
    main: socket.socket
    stats: socket.socket | None = None

    def close(self) -> None:
        for s in (self.main, self.stats):
            if s is not None:
                s.close()


def bind_port(host: str, port: int, flag: str) -> socket.socket:
    """A socket bound to host:port, or CLIError naming `flag` (and --host when the address is the problem)."""
    if not 0 <= port <= 65535:
        raise CLIError(f"{flag} must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio sets TCP_NODELAY only on connections whose socket says IPPROTO_TCP; one made with
    # proto 0 leaves Nagle on, and a kept-alive client then waits out its delayed ACK (40 ms) on every answer
    # written in more than one piece (headers then body, each SSE event)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may reuse TIME_WAIT ports
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise CLIError(f"{flag} {port}: address {host}:{port} is already in use (another server?); "
                           f"choose another {flag}") from None
        if e.errno == errno.EACCES:
            raise CLIError(f"{flag} {port}: permission denied on {host}:{port} (ports below 1024 need privileges); "
                           f"choose another {flag}") from None
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            raise CLIError(f"--host {host}: not an address of this machine ({e.strerror or e})") from None
        raise CLIError(f"{flag} {port}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def bind_listeners(host: str, port: int, stats_port: int = 0) -> Listeners:
    if stats_port and stats_port == port:
        raise CLIError("--stats-port must differ from --port")
    main = bind_port(host, port, "--port")
    try:
        stats = bind_port(host, stats_port, "--stats-port") if stats_port else None
    except CLIError:
        main.close()
        raise
    return Listeners(main, stats)


def bound_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]
