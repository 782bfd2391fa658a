"""Config and env vars, the `serve` flags, the metrics text format, and tool-call parsing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.config import ENV_VARS, GatewayConfig, UpstreamSpec, load_keys_file
from gateway.metrics import Registry
from gateway.serve import build_parser, config_from_args
from gateway.tool_calls import ParsedOutput, ToolCallFilter, parse_output

# ------------------------------------------------------------------------------ config


def test_env_vars_build_the_config_and_bad_values_fail_loudly(tmp_path: Path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# key tenant\nk1 team-a\nk2=team-b\n")
    env = {"PREFIXGATE_PORT": "9001", "PREFIXGATE_LINT_MODE": "rewrite",
           "PREFIXGATE_KEYS_FILE": str(keys), "PREFIXGATE_API_KEYS": "k3=team-c,k4",
           "PREFIXGATE_STORE_PROMPTS": "yes", "PREFIXGATE_OPENAI_API_KEY": "sk-up",
           "PREFIXGATE_UPSTREAMS": "openai=http://a/v1,openai=http://b/v1"}
    config = GatewayConfig.from_env(env)
    assert config.port == 9001 and config.lint_mode == "rewrite" and config.store_prompts
    assert dict(config.api_keys) == {"k1": "team-a", "k2": "team-b", "k3": "team-c",
                                     "k4": "default"}
    assert config.upstream_api_keys == {"openai": "sk-up"}
    assert config.upstreams == (UpstreamSpec("openai", "http://a/v1"),
                                UpstreamSpec("openai", "http://b/v1"))
    for name, value in [("PREFIXGATE_PORT", "eighty"), ("PREFIXGATE_LINT_MODE", "loud"),
                        ("PREFIXGATE_STORE_PROMPTS", "maybe")]:
        with pytest.raises(ValueError, match=name):
            GatewayConfig.from_env({name: value})
    assert all(name.startswith("PREFIXGATE_") for name in ENV_VARS)


def test_config_checks_itself():
    with pytest.raises(ValueError, match="lint_mode"):
        GatewayConfig(lint_mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="db_url"):
        GatewayConfig(db_url="stats.db")
    with pytest.raises(ValueError, match="kind=URL"):
        UpstreamSpec.parse("localhost:9001/v1")
    assert UpstreamSpec.parse(" http://x/v1?a=b ") == UpstreamSpec("auto", "http://x/v1?a=b")
    with pytest.raises(ValueError, match="http"):
        UpstreamSpec.parse("openai=ftp://x")


def test_keys_file_json_and_errors(tmp_path: Path):
    good = tmp_path / "keys.json"
    good.write_text(json.dumps({"a": "x"}))
    assert load_keys_file(good) == {"a": "x"}
    bad = tmp_path / "bad.txt"
    bad.write_text("only-a-key\n")
    with pytest.raises(ValueError, match="bad.txt:1"):
        load_keys_file(bad)


def test_a_keys_file_without_keys_is_refused(tmp_path: Path, capsys) -> None:
    """A keys file that holds no key (empty, comments only, `{}`: a secret not mounted yet)
    would leave the gateway open to anyone; the server refuses to start instead."""
    from gateway.serve import main

    keys = tmp_path / "keys.txt"
    for text in ("", "# keys go here\n\n", "{}"):
        keys.write_text(text)
        with pytest.raises(ValueError, match="no key"):
            load_keys_file(keys)
        with pytest.raises(ValueError, match="no key"):
            GatewayConfig.from_env({"PREFIXGATE_KEYS_FILE": str(keys)})
        assert main(["--keys-file", str(keys)]) == 2
        assert "holds no key" in capsys.readouterr().err
    for value in (" ", ",", " , "):  # set, but naming no key
        with pytest.raises(ValueError, match="PREFIXGATE_API_KEYS"):
            GatewayConfig.from_env({"PREFIXGATE_API_KEYS": value})


def test_a_key_keeps_its_own_equals_signs(tmp_path: Path) -> None:
    import base64
    import secrets

    padded = [base64.b64encode(secrets.token_bytes(n)).decode() for n in (31, 32)]
    assert [k.count("=") for k in padded] == [2, 1]  # base64 of 31 and 32 bytes is padded
    one, two = padded
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{one} alice\n{two}=bob\n{one}x = carol\n")
    assert load_keys_file(keys) == {one: "alice", two: "bob", one + "x": "carol"}
    args = build_parser().parse_args(["--api-key", two, "--api-key", f"{one}=dave"])
    assert dict(config_from_args(args, {}).api_keys) == {two: "default", one: "dave"}
    env = config_from_args(build_parser().parse_args([]),
                           {"PREFIXGATE_API_KEYS": f"{two}=erin,{one}"})
    assert dict(env.api_keys) == {two: "erin", one: "default"}
    for line in (f"{two}\n", "=alice\n"):
        keys.write_text(line)  # a line with no tenant
        with pytest.raises(ValueError, match="keys.txt:1"):
            load_keys_file(keys)


def test_serve_flags_override_env(tmp_path: Path):
    args = build_parser().parse_args([
        "--port", "8123", "--db", f"sqlite:///{tmp_path}/x.db", "--api-key", "k=alice",
        "--api-key", "plain", "--admin-key", "root", "--lint-mode", "off", "--store-prompts",
        "--upstream", "anthropic=https://api.example/v1"])
    config = config_from_args(args, {"PREFIXGATE_PORT": "9000", "PREFIXGATE_LINT_MODE": "report"})
    assert (config.port, config.lint_mode, config.admin_key) == (8123, "off", "root")
    assert dict(config.api_keys) == {"k": "alice", "plain": "default"}
    assert config.store_prompts and config.db_url.endswith("x.db")
    assert config.upstreams == (UpstreamSpec("anthropic", "https://api.example/v1"),)
    default = config_from_args(build_parser().parse_args([]), {})
    assert default.db_url == "sqlite:///prefixgate.db" and default.upstreams == ()
    seven = {"PREFIXGATE_GRACEFUL_TIMEOUT_S": "7"}
    grace = [config_from_args(build_parser().parse_args(flags), env).graceful_timeout_s
             for flags, env in (([], {}), ([], seven), (["--graceful-timeout", "3"], seven))]
    assert grace == [25, 7, 3]


def test_engine_quantization_from_env_flag_and_into_the_engine_config():
    from_env = config_from_args(build_parser().parse_args([]),
                                {"PREFIXGATE_ENGINE_QUANTIZATION": "fp16"})
    assert from_env.engine.quantization == "fp16"
    flag = config_from_args(build_parser().parse_args(["--quantization", "none"]),
                            {"PREFIXGATE_ENGINE_QUANTIZATION": "fp16"})
    assert flag.engine.quantization == "none"
    with pytest.raises(ValueError, match="PREFIXGATE_ENGINE_QUANTIZATION"):
        config_from_args(build_parser().parse_args([]), {"PREFIXGATE_ENGINE_QUANTIZATION": "int3"})


# ------------------------------------------------------------------------------ metrics

SAMPLE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]+="(?:[^"\\]|\\.)*",?)*\})? [-+0-9.eInf]+$')


def test_metrics_text_format_and_values():
    reg = Registry()
    requests = reg.counter("x_requests_total", "Requests.", ("route",))
    latency = reg.histogram("x_latency_seconds", "Latency.", ("route",), buckets=(0.1, 1.0))
    gauge = reg.gauge("x_pages", "Pages.")
    requests.inc(route="a")
    requests.inc(2, route='b"q')
    for value in (0.05, 0.5, 5.0):
        latency.observe(value, route="a")
    gauge.set(7)
    text = reg.render()
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert all(SAMPLE.match(line) for line in samples), samples
    # prometheus_client writes every value as a float ("1.0").
    assert 'x_requests_total{route="a"} 1.0' in samples
    assert 'x_requests_total{route="b\\"q"} 2.0' in samples
    buckets = [line for line in samples if line.startswith("x_latency_seconds_bucket")]
    assert [float(line.rsplit(" ", 1)[1]) for line in buckets] == [1, 2, 3]  # cumulative
    assert 'x_latency_seconds_sum{route="a"} 5.55' in samples
    assert "x_pages 7.0" in samples
    assert reg.counter("x_requests_total", "Requests.", ("route",)) is requests
    with pytest.raises(ValueError, match="another shape"):
        reg.gauge("x_requests_total", "no")
    with pytest.raises(ValueError, match="labels"):
        requests.inc(other="x")
    with pytest.raises(ValueError, match="decrease"):
        requests.inc(-1, route="a")


# ------------------------------------------------------------------------------ tool calls


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    '<tool_call>```json\n{"name": "f", "arguments": {"a": 1}}\n```</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
    '<tool_call>{"name": "f", "parameters": {"a": 1}}',  # stopped before the closing tag
    '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing</tool_call>',
])
def test_tool_call_formats_parse(text: str):
    parsed = parse_output("Sure. " + text, "rid")
    assert parsed.text == "Sure."
    assert len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "f"
    assert json.loads(call["function"]["arguments"]) == {"a": 1}


@pytest.mark.parametrize("text", [
    "no call here", "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
    "a < b and <tool> tags",
])
def test_unparseable_output_stays_text(text: str):
    parsed = parse_output(text, "rid")
    assert parsed == parse_output(text, "rid") and parsed.tool_calls == ()
    assert parsed.text == text


@pytest.mark.parametrize("cut", [
    "<tool_call>", '<tool_call>\n{"name', '<tool_call>{"name": "f", "arguments": ',
    '<tool_call>\n{"name": "f", "arguments": {"a": "12345',
    '<tool_call>{"name": "f", "arguments": {"a": 1}',
])
def test_a_call_cut_short_is_dropped_not_shown(cut: str):
    """max_tokens ended the output inside a call (before or after its name: a stream may have
    sent it as a call by then): no call, and none of its raw block as text."""
    parsed = parse_output("Sure. " + cut, "rid")
    assert parsed == ParsedOutput("Sure.", ())


def test_a_call_cut_after_a_newline_is_still_the_end_of_the_output():
    """A block cut just after a newline ends the output (`$` also matches before a final
    newline, so the cut call was mistaken for a finished one and everything became text)."""
    whole = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
    parsed = parse_output("Sure. " + whole + "<tool_call>\n", "rid")
    assert parsed.text == "Sure." and [c["function"]["name"] for c in parsed.tool_calls] == ["f"]


def test_two_calls_get_distinct_ids():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"x": [1]}}</tool_call>')
    calls = parse_output(text, "rid").tool_calls
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[0]["id"] != calls[1]["id"]


@given(st.text(alphabet="ab<>_/ltoc{}\" ", max_size=60), st.lists(st.integers(1, 7), max_size=12),
       st.booleans())
@example(body="Let me check. ", cuts=[3, 7], call=True)
def test_filter_streams_exactly_the_parsed_text(body: str, cuts: list[int], call: bool):
    """Reference: parse_output on the whole text. Streaming any split of the same text through
    the filter sends exactly that visible text (never a byte of a complete tool call; before,
    the blanks between the text and a call were streamed though the whole answer drops them,
    so a streamed `content` differed from the same answer unstreamed)."""
    text = body + '<tool_call>{"name": "f", "arguments": {}}</tool_call>' if call else body
    pieces, rest = [], text
    for cut in cuts:
        pieces.append(rest[:cut])
        rest = rest[cut:]
    pieces.append(rest)
    filt = ToolCallFilter()
    sent = "".join(filt.feed(p) for p in pieces)
    tail, parsed = filt.finish(text, "rid")
    reference = parse_output(text, "rid")
    assert parsed == reference
    assert sent + tail == reference.text
    if "<tool_call>" not in text:
        assert sent + tail == text


def test_serve_refuses_bad_config_with_status_2(capsys, monkeypatch):
    from gateway.serve import main

    monkeypatch.setenv("PREFIXGATE_PORT", "not-a-port")
    assert main([]) == 2
    assert "PREFIXGATE_PORT" in capsys.readouterr().err


def test_serve_names_a_stats_database_it_cannot_open_with_status_2(capsys, monkeypatch,
                                                                    tmp_path: Path) -> None:
    import uvicorn

    from gateway.serve import main
    from tests.support import free_port

    def never(*_: object, **__: object) -> None:
        raise AssertionError("served without a stats database")

    monkeypatch.setattr(uvicorn, "run", never)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    not_a_db = tmp_path / "not.db"
    not_a_db.write_text("not a database " * 100)
    closed = f"postgresql+pg8000://user:hunter2pw@127.0.0.1:{free_port()}/stats"
    for url, names in ((f"sqlite:///{a_file}/stats.db", str(a_file)),
                       (f"sqlite:///{not_a_db}", str(not_a_db)),
                       (closed, "127.0.0.1")):
        argv = ["--db", url, "--upstream", "vllm=http://127.0.0.1:9/v1",
                "--stats-spill-path", str(tmp_path / "spill.jsonl")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("prefixgate serve: stats database ") and names in err
        assert "Traceback" not in err and "hunter2pw" not in err


def test_serve_refuses_an_empty_admin_key(capsys) -> None:
    """An empty admin key would admit an empty sign-in form and sessions signed with no
    secret: refused at start-up, whichever way it is given."""
    from gateway.serve import main

    for argv, environ in ((["--admin-key", ""], {}), (["--admin-key", "  "], {}),
                          ([], {"PREFIXGATE_ADMIN_KEY": " "})):
        with pytest.raises(ValueError, match="admin_key"):
            config_from_args(build_parser().parse_args(argv), environ)
    assert main(["--admin-key", ""]) == 2
    assert "admin_key must not be empty" in capsys.readouterr().err


def test_serve_freezes_startup_objects_out_of_the_collectors_view() -> None:
    import gc

    from gateway.serve import freeze_startup_objects

    gc.unfreeze()
    marker = [object()]  # allocated before serving: frozen with the rest
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        assert not any(o is marker for o in gc.get_objects())  # no collection walks it
    finally:
        gc.unfreeze()
    assert any(o is marker for o in gc.get_objects())
