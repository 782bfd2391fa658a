"""`Scheduler`: continuous batching with chunked prefill, eviction, then preemption.

Each `schedule()` builds one step under a token budget (`max_num_batched_tokens`):
1. running sequences, oldest first: a decoding sequence gets 1 token, one still prefilling gets
   a chunk (leaving one token of budget for every decoding sequence after it);
   when pages run out, unlocked cache pages are evicted first; only then is the newest running
   sequence preempted (its pages released, its tokens recomputed later); with speculative
   decoding a decoding sequence may also get draft tokens (engine.speculative) when budget
   and free pages allow (a draft never evicts or preempts anything);
2. waiting sequences, in arrival order (preempted ones first), while budget, `max_num_seqs`
   and pages allow: each first reuses its cached prefix, then gets a prefill chunk.
Decode and prefill tokens go into one step; requests join and leave at every step.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import Speculator


class ScheduledSeq(NamedTuple):
    """One sequence of a step and how many of its uncomputed tokens the step computes.

    draft: speculative tokens run after the uncomputed ones (their KV is written, and kept only
    for the tokens verification accepts); the step computes num_new_tokens + len(draft) tokens.
    """

    seq: Sequence
    num_new_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def num_step_tokens(self) -> int:
        return self.num_new_tokens + len(self.draft)


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_step_tokens for s in self.scheduled)


class Scheduler:
    """Decides which sequences run in the next step and with how many tokens."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.speculator = Speculator.from_config(config)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence (the caller releases its pages)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        return SchedulerOutput(scheduled, preempted)

    # ------------------------------------------------------------------ running
    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledSeq], preempted: list[Sequence]
    ) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            later_decodes = sum(1 for s in self.running[i + 1 :] if s.num_uncomputed_tokens == 1)
            n = min(seq.num_uncomputed_tokens, max(budget - later_decodes, 1))
            draft = self._draft(seq, budget - later_decodes - n, len(self.running) - i - 1)
            if not self._allocate_or_preempt(seq, n, preempted):
                break  # seq itself was preempted: it was the newest, nothing follows
            scheduled.append(ScheduledSeq(seq, n, draft))
            budget -= n + len(draft)
            i += 1
        return budget

    def _draft(self, seq: Sequence, room: int, later: int) -> tuple[int, ...]:
        """Draft tokens for a decoding `seq` when speculation is on and their pages come from
        the free list, leaving one free page for each of the `later` running sequences."""
        if self.speculator is None or room <= 0:
            return ()
        draft = self.speculator.draft(seq, room)
        if not draft:
            return ()
        bm = self.block_manager
        total = seq.num_computed_tokens + 1 + len(draft)
        if bm.pages_for(total) - len(seq.pages) > bm.num_free_pages - later:
            return ()
        return draft if bm.allocate(seq, total, evict=False) else ()

    def _allocate_or_preempt(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        bm = self.block_manager
        while not bm.allocate(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ waiting
    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            bm.match(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.allocate(seq, seq.num_computed_tokens + n):
                bm.release(seq, keep_computed=False)
                break
            bm.count_admission(seq)
            if seq.num_preemptions == 0:  # a recompute reusing its own pages is no cache hit
                seq.cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
