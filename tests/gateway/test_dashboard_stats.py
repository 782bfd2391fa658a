"""/api/stats numbers against a naive recomputation, admin auth, the dashboard page,
`prefixgate stats`, `prefixgate bench`, and the dashboard drawn by headless Chromium."""

from __future__ import annotations

import html
import json
import re
import sqlite3
import subprocess
from collections import Counter
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event

from gateway import bench, stats_cli
from gateway.api_stats import MAX_POINTS, compute_stats
from gateway.pricing import DEFAULT_PRICES, Price, PriceTable
from gateway.sessions import SESSION_COOKIE, session_token
from gateway.stats import RecordStore, RequestRecord

from .upstream_helpers import fake_replicas, gateway_app, pool_over, seed_records, serving

ADMIN = "admin-secret"
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = RecordStore(f"sqlite:///{tmp_path / 'stats.db'}")
    yield s
    s.close()


@pytest.fixture
def admin_app(tmp_path: Path) -> Any:
    pool = pool_over(fake_replicas(1))
    app = gateway_app(tmp_path, pool, admin_key=ADMIN, api_keys={"user-key": "acme"})
    yield app
    app.state.store.close()


def naive_price(model: str) -> Price | None:
    matches = [k for k in DEFAULT_PRICES if model.lower().startswith(k)]
    return DEFAULT_PRICES[max(matches, key=len)] if matches else None


def naive_group(rows: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in rows if r.status < 400]
    prompt = sum(r.prompt_tokens for r in rows)  # every row's work, a cut request's included
    cached = sum(r.cached_tokens for r in rows)
    saved = 0.0
    for r in rows:
        price = naive_price(r.model)
        saved += r.cached_tokens * (price.input - price.cached_input) / 1e6 if price else 0.0
    return {"requests": len(rows), "errors": len(rows) - len(ok),
            "client_errors": sum(1 for r in rows if 400 <= r.status < 500),
            "failures": sum(1 for r in rows if r.status >= 500), "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": round(cached / prompt, 4),
            # predicted vs reported: over the answered rows that have both
            "predicted_cached_tokens": sum(r.predicted_cached_tokens or 0 for r in ok
                                           if r.reported_cached_tokens is not None),
            "reported_cached_tokens": sum(r.reported_cached_tokens or 0 for r in ok
                                          if r.predicted_cached_tokens is not None),
            "prefill_saved_ms": sum(r.prefill_saved_ms for r in rows), "cost_saved_usd": saved}


def assert_group(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def test_stats_match_naive_recomputation(store: RecordStore) -> None:
    now = datetime.now(UTC)
    rows = seed_records(store, now)
    stats = compute_stats(store.engine, PriceTable(), window_s=86400, now=now)
    assert_group(stats["totals"], naive_group(rows))
    for tenant in ("acme", "globex", "initech"):
        [got] = [t for t in stats["by_tenant"] if t["tenant"] == tenant]
        assert_group(got, naive_group([r for r in rows if r.tenant == tenant]))
    for row in stats["by_replica"]:
        assert_group(row, naive_group([r for r in rows if r.replica == row["replica"]]))
    lint = Counter(i for r in rows for i in r.lint_ids.split(",") if i)
    assert {x["id"]: x["requests"] for x in stats["lint"]} == dict(lint)
    families = Counter(r.family for r in rows)
    assert {f["family"]: f["requests"] for f in stats["families"]} == dict(families)
    assert sum(p["requests"] for p in stats["series"]) == len(rows)
    assert sum(p["cached_tokens"] for p in stats["series"]) == stats["totals"]["cached_tokens"]
    starts = [p["epoch"] for p in stats["series"]]
    assert starts == sorted(starts) and all(s % stats["bucket_s"] == 0 for s in starts)
    bucket_s = stats["bucket_s"]  # one point per distinct time bucket, counted naively
    per_bucket = Counter(int(r.ts.replace(tzinfo=UTC).timestamp()) // bucket_s * bucket_s
                         for r in rows)
    assert {p["epoch"]: p["requests"] for p in stats["series"]} == dict(per_bucket)
    short = compute_stats(store.engine, window_s=3600, now=now)  # only the last hour
    assert short["totals"]["requests"] == sum(
        1 for r in rows if (now - r.ts.replace(tzinfo=UTC)).total_seconds() <= 3600)


def test_price_table_file_and_prefix_match(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"local": {"input": 1, "cached_input": 0.1, "output": 2},
                                "*": {"input": 5, "cached_input": 5, "output": 5}}))
    table = PriceTable.load(path)
    assert table.price("local-model").saved(1_000_000) == pytest.approx(0.9)
    assert table.price("gpt-4o").saved(10**6) == 0.0  # the fallback entry saves nothing
    assert PriceTable().price("gpt-4o-mini-2024-07-18") == DEFAULT_PRICES["gpt-4o-mini"]
    path.write_text(json.dumps({"x": {"input": 1}}))
    with pytest.raises(ValueError, match="cached_input"):
        PriceTable.load(path)


