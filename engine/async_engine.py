"""`AsyncEngine`: the engine's step loop in one background thread, streamed to asyncio.

Threading contract: only the background thread touches the `Engine`. Callers talk to it through
a thread-safe command queue (add, abort, shutdown); it answers each stream through that
stream's own asyncio.Queue with `loop.call_soon_threadsafe`. Validation (`make_sequence`)
runs in the caller, so bad input raises `InvalidRequest` (a ValueError) right at `stream()`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineUnavailable, InvalidRequest, RequestError
from engine.llm_engine import Engine
from engine.loader import LoadedModel
from engine.outputs import EngineStats, RequestOutput, StreamDelta
from engine.requests import Prompt
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence as EngineSequence
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamDelta | BaseException]


@dataclass(frozen=True, slots=True)
class _Add:
    seq: EngineSequence
    stream: _Stream


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str
    done: asyncio.Future[bool] | None = None


@dataclass(frozen=True, slots=True)
class _Shutdown:
    pass


_Command = _Add | _Abort | _Shutdown


class AsyncEngine:
    """Asyncio front of an `Engine`: many concurrent streams, one step loop thread.

    `AsyncEngine(EngineConfig())` builds its own Engine (loading the model);
    `AsyncEngine(engine=eng)` wraps an existing one (which then belongs to the thread).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        engine: Engine | None = None,
        model: LoadedModel | None = None,
    ) -> None:
        self.engine = engine or Engine(config, model=model)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched only by the loop thread
        self._stats = self.engine.stats()
        self.engine.on_admit = self._deliver  # a request's first delta: scheduled, cached known
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="prefixgate-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def prefill_tokens_per_second(self) -> float | None:
        """Measured prefill throughput (EWMA); every delta carries the `prefill_saved_ms`
        this implies for its cached tokens."""
        return self.engine.prefill_tokens_per_second

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        namespace: str = "",
        request_id: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Stream one request: deltas of UTF-8-complete text and their token ids; the last
        delta has finished=True and carries the `RequestOutput` (usage, ttft, tpot).

        prompt: token ids (or text). namespace: the tenant's prefix-cache namespace.
        Cancelling the consumer (or closing the generator early) aborts the request and frees
        its pages. Raises `InvalidRequest` (`RequestTooLong`) for bad input, `RequestError` if
        the engine fails it, `EngineUnavailable` once shut down or when the step loop fails.
        """
        if self._closed:
            raise EngineUnavailable("AsyncEngine is shut down")
        if params is not None and params.constraint is not None:
            # compiling a grammar takes up to seconds (a schema of thousands of properties);
            # llguidance releases the GIL, so the loop serves other requests meanwhile
            seq = await asyncio.to_thread(self.engine.make_sequence, prompt, params, namespace,
                                          request_id)
        else:
            seq = self.engine.make_sequence(prompt, params, namespace, request_id)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(_Add(seq, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                out = item.output
                if finished and out is not None and out.finish_reason == "error":
                    if out.error_field is not None:  # the request's own content caused it
                        raise InvalidRequest(out.error or "invalid request", field=out.error_field)
                    raise RequestError(out)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(seq.request_id))

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        namespace: str = "",
        request_id: str | None = None,
    ) -> RequestOutput:
        """Run one request to completion; its `RequestOutput`."""
        async for delta in self.stream(prompt, params, namespace, request_id):
            if delta.output is not None:
                return delta.output
        raise RuntimeError("stream ended without an output")

    async def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        namespace: str = "",
    ) -> RequestOutput:
        ids = self.engine.tokenizer.apply_chat_template(messages, tools)
        return await self.generate(ids, params, namespace)

    async def abort(self, request_id: str) -> bool:
        """Abort a request (its stream ends with finish_reason "abort"); False if unknown."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._commands.put(_Abort(request_id, done))
        return await done

    def stats(self) -> EngineStats:
        """The latest snapshot (refreshed by the loop thread after every step)."""
        return self._stats

    async def shutdown(self) -> None:
        """Abort every request (their streams end with "abort") and stop the loop thread."""
        if not self._closed:
            self._closed = True
            self._commands.put(_Shutdown())
        await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        while True:
            for command in self._next_commands():
                if isinstance(command, _Shutdown):
                    self._abort_all()
                    self._stats = self.engine.stats()
                    return
                self._handle(command)
            if self.engine.has_unfinished():
                self._step()
            self._stats = self.engine.stats()

    def _next_commands(self) -> list[_Command]:
        commands: list[_Command] = []
        if not self.engine.has_unfinished():
            commands.append(self._commands.get())  # idle: block until there is work
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.enqueue(command.seq)
            except ValueError as exc:
                self._send(command.stream, exc)
                return
            self._streams[command.seq.request_id] = command.stream
            return
        output = self.engine.abort(command.request_id)
        if output is not None:
            self._deliver(self._final_delta(output))
        if command.done is not None:
            future = command.done
            self._call(future.get_loop(), _resolve, future, output is not None)

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - keep serving; fail what was in flight
            log.exception("engine loop failed; aborting in-flight requests")
            for rid, stream in list(self._streams.items()):
                self._safe_abort(rid)
                failure = EngineUnavailable(f"engine step failed: {type(exc).__name__}: {exc}")
                failure.__cause__ = exc
                self._send(stream, failure)
            self._streams.clear()
            return
        self._stats = self.engine.stats()  # fresh before any consumer sees this step's tokens
        for update in updates:
            self._deliver(update)

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # noqa: BLE001
            log.exception("abort of %s failed", request_id)

    def _abort_all(self) -> None:
        for rid in list(self._streams):
            output = self.engine.abort(rid)
            if output is not None:
                self._deliver(self._final_delta(output))

    def _final_delta(self, output: RequestOutput) -> StreamDelta:
        """The last delta of a request stopped from outside a step (abort, shutdown)."""
        return StreamDelta(
            request_id=output.request_id, text="", token_ids=[], finished=True, output=output,
            cached_tokens=output.cached_tokens,
            prefill_saved_ms=self.engine.prefill_saved_ms(output.cached_tokens),
        )

    def _deliver(self, update: StreamDelta) -> None:
        stream = self._streams.get(update.request_id)
        if stream is None:
            return
        if update.finished:
            del self._streams[update.request_id]
        if not self._send(stream, update) and not update.finished:
            self._streams.pop(update.request_id, None)
            self._safe_abort(update.request_id)  # the consumer's loop is gone

    def _send(self, stream: _Stream, item: StreamDelta | BaseException) -> bool:
        return self._call(stream.loop, stream.queue.put_nowait, item)

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, func: Any, *args: Any) -> bool:
        try:
            loop.call_soon_threadsafe(func, *args)
        except RuntimeError:  # the consumer's event loop is closed
            return False
        return True


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


