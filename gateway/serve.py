"""`prefixgate serve`: run the gateway under uvicorn.

Flags override PREFIXGATE_* environment variables (see gateway.config.ENV_VARS), which override
the defaults. With no --upstream the embedded engine serves SmolLM2-135M-Instruct and records go
to an SQLite file (./prefixgate.db unless --db says otherwise).
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from dataclasses import replace
from typing import Any

from gateway.config import (
    LINT_MODES,
    GatewayConfig,
    UpstreamSpec,
    load_keys_file,
    parse_api_key,
)
from gateway.engine_flags import add_engine_flags, engine_flag_values
from gateway.host_guard import default_allowed_hosts, page_origins


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixgate serve", description=__doc__.split("\n")[0])
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--db", dest="db_url", help="SQLAlchemy URL (default sqlite:///prefixgate.db)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY[=TENANT]",
                   help="accepted API key, optionally mapped to a tenant (repeatable)")
    p.add_argument("--keys-file", help="file of 'KEY TENANT' lines or a JSON {key: tenant}")
    p.add_argument("--admin-key", help="key for /metrics, /api/stats and /dashboard")
    p.add_argument("--lint-mode", choices=LINT_MODES, help="default lint mode (report)")
    p.add_argument("--store-prompts", action="store_true", default=None,
                   help="store prompt text in the stats database")
    p.add_argument("--upstream", action="append", default=[], metavar="[KIND=]URL",
                   help="proxy to an upstream: KIND=URL, KIND one of openai, vllm, sglang, "
                        "llamacpp, anthropic (its cache model), or URL alone to detect the "
                        "kind from /v1/models and /props (repeatable)")
    p.add_argument("--model-name", help="model id clients send (smollm2-135m-instruct)")
    p.add_argument("--model-alias", action="append", default=[],
                   help="another model id accepted for the embedded model (repeatable)")
    p.add_argument("--max-tokens-cap", type=int, help="clamp every max_tokens to this (4096)")
    p.add_argument("--max-concurrency", type=int, help="requests served at once (256)")
    p.add_argument("--max-queue", type=int, help="requests waiting for a slot; then 503 (1024)")
    p.add_argument("--tenant-max-concurrency", type=int,
                   help="requests in flight per tenant; then 429 (unlimited)")
    p.add_argument("--tenant-rate", dest="tenant_rate_per_s", type=float,
                   help="requests per second per tenant; then 429 (unlimited)")
    p.add_argument("--tenant-burst", type=int, help="burst of the per-tenant rate limit")
    p.add_argument("--auth-max-failures", type=int,
                   help="wrong keys from one client address within the window before its "
                        "attempts are refused (429) for a window; 0: no limit (10)")
    p.add_argument("--auth-failure-window", dest="auth_failure_window_s", type=float,
                   help="seconds of that window and of the lockout (300)")
    p.add_argument("--allowed-hosts", help="comma-separated Host names answered besides "
                   "loopback ones; '*': any (default: loopback names only for a gateway with no "
                   "keys on a loopback address, any otherwise; a guard against DNS rebinding); "
                   "a gateway with no keys also serves POSTs from web pages of these origins "
                   "(default: its own only)")
    p.add_argument("--stats-spill-path", help="file that holds records during a DB outage")
    p.add_argument("--graceful-timeout", dest="graceful_timeout_s", type=int,
                   help="seconds requests in flight get to finish on SIGTERM or Ctrl+C; then "
                        "they are cancelled and recorded before the process exits (25)")
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    add_engine_flags(p)  # --engine-<field> for every EngineConfig field; --model, --num-pages, ...
    return p


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> (
    GatewayConfig
):
    """Defaults < PREFIXGATE_* env < flags."""
    base = GatewayConfig.from_env(environ)
    keys = dict(base.api_keys)
    if args.keys_file:
        keys.update(load_keys_file(args.keys_file))
    keys.update(parse_api_key(item) for item in args.api_key)
    overrides: dict[str, Any] = {
        name: getattr(args, name)
        for name in ("host", "port", "db_url", "admin_key", "lint_mode", "store_prompts",
                     "model_name", "max_tokens_cap", "max_concurrency", "max_queue",
                     "tenant_max_concurrency", "tenant_rate_per_s", "tenant_burst",
                     "stats_spill_path", "graceful_timeout_s", "auth_max_failures",
                     "auth_failure_window_s")
    }
    overrides["api_keys"] = keys
    if args.upstream:
        overrides["upstreams"] = tuple(UpstreamSpec.parse(u) for u in args.upstream)
    if args.model_alias:
        overrides["model_aliases"] = tuple(args.model_alias)
    config = base.with_overrides(**overrides).with_engine(**engine_flag_values(args))
    given = args.allowed_hosts.split(",") if args.allowed_hosts else None
    # None is a value here (any name), which with_overrides would drop
    return replace(config, allowed_hosts=default_allowed_hosts(config.host, not config.api_keys,
                                                               given),
                   page_origins=page_origins(given))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"prefixgate serve: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from gateway.app import create_app
    from gateway.http_server import HttpProtocol
    from gateway.stats import StatsDatabaseError

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    try:
        app = create_app(config)
    except StatsDatabaseError as exc:
        print(f"prefixgate serve: {exc}", file=sys.stderr)
        return 2
    freeze_startup_objects()
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                http=HttpProtocol, timeout_graceful_shutdown=config.graceful_timeout_s)
    return 0


def freeze_startup_objects() -> None:
    """Move everything allocated so far (modules, the app, tokenizer tables) out of the
    garbage collector's view: they live as long as the process, and each full collection
    would otherwise walk them all again (half of its pause on the request path, measured
    in-process). Call once, after the app is built, before serving."""
    gc.collect()
    gc.freeze()


class BackgroundServer:
    """The gateway under uvicorn in a background thread (for examples and scripts).

    `with BackgroundServer(config) as server: ... server.url` serves on config.host and a free
    port (or `port`); leaving the block shuts it down cleanly (records flushed, engine stopped).
    """

    def __init__(self, config: GatewayConfig, *, port: int | None = None) -> None:
        import socket
        import threading

        import uvicorn

        from gateway.app import create_app
        from gateway.http_server import HttpProtocol

        if port is None:
            with socket.socket() as sock:
                sock.bind((config.host, 0))
                port = int(sock.getsockname()[1])
        self.url = f"http://{config.host}:{port}"
        self.app = create_app(config)
        uv_config = uvicorn.Config(self.app, host=config.host, port=port, log_level="warning",
                                   http=HttpProtocol,
                                   timeout_graceful_shutdown=config.graceful_timeout_s)
        self.server = uvicorn.Server(uv_config)
        self.thread = threading.Thread(target=self.server.run, name="prefixgate-serve",
                                       daemon=True)

    def __enter__(self) -> BackgroundServer:
        import time

        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the gateway failed to start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join()