async def test_admin_key_guards_stats_and_dashboard(admin_app: Any) -> None:
    seed_records(admin_app.state.store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=admin_app),
                                 base_url="http://gw") as client:
        for path in ("/api/stats", "/dashboard"):
            assert (await client.get(path)).status_code == 401
            assert (await client.get(path, headers={"authorization": "Bearer user-key"})
                    ).status_code == 401
        for how in ({"headers": {"authorization": f"Bearer {ADMIN}"}},
                    {"headers": {"x-api-key": ADMIN}}):
            r = await client.get("/api/stats", **how)
            assert r.status_code == 200 and r.json()["totals"]["requests"] == 60
        # a key in the URL is never accepted (URLs are logged)
        assert (await client.get("/api/stats", params={"key": ADMIN})).status_code == 401
        bad = await client.get("/api/stats", params={"window": "soon"},
                               headers={"x-api-key": ADMIN})
        assert bad.status_code == 400
        page = await client.get("/dashboard", headers={"x-api-key": ADMIN})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "<script>" in html and "api/stats" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing remote
    assert "@import" not in html and "url(http" not in html


async def _sign_in_through_the_form(client: httpx.AsyncClient, path: str) -> httpx.Response:
    """What a browser does with a bookmarked dashboard URL: GET it, get the sign-in form,
    submit the admin key to the form's own action, follow the redirect with the cookie."""
    form = await client.get(path)
    assert form.status_code == 401
    action = re.search(r'<form method="post" action="([^"]*)"', form.text)
    assert action, form.text
    signed = await client.post(action.group(1), data={"key": ADMIN})
    assert signed.status_code == 303 and SESSION_COOKIE in signed.cookies
    page = await client.get(signed.headers["location"])
    assert page.status_code == 200 and "<script>" in page.text
    return page


async def test_the_dashboard_signs_out(admin_app: Any) -> None:
    """The signed-in page has a sign-out button: its form ends the session cookie, and the
    browser is back at the sign-in form (a shared screen need not wait 12 hours)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=admin_app),
                                 base_url="http://gw") as client:
        page = await _sign_in_through_the_form(client, "/dashboard")
        form = re.search(r'<form id="signout" method="post" action="([^"]*)"', page.text)
        assert form, "no sign-out form on the dashboard"
        out = await client.post(form.group(1))
        assert out.status_code == 303 and SESSION_COOKIE not in client.cookies
        again = await client.get(out.headers["location"])
    assert again.status_code == 401 and 'name="key"' in again.text


async def test_signing_in_keeps_the_window_the_url_asked_for(admin_app: Any) -> None:
    """A bookmarked `/dashboard?window=6h` shows six hours after the sign-in form, not the
    default day; a window the page cannot read is dropped, never echoed into the form."""
    for asked, kept in (("6h", "6h"), ("7d", "7d"), ("3600", "3600"),
                        ('"><script>alert(1)</script>', None), ("//evil.example", None)):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=admin_app),
                                     base_url="http://gw") as client:
            form = await client.get("/dashboard", params={"window": asked})
            assert "alert(1)" not in form.text and "evil.example" not in form.text
            page = await _sign_in_through_the_form(client, str(form.url))
        assert page.url.path == "/dashboard"
        assert page.url.params.get("window") == kept, (asked, str(page.url))


async def test_without_an_admin_key_the_sign_in_form_says_why_no_key_works(
    tmp_path: Path,
) -> None:
    """Tenant keys but no admin key: the dashboard cannot be opened by anyone, and the form
    says so (and how to fix it) instead of answering every key with "Wrong admin key."."""
    app = gateway_app(tmp_path, pool_over(fake_replicas(1)), api_keys={"user-key": "acme"})
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            form = await client.get("/dashboard")
            tried = await client.post("/dashboard/login", data={"key": "user-key"})
    finally:
        app.state.store.close()
    for page in (form, tried):
        assert page.status_code == 401 and SESSION_COOKIE not in page.cookies
        assert "Wrong admin key" not in page.text
        assert "no admin key" in page.text and "--admin-key" in page.text


async def test_a_bucket_too_small_for_its_window_is_refused(admin_app: Any) -> None:
    """`bucket` may not split the window into more than MAX_POINTS points (a year in 1 s
    buckets answered one point per row, 37 MB); the largest allowed split still answers."""
    seed_records(admin_app.state.store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=admin_app),
                                 base_url="http://gw") as client:
        async def ask(window: int, bucket: int) -> httpx.Response:
            return await client.get("/api/stats", params={"window": window, "bucket": bucket},
                                    headers={"x-api-key": ADMIN})

        refused = await ask(86400, 1)
        assert refused.status_code == 400 and "bucket must be at least" in refused.text
        assert (await ask(31622400, 10)).status_code == 400
        fine = await ask(86400, 86400 // MAX_POINTS + 1)
    assert fine.status_code == 200 and fine.json()["totals"]["requests"] == 60
    assert len(fine.json()["series"]) <= MAX_POINTS


async def test_no_other_site_may_frame_the_dashboard(admin_app: Any) -> None:
    """The sign-in form, its answer and the signed-in page forbid framing (`frame-ancestors`
    does not fall back to `default-src 'none'`) and a moved base URL."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=admin_app),
                                 base_url="http://gw") as client:
        pages = [await client.get("/dashboard"),
                 await client.post("/dashboard/login", data={"key": "wrong"}),
                 await client.get("/dashboard", headers={"x-api-key": ADMIN})]
    for page in pages:
        policy = {d.split()[0]: d.split()[1:] for d in
                  page.headers["content-security-policy"].split(";") if d.strip()}
        assert policy.get("frame-ancestors") == ["'none'"], page.headers
        assert policy.get("base-uri") == ["'none'"]
        assert page.headers["x-frame-options"] == "DENY"


