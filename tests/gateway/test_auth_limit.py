"""Failed authentication per client address (gateway.auth_limit) through the real app: the
lockout at exactly the configured count, its 429 in each caller's format (parsed by the official
SDKs), `retry-after`, the window's end on an injected clock, other addresses and known keys
unaffected, the admin doors, and the bounded table."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from gateway import auth
from gateway.admission import Overloaded
from gateway.auth_limit import AuthLimiter
from gateway.serve import build_parser, config_from_args
from gateway.sessions import SESSION_COOKIE

from .gateway_fakes import FAKE_MODEL

KEYS = {"key-alice": "alice", "key-bob": "bob"}
ADMIN = "root-admin-key"
CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": FAKE_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
GUESSER = "203.0.113.7"  # documentation addresses (RFC 5737)
NEIGHBOUR = "198.51.100.20"


class Clock:
    """A hand-moved monotonic clock for the limiter."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def at(app: Any, address: str) -> httpx.AsyncClient:
    """A client whose connections come from `address`."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(address, 40000)),
                             base_url="http://gateway")


def with_clock(app: Any) -> Clock:
    clock = Clock()
    app.state.auth.limiter.clock = clock
    return clock


async def chat(http: httpx.AsyncClient, key: str) -> httpx.Response:
    return await http.post("/v1/chat/completions", json=CHAT,
                           headers={"authorization": f"Bearer {key}"})


async def test_the_eleventh_wrong_key_is_refused_in_each_callers_format(make_fake_app) -> None:
    """With the defaults (10 wrong keys in 300 s): ten 401s, then every door answers 429 with a
    `retry-after`, an OpenAI-shaped error for OpenAI routes (the SDK raises RateLimitError),
    an Anthropic-shaped one for /v1/messages; the right key is refused too from there."""
    app = make_fake_app(api_keys=KEYS)
    with_clock(app)  # retry-after counts from the lock, not from a slow test machine
    async with at(app, GUESSER) as http:
        for attempt in range(10):
            answer = await chat(http, f"guess-{attempt}")
            assert answer.status_code == 401, attempt
        refused = await chat(http, "guess-10")
        right_key = await chat(http, "key-alice")
        models = await http.get("/v1/models", headers={"authorization": "Bearer key-alice"})
        counted = await http.post("/v1/messages/count_tokens", json=MESSAGES,
                                  headers={"x-api-key": "key-alice"})
    for answer in (refused, right_key, models, counted):
        assert answer.status_code == 429
        assert answer.headers["retry-after"] == "300"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert counted.json()["error"]["type"] == "rate_limit_error"

    async with openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="key-alice",
                                  max_retries=0, http_client=at(app, GUESSER)) as sdk:
        with pytest.raises(openai.RateLimitError) as caught:
            await sdk.chat.completions.create(**CHAT)
    assert caught.value.response.headers["retry-after"] == "300"
    assert "too many failed authentication attempts" in caught.value.message
    # the anthropic SDK runs on httpx2, so its in-process transport comes from there
    transport = httpx2.ASGITransport(app=app, client=(GUESSER, 40000))
    async with anthropic.AsyncAnthropic(
            base_url="http://gateway", api_key="key-alice", max_retries=0,
            http_client=httpx2.AsyncClient(transport=transport)) as claude:
        with pytest.raises(anthropic.RateLimitError) as refused_messages:
            await claude.messages.create(**MESSAGES)
    assert refused_messages.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert refused_messages.value.response.headers["retry-after"] == "300"


async def test_a_refused_attempt_compares_no_key(make_fake_app, monkeypatch) -> None:
    app = make_fake_app(api_keys=KEYS, auth_max_failures=2)
    compared: list[bytes] = []
    real = auth.hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    async with at(app, GUESSER) as http:
        assert [(await chat(http, k)).status_code for k in ("a", "b")] == [401, 401]
        assert len(compared) == 2 * len(KEYS)  # each wrong key against every key
        compared.clear()
        assert (await chat(http, "key-bob")).status_code == 429
    assert compared == []


async def test_the_lock_ends_a_window_after_the_last_failure_and_refusals_do_not_extend_it(
    make_fake_app,
) -> None:
    """3 failures within 60 s lock the address for 60 s from the third; attempts during the
    lock are refused (`retry-after`: the seconds left, rounded up) and change nothing; at the
    lock's end the right key works and a wrong one starts a fresh count."""
    app = make_fake_app(api_keys=KEYS, auth_max_failures=3, auth_failure_window_s=60)
    clock = with_clock(app)
    async with at(app, GUESSER) as http:
        assert (await chat(http, "w1")).status_code == 401
        clock.now += 50
        assert (await chat(http, "w2")).status_code == 401
        clock.now += 9  # 59 s after the first: still inside its window
        assert (await chat(http, "w3")).status_code == 401  # the third: locked from here
        clock.now += 30
        during = await chat(http, "w4")
        assert during.status_code == 429 and during.headers["retry-after"] == "30"
        clock.now += 29.5
        last = await chat(http, "key-alice")
        assert last.status_code == 429 and last.headers["retry-after"] == "1"
        clock.now += 0.5  # 60 s after the third failure
        assert (await chat(http, "key-alice")).status_code == 200
        assert [(await chat(http, k)).status_code for k in ("w5", "w6")] == [401, 401]
        assert (await chat(http, "w7")).status_code == 401  # the fresh window's third
        assert (await chat(http, "key-bob")).status_code == 429
        # alice's key passed from this address while it had failures on file: known there
        assert (await chat(http, "key-alice")).status_code == 200


