"""A free TCP port for a torch.distributed rendezvous.

Kept apart from `parallel` so the Ray driver (`worker_group`) can use it without importing
Megatron. The port is free when asked; another process could take it before the rendezvous
binds it (the usual race of this idiom, acceptable for single-node test and check runs).
"""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on `host` ("" for every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