def test_stats_cli_prints_the_api_numbers(admin_app: Any, capsys: Any) -> None:
    seed_records(admin_app.state.store)
    with serving(admin_app) as server:
        assert stats_cli.main(["--url", server.url, "--admin-key", ADMIN]) == 0
        table = capsys.readouterr().out
        assert stats_cli.main(["--url", server.url, "--admin-key", ADMIN, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert stats_cli.main(["--url", server.url, "--admin-key", "wrong"]) == 1
        assert "401" in capsys.readouterr().err
    t = data["totals"]
    assert f"hit rate {100 * t['hit_rate']:.1f}%" in table
    assert f"{t['prompt_tokens']:,} prompt tokens" in table
    for row in data["by_tenant"]:
        line = next(x for x in table.splitlines() if x.startswith(row["tenant"] + " "))
        assert f"{100 * row['hit_rate']:.1f}%" in line and f"{row['requests']:,}" in line
    assert "PL004" in table


def test_stats_cli_takes_the_windows_the_dashboard_takes(admin_app: Any, capsys: Any) -> None:
    """`--window 6h` asks for the six hours `/dashboard?window=6h` shows; a window that is
    neither seconds nor a number with a unit is a usage error (exit status 2)."""
    with serving(admin_app) as server:
        for text, seconds in (("6h", 6 * 3600), ("7d", 7 * 86400), ("90m", 5400),
                              ("3600", 3600)):
            argv = ["--url", server.url, "--admin-key", ADMIN, "--json", "--window", text]
            assert stats_cli.main(argv) == 0
            assert json.loads(capsys.readouterr().out)["window_s"] == seconds
        for text in ("soon", "0", "-5", "1.5h"):
            with pytest.raises(SystemExit) as exit_:
                stats_cli.main(["--url", server.url, "--admin-key", ADMIN, "--window", text])
            assert exit_.value.code == 2
            assert "--window" in capsys.readouterr().err


def test_bench_command_finds_benchmarks(capsys: Any) -> None:
    assert bench.find("gateway") is not None and bench.find("gateway").name == "bench_gateway.py"
    assert bench.find("../etc") is None
    assert bench.main(["no_such_bench"]) == 2
    assert "available:" in capsys.readouterr().err and "gateway" in bench.available()


def _chromium(url: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
             "--virtual-time-budget=8000", "--window-size=1400,1800"]
    return subprocess.run([str(CHROMIUM), *flags, *extra, url], capture_output=True, text=True,
                          timeout=90, check=False)


def signed_in(app: Any) -> Any:
    """`app` as a browser sees it after `POST /dashboard/login`: every request carries the
    HttpOnly session cookie (headless Chromium cannot sign in by itself)."""
    token = session_token(app.state.config)

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            cookie = f"{SESSION_COOKIE}={token}".encode()
            scope = {**scope, "headers": [*scope["headers"], (b"cookie", cookie)]}
        await app(scope, receive, send)

    return wrapped


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_dashboard_draws_in_headless_chromium(admin_app: Any, tmp_path: Path) -> None:
    seed_records(admin_app.state.store)
    with serving(signed_in(admin_app)) as server:
        url = f"{server.url}/dashboard"
        dom = _chromium(url, tmp_path, "--dump-dom").stdout
        shot = tmp_path / "dashboard.png"
        _chromium(url, tmp_path, f"--screenshot={shot}")
    body = re.search(r"<body[^>]*>", dom)
    assert body, dom[:500]
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(0)))
    assert attrs.get("data-state") == "ready", attrs
    assert int(attrs["data-charts"]) == 6 and attrs["data-requests"] == "60"
    assert dom.count('data-drawn="1"') == 6
    points = [int(n) for n in re.findall(r'data-points="(\d+)"', dom)]
    assert len(points) == 6 and min(points) >= 2
    # uPlot draws on <canvas>: the page reports what each chart was given to draw.
    assert dom.count("<canvas") >= 5  # five uPlot charts (lint findings are HTML bars)
    bars = [int(n) for n in re.findall(r'data-bars="(\d+)"', dom)]
    assert sum(bars) > 50  # bars of non-zero height
    assert re.search(r'id="chart-hit"[^>]*data-series="3"', dom)  # hit rate, predicted, reported
    assert "<td" in dom and "acme" in dom and "PL004" in dom
    assert shot.exists() and shot.stat().st_size > 10_000