async def test_failures_spread_wider_than_the_window_never_lock(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS, auth_max_failures=3, auth_failure_window_s=60)
    clock = with_clock(app)
    async with at(app, GUESSER) as http:
        for _ in range(4):
            assert (await chat(http, "wrong")).status_code == 401
            assert (await chat(http, "wrong")).status_code == 401
            clock.now += 60  # the window closes before a third failure
        assert (await chat(http, "key-alice")).status_code == 200


async def test_other_addresses_and_keys_known_at_the_address_keep_working(
    make_fake_app,
) -> None:
    """A guesser behind the same NAT as alice: alice's key, which authenticated from that
    address while it had failures on file, still passes through the lock; bob's key, never
    used from there, is refused with the guesses; another address is not affected at all."""
    app = make_fake_app(api_keys=KEYS, auth_max_failures=3)
    async with at(app, GUESSER) as nat, at(app, NEIGHBOUR) as elsewhere:
        assert (await chat(nat, "guess")).status_code == 401
        assert (await chat(nat, "key-alice")).status_code == 200  # alice, same address
        assert [(await chat(nat, "guess")).status_code for _ in range(2)] == [401, 401]
        assert (await chat(nat, "guess")).status_code == 429
        assert (await chat(nat, "key-alice")).status_code == 200
        assert (await chat(nat, "key-bob")).status_code == 429
        assert (await chat(elsewhere, "key-bob")).status_code == 200
        assert (await chat(elsewhere, "guess")).status_code == 401  # its own count


async def test_the_sign_in_form_locks_with_a_readable_page(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS, admin_key=ADMIN, auth_max_failures=3)
    with_clock(app)  # retry-after counts from the lock, not from a slow test machine
    async with at(app, GUESSER) as http:
        for _ in range(3):
            wrong = await http.post("/dashboard/login", data={"key": "hunter2"})
            assert wrong.status_code == 401 and "Wrong admin key." in wrong.text
        locked = await http.post("/dashboard/login", data={"key": ADMIN})
        page = await http.get("/dashboard", headers={"x-api-key": ADMIN})
    assert locked.status_code == 429 and locked.headers["retry-after"] == "300"
    assert "Too many wrong keys from your address" in locked.text and "300" in locked.text
    assert SESSION_COOKIE not in locked.headers.get("set-cookie", "")
    assert locked.headers["content-type"].startswith("text/html")
    assert 'name="key"' in locked.text  # the form is still there for later
    assert page.status_code == 429
    async with at(app, NEIGHBOUR) as admin:
        signed = await admin.post("/dashboard/login", data={"key": ADMIN})
    assert signed.status_code == 303


