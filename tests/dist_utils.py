"""Helpers shared by the multi-process (gloo) tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a spawned process group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