def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_dashboard_at_1400px_clips_no_table_and_labels_replicas_whole(
    admin_app: Any, tmp_path: Path,
) -> None:
    """A 1400 px wide screenshot: every table fits its panel (scrollWidth <= clientWidth, as
    the page measures after layout), replica labels are whole, `?window=` picks the window."""
    store = admin_app.state.store
    seed_records(store)
    long_replica = "127.0.0.1:18001"  # the label the hand-drawn chart cut to 14 characters
    store.add(RequestRecord(
        ts=datetime.now(UTC), request_id="long", tenant="acme", model="gpt-4o-2024-08-06",
        backend="openai", replica=long_replica, provider="openai", route="chat.completions",
        status=200, prompt_tokens=4000, cached_tokens=3000, predicted_cached_tokens=3100,
        reported_cached_tokens=3000, completion_tokens=20, latency_ms=90.0,
        prefill_saved_ms=12.0, lint_ids="", family="family-x", stream=False))
    store.flush()
    with serving(signed_in(admin_app)) as server:
        url = f"{server.url}/dashboard?window=7d"
        dom = _chromium(url, tmp_path, "--dump-dom").stdout
        shot = tmp_path / "dashboard-1400.png"
        _chromium(url, tmp_path, f"--screenshot={shot}")
        lib = httpx.get(f"{server.url}/dashboard/static/uPlot.iife.min.js")
        other = httpx.get(f"{server.url}/dashboard/static/dashboard.py")
    body_tag = re.search(r"<body[^>]*>", dom)
    assert body_tag, dom[:500]
    body = dict(re.findall(r'([\w-]+)="([^"]*)"', body_tag.group(0)))
    assert body.get("data-state") == "ready", body
    assert body["data-clipped"] == "0"  # no table wider than its panel at 1400 px
    # every chart as wide as its panel: panels widen after the first draw (the scroll bar
    # appears and the grid drops to two columns), and charts follow them
    assert body["data-unfit"] == "0"
    assert body["data-window"] == "604800"  # ?window=7d
    found = re.search(r'data-labels="([^"]*)"', dom)
    assert found, "replica chart not drawn"
    labels = found.group(1).split("|")
    assert long_replica in labels and {f"10.0.0.{i}:8000" for i in range(4)} <= set(labels)
    assert _png_size(shot) == (1400, 1800)
    assert lib.status_code == 200 and lib.text.startswith("/*! https://github.com/leeoniya/uPlot")
    assert other.status_code == 404


def _database_down(store: RecordStore) -> None:
    """Every statement on the store's engine fails from now on, as on a dead database."""
    def refuse(*_: Any) -> None:
        raise sqlite3.OperationalError("unable to open database file")

    event.listen(store.engine, "before_cursor_execute", refuse)


