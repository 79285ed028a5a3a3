"""Rendezvous ports on this machine: pick a free one, or ask whether one is taken (torch-free)."""

from __future__ import annotations

import socket

# The source a picked port is recorded under; the launch may pick again if the port is taken meanwhile.
PICKED_PORT = "a free port picked now"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False