async def test_admin_json_doors_lock_and_metrics_count_the_refusals(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS, admin_key=ADMIN, auth_max_failures=2)
    with_clock(app)  # retry-after counts from the lock, not from a slow test machine
    async with at(app, GUESSER) as http:
        statuses = [(await http.get("/api/stats", headers={"x-api-key": k})).status_code
                    for k in ("x", "key-alice")]  # a tenant's key is a wrong admin key
        stats = await http.get("/api/stats", headers={"x-api-key": ADMIN})
        metrics = await http.get("/metrics", headers={"x-api-key": ADMIN})
    assert statuses == [401, 401]
    for answer in (stats, metrics):
        assert answer.status_code == 429 and answer.headers["retry-after"] == "300"
        assert answer.json()["error"]["type"] == "rate_limit_error"
    async with at(app, NEIGHBOUR) as admin:
        scraped = await admin.get("/metrics", headers={"x-api-key": ADMIN})
    assert "prefixgate_auth_refused_total 2.0" in scraped.text.splitlines()


async def test_a_stale_session_cookie_never_locks_its_browser_out(make_fake_app) -> None:
    """A dashboard left open polls /api/stats with its cookie after it expired: those 401s
    are no guesses (an HMAC cannot be guessed), so signing in again still works."""
    app = make_fake_app(api_keys=KEYS, admin_key=ADMIN, auth_max_failures=2)
    async with at(app, GUESSER) as http:
        http.cookies.set(SESSION_COOKIE, "1000.0123456789abcdef0123456789abcdef.00")
        assert [(await http.get("/api/stats")).status_code for _ in range(5)] == [401] * 5
        assert (await http.get("/dashboard")).status_code == 401
        assert (await http.post("/dashboard/login", data={"key": ADMIN})).status_code == 303


async def test_no_limit_when_switched_off(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS, auth_max_failures=0)
    async with at(app, GUESSER) as http:
        assert {(await chat(http, "guess")).status_code for _ in range(25)} == {401}
        assert (await chat(http, "key-alice")).status_code == 200
    assert len(app.state.auth.limiter) == 0


def _locked(limiter: AuthLimiter, address: str) -> bool:
    """Whether `address` is refused (its check never runs) for a key it never used."""
    ran: list[str] = []
    try:
        limiter.verify(address, "some-key", lambda key: ran.append(key) or "tenant")
    except Overloaded:
        return not ran
    return False


def test_the_table_keeps_at_most_its_cap_the_oldest_dropped() -> None:
    clock = Clock()
    limiter = AuthLimiter(2, 60.0, max_addresses=3, clock=clock)
    addresses = [f"192.0.2.{i}" for i in range(1, 6)]
    for address in addresses:
        for _ in range(2):
            assert limiter.verify(address, "wrong", lambda key: None) is None
            clock.now += 1
    assert len(limiter) == 3
    # the two oldest windows were dropped for newer ones; the last three are still locked
    assert [_locked(limiter, a) for a in addresses] == [False, False, True, True, True]
    assert len(limiter) == 3


def test_the_limit_is_set_by_env_and_flags_and_a_bad_value_fails() -> None:
    def config(flags: list[str], env: dict[str, str]) -> tuple[int, float]:
        c = config_from_args(build_parser().parse_args(flags), env)
        return c.auth_max_failures, c.auth_failure_window_s

    env = {"PREFIXGATE_AUTH_MAX_FAILURES": "5", "PREFIXGATE_AUTH_FAILURE_WINDOW_S": "30"}
    assert config([], {}) == (10, 300.0)
    assert config([], env) == (5, 30.0)
    assert config(["--auth-max-failures", "0", "--auth-failure-window", "90"], env) == (0, 90.0)
    for flags in (["--auth-max-failures", "-1"], ["--auth-failure-window", "0"]):
        with pytest.raises(ValueError, match="auth_"):
            config(flags, {})
