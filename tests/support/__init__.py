"""Helpers shared by more than one test package (servers on real sockets, fresh interpreters)."""

from tests.support.fresh_python import run_fresh_python
from tests.support.server import ServerThread, free_port, serve

__all__ = ["ServerThread", "free_port", "run_fresh_python", "serve"]
