"""Helpers shared by more than one test package (servers on real sockets)."""

from tests.support.server import ServerThread, free_port, serve

__all__ = ["ServerThread", "free_port", "serve"]
