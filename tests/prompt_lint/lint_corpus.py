"""Deterministic labelled corpus of agent sessions for prompt_lint's tests.

Every request comes with ground truth: the character spans of the dynamic
values injected into its template material (`Label`), the structural
problems it carries (tool order/JSON changes, edited history), and the
*ideal* request an agent designed for caching would have sent (static
system prompt and tools, dynamic values in a context block on the user turn
they were sent with, history appended). Clean look-alikes (versions, ports,
code, ratios, RFC numbers) sit in every system prompt and must not be flagged,
and so do per-family look-alikes that patterns would flag (office hours, policy
dates, versions, a support address, a pinned hash; `corpus_classes`).

Labels are set by behaviour, which is what "dynamic" means for a cache: once
the log is built, a labelled slot whose value changes inside some session
keeps the generator's kind; one that is constant inside every session but
differs across sessions becomes `session`; one with a single value in the
whole log is stable in this log and loses its label. Session start times are
spread over several days, so dates differ across sessions.

Run `python -m tests.prompt_lint.lint_corpus OUT_DIR` to write the corpus as
JSONL (raw.jsonl, ideal.jsonl, labels.jsonl).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import sys
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

from .corpus_classes import (
    HEADLINES,
    INCIDENTS,
    KILLER_KIND,
    KILLER_PHRASES,
    KILLERS,
    LOOKALIKES,
    ORGS,
    PLANS,
    TIPS,
    WEATHER,
    handle,
    lookalike_values,
    random_token,
)


class Label(NamedTuple):
    """One injected dynamic value: where it is and what kind of rule should fire."""

    path: str
    start: int
    end: int
    kind: str  # timestamp | identifier | nonce | learned | session
    value: str
    slot: str = ""  # the generator's name for where the value was injected


@dataclass
class CorpusRequest:
    """A raw request, its ideal layout and its ground truth."""

    body: dict[str, Any]
    ideal: dict[str, Any]
    labels: list[Label]
    structural: set[str]
    family: str
    session: str
    provider: str


STABLE_LINES = [
    "You are {name}, an assistant for the {team} engineering team (build v2.4.1).",
    "Supported runtimes: Python 3.11, Node 20.10.0 and Go 1.22; release channel v2026.11.",
    "Always answer in English unless the user writes in another language.",
    "When you show code, keep it short; slices such as items[1:3] are fine.",
    "Services listen on port 8080; health checks hit 127.0.0.1:8000/healthz.",
    "Screenshots use a 16:9 ratio and at most 1024 pixels of width.",
    "Follow RFC 2822 for mail headers and ISO 8601 for dates you write yourself.",
    "Return HTTP 404 when a record is missing and 409 on a version conflict.",
    "Step 3: run the test suite before proposing a commit.",
    "Prefer the get_user_by_id tool over scanning whole tables.",
    "Base URL for the internal API: https://api.internal.example/v1/items",
    "Never print secrets; refer to them by their variable name instead.",
    "Use the search tool before answering questions about recent events.",
    "Summaries stay under 200 words; lists use at most 7 bullets.",
    "def handler(event): return {'status': 200, 'body': event['body'][0:64]}",
    "If a tool fails twice, explain the failure and stop.",
    "Quote file paths like /usr/local/lib/python3.11/site-packages exactly.",
    "Tickets look like ENG-1234; mention them verbatim.",
    "Escalate to a human for refunds above 500 EUR.",
    "Keep a friendly, direct tone.",
]
FILLER = ("Policy {i}: handle {topic} requests by checking the runbook section {i} first, "
          "then confirm the plan with the user before changing anything.")
TOPICS = ["billing", "deploy", "database", "search", "access", "alerting", "backup", "network"]
TIME_FORMATS = ["iso_z", "iso_ms", "iso_offset", "iso_naive", "rfc2822", "written", "dmy",
                "epoch", "epoch_ms", "clock"]
TOOL_NAMES = ["search_web", "read_file", "run_tests", "get_user_by_id", "create_ticket",
              "list_files", "send_email"]


def format_time(t: datetime, fmt: str) -> str:
    """`t` in one of TIME_FORMATS."""
    return {
        "iso_z": t.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "iso_ms": t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z",
        "iso_offset": t.strftime("%Y-%m-%dT%H:%M:%S+01:00"),
        "iso_naive": t.strftime("%Y-%m-%d %H:%M:%S"),
        "rfc2822": t.strftime("%a, %d %b %Y %H:%M:%S +0000"),
        "written": t.strftime("%A, %B ") + str(t.day) + t.strftime(", %Y"),
        "dmy": t.strftime("%d/%m/%Y %H:%M"),
        "epoch": str(int(t.timestamp())),
        "epoch_ms": str(int(t.timestamp() * 1000)),
        "clock": t.strftime("%H:%M"),
    }[fmt]


_token = random_token


@dataclass
class FamilySpec:
    """A prompt template: provider, stable lines, which killers, tool behaviour."""

    name: str
    provider: str
    stable: list[str]
    killers: list[str]
    time_format: str
    tools: list[dict[str, Any]]
    shuffle_tools: bool
    reorder_schema: bool
    tool_desc_killer: bool
    edit_history: bool
    fields: dict[str, str] = field(default_factory=dict)
    phrases: dict[str, tuple[str, str]] = field(default_factory=dict)


def _tool(name: str, provider: str, rng: random.Random) -> dict[str, Any]:
    schema = {"type": "object",
              "properties": {"query": {"type": "string", "description": f"what {name} acts on"},
                             "limit": {"type": "integer", "minimum": 1}},
              "required": ["query"]}
    desc = f"Use {name.replace('_', ' ')} for the user's task. Returns JSON."
    if provider == "anthropic":
        return {"name": name, "description": desc, "input_schema": schema}
    return {"type": "function", "function": {"name": name, "description": desc,
                                             "parameters": schema}}


def make_family(i: int, rng: random.Random, phrasing: str = "train") -> FamilySpec:
    """Family `i`: alternating providers, a random mix of killers and look-alikes."""
    provider = "openai" if i % 2 == 0 else "anthropic"
    stable = [line.replace("{name}", f"Agent{i}").replace("{team}", rng.choice(TOPICS))
              for line in STABLE_LINES]
    stable += [FILLER.format(i=k, topic=rng.choice(TOPICS)) for k in range(rng.randint(20, 40))]
    looks = lookalike_values(rng)
    stable += [line.format(**looks) for line in rng.sample(LOOKALIKES[phrasing], 5)]
    rng.shuffle(stable)
    others = KILLERS[1:]  # three in turn (every class covered), then a random few
    turn = 3 * (i - i // 5)  # families 4, 9, ... are clean
    killers = ["time"] + [others[(turn + j) % len(others)] for j in range(3)]
    killers += rng.sample([k for k in others if k not in killers], rng.randint(0, 2))
    if i % 5 == 4:
        killers = []  # a clean family: look-alikes only
    tools = [_tool(n, provider, rng) for n in rng.sample(TOOL_NAMES, rng.randint(2, 5))]
    phrases = {k: rng.choice(KILLER_PHRASES[phrasing][k]) for k in KILLERS}
    return FamilySpec(f"family{i}", provider, stable, killers, TIME_FORMATS[i % len(TIME_FORMATS)],
                      tools, shuffle_tools=i % 3 == 1, reorder_schema=i % 4 == 2,
                      tool_desc_killer=i % 6 == 3 and bool(killers), edit_history=i % 4 == 1,
                      phrases=phrases)


class _Text:
    """Builds a string while recording labelled spans."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.spans: list[tuple[int, int, str, str]] = []

    def add(self, text: str, kind: str | None = None) -> None:
        if kind is not None:
            self.spans.append((self.size, self.size + len(text), kind, text))
        self.parts.append(text)
        self.size += len(text)

    def text(self) -> str:
        return "".join(self.parts)


