"""llama.cpp server slots as the gateway models them (`SlotShadow`, a cache model).

A llama.cpp server keeps one KV sequence per slot, reuses the longest common prefix of the slot
it runs a request on, and saves slots to a host prompt cache (the shadow keeps at most
`max_bytes / 2 / slots` of each slot's tokens, and half of `max_bytes` of host cache). With
that cache (llama-server's default) the server's own slot choice reaches every saved prompt,
and the gateway leaves it the choice (no `id_slot`): with one KV buffer for all slots (its
default) idle slots are cleared, and a request pinned to a cleared slot loads nothing back.
Whether idle slots are cleared is learnt (two models, the closer one predicts), and a request
waits in the gateway while every slot of its replica is busy, so the slot the server gives it
is the one the model expects. Without a host cache (`--cache-ram 0`) the gateway pins each
conversation to a slot of its own with `id_slot`: a request that continues a slot's
conversation goes to that slot; a new one takes an empty slot, else the least recently used
one, so two sessions sharing a system prompt never overwrite each other while a slot is free.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from gateway.shadow import Prompt, ShadowConfig, as_prompt
from prompt_lint.incremental import common_prefix

TOKEN_BYTES = 4


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Tokens two packed sequences share at their start (the first differing byte lies in the
    first differing token)."""
    return common_prefix(a, b) // TOKEN_BYTES


class Slot(NamedTuple):
    """What one llama.cpp slot holds (or one saved prompt of its host cache): namespace,
    packed tokens, last use."""

    namespace: str
    data: bytes
    used: float


class SlotChoice(NamedTuple):
    """The slot a prompt runs on, the prefix it reuses there, whether the server saves the
    slot to its host cache first (`swaps`), and the host-cache entry it then loads into the
    slot (-1: none)."""

    slot: int
    length: int
    swaps: bool = False
    loads: int = -1
    pinned: bool = True  # sent as `id_slot`; False: the server picks the slot itself


def _tokens(data: bytes) -> int:
    return len(data) // TOKEN_BYTES


class HostPromptCache:
    """llama-server's prompt cache in host memory (`--cache-ram`, on by default): slot states
    it saved, oldest first, bounded by `max_tokens` (the server bounds it by MiB)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.entries: list[Slot] = []

    def save(self, slot: Slot) -> None:
        """Keep `slot`'s tokens: skipped when an entry already starts with them; entries they
        extend are dropped; the oldest go past the bound."""
        if self.holds(slot):
            return
        self.entries = [e for e in self.entries if not (
            e.namespace == slot.namespace and slot.data.startswith(e.data))]
        self.entries.append(slot)
        total = sum(_tokens(e.data) for e in self.entries)
        while len(self.entries) > 1 and total > self.max_tokens:
            total -= _tokens(self.entries.pop(0).data)

    def holds(self, slot: Slot) -> bool:
        """True when an entry starts with all of `slot`'s tokens."""
        return any(e.namespace == slot.namespace and e.data.startswith(slot.data)
                   for e in self.entries)

    def best(self, data: bytes, namespace: str, keep: float, sim: float) -> int:
        """The entry the server would load for a prompt instead of a slot that keeps `keep`
        of its tokens and covers `sim` of the prompt: better on both, keeping >= 1/4 of
        itself; -1 when none."""
        found, n = -1, max(_tokens(data), 1)
        for k, entry in enumerate(self.entries):
            if entry.namespace != namespace:
                continue
            lcp = common_prefix_tokens(entry.data, data)
            keep_k, sim_k = lcp / max(_tokens(entry.data), 1), lcp / n
            if keep_k >= 0.25 and keep_k > keep and sim_k > sim:
                found, keep, sim = k, keep_k, sim_k
        return found


