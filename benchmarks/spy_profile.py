"""Where a server's CPU goes, from a py-spy sampling profile (`py-spy record --format raw`).

py-spy's raw output is one line per distinct stack, `frame;frame;...;leaf COUNT`, root first.
Samples whose leaf is a thread waiting (a lock, a queue, the event loop's poll) are dropped;
the rest are sorted into the request path's parts by the first category whose marker appears
in the stack (categories are ordered: the worker threads first, then the gateway's own stages,
then the libraries around them), and scaled to CPU ms per request with the process's measured
CPU time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

IDLE_LEAVES = ("Condition.wait", "Event.wait", "Queue.get", "_worker (concurrent",
               "Runner.run (asyncio/runners.py:118)", "select (selectors.py")
ROOT_FRAMES = ("gateway/cli.py", "gateway/serve.py")  # the process's own start-up frames

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("stats writer thread (SQLAlchemy batches)", ("prefixgate-stats",)),
    ("tokenize for the shadow caches", ("request_prompt",)),
    ("lint (prompt_lint)", ("lint_stage.py", "prompt_lint/")),
    ("worker thread (other)", ("AnyIO worker",)),
    ("metrics (prometheus_client)", ("gateway/metrics.py", "prometheus_client")),
    ("stats record (request path)", ("request_record.py",)),
    ("upstream HTTP client", ("httpx/", "httpcore/", "h11/", "aiohttp", "yarl/", "multidict",
                              "aiohttp_transport.py", "http1_transport.py", "http1_request.py",
                              "upstream_http.py (send")),
    ("body parse + validate", ("gateway/body.py", "parse_openai.py", "parse_anthropic.py",
                               "validate.py", "structured.py")),
    ("router + shadow lookup", ("router.py", "shadow.py", "shadow_models.py", "llama_slots.py",
                                "radix_cache/")),
    ("upstream body build + JSON encode", ("build_body", "dumps_body")),
    ("thread hop (anyio to_thread)", ("to_thread.py", "run_sync_in_worker_thread")),
    ("response render, headers and send", ("render_openai", "render_anthropic",
                                           "usage_report", "gateway/responses.py")),
    # the watcher's own frames: the request's work runs under `_unless_disconnected` too
    ("disconnect watch", ("wait_disconnect (gateway/answer.py",)),
    ("gateway pipeline (the rest)", ("gateway/",)),
    ("Starlette (routing, middleware, response send)", ("starlette/",)),
    ("uvicorn (HTTP parse, socket writes)", ("uvicorn/",)),
    ("asyncio / anyio scheduling", ("asyncio/", "anyio/", "sniffio")),
)


class Share(NamedTuple):
    """One category's part of the busy samples, and of the CPU per request."""

    category: str
    fraction: float
    ms_per_request: float


def busy_stacks(raw_lines: Iterable[str]) -> list[tuple[str, int]]:
    """(stack without the start-up frames, samples) of every stack that was not waiting."""
    out = []
    for line in raw_lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if any(idle in frames[-1] for idle in IDLE_LEAVES):
            continue
        kept = ";".join(f for f in frames if not any(r in f for r in ROOT_FRAMES))
        out.append((kept, int(count)))
    return out


def category(stack: str) -> str:
    """The first category whose marker appears anywhere in `stack`."""
    for name, markers in CATEGORIES:
        if any(m in stack for m in markers):
            return name
    return "other"


def shares(stacks: list[tuple[str, int]], cpu_ms_per_request: float) -> list[Share]:
    """Each category's fraction of the busy samples and its CPU ms per request, largest
    first."""
    counts: Counter[str] = Counter()
    for stack, n in stacks:
        counts[category(stack)] += n
    total = sum(counts.values()) or 1
    return [Share(name, n / total, cpu_ms_per_request * n / total)
            for name, n in counts.most_common()]


def top_leaves(stacks: list[tuple[str, int]], n: int) -> list[tuple[str, float]]:
    """The `n` frames with the most own samples, as fractions of the busy samples."""
    counts: Counter[str] = Counter()
    for stack, k in stacks:
        counts[stack.rsplit(";", 1)[-1]] += k
    total = sum(counts.values()) or 1
    return [(frame, k / total) for frame, k in counts.most_common(n)]