def _killer(text: _Text, spec: FamilySpec, killer: str, values: dict[str, str]) -> None:
    prefix, suffix = spec.phrases[killer]
    text.add(prefix)
    text.add(values[killer], killer)
    text.add(suffix)


def _values(spec: FamilySpec, session: dict[str, str], t: datetime, n: int,
            rng: random.Random) -> dict[str, str]:
    return {"time": format_time(t, spec.time_format), "user": session["user"],
            "session": session["session"], "email": session["email"], "jwt": session["jwt"],
            "apikey": session["apikey"], "counter": str(n),
            "digest": hashlib.sha256(f"{session['session']}{n}".encode()).hexdigest(),
            "nonce": _token(rng, 24), "weather": rng.choice(WEATHER), "tip": rng.choice(TIPS),
            "handle": session["handle"], "org": session["org"], "plan": session["plan"],
            "headline": rng.choice(HEADLINES), "incidents": rng.choice(INCIDENTS)}


def _system(spec: FamilySpec, values: dict[str, str]) -> tuple[str, list[tuple[int, int, str, str]],
                                                                str]:
    """(raw system text, its labelled spans, ideal system text)."""
    raw, ideal = _Text(), _Text()
    head = len(spec.killers) and 2
    for k, line in enumerate(spec.stable):
        if k == head:
            for killer in spec.killers:
                _killer(raw, spec, killer, values)
                raw.add("\n")
        raw.add(line + "\n")
        ideal.add(line + "\n")
    return raw.text(), raw.spans, ideal.text() + "Per-request context arrives in the user turn."


