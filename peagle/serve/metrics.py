"""Prometheus metrics with vLLM's names, so dashboards built for `vllm serve` work unchanged.

Counters are exposed with prometheus' `_total` suffix, as vLLM's are (`vllm:spec_decode_num_drafts_total`, ...).
Spec-decode counters advance by the engine's own engine-wide statistics, so they equal the sum of the
`speculative_decoding` stats of every response (aborted requests included, as in vLLM).

Each server gets its own registry (several apps can live in one process, as in the tests).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

from peagle.config import Speculation
from peagle.engine.prefix_cache import BLOCK_SIZE
from peagle.engine.stats import SpecDecodeStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# An engine step's time and its prefill tokens (the step budget at work: docs/engine.md, "Step time budget").
STEP_TIME_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                     10.0)
PREFILL_TOKEN_BUCKETS = (0, 16, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """One server's metrics; `speculation`, what the server runs, shows as the labels of `peagle:speculation_info`."""

    def __init__(self, model_name: str, num_speculative_tokens: int = 0, speculation: Speculation | None = None):
        disable_created_metrics()  # no `*_created` series (as vLLM)
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels,
                                  registry=r)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
                                        registry=r)
        self.num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                           labels, registry=r)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", labels + ["position"], registry=r)
        # Which drafter ran how often, and how well: the hybrid runs two (a head and the suffix tree).
        self.proposer_drafts = Counter("peagle:spec_decode_proposer_num_drafts",
                                       "Spec decoding drafts, by the proposer that made them.", labels + ["proposer"],
                                       registry=r)
        self.proposer_draft_tokens = Counter("peagle:spec_decode_proposer_num_draft_tokens",
                                             "Draft tokens verified, by proposer.", labels + ["proposer"], registry=r)
        self.proposer_accepted_tokens = Counter("peagle:spec_decode_proposer_num_accepted_tokens",
                                                "Accepted draft tokens, by proposer.", labels + ["proposer"],
                                                registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (per request, after the first).",
                              labels, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency.",
                             labels, buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in the model execution batch.",
                             labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                             registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r)
        # One observation per decode step per request: how many drafts the speculation policy had verified (0: a
        # plain step). Under the fixed policy every observation is num_speculative_tokens.
        self.k_chosen = Histogram("peagle:spec_decode_num_speculative_tokens",
                                  "Drafts verified per request per decode step, as the speculation policy chose.",
                                  labels, buckets=tuple(range(num_speculative_tokens + 1)), registry=r)
        # as vLLM counts them: prompt tokens looked up in the prefix cache, and those found there
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.", labels,
                                            registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r)
        # One observation per engine step: its seconds (of the engine's step clock: CPU time of the engine thread on
        # a CPU) and the prompt tokens it prefilled; the gauge is the time a step with decoding streams may cost.
        self.step_time = Histogram("peagle:engine_step_time_seconds", "Histogram of engine step time in seconds.",
                                   labels, buckets=STEP_TIME_BUCKETS, registry=r)
        self.prefill_tokens = Histogram("peagle:prefill_tokens_per_step",
                                        "Histogram of prompt tokens prefilled per engine step.", labels,
                                        buckets=PREFILL_TOKEN_BUCKETS, registry=r)
        self.step_time_target = Gauge("peagle:step_time_target_seconds",
                                      "Time an engine step in which streams decode may cost (the step budget).",
                                      labels, registry=r)
        # the main engine's paged KV cache: share of its blocks held (by requests or the prefix cache), and the
        # running requests that gave theirs back for others to grow (docs/memory.md, "KV cache memory")
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
                              registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   labels, registry=r)
        # what the resident memory under load is made of (docs/memory.md, "Under load"): the pool's blocks ever
        # handed out (their pages stay committed) and the blocks the prefix cache holds, up to --prefix-cache-gb
        self.kv_touched = Gauge("peagle:kv_cache_touched_blocks", "KV pool blocks ever handed out (resident).",
                                labels, registry=r)
        self.prefix_blocks = Gauge("peagle:prefix_cache_blocks", "KV pool blocks the prefix cache holds.", labels,
                                   registry=r)
        self.proposer_bytes = Gauge("peagle:proposer_cached_bytes", "Bytes the drafters keep across requests (the "
                                    "suffix trees of finished answers; an estimate, bounded).", labels, registry=r)
        self._seen_preemptions = 0
        self.rejected = Counter("peagle:requests_rejected", "Requests refused before reaching the engine.",
                                labels + ["reason"], registry=r)
        self._create_series(num_speculative_tokens)
        self._show(speculation)
        self._seen = SpecDecodeStats(num_speculative_tokens)
        self._seen_by_proposer: dict[str, SpecDecodeStats] = {}
        self._seen_prefix: dict[int, tuple[int, int]] = {}  # per prefix cache (the baseline engine has its own)
        self._last_token_at: dict[str, float] = {}

    def _show(self, speculation: Speculation | None) -> None:
        """`peagle:speculation_info`, a constant 1 whose labels say what runs (method, K, policy, head, origin)."""
        if speculation is None:
            return
        shown = {k: "" if v is None else str(v) for k, v in speculation.as_dict().items()}
        Info("peagle:speculation", "What speculation the server runs.", registry=self.registry).info(
            {"model_name": self.model_name, **shown})

    def _create_series(self, num_speculative_tokens: int) -> None:
        """Every labelled series up front, so that a scrape shows zeros rather than nothing."""
        m = self.model_name
        for c in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.prompt_tokens,
                  self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits, self.preemptions,
                  self.kv_usage):
            c.labels(model_name=m)
        for pos in range(num_speculative_tokens):
            self.accepted_per_pos.labels(model_name=m, position=str(pos))
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name=m, finished_reason=reason)

    def show_cache(self, engine) -> None:
        """`vllm:cache_config_info`: the main engine's KV pool, as vLLM labels it (block size in tokens, blocks),
        with the bytes of one block (the target's and the head's caches): with vllm:kv_cache_usage_perc, the KV
        cache's memory in use."""
        caches = [c for c in (engine.target_cache, engine.drafter_cache) if c is not None]
        Info("vllm:cache_config", "Information of the LLMEngine CacheConfig", registry=self.registry).info(
            {"block_size": str(BLOCK_SIZE), "num_gpu_blocks": str(caches[0].num_blocks - 1),
             "peagle_block_bytes": str(sum(c.bytes_per_block for c in caches)),
             # a cached block's bytes (its target features too) and the most the prefix cache holds
             **({"peagle_prefix_block_bytes": str(engine.prefix_cache.bytes_per_block),
                 "peagle_prefix_max_blocks": str(engine.prefix_cache.max_cached_blocks)}
                if engine.prefix_cache is not None else {})})

    # -- called from the engine thread after each step -------------------------------------------------------
    def record_spec(self, stats: SpecDecodeStats, by_proposer: dict[str, SpecDecodeStats] | None = None) -> None:
        """Advance the spec-decode counters to the engine's running totals (and those of each proposer)."""
        m = self.model_name
        for name, s in (by_proposer or {}).items():
            before = self._seen_by_proposer.get(name) or SpecDecodeStats()
            self.proposer_drafts.labels(model_name=m, proposer=name).inc(s.num_drafts - before.num_drafts)
            self.proposer_draft_tokens.labels(model_name=m, proposer=name).inc(
                s.num_draft_tokens - before.num_draft_tokens)
            self.proposer_accepted_tokens.labels(model_name=m, proposer=name).inc(
                s.num_accepted_tokens - before.num_accepted_tokens)
            self._seen_by_proposer[name] = s.copy()
        seen = self._seen
        self.num_drafts.labels(model_name=m).inc(stats.num_drafts - seen.num_drafts)
        self.num_draft_tokens.labels(model_name=m).inc(stats.num_draft_tokens - seen.num_draft_tokens)
        self.num_accepted_tokens.labels(model_name=m).inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        for pos, n in enumerate(stats.accepted_per_position):
            before = seen.accepted_per_position[pos] if pos < len(seen.accepted_per_position) else 0
            if n - before:
                self.accepted_per_pos.labels(model_name=m, position=str(pos)).inc(n - before)
        for k, n in enumerate(stats.steps_per_k):
            for _ in range(n - (seen.steps_per_k[k] if k < len(seen.steps_per_k) else 0)):
                self.k_chosen.labels(model_name=m).observe(k)
        self._seen = stats.copy()

    def record_prefix_cache(self, cache) -> None:
        """Advance the prefix-cache counters by what one engine's cache (engine.prefix_cache) has seen since."""
        m, (q0, h0) = self.model_name, self._seen_prefix.get(id(cache), (0, 0))
        self.prefix_cache_queries.labels(model_name=m).inc(cache.queries - q0)
        self.prefix_cache_hits.labels(model_name=m).inc(cache.hits - h0)
        self._seen_prefix[id(cache)] = (cache.queries, cache.hits)

    def record_step(self, budget, main: bool = True) -> None:
        """One engine step, from its step budget (engine.step_budget: the step's record and the current target, the
        gauge the main engine's only, not the baseline's)."""
        m = self.model_name
        self.step_time.labels(model_name=m).observe(budget.last.seconds)
        self.prefill_tokens.labels(model_name=m).observe(budget.last.prefill_tokens)
        if main:
            self.step_time_target.labels(model_name=m).set(budget.target_s)

    def record_kv_cache(self, engine) -> None:
        """The main engine's KV cache after a step: blocks in use, and preemptions since the last call."""
        m, cache = self.model_name, engine.target_cache
        self.kv_usage.labels(model_name=m).set(1 - cache.num_free_blocks / (cache.num_blocks - 1))
        self.kv_touched.labels(model_name=m).set(cache.num_touched_blocks)
        if engine.prefix_cache is not None:
            self.prefix_blocks.labels(model_name=m).set(engine.prefix_cache.num_cached_blocks)
        self.proposer_bytes.labels(model_name=m).set(engine.proposer.cached_bytes())
        self.preemptions.labels(model_name=m).inc(engine.num_preemptions - self._seen_preemptions)
        self._seen_preemptions = engine.num_preemptions

    def record_output(self, out) -> None:
        """One engine report (a RequestOutput) for one request."""
        m, rid, t = self.model_name, out.request_id, time.perf_counter()
        new = len(out.delta_token_ids)
        last = self._last_token_at.get(rid)
        if new:
            if last is None:
                if out.time_to_first_token is not None:
                    self.ttft.labels(model_name=m).observe(out.time_to_first_token)
                    self.prompt_tokens.labels(model_name=m).inc(out.num_prompt_tokens)
                # the first token's latency is TTFT; tokens that came with it in the same step share the time since
                count = new - 1
                per_token = ((out.elapsed - (out.time_to_first_token or 0.0)) / count) if count else None
            else:
                per_token, count = (t - last) / new, new
            if per_token is not None:
                for _ in range(count):
                    self.itl.labels(model_name=m).observe(per_token)
            self.generation_tokens.labels(model_name=m).inc(new)
            self._last_token_at[rid] = t
        if out.finished:
            self._last_token_at.pop(rid, None)
            self.success.labels(model_name=m, finished_reason=out.finish_reason or "stop").inc()
            self.e2e.labels(model_name=m).observe(out.elapsed)
            if out.num_output_tokens > 1 and out.time_to_first_token is not None:
                self.tpot.labels(model_name=m).observe(
                    (out.elapsed - out.time_to_first_token) / (out.num_output_tokens - 1))

    def reject(self, reason: str) -> None:
        self.rejected.labels(model_name=self.model_name, reason=reason).inc()

    def render(self, running: int, waiting: int) -> bytes:
        self.running.labels(model_name=self.model_name).set(running)
        self.waiting.labels(model_name=self.model_name).set(waiting)
        return generate_latest(self.registry)
