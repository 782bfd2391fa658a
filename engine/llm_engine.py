"""`Engine`: the synchronous engine. `step()` = schedule, run, sample, collect.

Not thread-safe: one thread drives it (`AsyncEngine` runs it in its own background thread).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, cast

import torch

from engine.block_manager import BlockManager
from engine.config import DEFAULT_MEMORY_BUDGET, EngineConfig
from engine.errors import InvalidRequest
from engine.grammar import GrammarCompiler
from engine.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.outputs import EngineStats, RequestOutput, StreamDelta
from engine.plan import pages_for_budget, shape_from_config
from engine.rate_meter import RateMeter
from engine.requests import Prompt, RequestLimits, SequenceFactory
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import Verdict, verify_draft

log = logging.getLogger(__name__)


class Engine:
    """Paged-KV, continuously batching engine with radix prefix caching.

    `Engine(EngineConfig())` loads the default model (SmolLM2-135M-Instruct from the wheel);
    pass `model=` to share an already loaded `LoadedModel` (then `config.model`,
    `config.dtype` and `config.quantization` are not applied: the model is used as it is, and
    torch's thread count is left alone unless `config.num_threads` is set). An engine that
    loads its own model sets torch's intra-op threads to `config.threads` (every core).
    """

    def __init__(self, config: EngineConfig | None = None, *, model: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if model is None or config.num_threads is not None:
            torch.set_num_threads(config.threads)  # every core unless told otherwise
        if model is None:
            model = load_model(config.model, config.torch_dtype, quantization=config.quantization)
        self.loaded = model
        self.loaded.model.to(config.device)
        self.tokenizer = self.loaded.tokenizer
        self.num_pages = config.num_pages or self._pages_from_budget()
        model_len = self.loaded.config.max_position
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.max_seq_len = min(self.max_model_len, self.num_pages * config.page_size)
        self.block_manager = BlockManager(
            self.num_pages, config.page_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(
            self.loaded, self.num_pages, config.page_size, config.device, config.kernel_backend,
            config.kv_torch_dtype,
        )
        native = self.runner.native_decoder
        self.sampler = Sampler(argmax=native.argmax if native is not None else None)
        self.grammar = GrammarCompiler(self.tokenizer, sorted(self.tokenizer.special_token_ids))
        self.requests = SequenceFactory(RequestLimits(
            vocab_size=self.loaded.config.vocab_size, max_seq_len=self.max_seq_len,
            max_model_len=self.max_model_len, pool_tokens=self.num_pages * config.page_size,
            device=config.device, seed=config.seed), self.tokenizer, self.grammar)
        self._seqs: dict[str, Sequence] = {}
        self.prefill_rate = RateMeter()
        self.prefill_tokens_computed = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_steps = 0
        # called once per request when it is first scheduled, before the step runs the model
        # (an update with no tokens and the request's cached_tokens): the async front uses it
        # to let a response head go out before the first token
        self.on_admit: Callable[[StreamDelta], None] | None = None
        self._admitted: set[str] = set()

    def _pages_from_budget(self) -> int:
        c = self.config
        weights = self.loaded.weight_bytes  # quantised projections at their packed size
        dtype_bytes = self.loaded.model.embed.element_size()
        return pages_for_budget(
            c.memory_budget_bytes or DEFAULT_MEMORY_BUDGET, shape_from_config(self.loaded.config),
            weights, dtype_bytes, c.page_size, c.max_num_batched_tokens, c.max_num_seqs,
            c.kv_torch_dtype.itemsize,
        )  # fmt: skip

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        namespace: str = "",
        request_id: str | None = None,
    ) -> str:
        """Queue one request; returns its id. `prompt` is text or token ids.

        namespace: the tenant's prefix-cache namespace; requests share cached KV only within
        one namespace. Raises ValueError for an empty prompt, a bad token id, or a prompt that
        can never fit (>= max_model_len or the whole page pool), or a grammar
        (json_schema / regex / grammar) that cannot be compiled (GrammarError, a ValueError).
        """
        seq = self.make_sequence(prompt, params, namespace, request_id)
        self.enqueue(seq)
        return seq.request_id

    def make_sequence(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        namespace: str = "",
        request_id: str | None = None,
    ) -> Sequence:
        """Validate a request and build its `Sequence` without queueing it (no engine state
        changes, so another thread may call it)."""
        return self.requests.build(prompt, params, namespace, request_id)

    def enqueue(self, seq: Sequence) -> None:
        """Queue a sequence built by `make_sequence`."""
        if seq.request_id in self._seqs:
            raise InvalidRequest(f"request id {seq.request_id!r} is already running",
                                 field="request_id")
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages; its computed full pages stay in the cache.
        Returns its output (finish_reason "abort"), or None if it is unknown or finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        return seq.to_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[StreamDelta]:
        """Run one scheduling step; returns a delta for every request that got tokens
        (or finished, with its `RequestOutput`). With speculative decoding a request may get
        several tokens in one step."""
        out = self.scheduler.schedule()
        if self.on_admit is not None:
            self._announce(out.scheduled)
        if not out.scheduled:
            if self.scheduler.has_unfinished() and not out.preempted:
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        start = time.perf_counter()
        try:
            inputs = self.runner.prepare(out.scheduled)
            sampled = [out.scheduled[i] for i in inputs.sampling]
            masks = self.grammar.start_masks([s.seq.grammar for s in sampled])  # overlaps forward
            logits = self.runner.run(inputs)
            bitmask = masks.result() if masks is not None else None
            verdicts = (
                self._sample(logits, sampled, inputs.num_logits, bitmask) if sampled else []
            )
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the engine
            log.exception("engine step failed")
            return self._fail(out.scheduled, exc)
        now = time.perf_counter()
        self._account(out.scheduled, now - start)
        return self._postprocess(sampled, verdicts, now)

    def _announce(self, batch: list[ScheduledSeq]) -> None:
        """Tell `on_admit` about requests scheduled for the first time (cached tokens known)."""
        assert self.on_admit is not None
        for seq, _, _ in batch:
            if seq.request_id not in self._admitted:
                self._admitted.add(seq.request_id)
                self.on_admit(self.delta(seq, [], "", None))

    def _row(self, seq: Sequence) -> SamplingRow:
        return SamplingRow(seq.params, seq.output_token_ids, seq.generator)

    def _sample(
        self,
        logits: torch.Tensor,
        sampled: list[ScheduledSeq],
        num_logits: list[int],
        bitmask: torch.Tensor | None,
    ) -> list[Verdict]:
        """One verdict per sampling sequence: a plain draw (one row, masked by its grammar), or
        a verified draft (1 + len(draft) rows; constrained sequences never draft)."""
        plain = [i for i, s in enumerate(sampled) if not s.draft]
        verdicts: dict[int, Verdict] = {}
        if plain:
            starts = list(itertools.accumulate(num_logits, initial=0))
            rows = logits if len(plain) == len(sampled) else logits[[starts[i] for i in plain]]
            masks = None if bitmask is None else bitmask[plain]
            tokens = self.sampler(rows, [self._row(sampled[i].seq) for i in plain], masks)
            verdicts.update((i, Verdict([t], 0, 0)) for i, t in zip(plain, tokens, strict=True))
        if len(plain) < len(sampled):
            chunks = torch.split(logits, num_logits)
            for i, s in enumerate(sampled):
                if s.draft:
                    verdicts[i] = verify_draft(self.sampler, s.seq, s.draft, chunks[i])
        return [verdicts[i] for i in range(len(sampled))]

    def _account(self, batch: list[ScheduledSeq], seconds: float) -> None:
        prefill = 0
        for seq, n, _ in batch:
            is_decode = n == 1 and seq.num_output_tokens > 0 and seq.num_uncomputed_tokens == 1
            if not is_decode:
                prefill += n
                seq.prefill_time += seconds
            seq.num_computed_tokens += n
            self.block_manager.cache_computed(seq)
        total = sum(s.num_step_tokens for s in batch)
        self.prefill_tokens_computed += prefill
        if prefill >= 8 and 2 * prefill >= total:
            self.prefill_rate.update(total, seconds)

    def _postprocess(
        self, sampled: list[ScheduledSeq], verdicts: list[Verdict], now: float
    ) -> list[StreamDelta]:
        updates = []
        for scheduled, verdict in zip(sampled, verdicts, strict=True):
            seq = scheduled.seq
            tokens = self._commit(seq, verdict, now)
            output = seq.to_output() if seq.is_finished else None
            text = seq.detokenizer.delta(final=seq.is_finished)
            updates.append(self.delta(seq, tokens, text, output))
        return updates

    def _commit(self, seq: Sequence, verdict: Verdict, now: float) -> list[int]:
        """Append one step's verified tokens to `seq` in order, up to the first stop.

        The one place generated tokens enter a sequence. Draft tokens arrive here only once
        verified (rejected ones never do), so per-sequence state that must follow the output
        exactly (stop strings, the detokenizer, a grammar matcher) advances here.
        """
        committed: list[int] = []
        reason: Any = None
        for token in verdict.tokens:
            seq.append_token(token, now)
            committed.append(token)
            reason = self._grammar_reason(seq, token) or seq.stop_reason()
            if reason is not None:
                break
        if verdict.num_drafted:
            self._settle_draft(seq, verdict, len(committed))
        if reason is not None:
            self._finish(seq, reason)
        return committed

    def _settle_draft(self, seq: Sequence, verdict: Verdict, num_committed: int) -> None:
        """After verification the accepted draft tokens' KV counts as computed; the pages only
        rejected tokens reached go back to the pool; full pages go to the prefix cache."""
        accepted = min(verdict.num_accepted, num_committed)
        seq.num_computed_tokens += accepted
        assert seq.spec is not None, "a draft without a SpecState"
        seq.spec.record(verdict.num_drafted, accepted)
        self.spec_draft_tokens += verdict.num_drafted
        self.spec_accepted_tokens += accepted
        self.spec_steps += 1
        self.block_manager.rollback(seq)
        self.block_manager.cache_computed(seq)

    @staticmethod
    def _grammar_reason(seq: Sequence, token: int) -> Any:
        """Advance a constrained sequence's matcher by its committed token; "error" if the
        grammar rejects it (the mask makes that impossible unless the matcher failed: a grammar
        past its limits, e.g. an `anyOf` of thousands of objects, which is the request's)."""
        if seq.grammar is None or seq.grammar.accept(token):
            return None
        seq.error = f"the output grammar could not be followed: {seq.grammar.error}"
        seq.error_field = "grammar"
        return "error"

    def delta(
        self, seq: Sequence, token_ids: list[int], text: str, output: RequestOutput | None
    ) -> StreamDelta:
        """The `StreamDelta` of `seq` for this step (finished when `output` is set)."""
        return StreamDelta(
            request_id=seq.request_id, text=text, token_ids=token_ids,
            finished=output is not None, output=output, cached_tokens=seq.cached_tokens,
            prefill_saved_ms=self.prefill_saved_ms(seq.cached_tokens),
        )

    def prefill_saved_ms(self, cached_tokens: int) -> float:
        """Prefill time that `cached_tokens` reused tokens saved: cached_tokens divided by the
        measured prefill throughput, in ms (0.0 before any prefill was measured)."""
        rate = self.prefill_rate.value
        return cached_tokens / rate * 1000.0 if rate and cached_tokens else 0.0

    def _finish(self, seq: Sequence, reason: Any, *, keep_computed: bool = True) -> None:
        seq.finish_reason = reason
        seq.detokenizer.flush()
        self.scheduler.remove(seq)
        self.block_manager.release(seq, keep_computed=keep_computed)
        seq.status = SequenceStatus.FINISHED
        del self._seqs[seq.request_id]
        self._admitted.discard(seq.request_id)

    def _fail(self, batch: list[ScheduledSeq], exc: Exception) -> list[StreamDelta]:
        updates = []
        for seq, _, _ in batch:
            seq.error = f"{type(exc).__name__}: {exc}"
            self._finish(seq, "error", keep_computed=False)
            text = seq.detokenizer.delta(final=True)
            updates.append(self.delta(seq, [], text, seq.to_output()))
        return updates

    # ------------------------------------------------------------------ batch API
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        namespace: str = "",
    ) -> list[RequestOutput]:
        """Run prompts (text or token-id lists) to completion with continuous batching;
        outputs in prompt order. `params` is one SamplingParams for all or one per prompt;
        namespace is the tenant's prefix-cache namespace (cached_tokens counts reuse within it).
        Requests queued earlier with `add_request` advance too, but their updates are not
        returned here. Raises RuntimeError if a step fails."""
        batch = self._as_prompt_list(prompts)
        per: list[SamplingParams | None] = (
            [params] * len(batch) if params is None or isinstance(params, SamplingParams)
            else list(params)
        )
        if len(per) != len(batch):
            raise ValueError(f"{len(per)} SamplingParams for {len(batch)} prompts")
        seqs = [self.make_sequence(p, sp, namespace) for p, sp in zip(batch, per, strict=True)]
        for seq in seqs:
            self.enqueue(seq)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(seqs) and self.has_unfinished():
            for update in self.step():
                if update.output is not None:
                    results[update.request_id] = update.output
        errors = [o.error for o in results.values() if o.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}")
        return [results[s.request_id] for s in seqs]

    @staticmethod
    def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        items = list(prompts)
        if items and all(isinstance(t, int) for t in items):
            return [cast(list[int], items)]  # one prompt of token ids
        return cast(list[Prompt], items)

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        namespace: str = "",
    ) -> RequestOutput:
        """One conversation (OpenAI-style messages, optional tools) through the chat template."""
        ids = self.tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True)
        return self.generate([ids], params, namespace)[0]

    # ------------------------------------------------------------------ introspection
    @property
    def prefill_tokens_per_second(self) -> float | None:
        """Measured prefill throughput (EWMA over prefill-dominated steps); None before any.
        Prefill time saved by the cache ~= cached_tokens / this rate."""
        return self.prefill_rate.value

    def stats(self) -> EngineStats:
        bm = self.block_manager
        counters = bm.counters
        return EngineStats(
            page_size=self.config.page_size,
            pages_total=self.num_pages,
            pages_used=self.num_pages - bm.num_free_pages - bm.num_cached_pages,
            pages_free=bm.num_free_pages,
            pages_cached=bm.num_cached_pages,
            prefix_cache_queries=counters.queries,
            prefix_cache_query_tokens=counters.query_tokens,
            prefix_cache_hit_tokens=counters.hit_tokens,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.num_preemptions,
            prefill_tokens_computed=self.prefill_tokens_computed,
            prefill_tokens_per_second=self.prefill_rate.value,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_steps=self.spec_steps,
        )

    def check(self) -> None:
        """Raise AssertionError unless every KV page is free, cached, or held by a live request."""
        self.block_manager.check(self.scheduler.running)
        for seq in self.scheduler.waiting:
            assert not seq.pages, f"waiting request {seq.request_id} holds pages"