def _context(spec: FamilySpec, values: dict[str, str]) -> str:
    lines = "".join(f"{k}: {values[k]}\n" for k in spec.killers)
    return f"<context>\n{lines}</context>\n\n" if lines else ""


@dataclass
class _SessionState:
    spec: FamilySpec
    session: str
    raw_history: list[dict[str, Any]]
    ideal_history: list[dict[str, Any]]
    ids: dict[str, str]


def _session_ids(rng: random.Random) -> dict[str, str]:
    name = rng.choice(["ana", "bo", "chen", "dara"])
    return {"user": f"u_{rng.randint(10000, 99999)}",
            "session": str(uuid.UUID(int=rng.getrandbits(128))),
            "email": f"{name}.{rng.randint(1, 999)}@example.com",
            "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJ" + _token(rng, 30) + "." + _token(rng, 43),
            "apikey": "sk-proj-" + _token(rng, 32), "handle": handle(rng),
            "org": rng.choice(ORGS), "plan": rng.choice(PLANS)}


def _tools_for(spec: FamilySpec, rng: random.Random, values: dict[str, str],
               labels: list[Label]) -> list[dict[str, Any]]:
    tools = copy.deepcopy(spec.tools)
    if spec.shuffle_tools:
        rng.shuffle(tools)
    if spec.reorder_schema:
        for tool in tools:
            schema = tool.get("input_schema") or tool["function"]["parameters"]
            keys = list(schema)
            rng.shuffle(keys)
            items = {k: schema[k] for k in keys}
            schema.clear()
            schema.update(items)
    if spec.tool_desc_killer:
        target = tools[0] if spec.provider == "anthropic" else tools[0]["function"]
        prefix = target["description"] + " Index refreshed at "
        target["description"] = prefix + values["time"]
        path = "tools[0].description" if spec.provider == "anthropic" else \
            "tools[0].function.description"
        labels.append(Label(path, len(prefix), len(prefix) + len(values["time"]), "timestamp",
                            values["time"], "tool_time"))
    return tools


def _ideal_tools(spec: FamilySpec) -> list[dict[str, Any]]:
    def name(t: dict[str, Any]) -> str:
        return str(t.get("name") or t["function"]["name"])
    return [json.loads(json.dumps(t, sort_keys=True)) for t in sorted(spec.tools, key=name)]


