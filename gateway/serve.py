"""`prefixgate serve`: placeholder until the gateway app lands."""

from __future__ import annotations

import argparse

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


async def _healthz(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    app = Starlette(routes=[Route("/healthz", _healthz)])
    uvicorn.run(app, host=args.host, port=args.port)
    return 0
