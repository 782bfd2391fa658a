"""Gateway benchmark: the latency the gateway adds in upstream mode, and prefix-aware routing.

1. Added latency. A fake OpenAI-compatible upstream (`gateway.fake_upstream`, no caching, so it
   answers at once) and a real `prefixgate serve --upstream openai=...` gateway run as separate
   uvicorn processes on 127.0.0.1. The same ~4k-token agent requests (growing sessions, as
   agents resend history) go to the upstream directly and through the gateway, interleaved, at 1
   and at 32 concurrent clients. Through the gateway each request is parsed, linted (report
   mode, and lint off for comparison), tokenized (prompt_lint's layout), looked up in the shadow
   caches, proxied, and recorded. Lint off is a second gateway process (`--lint-mode off`), so
   each gateway meets each request once, as a gateway meets an agent's turn: one process serving
   both modes would tokenize and lint a body on its first visit and find it in its memos on the
   second (that bias made lint off look 0.3 ms cheaper than it is). The warm-up requests are
   not among the measured ones. LiteLLM's proxy on the same upstream is a side row when it is
   installed in its own venv (see `benchmarks/gateway_servers.py`). A bare pass-through proxy
   (`benchmarks/bare_proxy.py`: the same uvicorn and upstream transport, none of the gateway's
   work) is the floor row: what one more Python HTTP hop costs here. Targets: at 1 client p50
   added <= 1 ms and p99 added <= 5 ms; at 32 clients >= 0.8x the upstream's own throughput.
2. Routing. A multi-session agent trace (sessions run concurrently, turns in order) over 4 fake
   replicas that really cache and prefill one prompt at a time (simulated time per uncached
   token); sessions pause a random think time between turns. The hit rate the replicas
   themselves report, the tokens they prefilled and the latency, prefix-aware vs round-robin.

    python benchmarks/bench_gateway.py [--quick]      (or: prefixgate bench gateway --quick)

Prints tables and writes benchmarks/results/gateway.json (--quick: a scratch file).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gateway_llama import find_binary, llama_table, run_llama  # noqa: E402
from benchmarks.gateway_routing import routing_table, run_routing  # noqa: E402
from benchmarks.gateway_servers import (  # noqa: E402
    LITELLM_KEY,
    bare_proxy,
    cpu_ms,
    fake_upstream,
    gateway_server,
    litellm_path,
    litellm_proxy,
)
from gateway.agent_trace import agent_trace  # noqa: E402
from gateway.backends.pool import ReplicaPool  # noqa: E402
from gateway.backends.providers import make_upstream  # noqa: E402
from gateway.backends.upstream_http import UpstreamOptions  # noqa: E402
from gateway.fake_upstream import (  # noqa: E402
    FakeUpstreamConfig,
    create_fake_upstream,
    render_prompt,
)
from prompt_lint.tokens import get_encoding  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gateway.json"
SETUP = ("setup: every server in its own process on 127.0.0.1, one uvicorn worker each (uvloop, "
         "httptools): the fake upstream (no caching), prefixgate serve --upstream openai=... "
         "(lint report; lint runs once the request is sent, for a body up to 64 KiB on the "
         "event loop, a larger one in a worker thread; the shadow's tokens once the answer, "
         "which carries the upstream's own figures, is sent; its upstream client: "
         "httpx's interface over its own HTTP/1.1 connections), "
         "the bare proxy (benchmarks/bare_proxy.py: uvicorn + the gateway's upstream transport, "
         "forwarding only), "
         "LiteLLM's proxy (--num_workers 1; in its own pass beside direct requests: its 10 ms "
         "of Python a request leave the CPU caches cold for whichever request follows, which "
         "added up to 0.5 ms to the gateway's p50 when interleaved with it); "
         "the client (httpx) in the benchmark's own process; "
         f"{os.cpu_count()} CPUs shared by all")
MODES = ["direct", "bare_proxy", "gateway", "gateway_lint_off"]  # + "litellm" when installed
IN_PROCESS_MODES = ("direct", "gateway", "gateway_lint_off")
# a GPU server's time to first token for a 4k-token prompt whose prefix it holds: about this
SLOW_UPSTREAM_MS = 20.0
WARM_UP = 10  # requests sent to every server before the measured ones (not among them)


# ---------------------------------------------------------------- added latency


def latency_bodies(n: int) -> tuple[list[dict[str, Any]], float]:
    """`n` agent requests of about 4k tokens (sessions of a growing history), mean tokens."""
    trace = agent_trace(sessions=max(2, n // 8), turns=24, system_words=2200, task_words=700,
                        output_words=45, seed=1, model="fake")
    enc = get_encoding()
    picked = [(t.body, len(enc.encode_ordinary(render_prompt(t.body)))) for t in trace]
    picked = [(b, k) for b, k in picked if 3500 <= k <= 4600][:n]
    if len(picked) < n:
        raise RuntimeError(f"trace too short: {len(picked)} of {n} requests near 4k tokens")
    return [b for b, _ in picked], statistics.mean(k for _, k in picked)


def _target(mode: str, urls: dict[str, str]) -> tuple[str, dict[str, str]]:
    """A mode's URL and headers (each mode is its own server process)."""
    if mode == "litellm":
        return f"{urls['litellm']}/v1/chat/completions", {"authorization": f"Bearer {LITELLM_KEY}"}
    return f"{urls[mode]}/v1/chat/completions", {}


