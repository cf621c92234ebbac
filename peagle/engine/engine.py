"""The speculative decoding engine: draft, verify, accept, roll back (docs/design.md, "Decoding step") for many
requests at once.

Every step:
  1. admit waiting requests into free cache slots, and prefill: under a budget of max_num_batched_tokens prompt
     tokens per step, each prompt in turn continues from what the prefix cache holds (prefix_cache.py) and runs its
     next chunk through the target; a prompt's last chunk samples its first token. Chunks start on block boundaries
     and compute each row as one pass would, so chunking and caching change no output;
  2. ask the proposer for its model-free drafts and the speculation policy (policy.py) how many drafts K_b, from 0
     to the widest window, each request verifies;
  3. catch the head's drafter up: it runs the real rows (prompt rows included) a request's head draft needs, only
     once the policy gives that head a window, in slices under the step's time budget (step_budget.py), oldest
     request first; a head still behind after its slice verifies no window this step. So a request that some other
     proposer drafts for, or none, never pays for the drafter;
  4. draft for the requests with K_b > 0 in one drafter forward (P-EAGLE) or one per draft (EAGLE-3), at the
     widest K_b (model-free drafts were made in 2);
  5. verify every request's [x_n, d_1..d_K_b] in one target forward (ragged when the K_b differ: each request
     pays only for its own rows);
  6. accept per request, emit, and queue the accepted positions as the drafter's next real rows.
Real rows wait in the request (request.DrafterBacklog) until its head drafts, or until they would hold more than
MAX_PENDING_BYTES of features: then the oldest run, so a request's waiting rows stay bounded in memory. A joint
drafting pass brings at most JOINT_PENDING_ROWS waiting rows per request, so that its padded rows never reach past
any request's cache.
Stale cache entries past a request's accepted length are overwritten by later writes; nothing is copied.

Thread model: `add_request` and `abort` may be called from any thread; `step` runs in one thread (the server's
engine loop, or `generate`'s caller).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path

import torch

from peagle.config import Speculation, SpeculativeConfig
from peagle.engine.detokenize import IncrementalDetokenizer
from peagle.engine.grammar import GrammarCompiler, count_forced, stack_bias
from peagle.engine.errors import RequestError
from peagle.engine.request import Request, RequestOutput, TokenLogprob
from peagle.engine import prefix_cache
from peagle.engine.acceptance import Candidate
from peagle.engine.policy import DEFAULT_POLICY, NoSpeculation, make_policy
from peagle.engine.timing import step_clock, timed
from peagle.engine.proposers import Draft, Proposer, make_proposer
from peagle.engine.proposers.heads import HeadProposer
from peagle.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from peagle.engine.sampling import SamplingParams, target_logprobs, target_probs
from peagle.engine.stats import SpecDecodeStats
from peagle.engine.step_budget import StepBudget
from peagle.engine.verify import verify_greedy, verify_sampled
from peagle.model import kernels
from peagle.model.drafter import Drafter
from peagle.model.layers import BatchLayout
from peagle.model.target import TargetModel

logger = logging.getLogger("peagle")

Prompt = str | list[int] | list[dict]
# Features of real rows (prompt included) a request may hold back from the drafter while its head does not draft:
# past this the oldest run anyway (a bound on memory, not on time: catching up later costs the same rows).
MAX_PENDING_BYTES = 16 << 20
# Waiting rows a request may bring into a joint (padded) drafter pass; more run first, on their own.
JOINT_PENDING_ROWS = 16
# Prompt rows turned into log-probabilities at once (each row is a vocabulary-sized float32 vector).
PROMPT_LOGPROB_ROWS = 256
# Prompt tokens prefilled per step (vLLM's --max-num-batched-tokens; decode rows come on top). With chunked prefill a
# longer prompt takes several steps, so a running stream waits at most one chunk (docs/engine.md, "Chunked prefill",
# measures the longest gap on one CPU core).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 128
# Forced tokens (the only ones a grammar allows) a step may append to a verify window past its drafts; the cache's
# spare room past max_model_len (JOINT_PENDING_ROWS) holds them.
MAX_FORCED_RUN = JOINT_PENDING_ROWS


def kernels_in_use(target: TargetModel, drafter: Drafter | None) -> dict:
    """Which kernels run the forward, in which weight formats, and whether greedy speculation is bit-exact."""
    out = {**kernels.summary(target.device), "weights": target.weights}
    if drafter is not None:
        out["drafter_weights"] = drafter.weights
    if target.quantized or out.get("drafter_weights", "bf16") != "bf16":
        out["block_kernels"] = kernels.quant_path()  # whose integer dot products run the blocks
    return out


class LLMEngine:
    def __init__(self, target: TargetModel, tokenizer=None, drafter: Drafter | None = None,
                 speculative_config: SpeculativeConfig | None = None, max_num_seqs: int = 8,
                 max_model_len: int | None = None, model_name: str = "model",
                 speculation_policy: str = DEFAULT_POLICY, enable_prefix_caching: bool = True,
                 prefix_cache_gb: float = prefix_cache.DEFAULT_MEMORY_GB, enable_chunked_prefill: bool = True,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_step_time_ms: float | None = None):
        """`speculation_policy`: "adaptive" (the default, as in `peagle serve` and `generate`) treats
        num_speculative_tokens as a maximum and picks K (0 included) every step for the most tokens per second;
        "fixed" verifies num_speculative_tokens drafts every step, as vLLM does. Without a drafter nothing is
        drafted whatever the policy (policy.NoSpeculation).
        `enable_prefix_caching` keeps computed blocks of every request (up to `prefix_cache_gb` GiB) for later
        requests that start with the same tokens; `enable_chunked_prefill` splits a prompt longer than
        `max_num_batched_tokens` over several steps (off: whole prompts, that many tokens of them per step, at least
        one). While streams decode, a step's prefill work is sized in time to at most `max_step_time_ms`
        (None: step_budget.DEFAULT_STEP_TIME_MULTIPLE plain decode steps, as measured here). None changes any
        output."""
        spec = speculative_config
        if spec is not None and spec.uses_head and drafter is None:
            spec = spec.without_head()
        if spec is None or not spec.uses_head:
            drafter = None  # model-free drafts (ngram, suffix) run no head
        self.target, self.tokenizer, self.drafter, self.spec = target, tokenizer, drafter, spec
        if drafter is not None:
            spec.check_head(drafter.config.parallel_capable, spec.model or "the head")
        self.k = spec.max_draft_tokens if spec else 0  # the widest window any proposer drafts
        head_k = spec.num_speculative_tokens if drafter is not None else 0
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        if max_num_batched_tokens < BLOCK_SIZE:
            raise ValueError(f"max_num_batched_tokens must be at least {BLOCK_SIZE} (one block), got "
                             f"{max_num_batched_tokens}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_model_len = max_model_len or min(target.config.max_position_embeddings, 4096)
        if self.spec and self.spec.max_model_len:
            self.max_model_len = min(self.max_model_len, self.spec.max_model_len)
        # Room past max_model_len for the verify window and the drafter's padded rows, whose writes are stale.
        # ... and for a padded prefill's rows past a short chunk's end (a chunk is at most the budget or a prompt).
        capacity = self.max_model_len + max(JOINT_PENDING_ROWS + 2 * self.k + 2,
                                            min(max_num_batched_tokens, self.max_model_len))
        self.target_cache = target.new_cache(max_num_seqs, capacity)
        self.drafter_cache = drafter.new_cache(max_num_seqs, capacity) if drafter is not None else None
        self.prefix_cache = (PrefixCache(self.target_cache, self.drafter_cache, target.feature_dim, prefix_cache_gb,
                                         target.norm.weight.dtype) if enable_prefix_caching else None)
        # MAX_PENDING_BYTES as rows of this target's features
        row_bytes = target.feature_dim * target.norm.weight.dtype.itemsize
        self.max_pending_rows = max(JOINT_PENDING_ROWS + 1, MAX_PENDING_BYTES // row_bytes)
        self.device = target.device
        self.kernels = kernels_in_use(target, drafter)
        logger.info("peagle engine: %s weights, %s", target.weights, kernels.describe(self.device))
        self.eos_token_ids = set(target.config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.free_slots = list(range(max_num_seqs))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._incoming: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.stats = SpecDecodeStats(self.k)  # engine-wide, since start
        self.num_finished = 0
        self._build_speculation(speculation_policy, head_k)
        self._step_clock = step_clock(self.device)
        self.policy.calibrate(self._time_target, self._time_draft)
        self.step_budget = StepBudget(self._step_clock, max_step_time_ms)
        self.step_budget.calibrate(self._time_prefill, lambda: self._time_target(1),
                                   self._time_drafter_rows if self.drafter is not None else None,
                                   self.max_model_len)
        self.max_forced_run = MAX_FORCED_RUN  # 0: verify no forced tokens past the drafts (token-by-token reference)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()  # request threads build the compiler on first use

    def _build_speculation(self, speculation_policy: str, head_k: int) -> None:
        """The policy that picks each step's windows, the head's proposer and the proposer the engine asks."""
        spec = self.spec
        self.policy = (make_policy(speculation_policy, self.k, self.max_num_seqs, spec.disable_by_batch_size, head_k)
                       if spec else NoSpeculation())
        self.head = (HeadProposer(self.drafter, self.drafter_cache, spec.parallel_drafting, self.device)
                     if self.drafter is not None else None)
        self.proposer: Proposer | None = make_proposer(spec, self.head, self.policy) if spec else None
        # engine-wide, since start, per drafter that ran (the hybrid has two)
        self.proposer_stats = {name: SpecDecodeStats(self.k) for name in (self.proposer.names if spec else ())}

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: Speculation | str | None = None,
                        speculative_config: SpeculativeConfig | str | dict | None = None,
                        max_num_seqs: int = 8, max_model_len: int | None = None, device: str | None = None,
                        dtype: str | torch.dtype | None = None, speculation_policy: str = DEFAULT_POLICY,
                        quantization: str | None = None, **options) -> "LLMEngine":
        """The engine for a resolved `Speculation` (peagle.model.speculation.resolve_speculation: its target, head
        and policy are loaded as they are, nothing is resolved again), or for a model name (None: the embedded
        SmolLM2; a .gguf file runs its block-quantized weights as they are) with `speculative_config` (None: no
        speculation) and `speculation_policy`, resolved here by that same function. `quantization` (q4_0, q4_1,
        q8_0) quantizes a float target's matrices at load, as vLLM's --quantization does. `options`: the
        constructor's prefill options."""
        from peagle.model.checkpoint import load_head
        from peagle.model.loading import config_dir, is_gguf, load_tokenizer, torch_dtype
        from peagle.model.quant import drafter_quantization
        from peagle.model.speculation import resolve_speculation

        chosen = model if isinstance(model, Speculation) else resolve_speculation(
            model, speculative_config if speculative_config is not None else "none", source="speculative_config",
            policy=speculation_policy)
        path = chosen.model_path
        device = device or ("cpu" if is_gguf(path) or quantization else
                            "cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch_dtype(dtype)
        target = TargetModel.from_pretrained(path, dtype=dtype, device=device, quantization=quantization)
        meta = config_dir(path)
        has_tokenizer = any((meta / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        tokenizer = load_tokenizer(path) if has_tokenizer else None
        spec, drafter = chosen.config, None
        if spec is not None and spec.uses_head:
            drafter = load_head(chosen.head_path, target_embeddings=target.input_embeddings(), dtype=dtype,
                                device=device)
            # the engine never trains it: pack its weights once for the CPU kernels (no-op elsewhere), in 8 bits
            # beside a block-quantized target
            drafter.pack_(drafter_quantization(spec.quantization, target.quantized))
        return cls(target, tokenizer, drafter, spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                   model_name=chosen.model or Path(path).name, speculation_policy=chosen.policy, **options)

    @property
    def method(self) -> str:
        return self.spec.method_name if self.spec else "none"

    # -- request API -------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids for a prompt: ids pass through, chat messages get the chat template, text is tokenised (with
        the chat template when `chat` is true). Text that cannot fit the context is refused before tokenising."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer: send token ids", "prompt")
        texts = [prompt] if isinstance(prompt, str) else [m.get("content") or "" for m in prompt]
        self._check_text_fits(sum(len(t) for t in texts if isinstance(t, str)))
        if isinstance(prompt, str) and not chat:
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; send a plain prompt instead of messages",
                               "prompt")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @cached_property
    def _max_token_chars(self) -> int:
        """An upper bound on the characters any one token decodes to. A byte-level BPE entry spells each of its bytes
        with one character, so it decodes to at most as many characters as it has; any other entry (SentencePiece,
        byte fallback) spells each byte or space with one or more UTF-8 bytes, so its UTF-8 length bounds it."""
        decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        size = len if type(decoder).__name__ == "ByteLevel" else (lambda t: len(t.encode()))
        return max(1, max(size(t) for t in self.tokenizer.get_vocab()))

    def _check_text_fits(self, num_chars: int) -> None:
        """Refuse text that needs more tokens than the context holds, without tokenising it: no token covers more
        than `_max_token_chars` characters, so the text needs at least num_chars / that many tokens."""
        at_least = num_chars // self._max_token_chars
        if at_least >= self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                               f"has at least {at_least} ({num_chars} characters); shorten the prompt", "prompt",
                               "context_length_exceeded")

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     chat: bool | None = None, arrival: float | None = None, cache_salt: str = "") -> Request:
        """Tokenise and check a request without queueing it (see `submit`). This is the CPU-heavy part of intake,
        so a server runs it off its event loop. Raises RequestError naming the parameter at fault. `cache_salt`:
        reuse only what requests of the same salt left in the prefix cache and the suffix trees."""
        params = params or SamplingParams()
        prompt_ids = self.encode_prompt(prompt, chat)
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.target.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"stop_token_ids must be token ids in [0, {vocab}); got {bad[0]}", "stop_token_ids")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                               f"has {len(prompt_ids)}; shorten the prompt or raise the context length "
                               "(--max-model-len)", "prompt", "context_length_exceeded")
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens, but "
                               f"{len(prompt_ids) + params.max_tokens} were requested ({len(prompt_ids)} in the "
                               f"prompt, {params.max_tokens} for the output); reduce max_tokens or the prompt",
                               "max_tokens", "context_length_exceeded")
        matcher = self.grammar_compiler.matcher(params.constraint) if params.constraint is not None else None
        request_id = request_id or f"req-{next(self._ids)}"
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed % 2**64 if params.seed is not None else torch.seed())
        return Request(request_id, prompt_ids, params, SpecDecodeStats(self.k), gen,
                       arrival=arrival if arrival is not None else time.perf_counter(),
                       detokenizer=IncrementalDetokenizer(self.tokenizer), matcher=matcher, cache_salt=cache_salt)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this engine's tokenizer (built on first use: about a second)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise RequestError("structured output needs a tokenizer, and this engine has none", "constraint")
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.target.config.vocab_size,
                                                         sorted(self.eos_token_ids))
            return self._grammar_compiler

    def submit(self, req: Request) -> str:
        """Queue a request from `make_request`. Safe from any thread."""
        self._incoming.put(req)
        return req.request_id

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    chat: bool | None = None, cache_salt: str = "") -> str:
        """Queue a request; raises RequestError at once if it cannot fit. Safe from any thread."""
        return self.submit(self.make_request(prompt, params, request_id, chat, cache_salt=cache_salt))

    def abort(self, request_id: str) -> None:
        """Stop a request and free its slot at the next step. Safe from any thread."""
        self._aborts.put(request_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or not self._incoming.empty() or not self._aborts.empty())

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self._incoming.qsize()

    # -- the step ----------------------------------------------------------------------------------------------
    def step(self, on_first_tokens: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Advance every request by one engine step; returns a report for each request that changed.
        `on_first_tokens` gets the reports of requests that prefill just started, before this step's decode, so a
        server can send first tokens (and time them) as soon as they exist."""
        with self._lock, torch.inference_mode():
            reports: dict[str, RequestOutput] = {}
            self._take_incoming(reports)
            self._admit()
            touched, prefilled = self._prefill_step()
            if touched and on_first_tokens is not None:
                on_first_tokens([self._report(r) for r in touched if not r.finished])
            decoding = [r for r in self.running if not r.finished and not r.prefilling]
            ks, free = self._plan(decoding)
            heads = {r for r, k, d in zip(decoding, ks, free) if k and d is None}  # the head drafts for these
            caught_up = self._catch_up_drafters(heads)
            # a head still behind after its slice drafts from a later step on
            ks = [0 if r in heads and len(r.backlog) > JOINT_PENDING_ROWS else k for r, k in zip(decoding, ks)]
            self.step_budget.end_prefill(prefilled, caught_up)
            if decoding:
                self._decode_step(decoding, ks, free)
            self.step_budget.end_step(decoded=bool(decoding))
            for req in dict.fromkeys(touched + decoding):
                reports[req.request_id] = self._report(req)
                self._retire_if_finished(req)
            return list(reports.values())

    def _take_incoming(self, reports: dict[str, RequestOutput]) -> None:
        while not self._incoming.empty():
            self.waiting.append(self._incoming.get())
        aborted = set()
        while not self._aborts.empty():
            aborted.add(self._aborts.get())
        if not aborted:
            return
        for req in [r for r in self.waiting if r.request_id in aborted]:
            self.waiting.remove(req)
            self._finish(req, "abort")
            reports[req.request_id] = self._report(req)
        for req in [r for r in self.running if r.request_id in aborted]:
            self._finish(req, "abort")
            reports[req.request_id] = self._report(req)
            self._retire_if_finished(req)

    def _retire_if_finished(self, req: Request) -> None:
        if req.finished and req in self.running:
            self._cache_drafter_entries(req)
            self.running.remove(req)
            self.free_slots.append(req.slot)
            self.free_slots.sort()  # lowest slots first keeps batches contiguous (no cache gather)
            req.finished_at = time.perf_counter()
            req.backlog.clear()
            self.policy.forget(req.request_id)
            if self.proposer is not None:
                self.proposer.finish(req)
            self.num_finished += 1

    def _admit(self) -> None:
        """Waiting requests take the free slots (their prefill is budgeted step by step in _prefill_step)."""
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            self.running.append(req)
            if self.prefix_cache is not None and req.params.prompt_logprobs is None:
                self.prefix_cache.queries += len(req.prompt_ids)  # looked up once its prefill begins

    def _prefill_step(self) -> tuple[list[Request], int]:
        """Prefill one chunk for as many prompts as this step's budget holds, in the order they came, in one padded
        forward (its rows cost max chunk x prompts, kept within max_num_batched_tokens); while streams decode the
        work is sized in time (step_budget.py), the oldest prompt getting at least one block. Returns the requests
        whose prompt is now complete (and first token sampled), and the prompt tokens computed."""
        budget = self.step_budget
        clock = budget.clock
        admitting = [r for r in self.running if not r.finished and r.prefilling]
        budget.start_step(decoding=len(admitting) < sum(not r.finished for r in self.running))
        tokens_budget, batch, widest = self.max_num_batched_tokens, [], 0
        for req in admitting:
            started = clock()
            self._continue_from_prefix_cache(req)
            budget.spend(clock() - started)
            if any(self._will_compute_its_next_block(other, n, req) for other, n in batch):
                continue  # the next step finds that block in the cache instead of computing it twice
            left = len(req.prompt_ids) - req.num_computed
            if left <= tokens_budget or not self.enable_chunked_prefill:
                cap = left
            else:  # whole blocks, so that the next chunk starts where a cached block would
                cap = tokens_budget // BLOCK_SIZE * BLOCK_SIZE
            if self.enable_chunked_prefill:
                n = budget.largest(lambda n: self._chunk_cost(batch + [(req, n)]), cap, floor=not batch)
            else:
                n = cap if not batch or budget.fits(self._chunk_cost(batch + [(req, cap)])) else 0
            if not n or batch and max(widest, n) * (len(batch) + 1) > tokens_budget:
                break
            batch.append((req, n))
            widest = max(widest, n)
        if batch:
            predicted, started = self._chunk_cost(batch, drafter=False), clock()
            self._prefill_chunks(batch)
            seconds = clock() - started
            budget.target.observe(predicted, seconds)
            budget.spend(seconds)
            if self.proposer is not None:  # index what was prefilled (suffix trees), a chunk at a time
                started = clock()
                for req, _ in batch:
                    if req.decodes:
                        self.proposer.prefill(req)
                budget.spend(clock() - started)
        return [req for req, _ in batch if not req.prefilling], sum(n for _, n in batch)

    def _drafts_later(self, req: Request) -> bool:
        """Whether the drafter may ever draft for this request."""
        return self.drafter is not None and req.decodes

    def _chunk_cost(self, batch: list[tuple[Request, int]], drafter: bool = True) -> float:
        """Predicted seconds of a padded prefill forward over batch's chunks (and, with `drafter`, of the drafter's
        pass later in the step over the rows that would take a request's waiting rows past max_pending_rows)."""
        width = max(n for _, n in batch)
        every_row = any(req.params.prompt_logprobs is not None for req, _ in batch)
        logit_rows = len(batch) * width if every_row else \
            sum(req.num_computed + n == len(req.prompt_ids) for req, n in batch)
        cost = self.step_budget.target.predict([(width, req.num_computed) for req, _ in batch], logit_rows)
        if drafter:
            cost += sum(self.step_budget.drafter.predict([(due, req.backlog.start)]) for req, n in batch
                        if (due := self._rows_due(req, n)))
        return cost

    def _rows_due(self, req: Request, coming: int = 0) -> int:
        """Waiting rows the drafter must run now to keep the request's backlog within max_pending_rows once
        `coming` more rows join it."""
        if not self._drafts_later(req):
            return 0
        return max(0, len(req.backlog) + coming - self.max_pending_rows)

    def _catch_up_drafters(self, heads: set[Request]) -> int:
        """The drafter runs waiting real rows, oldest request first, as far as the step's budget goes (and at most
        max_num_batched_tokens a request): of a request in `heads` (its head drafts this step) all but the newest,
        the first such request at least one block; of a request past max_pending_rows all but the newest
        JOINT_PENDING_ROWS, and at least the rows past the bound (and one block) whatever the budget: a bound on
        memory, reached again only a block or more later. Returns the rows run."""
        budget, total = self.step_budget, 0
        clock = budget.clock
        for req in self.running:
            if req.finished or not self._drafts_later(req):
                continue
            due, waiting, start = self._rows_due(req), len(req.backlog), req.backlog.start
            if req in heads and waiting > JOINT_PENDING_ROWS:
                cap = waiting - 1
            elif due:
                cap = waiting - JOINT_PENDING_ROWS
            else:
                continue
            cap = min(cap, self.max_num_batched_tokens)  # a step's bound in tokens, the drafter's as the target's
            rows = max(due, budget.largest(lambda n: budget.drafter.predict([(n, start)]), cap,
                                           floor=bool(due) or not total))
            predicted, started = budget.drafter.predict([(rows, start)]), clock()
            self._run_backlog(req, rows)
            seconds = clock() - started
            budget.drafter.observe(predicted, seconds)
            budget.spend(seconds)
            total += rows
        return total

    @staticmethod
    def _will_compute_its_next_block(other: Request, n: int, req: Request) -> bool:
        """Whether `other`'s chunk of n rows computes the block `req` needs next (same tokens up to its end)."""
        start, end = req.num_computed, req.num_computed + BLOCK_SIZE
        return (other.num_computed <= start and other.num_computed + n >= end
                and len(req.prompt_ids) > end and other.prompt_ids[:end] == req.prompt_ids[:end])

    def _continue_from_prefix_cache(self, req: Request) -> None:
        """Take the prompt's next positions from the prefix cache, whole blocks while they match (never the last
        prompt token: its logits give the first token). Where the drafter is caught up and a block has the
        drafter's entries for the same next token, those are copied too; otherwise the block's features wait for
        the drafter like computed rows. A request that wants prompt log-probabilities computes every position."""
        pc, start = self.prefix_cache, req.num_computed
        if pc is None or req.params.prompt_logprobs is not None or start != len(req.blocks) * BLOCK_SIZE:
            return
        m = len(req.prompt_ids)
        hit = pc.match(req.blocks[-1] if req.blocks else None, req.prompt_ids[start:], (m - 1 - start) // BLOCK_SIZE,
                       req.cache_salt)
        if not hit:
            return
        end = start + len(hit) * BLOCK_SIZE
        features = pc.load(hit, req.slot, start, self.target_cache)
        if self._drafts_later(req):
            reused = 0
            if not req.backlog.tokens and req.backlog.start == start:
                for j, block in enumerate(hit):
                    if block.next_token != req.prompt_ids[start + (j + 1) * BLOCK_SIZE]:
                        break
                    reused = j + 1
            if reused:
                pc.load_drafter(hit[:reused], req.slot, start, self.drafter_cache)
                req.backlog.skip(reused * BLOCK_SIZE)
            mid = start + reused * BLOCK_SIZE
            if mid < end:
                req.backlog.append(req.prompt_ids[mid + 1:end + 1], features[mid - start:])
        req.blocks += hit
        req.num_computed = req.num_cached_tokens = end
        pc.hits += end - start

    def _prefill_chunks(self, batch: list[tuple[Request, int]]) -> None:
        """Run each request's next n prompt positions through the target in one padded batch (pad rows write past
        a chunk's end: stale entries that later rows overwrite); a request whose prompt is then complete samples
        its first token. The rows wait for the drafter (row t: token x_{t+1}, feature g_t)."""
        dev, B = self.device, len(batch)
        T = max(n for _, n in batch)
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, (req, n) in enumerate(batch):
            tokens[b, :n] = torch.tensor(req.prompt_ids[req.num_computed:req.num_computed + n], device=dev)
        starts = torch.tensor([req.num_computed for req, _ in batch], device=dev)
        layout = BatchLayout.build(torch.tensor([req.slot for req, _ in batch], device=dev),
                                   starts[:, None] + torch.arange(T, device=dev)[None])
        every_row = any(req.params.prompt_logprobs is not None for req, _ in batch)
        finishing = any(req.num_computed + n == len(req.prompt_ids) for req, n in batch)
        if every_row or finishing:
            last = torch.tensor([n - 1 for _, n in batch], device=dev)[:, None]
            out = self.target(tokens, layout, self.target_cache, logit_index=None if every_row else last,
                              num_logits=None)
            logits, features = out.logits, out.features
        else:  # no chunk here is a prompt's last: no logits needed
            logits, features = None, self.target.trunk(tokens, layout, self.target_cache)[1]
        for b, (req, n) in enumerate(batch):
            rows = logits[b, :n] if every_row else logits[b] if logits is not None else None
            self._after_chunk(req, n, rows, features[b, :n])

    def _after_chunk(self, req: Request, n: int, logits: torch.Tensor | None, features: torch.Tensor) -> None:
        """A chunk of n prompt rows is in the cache: logits (every row's, or only the last's) and features [n, F]."""
        start, m = req.num_computed, len(req.prompt_ids)
        end = req.num_computed = start + n
        if req.params.prompt_logprobs is not None:
            self._add_prompt_logprobs(req, start, logits)
        next_tokens = req.prompt_ids[start + 1:end + 1]  # each row's x_{t+1}; the last prompt row's is the first token
        if end == m:
            last = logits[-1] if req.matcher is None else req.matcher.mask_logits(logits[-1])
            first = self._sample_one(req, last)
            req.first_token_at = time.perf_counter()
            self._commit(req, [first], last[None])
            next_tokens.append(first)
        if self._drafts_later(req):  # the rows wait for the drafter
            req.backlog.append(next_tokens, features)
        self._cache_blocks(req, features)

    def _add_prompt_logprobs(self, req: Request, start: int, logits: torch.Tensor) -> None:
        """The prompt is not drawn from anything: its log-probabilities are the model's own softmax (a block of rows
        at a time, so a long prompt does not hold a second copy of its logits). logits[i] predict position
        start + i + 1."""
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        num = min(len(logits), len(req.prompt_ids) - 1 - start)
        for i in range(0, num, PROMPT_LOGPROB_ROWS):
            lp = torch.log_softmax(logits[i: min(i + PROMPT_LOGPROB_ROWS, num)], dim=-1)
            first = start + 1 + i
            req.prompt_logprobs += _token_logprobs(lp, req.prompt_ids[first:first + len(lp)],
                                                   req.params.prompt_logprobs)

    def _cache_blocks(self, req: Request, features: torch.Tensor) -> None:
        """Positions that just got their final keys and values (features [n, F], right after those before): every
        block they complete goes into the prefix cache."""
        pc = self.prefix_cache
        if pc is None:
            return
        req.unstored_features.append(features)
        have = sum(len(f) for f in req.unstored_features)
        if have < BLOCK_SIZE:
            req.unstored_features = [torch.cat(req.unstored_features)]  # a copy: not a view of the step's batch
            return
        feats, seq, start = torch.cat(req.unstored_features), req.prompt_ids + req.output_ids, len(req.blocks) * BLOCK_SIZE
        full = have // BLOCK_SIZE
        for j in range(full):
            p = start + j * BLOCK_SIZE
            req.blocks.append(pc.store(req.blocks[-1] if req.blocks else None, tuple(seq[p:p + BLOCK_SIZE]),
                                       req.slot, p, self.target_cache, feats[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE],
                                       req.cache_salt))
        rest = feats[full * BLOCK_SIZE:]
        req.unstored_features = [rest.clone()] if len(rest) else []

    def _cache_drafter_entries(self, req: Request) -> None:
        """Before a request's slot is freed: the drafter's entries of its cached blocks that it has run (and that
        no request has given yet), with the token after each block that they were computed with."""
        if self.prefix_cache is None or self.drafter is None:
            return
        seq = req.prompt_ids + req.output_ids
        for j, block in enumerate(req.blocks):
            p = j * BLOCK_SIZE
            if p + BLOCK_SIZE > req.backlog.start or p + BLOCK_SIZE >= len(seq):
                break
            if block.next_token is None and block.tokens == tuple(seq[p:p + BLOCK_SIZE]):
                self.prefix_cache.store_drafter(block, req.slot, p, self.drafter_cache, seq[p + BLOCK_SIZE])

    def _plan(self, reqs: list[Request]) -> tuple[list[int], list[Draft | None]]:
        """This step's windows: the proposer's model-free drafts (None: the head's, if any) and the number of drafts
        the policy gives each request (cutting a model-free draft where a longer window stops paying)."""
        if not reqs:
            return [], []
        free = self.proposer.score(reqs) if self.proposer is not None else [None] * len(reqs)
        ks = self.policy.choose([Candidate(r.request_id, r.params.max_tokens - len(r.output_ids), d)
                                 for r, d in zip(reqs, free)])
        return ks, free

    def _decode_step(self, reqs: list[Request], ks: list[int], free: list[Draft | None] | None = None) -> None:
        """Draft for the requests with K_b > 0 (the head's together, at their widest K; model-free drafts as they
        were made), then verify every request's [x_n, d_1..d_K_b] in one target forward, accept, emit.
        free[b]: request b's model-free draft (None: the head drafts it)."""
        free = free or [None] * len(reqs)
        started = self._step_clock()
        kmax, drafting = max(ks), [b for b, k in enumerate(ks) if k]
        head_rows = [b for b in drafting if free[b] is None]
        head_kmax = max((ks[b] for b in head_rows), default=0)
        drafts = self._drafts(reqs, ks, free, drafting, head_rows, head_kmax) if kmax else None
        drafted = ks
        if any(r.matcher is not None for r in reqs):
            ks, drafted, drafting, drafts = self._grammar_windows(reqs, ks, drafting, drafts)
        draft_row = {b: j for j, b in enumerate(drafting)}
        windows = self._verify(reqs, ks, drafting, drafts)
        for b, (req, k, logits, features) in enumerate(zip(reqs, ks, *windows)):
            masks = req.matcher.window_masks() if req.matcher is not None else None
            if masks is not None:
                logits = req.matcher.mask_logits(logits, stack_bias(masks))
            if k == 0:
                new = [self._sample_one(req, logits[0])]
            else:
                d = drafts[draft_row[b], :k]
                if req.params.greedy:
                    num_acc, emitted = verify_greedy(d[None], logits.argmax(-1)[None])
                    new = emitted[0, : int(num_acc[0]) + 1].tolist()
                else:
                    new = verify_sampled(d, target_probs(logits, req.params), req.generator)
            if self.spec is not None:
                # Statistics and the policy count the drafts only, not forced tokens verified after them.
                a, kd = len(new) - 1, drafted[b]
                req.spec.record(kd, min(a, kd))
                self.stats.record(kd, min(a, kd))
                if kd:
                    self.proposer_stats[free[b].proposer if free[b] is not None else self.head.name].record(
                        kd, min(a, kd))
                if free[b] is not None:
                    self.proposer.observe(req, free[b], kd, min(a, kd))
                elif kd:
                    self.policy.observe(req.request_id, kd, min(a, kd))
            if self.drafter is not None:  # positions n..n+a are now verified: the drafter's next real rows
                req.backlog.append(new, features[: len(new)])
            before = len(req.output_ids)
            self._commit(req, new, logits)
            if self.proposer is not None:
                self.proposer.add_tokens(req, req.output_ids[before:])
            # Positions n..n+a now hold their final keys and values: those whose tokens were kept (a stop ends the
            # request, so nothing after it needs the chain) can be reused.
            kept = len(req.output_ids) - before
            if kept > 0:
                self._cache_blocks(req, features[: min(kept, len(new) - 1) + 1])
            if masks is not None:
                forced = count_forced(masks, kept)
                req.spec.num_forced_tokens += forced
                self.stats.num_forced_tokens += forced
        # Timed after the backlogs (work earlier plain steps skipped, not this step's); not a step that verified
        # forced tokens after its drafts, whose layout the cost model does not describe.
        if sum(ks) == sum(drafted):
            self.policy.observe_step(len(reqs) + sum(ks), len(head_rows), head_kmax, self._step_clock() - started)

    def _drafts(self, reqs: list[Request], ks: list[int], free: list[Draft | None], drafting: list[int],
                head_rows: list[int], head_kmax: int) -> torch.Tensor:
        """The drafting requests' drafts [len(drafting), max K]: the head's (one forward at their widest K) and the
        model-free ones cut to their K. Under a grammar a model-free draft is proposed to the matcher token by
        token and ends at the first token it does not allow (`_grammar_windows` verifies what it kept)."""
        dev = self.device
        drafts = torch.zeros(len(drafting), max(ks), dtype=torch.long, device=dev)
        row = {b: j for j, b in enumerate(drafting)}
        if head_rows:
            heads = [reqs[b] for b in head_rows]
            made = self._draft(heads, torch.tensor([r.slot for r in heads], device=dev), head_kmax)
            drafts[[row[b] for b in head_rows], :head_kmax] = made
        for b in drafting:
            if free[b] is None:
                continue
            tokens = free[b].tokens[: ks[b]]
            drafts[row[b], : len(tokens)] = torch.tensor(tokens, device=dev)
            if reqs[b].matcher is not None:
                reqs[b].matcher.open_window()
                reqs[b].matcher.propose_tokens(tokens)
        return drafts

    def _grammar_windows(self, reqs: list[Request], ks: list[int], drafting: list[int], drafts: torch.Tensor | None):
        """Verify windows under grammars. A constrained request's drafts were proposed under its mask (`_draft`),
        cut where the grammar ends or allows nothing in the draft vocabulary; when those are certain to be accepted
        (there are none, or all were forced) the forced tokens that follow (the only ones the grammar allows) join
        them, verified in the same forward without being drafted, so a plain step of a constrained request can emit
        several tokens. Unconstrained windows are unchanged. Returns each
        request's window size, its drafted part, the requests with a window, and their tokens [rows, widest]."""
        row = {b: j for j, b in enumerate(drafting)}
        windows, drafted = [], []
        for b, (req, k) in enumerate(zip(reqs, ks)):
            m = req.matcher
            if m is None:
                windows.append(drafts[row[b], :k].tolist() if k else [])
                drafted.append(k)
                continue
            if not m.window_open:  # not drafted this step
                m.open_window()
            drafted.append(len(m.proposed))
            # Only behind proposals that are certain to be accepted (none, or all forced): behind a draft the target
            # may reject, the run would cost rows for tokens that are usually thrown away.
            if m.window_certain:
                room = req.params.max_tokens - len(req.output_ids) - 1 - len(m.proposed)  # and one for the bonus
                m.extend_forced(min(self.max_forced_run, room))
            windows.append(list(m.proposed))
        sizes = [len(w) for w in windows]
        rows = [b for b, n in enumerate(sizes) if n]
        tokens = None
        if rows:
            tokens = torch.zeros(len(rows), max(sizes), dtype=torch.long, device=self.device)
            for j, b in enumerate(rows):
                tokens[j, : sizes[b]] = torch.tensor(windows[b], device=self.device)
        return sizes, drafted, rows, tokens

    def _verify(self, reqs: list[Request], ks: list[int], drafting: list[int], drafts: torch.Tensor | None):
        """The target's forward over every request's window [x_n, d_1..d_K_b] at positions n..n+K_b: per request,
        logits [K_b + 1, V] and features [K_b + 1, 3H]. One K for all: a [B, K + 1] batch. Different K: every row
        its own batch entry ([sum (K_b + 1), 1]), so no request pays for a wider neighbour's rows (attention and
        the matrix kernels compute each row alone, so the layout never changes a row's result)."""
        dev = self.device
        slots = torch.tensor([r.slot for r in reqs], device=dev)
        n = torch.tensor([r.num_tokens - 1 for r in reqs], device=dev)  # position of x_n, the newest token
        last = torch.tensor([[r.last_token] for r in reqs], device=dev)
        if len(set(ks)) == 1:
            tokens = last if drafts is None else torch.cat([last, drafts], dim=1)
            positions = n[:, None] + torch.arange(ks[0] + 1, device=dev)[None, :]
            out = self.target(tokens, BatchLayout.build(slots, positions), self.target_cache, num_logits=None)
            return out.logits, out.features
        sizes = [k + 1 for k in ks]
        tokens = last.expand(-1, max(sizes)).clone()
        for j, b in enumerate(drafting):
            tokens[b, 1: sizes[b]] = drafts[j, : ks[b]]
        keep = torch.arange(max(sizes), device=dev)[None, :] < torch.tensor(sizes, device=dev)[:, None]
        positions = n[:, None] + torch.arange(max(sizes), device=dev)[None, :]
        layout = BatchLayout.build(slots[:, None].expand_as(keep)[keep], positions[keep][:, None])
        out = self.target(tokens[keep][:, None], layout, self.target_cache, num_logits=None)
        return out.logits[:, 0].split(sizes), out.features[:, 0].split(sizes)

    def _draft(self, reqs: list[Request], slots: torch.Tensor, k: int) -> torch.Tensor:
        """The head's drafts [B, k] as target ids (proposers/heads.py); its drafter runs every request's pending
        real rows on the way."""
        return self.head.draft(reqs, slots, k)

    def _run_backlog(self, req: Request, rows: int | None = None) -> None:
        """Bring one request's drafter cache up to date without drafting (real rows only: no mask slots, no LM
        head), alone, so no pad rows: its first `rows` waiting rows, by default all but the newest (which stays
        pending: the next draft starts from that row's output). In slices of at most max_num_batched_tokens rows,
        in order: the drafter computes each row as one pass would (docs/design.md), so slices change nothing."""
        backlog, dev = req.backlog, self.device
        n = len(backlog) - 1 if rows is None else rows
        feats = backlog.features()
        for lo in range(0, n, self.max_num_batched_tokens):
            hi = min(n, lo + self.max_num_batched_tokens)
            tokens = torch.tensor([backlog.tokens[lo:hi]], device=dev)
            positions = backlog.start + torch.arange(lo, hi, device=dev)[None, :]
            layout = BatchLayout.build(torch.tensor([req.slot], device=dev), positions)
            self.drafter(tokens, feats[None, lo:hi], layout, self.drafter_cache)
        backlog.consume(n)

    # -- start-up cost calibration of the adaptive policy: forwards on scratch rows in slots no request holds yet --
    @property
    def _calibration_context(self) -> int:
        """Cached positions a calibration row attends to: a typical context."""
        return min(128, self.max_model_len // 2)

    def _time_target(self, rows: int) -> float:
        """Seconds of the target's forward over `rows` rows, one per batch entry, spread over the cache slots."""
        dev, p0 = self.device, self._calibration_context
        slot_of_row = torch.arange(rows, device=dev) % self.max_num_seqs
        positions = p0 + torch.arange(rows, device=dev) // self.max_num_seqs
        layout = BatchLayout.build(slot_of_row, positions[:, None])
        tokens = torch.ones(rows, 1, dtype=torch.long, device=dev)

        def forward():
            with torch.inference_mode():
                self.target(tokens, layout, self.target_cache, num_logits=None)

        return timed(forward, self._step_clock)

    def _time_draft(self, batch: int, k: int) -> float:
        """Seconds of the head drafting k tokens for `batch` requests (no head: nothing to time)."""
        return self.head.time_draft(batch, k, self._calibration_context, self._step_clock) if self.head else 0.0

    # -- start-up calibration of the step budget: a prompt chunk's forwards on scratch rows of slot 0 -------------
    def _chunk_layout(self, rows: int, position: int) -> tuple[torch.Tensor, BatchLayout]:
        dev = self.device
        positions = position + torch.arange(rows, device=dev)[None, :]
        return torch.ones(1, rows, dtype=torch.long, device=dev), BatchLayout.build(torch.zeros(1, dtype=torch.long,
                                                                                                device=dev), positions)

    def _time_prefill(self, rows: int, position: int, every_row_logits: bool) -> float:
        """Seconds of the target's forward over one chunk of `rows` prompt rows from `position` (without logits, as
        a chunk that does not end its prompt; or with every row's log-probabilities, as for prompt_logprobs)."""
        tokens, layout = self._chunk_layout(rows, position)

        def forward():
            with torch.inference_mode():
                if every_row_logits:
                    torch.log_softmax(self.target(tokens, layout, self.target_cache, num_logits=None).logits, -1)
                else:
                    self.target.trunk(tokens, layout, self.target_cache)

        return timed(forward, self._step_clock, repeats=1)

    def _time_drafter_rows(self, rows: int, position: int) -> float:
        """Seconds of the drafter's catch-up pass over `rows` real rows from `position`."""
        tokens, layout = self._chunk_layout(rows, position)
        w = self.drafter.fc.weight
        feats = torch.zeros(1, rows, w.shape[1], dtype=w.dtype, device=self.device)

        def forward():
            with torch.inference_mode():
                self.drafter(tokens, feats, layout, self.drafter_cache)

        return timed(forward, self._step_clock, repeats=1)

    def _sample_one(self, req: Request, logits: torch.Tensor) -> int:
        if req.params.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(target_probs(logits, req.params), 1, generator=req.generator))

    # -- output ------------------------------------------------------------------------------------------------
    def _commit(self, req: Request, tokens: list[int], logits: torch.Tensor) -> None:
        """Append tokens one by one, stopping exactly at EOS, a stop token, max_tokens or a stop string.
        logits[i] are the target's logits that tokens[i] was drawn from (for log-probabilities)."""
        p = req.params
        before = len(req.output_ids)
        for tok in tokens:
            req.output_ids.append(tok)
            # Under a grammar the end of sequence is allowed only where it matches, and ends the answer.
            if (tok in self.eos_token_ids and (not p.ignore_eos or req.matcher is not None)) or \
                    tok in p.stop_token_ids:
                req.finish_reason = "stop"
                break
            if len(req.output_ids) >= p.max_tokens:
                req.finish_reason = "length"
                break
        if req.matcher is not None:
            req.matcher.commit(req.output_ids[before:])
            if req.matcher.error is not None and req.finished:  # it ended on the end of sequence it was left with
                logger.warning("request %s: structured output stopped: %s", req.request_id, req.matcher.error)
                req.finish_reason = "abort"
        if p.logprobs is not None:
            kept = req.output_ids[before:]
            req.logprobs += _token_logprobs(target_logprobs(logits[: len(kept)], p), kept, p.logprobs)
        searched_from = len(req.text)
        req.text += req.detokenizer.step(req.output_ids, final=req.finished)
        for s in p.stop:
            i = req.text.find(s, max(0, searched_from - len(s) + 1))
            if i != -1:
                req.text = req.text[:i]
                req.finish_reason = "stop"
                self._truncate_ids_to_text(req)
                del req.logprobs[len(req.output_ids):]

    def _finish(self, req: Request, reason: str) -> None:
        """End a request from outside the decode (abort): text held back for an incomplete character is flushed,
        as the whole output's decode would show it."""
        req.finish_reason = reason
        req.text += req.detokenizer.step(req.output_ids, final=True)

    def _truncate_ids_to_text(self, req: Request) -> None:
        """After a stop string: drop output tokens that lie wholly past the kept text (the rest still spell all of
        it, including a last character split across tokens)."""
        while req.output_ids and self._decode_text(req.output_ids[:-1]).startswith(req.text):
            req.output_ids.pop()

    def _decode_text(self, ids: list[int]) -> str:
        # A tokenizer-less engine (token ids in, token ids out) has no text.
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _report(self, req: Request) -> RequestOutput:
        text = req.text  # never ends inside a character before the request finishes (the detokenizer holds back)
        if not req.finished:
            # Hold back text that may still turn into a stop string.
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            text = text[: max(req.reported_text_len, len(text) - hold)]
        delta = text[req.reported_text_len:] if len(text) >= req.reported_text_len else ""
        delta_ids = req.output_ids[req.reported_token_len:]
        want_logprobs = req.params.logprobs is not None
        delta_logprobs = req.logprobs[req.reported_token_len:] if want_logprobs else None
        req.reported_text_len = max(req.reported_text_len, len(text))
        req.reported_token_len = len(req.output_ids)
        now = req.finished_at or time.perf_counter()
        return RequestOutput(
            request_id=req.request_id, text=text, delta_text=delta, token_ids=list(req.output_ids),
            delta_token_ids=delta_ids, finished=req.finished, finish_reason=req.finish_reason,
            num_prompt_tokens=len(req.prompt_ids), spec=req.spec, num_cached_tokens=req.num_cached_tokens,
            time_to_first_token=(req.first_token_at - req.arrival) if req.first_token_at else None,
            elapsed=now - req.arrival, logprobs=list(req.logprobs) if want_logprobs else None,
            delta_logprobs=delta_logprobs, prompt_logprobs=req.prompt_logprobs)

    # -- blocking helpers --------------------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool | None = None, cache_salt: str = "") -> list[RequestOutput]:
        """Run prompts to completion (continuously batched) and return their final outputs in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, _copy(sp), chat=chat, cache_salt=cache_salt) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, chat: bool | None = None
               ) -> Iterator[RequestOutput]:
        """Yield reports for one request as it decodes (drives the engine itself)."""
        rid = self.add_request(prompt, _copy(params), chat=chat)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return


def _copy(params: SamplingParams | None) -> SamplingParams:
    from dataclasses import replace

    return replace(params) if params is not None else SamplingParams()


def _token_logprobs(logprobs: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """logprobs [n, V] at the positions of tokens[:n] -> each token's log-probability and the num_top most likely."""
    if not tokens:
        return []
    ids = torch.tensor(tokens, device=logprobs.device)
    chosen = logprobs.gather(-1, ids[:, None])[:, 0].tolist()
    if num_top:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]
