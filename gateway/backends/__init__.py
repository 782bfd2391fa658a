"""Backends serve ChatRequests: the embedded engine (default) or upstream providers."""

from gateway.backends.base import Backend, BackendError, collect

__all__ = ["Backend", "BackendError", "collect"]