async def _timed(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                 body: bytes) -> float:
    start = time.perf_counter()
    response = await client.post(url, content=body, headers={
        "content-type": "application/json", **headers})
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:200]}")
    return elapsed * 1000.0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_client(urls: dict[str, str], bodies: list[bytes],
                     modes: list[str] | None = None) -> dict[str, list[float]]:
    """Each body sent once per mode, modes interleaved and rotated (side by side)."""
    modes = modes or MODES
    out: dict[str, list[float]] = {m: [] for m in modes}
    async with httpx.AsyncClient(timeout=60.0) as client:
        for i, body in enumerate(tqdm(bodies, desc="1 client", leave=False)):
            for k in range(len(modes)):
                mode = modes[(i + k) % len(modes)]
                url, headers = _target(mode, urls)
                out[mode].append(await _timed(client, url, headers, body))
    return out


async def _burst(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                 bodies: list[bytes], concurrency: int) -> tuple[list[float], float]:
    queue = list(reversed(bodies))
    latencies: list[float] = []

    async def worker() -> None:
        while queue:
            latencies.append(await _timed(client, url, headers, queue.pop()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, len(bodies) / (time.perf_counter() - start)


async def many_clients(urls: dict[str, str], bodies: list[bytes], concurrency: int,
                       rounds: int, pids: dict[str, int] | None = None,
                       modes: list[str] | None = None) -> dict[str, Any]:
    """Bursts of `concurrency` clients per mode, alternating `modes` (default MODES) for
    `rounds` rounds; with `pids` (a gateway mode's server process), also that process's CPU
    ms per request (from /proc: user + system time over a burst, so it holds all the gateway's
    threads)."""
    pids = pids or {}
    modes = modes or MODES
    lat: dict[str, list[float]] = {m: [] for m in modes}
    rps: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes if m in pids}
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    for _ in tqdm(range(rounds), desc=f"{concurrency} clients", leave=False):
        for mode in modes:
            url, headers = _target(mode, urls)
            before = cpu_ms(pids[mode]) if mode in pids else 0.0
            async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
                values, rate = await _burst(client, url, headers, bodies, concurrency)
            if mode in pids:
                cpu[mode].append((cpu_ms(pids[mode]) - before) / len(bodies))
            lat[mode] += values
            rps[mode].append(rate)
    return {"latencies": lat, "rps": {m: statistics.median(v) for m, v in rps.items()},
            "gateway_cpu_ms": {m: statistics.median(v) for m, v in cpu.items() if v}}


def _beside(summary: dict[str, Any], side: dict[str, Any]) -> None:
    """Add LiteLLM's rows, measured in their own pass, to `summary` (its `added` figures are
    against that pass's own direct requests, kept as `litellm_direct`)."""
    summary["litellm"], summary["litellm_added"] = side["litellm"], side["litellm_added"]
    summary["litellm_direct"] = side["direct"]


def _balanced_order(i: int) -> list[str]:
    """The in-process modes for body `i`: rotated, and the two gateway modes swapped every
    other rotation, so that over six bodies each mode comes first, second and third as often,
    and each gateway mode meets an unseen body half the time."""
    direct, first, second = IN_PROCESS_MODES
    modes = [direct, first, second] if (i // 3) % 2 == 0 else [direct, second, first]
    k = i % 3
    return modes[k:] + modes[:k]


def _summary(lat: dict[str, list[float]], rps: dict[str, float] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    modes = [m for m in MODES if lat.get(m)]
    for mode in modes:
        out[mode] = {"p50_ms": _pct(lat[mode], 0.5), "p99_ms": _pct(lat[mode], 0.99),
                     "n": len(lat[mode])}
        if rps:
            out[mode]["requests_per_s"] = rps[mode]
    for mode in modes[1:]:
        out[f"{mode}_added"] = {
            "p50_ms": out[mode]["p50_ms"] - out["direct"]["p50_ms"],
            "p99_ms": out[mode]["p99_ms"] - out["direct"]["p99_ms"]}
        if rps:
            out[f"{mode}_added"]["throughput_ratio"] = rps[mode] / rps["direct"]
    return out


def run_latency(quick: bool, litellm: str | None) -> dict[str, Any]:
    n = 40 if quick else 200
    bodies_json, mean_tokens = latency_bodies(n + WARM_UP)
    every = [json.dumps(b).encode() for b in bodies_json]
    bodies, warm = every[:n], every[n:]  # the warm-up's requests are not measured
    stages = stage_breakdown(bodies)
    executable = litellm_path(litellm)
    if executable is None:
        print("LiteLLM: not found (--litellm PATH or PREFIXGATE_BENCH_LITELLM); row skipped")
    elif "litellm" not in MODES:
        MODES.append("litellm")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        inproc, cpu = asyncio.run(in_process(bodies, warm, Path(tmp)))
        up = stack.enter_context(fake_upstream())
        urls, pids = gateways(stack, up, Path(tmp))
        urls["bare_proxy"] = stack.enter_context(bare_proxy(up))
        if executable is not None:
            urls["litellm"] = stack.enter_context(litellm_proxy(executable, up, Path(tmp)))
        asyncio.run(one_client(urls, warm))  # warm-up: caches, connections
        ours = [m for m in MODES if m != "litellm"]
        rounds = 2 if quick else 4
        single = _summary(asyncio.run(one_client(urls, bodies, ours)), None)
        multi = asyncio.run(many_clients(urls, bodies, 32, rounds, pids, ours))
        c32 = _summary(multi["latencies"], multi["rps"])
        if "litellm" in urls:  # its own pass beside direct (see SETUP)
            side = ["direct", "litellm"]
            _beside(single, _summary(asyncio.run(one_client(urls, bodies, side)), None))
            lite = asyncio.run(many_clients(urls, bodies, 32, rounds, None, side))
            _beside(c32, _summary(lite["latencies"], lite["rps"]))
    slow = slow_upstream(bodies, warm)
    return {"requests": n, "mean_prompt_tokens": round(mean_tokens), "stages": stages,
            "setup": SETUP,
            "in_process": _summary(inproc, None), "cpu_ms_per_request": cpu,
            "c1": single, "c32": c32,
            "gateway_server_cpu_ms_per_request": multi["gateway_cpu_ms"],
            "c1_slow_upstream": {"upstream_delay_ms": SLOW_UPSTREAM_MS,
                                 **_summary(slow, None)}}


def gateways(stack: contextlib.ExitStack, upstream: str, tmp: Path
             ) -> tuple[dict[str, str], dict[str, int]]:
    """The direct URL and the two gateway processes (lint report, lint off) in front of
    `upstream`: URLs and process ids by mode."""
    report = stack.enter_context(gateway_server(upstream, tmp / "report.db"))
    off = stack.enter_context(gateway_server(upstream, tmp / "off.db", lint_mode="off"))
    urls = {"direct": upstream, "gateway": report.url, "gateway_lint_off": off.url}
    return urls, {"gateway": report.pid, "gateway_lint_off": off.pid}


def slow_upstream(bodies: list[bytes], warm: list[bytes]) -> dict[str, list[float]]:
    """One client again, in front of a fake upstream that answers `SLOW_UPSTREAM_MS` after it
    has read a request: the gateway's work that waits for the send (report-mode lint, the
    shadow's tokens) then overlaps the upstream's time, as it does against a real server."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        up = stack.enter_context(fake_upstream(SLOW_UPSTREAM_MS))
        urls, _ = gateways(stack, up, Path(tmp))
        urls["bare_proxy"] = stack.enter_context(bare_proxy(up))
        modes = [m for m in MODES if m in urls]
        asyncio.run(one_client(urls, warm, modes))  # warm-up
        return asyncio.run(one_client(urls, bodies, modes))


def _stage_ms(fn: Any, items: list[Any]) -> dict[str, float]:
    values = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        values.append((time.perf_counter() - start) * 1000.0)
    return {"p50_ms": _pct(values, 0.5), "p99_ms": _pct(values, 0.99)}


def stage_breakdown(bodies: list[bytes]) -> dict[str, dict[str, float]]:
    """Per-request cost of each gateway stage, in-process (no network, no other process), each
    through the functions the upstream-mode request path calls (orjson in and out, the parser
    without the embedded engine's grammar)."""
    from gateway.backends.upstream_http import dumps_body
    from gateway.body import parse_body
    from gateway.lint_stage import LintStage
    from gateway.parse_openai import parse_chat
    from gateway.shadow import Prompt, ShadowCache, request_prompt
    from gateway.validate import ParseContext

    ctx = ParseContext("bench", "bench", ("*",), grammar=False, embedded=False)
    parsed = [parse_body(b) for b in bodies]
    reqs = [parse_chat(p, ctx) for p in parsed]
    lint = LintStage()
    shadows = [ShadowCache() for _ in range(4)]
    options = UpstreamOptions(url="http://127.0.0.1:1/v1")
    for r in reqs[:10]:  # warm, as a running gateway is; then each request once, in order:
        request_prompt(r)  # its earlier turns' messages are memoized, its new ones are not
    tokenize = _stage_ms(request_prompt, reqs[10:])
    prompts = [request_prompt(r) for r in reqs]
    from gateway.backends.openai_upstream import build_body

    def shadow_ops(prompt: Prompt) -> None:  # what the router and the pool do per request
        for s in shadows:
            s.match_length(prompt, "bench")
        shadows[0].record(prompt, "bench")

    return {
        "json decode + parse/validate": _stage_ms(lambda b: parse_chat(
            parse_body(b), ctx), bodies),
        "lint (report)": _stage_ms(lambda p: lint.run(p, "openai", "bench", "report"), parsed),
        "tokenize + pack once (prompt_lint layout)": tokenize,
        "shadow lookup x4 + record": _stage_ms(shadow_ops, prompts),
        "upstream body + JSON encode": _stage_ms(
            lambda r: dumps_body(build_body(r, options)[1]), reqs),
    }


async def in_process(bodies: list[bytes], warm: list[bytes], tmp: Path
                     ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Client -> gateway app -> fake upstream app over ASGI transports (no TCP, one process):
    wall-clock latencies per mode, and CPU ms per request per mode (blocks of one mode, CPU
    time of the whole process, the least of three blocks, so it depends little on how busy
    the machine is). Both gateway modes are one app here and share prompt_lint's process-wide
    memos, so each goes first (meets a body unseen) for half the bodies; the CPU blocks come
    after, when every body has been served (memos warm for both)."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    fake = create_fake_upstream(FakeUpstreamConfig(cache=False, keep_bodies=False))
    upstream = make_upstream("openai", UpstreamOptions(url="http://up.bench/v1"),
                             transport=httpx.ASGITransport(app=fake))
    app = create_app(GatewayConfig(db_url=f"sqlite:///{tmp / 'inproc.db'}", lint_mode="report"),
                     backend=ReplicaPool("openai", [upstream]))
    out: dict[str, list[float]] = {m: [] for m in IN_PROCESS_MODES}
    targets = {"direct": ("http://up.bench/v1/chat/completions", {}),
               "gateway": ("http://gw.bench/v1/chat/completions", {}),
               "gateway_lint_off": ("http://gw.bench/v1/chat/completions",
                                    {"x-prefixgate-lint-mode": "off"})}
    mounts = {"http://up.bench": httpx.ASGITransport(app=fake),
              "http://gw.bench": httpx.ASGITransport(app=app)}
    async with httpx.AsyncClient(mounts=mounts) as client:
        for body in warm:
            await _timed(client, targets["gateway"][0], {}, body)
        for i, body in enumerate(tqdm(bodies, desc="in-process", leave=False)):
            for mode in _balanced_order(i):
                url, headers = targets[mode]
                out[mode].append(await _timed(client, url, headers, body))
        cpu: dict[str, float] = {m: float("inf") for m in IN_PROCESS_MODES}
        for _ in range(3):  # blocks of each mode in turn; the least CPU of three (load noise)
            for mode in IN_PROCESS_MODES:
                url, headers = targets[mode]
                app.state.store.flush()
                start = time.process_time()
                for body in bodies:
                    await _timed(client, url, headers, body)
                app.state.store.flush()  # the record writer's CPU counts too
                spent = (time.process_time() - start) * 1000.0 / len(bodies)
                cpu[mode] = min(cpu[mode], spent)
    app.state.store.close()
    await upstream.aclose()
    return out, cpu


# ---------------------------------------------------------------- output


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(
        zip(cells, widths, strict=True)))


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([_row(header, widths), rule, *(_row(r, widths) for r in rows)])


def latency_table(res: dict[str, Any]) -> str:
    rows = []
    for conc in ("c1", "c1_slow_upstream", "c32", "in_process"):
        if conc not in res:
            continue
        s = res[conc]
        for mode in [m for m in MODES if m in s]:
            added = s.get(f"{mode}_added", {"p50_ms": 0.0, "p99_ms": 0.0})
            rps = s[mode].get("requests_per_s")
            label = _clients_label(conc, s)
            rows.append([label, mode, f"{s[mode]['p50_ms']:.2f}", f"{s[mode]['p99_ms']:.2f}",
                         "-" if mode == "direct" else f"{added['p50_ms']:+.2f}",
                         "-" if mode == "direct" else f"{added['p99_ms']:+.2f}",
                         "-" if rps is None else f"{rps:.0f}"])
    header = ["clients", "path", "p50 ms", "p99 ms", "p50 added", "p99 added", "req/s"]
    return table(header, rows)


def _clients_label(section: str, s: dict[str, Any]) -> str:
    if section == "in_process":
        return "1 (ASGI)"
    if section == "c1_slow_upstream":
        return f"1 ({s['upstream_delay_ms']:.0f} ms upstream)"
    return section[1:]


def stage_table(stages: dict[str, dict[str, float]]) -> str:
    rows = [[name, f"{v['p50_ms']:.3f}", f"{v['p99_ms']:.3f}"] for name, v in stages.items()]
    return table(["gateway stage (in-process)", "p50 ms", "p99 ms"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-routing", action="store_true")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON path ({RESULTS}; --quick: a scratch file in the temp dir)")
    parser.add_argument("--litellm", help="LiteLLM executable (its own venv) for a side row")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server for a real-upstream row")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--update", action="store_true",
                        help="keep the other sections already in the JSON file (with --skip-*)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "gateway_quick.json" if args.quick else RESULTS
    result: dict[str, Any] = {"quick": args.quick, "python": platform.python_version(),
                              "cpus": os.cpu_count()}
    if not args.skip_latency:
        result["latency"] = run_latency(args.quick, args.litellm)
        lat = result["latency"]
        print(f"\nAdded latency, upstream mode ({lat['requests']} agent requests, "
              f"mean {lat['mean_prompt_tokens']} prompt tokens):")
        print(SETUP)
        print(latency_table(lat))
        print(stage_table(lat["stages"]))
        cpu = lat["cpu_ms_per_request"]
        added = {m: cpu[m] - cpu["direct"] for m in IN_PROCESS_MODES[1:]}
        server_cpu = lat["gateway_server_cpu_ms_per_request"]
        print("CPU ms per request of the gateway server process at 32 clients (all its "
              "threads): " + ", ".join(f"{m} {v:.2f}" for m, v in server_cpu.items()))
        print("CPU ms per request, in-process (client + gateway + fake upstream): "
              + ", ".join(f"{m} {v:.2f}" for m, v in cpu.items())
              + f"; gateway adds {added['gateway']:.2f} "
              f"(lint off {added['gateway_lint_off']:.2f})")
        c1, ratio = lat["c1"]["gateway_added"], lat["c32"]["gateway_added"]["throughput_ratio"]
        result["targets"] = {"p50_added_le_1ms": c1["p50_ms"] <= 1.0,
                             "p99_added_le_5ms": c1["p99_ms"] <= 5.0,
                             "c32_throughput_ge_0.8x": ratio >= 0.8}
        print(f"targets: 1 client p50 added {c1['p50_ms']:.2f} ms (<= 1), p99 added "
              f"{c1['p99_ms']:.2f} ms (<= 5); 32 clients {ratio:.2f}x the upstream's "
              "throughput (>= 0.8)")
        slow = lat["c1_slow_upstream"]
        gw_slow, bare_slow = slow["gateway_added"], slow["bare_proxy_added"]
        print(f"upstream answering after {slow['upstream_delay_ms']:.0f} ms: 1 client p50 added "
              f"{gw_slow['p50_ms']:.2f} ms, p99 added {gw_slow['p99_ms']:.2f} ms (bare proxy "
              f"{bare_slow['p50_ms']:.2f} / {bare_slow['p99_ms']:.2f})")
        floor = lat["c1"]["bare_proxy_added"]
        print(f"bare pass-through proxy (the floor of one Python hop here): p50 added "
              f"{floor['p50_ms']:.2f} ms; the gateway's own share "
              f"{c1['p50_ms'] - floor['p50_ms']:+.2f} ms")
        if "litellm_added" in lat["c1"]:
            ll = lat["c1"]["litellm_added"]
            print(f"LiteLLM proxy, same upstream: p50 added {ll['p50_ms']:.2f} ms, p99 added "
                  f"{ll['p99_ms']:.2f} ms; 32 clients "
                  f"{lat['c32']['litellm_added']['throughput_ratio']:.2f}x")
    if not args.skip_routing:
        result["routing"] = run_routing(args.quick)
        r = result["routing"]
        print(f"\nRouting: {r['sessions']} concurrent agent sessions x {r['turns']} turns over "
              f"4 caching replicas:")
        print(routing_table(r))
    if not args.skip_llama:
        binary = find_binary(args.llama_server)
        if binary is None:
            print("\nllama-server: not found (--llama-server PATH); row skipped")
        else:
            result["llama_server"] = res = run_llama(args.quick, binary)
            print(f"\nllama-server x2, {res['sessions']} sessions x {res['turns']} turns:")
            print(table(["sessions", "server setup", "cache model", "routing",
                         "hit rate (reported)", "predictions within 5%"], llama_table(res)))
    if args.update and args.out.exists():
        result = {**json.loads(args.out.read_text()), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
