"""The bridge between asyncio request handlers and the synchronous engine.

One background thread owns the engine(s) and calls `step()` whenever there is work; each step's reports are
handed to the event loop in one batch (`call_soon_threadsafe`) and fanned out to per-request asyncio queues.
Requests join and leave the running batch between steps (continuous batching in the engine).

- Admission: requests that have been accepted but have not yet produced a token count as *waiting*; when
  `max_waiting` of them exist, new requests are refused with 503 and a `Retry-After` estimate. A request with more
  prompts (times n) than `max_waiting` could never be taken: it gets 400.
- Intake: handlers tokenise with the engine's `make_request` off the event loop, then `submit` here, on it.
- First tokens: each step hands over the reports of requests that prefill just started before it decodes, so a
  first token reaches its client one decode step sooner.
- Abort: a handler whose client went away calls `abort`; the engine frees the slot at its next step.
- Drain: `drain(deadline)` refuses new work (503), waits for in-flight requests up to the deadline, then aborts
  what is left (their streams end with finish_reason "abort"), waits for those reports, and stops the thread.
- Optional *baseline* engine: the same target weights with no drafter, for requests that ask for
  `"speculation": false` (the playground's side-by-side mode). It has its own small KV cache and is stepped by
  the same thread, alternating with the main engine, so the two never run forward passes at the same time.
- Full garbage collections: `peagle serve` hands them to this thread, between steps (idle_gc.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator

from peagle.engine import LLMEngine, RequestOutput
from peagle.engine.request import Request
from peagle.serve.idle_gc import IdleCollector
from peagle.serve.metrics import Metrics
from peagle.serve.protocol import APIError

log = logging.getLogger("peagle.serve")


class EngineFailure(RuntimeError):
    """The engine raised while stepping; requests in flight on it are failed and aborted."""


class RequestStream:
    """The reports of one request, as an async iterator. Reports that pile up between reads are merged (their
    deltas concatenated), so a slow reader gets fewer, larger chunks instead of falling behind."""

    def __init__(self, request_id: str, engine: LLMEngine, owner: "AsyncEngine"):
        self.request_id, self.engine, self.owner = request_id, engine, owner
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.started = False  # has produced its first report (left the waiting queue)
        self.finished = False
        self.last: RequestOutput | None = None

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        while not self.queue.empty() and isinstance(item, RequestOutput) and not item.finished:
            nxt = self.queue.get_nowait()
            if isinstance(nxt, BaseException):
                item = nxt
                break
            item = dataclasses.replace(nxt, delta_text=item.delta_text + nxt.delta_text,
                                       delta_token_ids=item.delta_token_ids + nxt.delta_token_ids,
                                       delta_logprobs=None if nxt.delta_logprobs is None
                                       else item.delta_logprobs + nxt.delta_logprobs)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
        return item

    async def final(self) -> RequestOutput:
        """Run to the end; the last report (its `text` is the whole output)."""
        async for _ in self:
            pass
        return self.last

    def abort(self) -> None:
        if not self.finished:
            self.owner.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, baseline: LLMEngine | None = None, max_waiting: int = 256,
                 metrics: Metrics | None = None, idle_wait: float = 0.05):
        self.engine, self.baseline = engine, baseline
        self.engines = [e for e in (engine, baseline) if e is not None]
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.idle_wait = idle_wait
        self.draining = False
        self._streams: dict[str, RequestStream] = {}
        self._waiting = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recent_latency = 1.0  # seconds, a running mean of request latency for Retry-After
        self.error: BaseException | None = None
        self.collector: IdleCollector | None = None  # set by `peagle serve`: full collections between steps

    # -- lifecycle --------------------------------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine thread reports to (set by `start`)."""
        return self._loop

    @property
    def started(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread, bound to the running event loop."""
        if self.started:
            return
        self._loop = asyncio.get_running_loop()
        self._stop.clear()
        self.draining = False
        self._thread = threading.Thread(target=self._run, name="peagle-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._thread = None

    async def drain(self, deadline: float = 30.0) -> None:
        """Refuse new work, let requests in flight finish for up to `deadline` seconds, abort the rest, stop."""
        self.draining = True
        if not self.started:
            return
        end = time.monotonic() + deadline
        while self._streams and time.monotonic() < end:
            await asyncio.sleep(0.05)
        left = list(self._streams)
        for rid in left:
            self.abort(rid)
        if left:
            log.warning("drain deadline passed: aborted %d request(s) still running", len(left))
            end = time.monotonic() + 5
            while self._streams and time.monotonic() < end:
                await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    # -- state ------------------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines)

    @property
    def num_waiting(self) -> int:
        return self._waiting

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def healthy(self) -> bool:
        return self.started and not self._stop.is_set()

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the waiting queue drained at the recent request rate."""
        slots = sum(e.max_num_seqs for e in self.engines)
        return max(1, min(60, math.ceil(self._recent_latency * (self._waiting + 1) / max(1, slots))))

    # -- requests ---------------------------------------------------------------------------------------------
    def engine_for(self, speculation: bool) -> LLMEngine:
        """The engine a request runs on: the main one, or the baseline for "speculation": false."""
        if speculation or self.engine.spec is None:
            return self.engine
        if self.baseline is None:
            raise APIError("speculation: false needs the baseline engine, which this server was started without "
                           "(--no-baseline)", 400, param="speculation")
        return self.baseline

    def check_room(self, count: int, param: str) -> None:
        """Raise APIError unless `count` more requests could be taken now (safe from any thread: a hint; `submit`
        decides). `param` names the field that sets the count."""
        if self.draining or not self.healthy:
            self._reject("draining")
            raise APIError("the server is shutting down and takes no new requests", 503, type="service_unavailable",
                           code="server_shutting_down", headers={"Retry-After": "5"})
        if count > self.max_waiting:
            raise APIError(f"{param}: this request asks for {count} completions (prompts times n), more than this "
                           f"server ever queues at once ({self.max_waiting}, --max-waiting); split it into smaller "
                           "requests", 400, param=param)
        if self._waiting + count > self.max_waiting:
            self._reject("queue_full")
            raise APIError(f"the server is at capacity ({self._waiting} requests waiting, limit {self.max_waiting}); "
                           "retry later", 503, type="service_unavailable", code="queue_full",
                           headers={"Retry-After": str(self.retry_after())})

    def submit(self, engine: LLMEngine, requests: list[Request], param: str = "prompt") -> list[RequestStream]:
        """Queue requests from `engine.make_request`, all or none (on the event loop thread)."""
        self.check_room(len(requests), param)
        streams = []
        for req in requests:
            # Registered before the engine can see it; reports are delivered on this (the event loop's) thread.
            stream = RequestStream(req.request_id, engine, self)
            self._streams[req.request_id] = stream
            self._waiting += 1
            streams.append(stream)
            engine.submit(req)
        self._wake.set()
        return streams

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.engine.abort(request_id)
            self._wake.set()

    def _reject(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.reject(reason)

    # -- the engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            busy = False
            for engine in self.engines:
                if not engine.has_work():
                    continue
                busy = True
                try:
                    outputs = engine.step(on_first_tokens=self._hand_over)
                except Exception as e:  # noqa: BLE001 - an engine bug must not kill the server
                    log.exception("engine step failed")
                    self.error = e
                    self._post(self._fail_engine, engine, e)
                    continue
                self._hand_over(outputs)
                if self.metrics is not None:
                    self.metrics.record_step(engine.step_budget, main=engine is self.engine)
                if self.metrics is not None and engine is self.engine:
                    self.metrics.record_kv_cache(engine)
                if self.metrics is not None and engine.spec is not None:
                    self.metrics.record_spec(engine.stats, engine.proposer_stats)
                if self.metrics is not None and engine.prefix_cache is not None:
                    self.metrics.record_prefix_cache(engine.prefix_cache)
            if self.collector is not None:
                self.collector.tick(idle=not busy)
            if not busy:
                self._wake.wait(self.idle_wait)
                self._wake.clear()

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """Record and deliver a batch of reports (from the engine thread, during or after a step)."""
        if self.metrics is not None:
            for out in outputs:
                self.metrics.record_output(out)
        if outputs:
            self._post(self._deliver, outputs)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    # -- on the event loop ------------------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if not stream.started:
                stream.started = True
                self._waiting -= 1
            stream.queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]
                self._recent_latency = 0.8 * self._recent_latency + 0.2 * out.elapsed

    def _fail_engine(self, engine: LLMEngine, error: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            if stream.engine is engine:
                if not stream.started:
                    self._waiting -= 1
                engine.abort(rid)
                del self._streams[rid]
                stream.queue.put_nowait(EngineFailure(f"the engine failed while running this request: {error}"))
        self._wake.set()