class SlotModel:
    """One model of a llama.cpp server's slots and host prompt cache (see `SlotShadow`).

    Per request the server (tools/server, `get_available_slot`) takes the pinned slot, else the
    idle slot that shares the most of the prompt (over `similarity` of it), else the least
    recently used one; when the prompt reuses under half of what that slot holds (or at most
    `similarity` of the prompt, or the slot is empty), it saves the slot to its host cache and
    loads from there the saved prompt that fits better, if any; it reuses the longest common
    prefix of the slot and the prompt (all but the last token). A request pinned to an empty
    slot loads nothing (the share it keeps of an empty slot is 0/0, which passes no test).
    Starting a request also saves every idle slot, and clears them where all slots share one
    KV buffer (the server's default when it picks the slot count itself).

    With a host cache the gateway never pins (a pin to a slot that was cleared loses the whole
    prefix, and the server's slot indices cannot be known from outside): the model follows the
    server's own choice, with the idle slots cleared once saved or kept (`clears_idle`). A
    slot is busy from the start of its request to the end of its answer (`finished`), and the
    server passes busy slots by. Without a host cache (`--cache-ram 0`) slots are never
    cleared and each conversation is pinned to a slot of its own."""

    #: a request continues a slot's conversation when it reuses this share of what it holds
    CONTINUES = 0.9

    def __init__(self, config: ShadowConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, *, similarity: float = 0.1,
                 host_cache: bool = True, clears_idle: bool = True) -> None:
        self.config = config or ShadowConfig(page_size=1, slots=1)
        self.clears_idle = clears_idle and host_cache
        self._clock = clock
        self.slots: list[Slot | None] = [None] * self.config.slots
        self.similarity = similarity
        # with a host cache, slots and host cache each get half of `max_bytes`
        self._budget = self.config.max_bytes // (2 if host_cache else 1)
        self.host = (HostPromptCache(min(self.config.max_pages * 16, self._budget // TOKEN_BYTES))
                     if host_cache else None)
        self.misses = 0
        self.busy = [0] * len(self.slots)  # requests running on each slot
        self._running: dict[int, int] = {}  # id of a started request's prompt -> its slot

    def resize(self, slots: int) -> None:
        """Take the slot count the server reports (`/props` total_slots)."""
        if slots > 0 and slots != len(self.slots):
            self.slots = (self.slots + [None] * slots)[:slots]
            self.busy = (self.busy + [0] * slots)[:slots]

    def served(self, i: int, data: bytes, namespace: str) -> SlotChoice:
        """What the server reuses when the prompt runs on slot `i` (picked by the server)."""
        slot, n = self.slots[i], max(_tokens(data), 1)
        same = slot is not None and slot.namespace == namespace
        lcp = common_prefix_tokens(slot.data, data) if slot is not None and same else 0
        keep = -1.0 if slot is None else lcp / max(_tokens(slot.data), 1)
        sim = lcp / n
        swaps = self.host is not None and (slot is None or sim <= self.similarity or keep < 0.5)
        loads = self.host.best(data, namespace, keep, sim) if swaps and self.host else -1
        if loads >= 0 and self.host is not None:
            lcp = common_prefix_tokens(self.host.entries[loads].data, data)
        return SlotChoice(i, min(lcp, n - 1), swaps, loads)

    def choose(self, prompt: Prompt, namespace: str) -> SlotChoice:
        """Where the prompt runs and what it reuses there (see the class docstring)."""
        data = prompt.tokens.data
        if self.host is None:
            return self._own_slot(data, namespace)
        return self._server_choice(data, namespace)

    def _server_choice(self, data: bytes, namespace: str) -> SlotChoice:
        """The idle slot the server picks for a request that names none, and what it reuses
        there. When none is idle the server waits for one: the one freed first, taken as the
        least recently started, still holding its request's prompt."""
        idle = [i for i in range(len(self.slots)) if not self.busy[i]]
        if not idle:
            first = min(range(len(self.slots)), key=lambda i: (self._used(i), -i))
            return self.served(first, data, namespace)._replace(pinned=False)
        n, picked, best = max(_tokens(data), 1), -1, self.similarity
        for i in idle:
            slot = self.slots[i]
            if slot is not None and slot.namespace == namespace:
                sim = common_prefix_tokens(slot.data, data) / n
                if sim > best:
                    picked, best = i, sim
        if picked < 0:  # the least recently used (of equals, the last)
            picked = min(idle, key=lambda i: (self._used(i), -i))
        return self.served(picked, data, namespace)._replace(pinned=False)

    def _own_slot(self, data: bytes, namespace: str) -> SlotChoice:
        """Without a host cache: the slot where the prompt reuses the most among those whose
        tokens survive it (empty, or continued by the prompt); ties: an empty slot, then the
        least recently used. So a session keeps its slot while others are free."""
        choices = [self.served(i, data, namespace) for i in range(len(self.slots))]
        kept = [c for c in choices if self._survives(c, data)] or choices
        return max(kept, key=lambda c: (c.length, self.slots[c.slot] is None,
                                        -self._used(c.slot)))

    def _survives(self, choice: SlotChoice, data: bytes) -> bool:
        """True when running `data` on the slot loses nothing the slot holds."""
        slot = self.slots[choice.slot]
        if slot is None:
            return True
        return common_prefix_tokens(slot.data, data) >= self.CONTINUES * _tokens(slot.data)

    def _used(self, i: int) -> float:
        slot = self.slots[i]
        return -1.0 if slot is None else slot.used

    def match_length(self, prompt: Prompt | Any, namespace: str) -> int:
        return self.choose(as_prompt(prompt), namespace).length

    def predict(self, prompt: Prompt | Any, namespace: str) -> int:
        length = self.match_length(prompt, namespace)
        return length if length >= self.config.min_cached_tokens else 0

    def upstream_fields(self, prompt: Prompt, namespace: str) -> dict[str, Any]:
        """Without a host cache, pin the request to its slot and ask the server to reuse the
        slot's prefix; the slot is taken now (the server queues a request for a busy slot)."""
        choice = self.start(prompt, namespace)
        return {"id_slot": choice.slot, "cache_prompt": True} if choice.pinned else {}

    def start(self, prompt: Prompt, namespace: str) -> SlotChoice:
        """Run the request on the slot it takes (busy until `finished`); that choice."""
        choice = self.choose(prompt, namespace)
        self._run(choice, self._held(prompt.tokens.data), namespace)
        self.busy[choice.slot] += 1
        self._running[id(prompt)] = choice.slot
        return choice

    def finished(self, prompt: Prompt, namespace: str) -> None:
        """The request's slot is idle again (once no other request runs on it)."""
        slot = self._running.pop(id(prompt), None)
        if slot is not None and slot < len(self.busy):
            self.busy[slot] = max(self.busy[slot] - 1, 0)

    def _run(self, choice: SlotChoice, data: bytes, namespace: str) -> None:
        """What the server does to its slots and host cache for a request on `choice`."""
        old = self.slots[choice.slot]
        if self.host is not None and choice.swaps:
            loaded = self.host.entries[choice.loads] if choice.loads >= 0 else None
            if old is not None:
                self.host.save(old)
            if loaded is not None and loaded in self.host.entries:
                self.host.entries.remove(loaded)
        self.slots[choice.slot] = Slot(namespace, data, self._clock())
        if self.host is not None:  # the server saves the idle slots as the request starts
            for i, slot in enumerate(self.slots):  # (and with one KV buffer, clears them)
                if i != choice.slot and slot is not None and not self.busy[i]:
                    self.host.save(slot)
                    if self.clears_idle:
                        self.slots[i] = None

    def _held(self, data: bytes) -> bytes:
        """What a slot keeps of a prompt: at most its share of the slots' half of `max_bytes`
        (a prefix, whole tokens), so slots and host cache together stay within the budget."""
        share = self._budget // len(self.slots) // TOKEN_BYTES * TOKEN_BYTES
        return data if len(data) <= share else data[:share]

    def record(self, prompt: Prompt | Any, namespace: str) -> None:
        """Store the prompt in its slot (already done when `upstream_fields` pinned it)."""
        prompt = as_prompt(prompt)
        data = self._held(prompt.tokens.data)
        if any(s is not None and s.data == data and s.namespace == namespace
               for s in self.slots):
            return
        self._run(self.choose(prompt, namespace), data, namespace)

    def learn(self, prompt: Prompt | Any, namespace: str, predicted: int, reported: int) -> None:
        """A slot is rewritten by every request, so there is nothing to trim: count misses."""
        if predicted - reported > max(16, 0.02 * len(as_prompt(prompt))):
            self.misses += 1

    @property
    def pages(self) -> int:
        """Occupied slots (the router's tie-break prefers emptier replicas)."""
        return sum(slot is not None for slot in self.slots)


class SlotShadow:
    """A llama.cpp server's slots and its host prompt cache (see the module docstring).

    Whether the server clears its idle slots as a request starts (one KV buffer for all slots,
    its default when it picks the slot count) or keeps them (`--parallel N`) changes which slot
    it picks and what it reuses there once requests overlap, and nothing it serves says which.
    So with a host cache two models follow every request, one for each, and predictions come
    from the one whose guesses have been closer to what the server reported (a moving average
    of the error in shares of the prompt; at first the one that clears). Without a host cache
    slots are never cleared: one model, pinning each conversation to a slot of its own."""

    steers = True  # requests change the slots in the order they start (and `id_slot`)
    #: weight of the newest request in each model's moving error
    ERROR_EWMA = 0.2

    def __init__(self, config: ShadowConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, *, similarity: float = 0.1,
                 host_cache: bool = True) -> None:
        self.config = config or ShadowConfig(page_size=1, slots=1)
        half = dataclasses.replace(self.config, max_bytes=self.config.max_bytes // 2)
        self.models = ((SlotModel(half, clock, similarity=similarity, clears_idle=True),
                        SlotModel(half, clock, similarity=similarity, clears_idle=False))
                       if host_cache else
                       (SlotModel(self.config, clock, similarity=similarity, host_cache=False),))
        self.errors = [0.0] * len(self.models)
        self.active = 0  # the model that predicts
        self._guesses: dict[int, tuple[int, ...]] = {}
        self._freed = asyncio.Event()
        self.sized = False  # the slot count came from the server (`resize`)

    async def slot_free(self) -> None:
        """Wait until a slot is idle. The server would queue a request sent while every slot
        is busy and pick its slot once one frees; waiting here instead, the request is sent
        when the slot it takes is known. Only once the server said how many slots it has (a
        guessed count must never hold requests back)."""
        model = self.model
        while self.sized and all(model.busy):
            self._freed.clear()
            await self._freed.wait()

    @property
    def model(self) -> SlotModel:
        return self.models[self.active]

    def resize(self, slots: int) -> None:
        """Take the slot count the server reports (`/props` total_slots)."""
        self.sized = self.sized or slots > 0
        for model in self.models:
            model.resize(slots)

    def match_length(self, prompt: Prompt | Any, namespace: str) -> int:
        return self.model.match_length(prompt, namespace)

    def predict(self, prompt: Prompt | Any, namespace: str) -> int:
        return self.model.predict(prompt, namespace)

    def upstream_fields(self, prompt: Prompt, namespace: str) -> dict[str, Any]:
        """Every model takes the request (its guess kept for `learn`); the fields are the
        predicting model's."""
        choices = [m.start(prompt, namespace) for m in self.models]
        self._guesses[id(prompt)] = tuple(c.length for c in choices)
        choice = choices[self.active]
        return {"id_slot": choice.slot, "cache_prompt": True} if choice.pinned else {}

    def finished(self, prompt: Prompt, namespace: str) -> None:
        self._guesses.pop(id(prompt), None)
        for model in self.models:
            model.finished(prompt, namespace)
        self._freed.set()

    def record(self, prompt: Prompt | Any, namespace: str) -> None:
        for model in self.models:
            model.record(prompt, namespace)

    def learn(self, prompt: Prompt | Any, namespace: str, predicted: int, reported: int) -> None:
        """Score each model's guess against the report; the closer one predicts from then
        on (on a tie the predicting one stays)."""
        guesses = self._guesses.pop(id(prompt), None)
        for model in self.models:
            model.learn(prompt, namespace, predicted, reported)
        if guesses is None:
            return
        n = max(len(as_prompt(prompt)), 1)
        for k, guess in enumerate(guesses):
            self.errors[k] += self.ERROR_EWMA * (abs(guess - reported) / n - self.errors[k])
        best = min(range(len(self.models)), key=lambda k: self.errors[k])
        if self.errors[best] < self.errors[self.active]:
            self.active = best

    @property
    def pages(self) -> int:
        return self.model.pages