def _user_message(spec: FamilySpec, text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _tool_exchange(spec: FamilySpec, call_id: str, tool: str, result: str) -> list[dict[str, Any]]:
    if spec.provider == "anthropic":
        return [{"role": "assistant", "content": [
                    {"type": "text", "text": f"Calling {tool}."},
                    {"type": "tool_use", "id": call_id, "name": tool, "input": {"query": "x"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": call_id, "content": result}]}]
    return [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": tool, "arguments": json.dumps({"query": "x"})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


def _body(spec: FamilySpec, system: str, tools: list[dict[str, Any]],
          history: list[dict[str, Any]]) -> dict[str, Any]:
    if spec.provider == "anthropic":
        model = "claude-3-5-haiku-latest" if spec.name.endswith(("1", "5")) else "claude-sonnet-4-5"
        return {"model": model, "max_tokens": 1024,
                "system": [{"type": "text", "text": system,
                            "cache_control": {"type": "ephemeral"}}],
                "tools": tools, "messages": copy.deepcopy(history)}
    return {"model": "gpt-4o-mini", "tools": tools,
            "messages": [{"role": "system", "content": system}] + copy.deepcopy(history)}


def _system_path(spec: FamilySpec) -> str:
    return "system[0].text" if spec.provider == "anthropic" else "messages[0].content"


def _with_context(message: dict[str, Any], context: str) -> dict[str, Any]:
    return {**message, "content": context + message["content"]}


def _session_requests(state: _SessionState, rng: random.Random, start: datetime,
                      counter: list[int]) -> list[CorpusRequest]:
    spec = state.spec
    out: list[CorpusRequest] = []
    t = start
    for turn in range(rng.randint(2, 4)):
        user = _user_message(spec, f"Task {turn} for {state.session[:8]}: "
                             f"{rng.choice(['fix', 'explain', 'review', 'plan'])} the "
                             f"{rng.choice(TOPICS)} change, please.")
        values = _values(spec, state.ids, t, len(out) + 1, rng)
        state.raw_history.append(user)
        state.ideal_history.append(_with_context(user, _context(spec, values)))
        for call in range(rng.randint(0, 2) + 1):
            values = _values(spec, state.ids, t, len(out) + 1, rng)
            out.append(_request(state, values, rng))
            t += timedelta(seconds=rng.randint(3, 90), milliseconds=rng.randint(0, 999))
            if call < 2 and rng.random() < 0.6:
                tool = rng.choice(spec.tools)
                name = str(tool.get("name") or tool["function"]["name"])
                result = {"id": str(uuid.UUID(int=rng.getrandbits(128))), "ok": True,
                          "at": t.isoformat()}
                exchange = _tool_exchange(spec, f"call_{_token(rng, 12)}", name,
                                          json.dumps(result))
                state.raw_history += exchange
                state.ideal_history += copy.deepcopy(exchange)
            else:
                break
        answer = {"role": "assistant", "content": f"Done with task {turn}."}
        state.raw_history.append(answer)
        state.ideal_history.append(dict(answer))
        if spec.edit_history and turn == 1:
            _edit(state, out)
        t += timedelta(minutes=rng.randint(1, 30))
    counter[0] += len(out)
    return out


def _edit(state: _SessionState, out: list[CorpusRequest]) -> None:
    """Rewrite the first assistant answer in place: the next request breaks append-only."""
    for msgs in (state.raw_history, state.ideal_history):
        for m in msgs:
            if m["role"] == "assistant" and isinstance(m["content"], str):
                m["content"] = m["content"] + " (edited summary)"
                break
    state.spec.fields.setdefault("edited", "")
    state.spec.fields["edited"] += f"{state.session},"


def _request(state: _SessionState, values: dict[str, str], rng: random.Random) -> CorpusRequest:
    spec = state.spec
    system, spans, ideal_system = _system(spec, values)
    labels = [Label(_system_path(spec), s, e, KILLER_KIND[k], v, k) for s, e, k, v in spans]
    tools = _tools_for(spec, rng, values, labels)
    body = _body(spec, system, tools, state.raw_history)
    ideal = _body(spec, ideal_system, _ideal_tools(spec), state.ideal_history)
    if spec.tool_desc_killer:  # the ideal carries that value in the context block too
        last = ideal["messages"][-1]
        if isinstance(last["content"], str):
            last["content"] = f"<context>\ntool_index: {values['time']}\n</context>\n\n" + \
                last["content"]
    return CorpusRequest(body, ideal, labels, set(), spec.name, state.session, spec.provider)


def _structural(requests: list[CorpusRequest], edited: set[tuple[str, int]]) -> None:
    last_tools: dict[str, list[str]] = {}
    last_json: dict[str, dict[str, str]] = {}
    for k, req in enumerate(requests):
        tools = req.body.get("tools") or []
        names = [str(t.get("name") or t["function"]["name"]) for t in tools]
        prints = {n: json.dumps(t) for n, t in zip(names, tools, strict=True)}
        before = last_tools.get(req.family)
        if before is not None and before != names:
            req.structural.add("PL004")
        old = last_json.get(req.family, {})
        if any(n in old and old[n] != p for n, p in prints.items()):
            req.structural.add("PL006")
        last_tools[req.family] = names
        last_json.setdefault(req.family, {}).update(prints)
        if (req.session, k) in edited:
            req.structural.add("PL009")


def build_corpus(seed: int = 7, families: int = 10, sessions: int = 40,
                 phrasing: str = "train") -> list[CorpusRequest]:
    """The corpus: `sessions` agent sessions over `families` templates, interleaved;
    `phrasing` picks the phrase pools (`holdout` for the held-out check)."""
    rng = random.Random(seed)
    specs = [make_family(i, rng, phrasing) for i in range(families)]
    start = datetime(2026, 11, 29, 8, 0, 0, tzinfo=UTC)
    per_session: list[list[CorpusRequest]] = []
    counter = [0]
    for s in range(sessions):
        spec = specs[s % families]
        state = _SessionState(spec, f"s{s:03d}-" + _token(rng, 8), [], [], _session_ids(rng))
        begin = start + timedelta(hours=5 * s + rng.randint(0, 3), minutes=rng.randint(0, 59))
        per_session.append(_session_requests(state, rng, begin, counter))
    out: list[CorpusRequest] = []
    while any(per_session):  # round-robin interleave, like a gateway log
        for reqs in per_session:
            if reqs:
                out.append(reqs.pop(0))
    _structural(out, _edited_requests(out))
    _relabel(out)
    return out


def _relabel(requests: list[CorpusRequest]) -> None:
    """Set each label's kind by how its slot's value behaves (module docstring)."""
    values: dict[tuple[str, str], dict[str, set[str]]] = {}
    for req in requests:
        for lb in req.labels:
            values.setdefault((req.family, lb.slot), {}).setdefault(req.session, set()).add(
                lb.value)
    for req in requests:
        kept = []
        for lb in req.labels:
            by_session = values[(req.family, lb.slot)]
            if any(len(v) > 1 for v in by_session.values()):
                kept.append(lb)
            elif len(set().union(*by_session.values())) > 1:
                kept.append(lb._replace(kind="session"))
        req.labels = kept


def _edited_requests(requests: list[CorpusRequest]) -> set[tuple[str, int]]:
    """(session, log index) of the first request after each in-place edit."""
    seen: dict[str, list[dict[str, Any]]] = {}
    found: set[tuple[str, int]] = set()
    for k, req in enumerate(requests):
        history = [m for m in req.body["messages"] if m["role"] not in {"system"}]
        before = seen.get(req.session)
        if before is not None and history[: len(before)] != before:
            found.add((req.session, k))
        seen[req.session] = history
    return found


def main(argv: list[str] | None = None) -> int:
    """Write raw.jsonl, ideal.jsonl and labels.jsonl into OUT_DIR."""
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "lint_corpus")
    out.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus()
    with (out / "raw.jsonl").open("w") as raw, (out / "ideal.jsonl").open("w") as ideal, \
            (out / "labels.jsonl").open("w") as labels:
        for req in corpus:
            raw.write(json.dumps(req.body) + "\n")
            ideal.write(json.dumps(req.ideal) + "\n")
            labels.write(json.dumps({"labels": [lb._asdict() for lb in req.labels],
                                     "structural": sorted(req.structural),
                                     "family": req.family, "session": req.session}) + "\n")
    print(f"wrote {len(corpus)} requests to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