async def test_stats_during_a_database_outage_say_so(admin_app: Any) -> None:
    """While the stats database is down /api/stats is a 503 naming the outage (records wait
    in the spill file), not a bare 500 "Internal Server Error"."""
    store: RecordStore = admin_app.state.store
    seed_records(store)
    _database_down(store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=admin_app),
                                 base_url="http://gw") as client:
        answer = await client.get("/api/stats", headers={"x-api-key": ADMIN})
    assert answer.status_code == 503 and answer.headers["retry-after"].isdigit()
    error = answer.json()["error"]
    assert error["code"] == "stats_database_unavailable"
    assert error["message"].startswith("stats database unavailable (OperationalError)")


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_the_dashboard_shows_why_it_has_no_numbers(admin_app: Any, tmp_path: Path) -> None:
    """The page's status line carries /api/stats' own error message, so an operator reads
    "stats database unavailable" rather than a bare status code."""
    store: RecordStore = admin_app.state.store
    seed_records(store)
    _database_down(store)
    with serving(signed_in(admin_app)) as server:
        dom = _chromium(f"{server.url}/dashboard", tmp_path, "--dump-dom").stdout
        expected = httpx.get(f"{server.url}/api/stats", headers={"x-api-key": ADMIN})
    assert expected.status_code == 503
    status = re.search(r'<span id="status" class="err">([^<]*)</span>', dom)
    assert status, dom[:800]
    want = f"/api/stats answered 503: {expected.json()['error']['message']}"
    assert html.unescape(status.group(1)) == want


class _Cells(HTMLParser):
    """Every table cell of a page: (its title attribute, its text), both as the browser has
    them (entities decoded once)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.cells: list[tuple[str | None, str]] = []
        self._open: list[str] | None = None
        self._title: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "td":
            self._open, self._title = [], dict(attrs).get("title")

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._open is not None:
            self.cells.append((self._title, "".join(self._open)))
            self._open = None


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_names_with_markup_and_entities_are_shown_as_sent(admin_app: Any, tmp_path: Path) -> None:
    """A tenant or model named with HTML, quotes or character references is text, in the cell
    and in its hover title alike (a title that decoded `&quot;` showed a different name)."""
    store: RecordStore = admin_app.state.store
    names = ['x&quot;y&lt;b&gt;', '<img src=x onerror=alert(1)>', 'q"\'<b>&amp;m']
    for i, name in enumerate(names):
        store.add(RequestRecord(
            ts=datetime.now(UTC), request_id=f"n{i}", tenant=name, model=name,
            backend="openai", replica="10.0.0.9:8000", provider="openai",
            route="chat.completions", status=200, prompt_tokens=10, cached_tokens=5,
            completion_tokens=1, latency_ms=1.0, lint_ids="", family=None, stream=False))
    store.flush()
    with serving(signed_in(admin_app)) as server:
        dom = _chromium(f"{server.url}/dashboard", tmp_path, "--dump-dom").stdout
    assert 'data-state="ready"' in dom, dom[:500]
    parser = _Cells()
    parser.feed(dom)
    first = [text for title, text in parser.cells if text in names]
    assert sorted(first) == sorted(names * 2)  # each name once per tenant and model table
    assert "<img" not in re.sub(r"<td[^>]*>[^<]*</td>", "", dom.split("<main>")[1])
    assert [(t, x) for t, x in parser.cells if t != x] == []


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_a_window_the_page_cannot_read_is_named_not_silently_replaced(
    admin_app: Any, tmp_path: Path,
) -> None:
    """`?window=1w` (or `1.5h`, or markup) is not a window the page reads: it shows the default
    day and its status line says the asked window was not understood, as text."""
    seed_records(admin_app.state.store)
    with serving(signed_in(admin_app)) as server:
        asked = "1w<b>x</b>"
        url = str(httpx.URL(f"{server.url}/dashboard", params={"window": asked}))
        dom = _chromium(url, tmp_path, "--dump-dom").stdout
    body = re.search(r"<body[^>]*>", dom)
    assert body, dom[:500]
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(0)))
    assert attrs.get("data-state") == "ready" and attrs["data-window"] == "86400"
    status = re.search(r'<span id="status" class="">([^<]*)</span>', dom)
    assert status, dom[:800]
    assert f'(window "{asked}" not understood' in html.unescape(status.group(1))
