"""The benchmark's agent trace replayed through RadixCache and the per-token trie baseline."""

from __future__ import annotations

from types import ModuleType

import pytest

from benchmarks import radix_trace
from radix_cache import RadixCache


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark's trace, baseline trie and runner (`benchmarks/radix_trace.py`)."""
    return radix_trace


def test_radix_agrees_with_token_trie_on_agent_trace(bench: ModuleType) -> None:
    cfg = bench.TraceConfig(sessions=3, turns=3, prefix_tokens=300, long_prompt_tokens=1024)
    cache, trie = RadixCache(page_size=bench.PAGE_SIZE), bench.TokenTrie(bench.PAGE_SIZE)
    hits = 0
    for req in bench.agent_trace(cfg):
        got = cache.match(req.prompt)
        assert (got.length, got.pages) == trie.match(req.prompt)
        inserted = cache.insert(req.full, req.pages)
        assert inserted.cached_len == trie.insert(req.full, req.pages)
        hits += got.length
        cache.check()
    assert hits > 0
    assert cache.stats.total_pages == trie.pages


def test_benchmark_run_reports_every_row(bench: ModuleType) -> None:
    cfg = bench.TraceConfig(sessions=2, turns=2, prefix_tokens=100, long_prompt_tokens=512)
    report = bench.run(cfg, repeats=3, rounds=1)
    assert set(report["rows"]) >= {"trie", "radix"}
    assert report["rows"]["radix"]["hit_rate"] == report["rows"]["trie"]["hit_rate"] > 0
    assert set(report["match_32k_ms"]) == {"radix_list", "radix_numpy", "trie_list"}
