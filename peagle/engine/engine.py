"""The speculative decoding engine: draft, verify, accept, roll back (docs/design.md, "Decoding step") for many
requests at once.

Every step, as `step` reads:
  1. take new requests and aborts, admit waiting requests into free cache slots while the KV pool holds their
     first step, and preempt the newest running requests while it cannot hold every running one's next step;
  2. prefill (prefill.py): a chunk of as many prompts as the step's budgets hold, each continuing from what the
     prefix cache holds (prefix_reuse.py); a prompt's last chunk samples its first token;
  3. plan (step_plan.py): the proposer's model-free drafts and the speculation policy's K_b, from 0 to the widest
     window, for every decoding request, as one `Window` each in a `StepPlan`;
  4. catch the head's drafter up (catch_up.py) on the real rows its windows need, under the step's time budget
     (step_budget.py); a head still behind after its slice verifies no window this step;
  5. draft: the head's windows in one drafter forward (P-EAGLE) or one per draft (EAGLE-3), at their widest K_b,
     shaped into draft trees where they are on; model-free drafts cut to their K_b (with side leaves where they
     pay); under a grammar, the tokens it allows (grammar.GrammarWindow) and the forced tokens after them;
  6. verify every request's [x_n, window] in one target forward (ragged when the windows differ: each request
     pays only for its own rows);
  7. accept per request, commit, and record the window's `Outcome`, the one record every statistic comes from.
Stale cache entries past a request's accepted length are overwritten by later writes; nothing is copied.

Thread model: `add_request` and `abort` may be called from any thread; `step` runs in one thread (the server's
engine loop, or `generate`'s caller).
"""
from __future__ import annotations

import heapq
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

from peagle import threads
from peagle.config import MAX_TREE_NODES, TREE_TOP_M, Speculation, SpeculativeConfig
from peagle.engine import prefix_cache
from peagle.engine.acceptance import Candidate
from peagle.engine.calibration import RememberedTimings, ScratchTimings, timings_key
from peagle.engine.catch_up import JOINT_PENDING_ROWS, DrafterCatchUp
from peagle.engine.detokenize import IncrementalDetokenizer
from peagle.engine.draft_tree import CandidateTree, DraftTree, TreeShaper
from peagle.engine.errors import RequestError
from peagle.engine.grammar import GrammarCompiler, GrammarWindow, count_forced, stack_bias
from peagle.engine.kv_memory import pool_blocks
from peagle.engine.logprobs import token_logprobs
from peagle.engine.policy import DEFAULT_POLICY, NoSpeculation, make_policy
from peagle.engine.prefill import Prefill
from peagle.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from peagle.engine.prefix_reuse import PrefixReuse
from peagle.engine.proposers import Proposer, make_proposer
from peagle.engine.proposers.heads import HeadProposer
from peagle.engine.request import DrafterBacklog, Request, RequestOutput
from peagle.engine.sampling import SamplingParams, target_logprobs, target_probs
from peagle.engine.stats import SpecDecodeStats
from peagle.engine.forward_cost import ForwardCost
from peagle.engine.step_budget import StepBudget
from peagle.model.quant import release_freed_memory
from peagle.engine.step_plan import Outcome, StepPlan, Window
from peagle.engine.thread_count import StepThreads
from peagle.engine.timing import step_clock
from peagle.engine.verify import verify_greedy, verify_sampled
from peagle.model import kernels
from peagle.model.drafter import Drafter
from peagle.model.layers import BatchLayout, KVCache
from peagle.model.target import TargetModel

logger = logging.getLogger("peagle")

Prompt = str | list[int] | list[dict]
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
    if torch.device(target.device).type == "cpu":
        out.update(threads.summary())  # the count in force now, where it came from, the OpenMP wait policy
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
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_step_time_ms: float | None = None,
                 calibration_dir: Path | None = None, kv_cache_gb: float | None = None):
        """`speculation_policy`: "adaptive" (the default, as in `peagle serve` and `generate`) treats
        num_speculative_tokens as a maximum and picks K (0 included) every step for the most tokens per second;
        "fixed" verifies num_speculative_tokens drafts every step, as vLLM does. Without a drafter nothing is
        drafted whatever the policy (policy.NoSpeculation).
        `enable_prefix_caching` keeps computed blocks of every request (up to `prefix_cache_gb` GiB) for later
        requests that start with the same tokens; `enable_chunked_prefill` splits a prompt longer than
        `max_num_batched_tokens` over several steps (off: whole prompts, that many tokens of them per step, at least
        one). While streams decode, a step's prefill work is sized in time to at most `max_step_time_ms`
        (None: step_budget.DEFAULT_STEP_TIME_MULTIPLE plain decode steps, as measured here). With
        `calibration_dir` the start-up timings are remembered there, and a later start with the same shapes,
        formats, kernels, threads and CPU takes them instead of timing forwards (calibration.RememberedTimings).
        `kv_cache_gb`: the most memory the paged KV cache may take (None: kv_memory's default share of the memory
        available at start); requests wait for blocks, and the newest running request gives its blocks back and is
        computed again later when the running ones outgrow them (preemption). None changes any output."""
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
        # the most positions a draft tree takes past its window (its nodes beyond its depth): a head's, and under
        # "auto" a suffix draft's side leaves
        auto = spec is not None and spec.draft_tree_nodes == "auto" and not spec.token_tree
        tree_nodes = (0 if drafter is None else len(spec.token_tree) if spec.token_tree else
                      MAX_TREE_NODES if auto else spec.draft_tree_nodes)
        leaf_rows = MAX_TREE_NODES - self.k if auto and spec.uses_suffix_tree else 0
        self.tree_rows = max(0, tree_nodes - head_k, leaf_rows)
        # an EAGLE-3 head's dynamic tree writes its beams' rows at scratch positions past the real rows
        self.beam_rows = ((head_k - 1) * spec.draft_tree_beams
                          if tree_nodes and not spec.token_tree and not spec.parallel_drafting else 0)
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        if max_num_batched_tokens < BLOCK_SIZE:
            raise ValueError(f"max_num_batched_tokens must be at least {BLOCK_SIZE} (one block), got "
                             f"{max_num_batched_tokens}")
        self.max_model_len = max_model_len or min(target.config.max_position_embeddings, 4096)
        if self.spec and self.spec.max_model_len:
            self.max_model_len = min(self.max_model_len, self.spec.max_model_len)
        self.device = target.device
        self.max_num_batched_tokens = max_num_batched_tokens
        self._build_caches(prefix_cache_gb if enable_prefix_caching else None, kv_cache_gb)
        self.kernels = kernels_in_use(target, drafter)
        self.step_threads = StepThreads(self.kernels["greedy_bit_exact"])  # each decode step's thread count
        logger.info("peagle engine: %s weights, %s, %s", target.weights, kernels.describe(self.device),
                    threads.describe())
        self.eos_token_ids = set(target.config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.free_slots = list(range(max_num_seqs))  # a heap (sorted is one): the lowest free slot goes first
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._incoming: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.stats = SpecDecodeStats(self.k)  # engine-wide, since start
        self.num_finished = 0
        self.num_preemptions = 0  # running requests that gave their blocks back (_make_room)
        head = self._build_speculation(speculation_policy, head_k)
        self._build_phases(max_num_batched_tokens, enable_chunked_prefill, max_step_time_ms, calibration_dir, head)
        self.max_forced_run = MAX_FORCED_RUN  # 0: verify no forced tokens past the drafts (token-by-token reference)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()  # request threads build the compiler on first use

    def _build_caches(self, prefix_cache_gb: float | None, kv_cache_gb: float | None) -> None:
        """The target's and the drafter's paged KV caches (a slot per request, blocks from a pool sized by
        kv_memory.pool_blocks, the same count in both) and the prefix cache (None: off)."""
        target, drafter = self.target, self.drafter
        # Room past max_model_len for the verify window and the drafter's padded rows, whose writes are stale.
        # ... and for a padded prefill's rows past a short chunk's end (a chunk is at most the budget or a prompt).
        self.capacity = self.max_model_len + max(
            JOINT_PENDING_ROWS + 2 * self.k + self.tree_rows + self.beam_rows + 2,
            min(self.max_num_batched_tokens, self.max_model_len))
        probe = [target.new_cache(1, BLOCK_SIZE, 2)] + ([drafter.new_cache(1, BLOCK_SIZE, 2)] if drafter else [])
        per_slot = KVCache.blocks_for(self.capacity)
        num_blocks = pool_blocks(sum(c.bytes_per_block for c in probe), self.max_num_seqs * per_slot + 1,
                                 per_slot + 1, kv_cache_gb)
        self.target_cache = target.new_cache(self.max_num_seqs, self.capacity, num_blocks)
        self.drafter_cache = (drafter.new_cache(self.max_num_seqs, self.capacity, num_blocks)
                              if drafter is not None else None)
        self.prefix_cache = (PrefixCache(self.target_cache, self.drafter_cache, target.feature_dim, prefix_cache_gb,
                                         target.norm.weight.dtype) if prefix_cache_gb is not None else None)

    def _build_speculation(self, speculation_policy: str, head_k: int) -> HeadProposer | None:
        """The policy that picks each step's windows, the draft trees' shaper and the proposer the engine asks (the
        head's drafts included); returns the head's proposer, for the start-up timings."""
        spec = self.spec
        # "auto" trees share one tree's extra rows per step (the shaper sizes each tree to what the step has left);
        # a fixed or static tree's come with every request
        step_tree_rows = self.tree_rows * (1 if spec and spec.draft_tree_nodes == "auto" and not spec.token_tree
                                           else self.max_num_seqs)
        # the one cost model of a forward (forward_cost.py), calibrated with the other phases' (_build_phases)
        self.cost = ForwardCost(self.max_num_seqs, self.k, head_k, step_tree_rows)
        self.policy = (make_policy(speculation_policy, self.cost, spec.disable_by_batch_size) if spec
                       else NoSpeculation())
        self.trees = TreeShaper(spec.draft_tree_nodes if self.tree_rows else 0, spec.token_tree if spec else None,
                                self.policy.cost)
        # where the shaper sizes trees and the head drafts in parallel, a drafting window drafts the head's whole K
        # (one pass either way) and the shaper picks the tree within it: the policy decides whether, not how deep
        self.tree_depth = head_k if self.trees.sizes and spec.parallel_drafting else 0
        beams = spec.draft_tree_beams if self.trees.enabled and self.trees.static is None else 0
        head = (HeadProposer(self.drafter, self.drafter_cache, spec.parallel_drafting, self.device, beams)
                if self.drafter is not None else None)
        self.proposer: Proposer = make_proposer(spec, head, self.policy, side_leaves=self.trees.sizes)
        # engine-wide, since start, per drafter that ran (the hybrid has two)
        self.proposer_stats = {name: SpecDecodeStats(self.k) for name in self.proposer.names}
        return head

    def _build_phases(self, max_num_batched_tokens: int, enable_chunked_prefill: bool,
                      max_step_time_ms: float | None, calibration_dir: Path | None,
                      head: HeadProposer | None) -> None:
        """The cost models, calibrated at start-up on scratch rows, and the phases of a step before its decode: the
        drafter's catch-up, the prefix cache's reuse, and prefill."""
        self._step_clock = step_clock(self.device)
        remembered = None
        if calibration_dir is not None:
            remembered = RememberedTimings(calibration_dir, timings_key(self.target, head))
        timings = ScratchTimings(self.target, self.target_cache, head, self.max_num_seqs, self.max_model_len,
                                 self.cost.max_rows, self._step_clock, remembered)
        self.cost.calibrate(timings.target_rows, timings.head_draft, timings.prefill_chunk,
                            timings.drafter_rows if self.drafter is not None else None, self.max_model_len)
        self.step_budget = StepBudget(self._step_clock, self.cost, max_step_time_ms)
        for cache in (self.target_cache, self.drafter_cache):  # the scratch rows' memory goes back (their blocks
            if cache is not None:                                # went back after each timing: ScratchTimings)
                cache.return_free_pages()
        if remembered is not None:
            remembered.save()
            logger.info("peagle engine: start-up timings %s (%s)", "remembered" if not remembered.measured else
                        f"measured ({remembered.measured})", remembered.path)
        row_bytes = self.target.feature_dim * self.target.norm.weight.dtype.itemsize
        self.catch_up = DrafterCatchUp(self.drafter, self.drafter_cache, self.step_budget, max_num_batched_tokens,
                                       row_bytes, self.device)
        self.prefix_reuse = PrefixReuse(self.prefix_cache, self.catch_up)
        self.prefill = Prefill(self.target, self.target_cache, self.step_budget, self.catch_up, self.prefix_reuse,
                               self.proposer, max_num_batched_tokens, enable_chunked_prefill, self._first_token)
        release_freed_memory()  # calibration's scratch activations (a full prefill chunk's) are freed but kept

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
        from peagle.model.loading import config_dir, is_gguf, torch_dtype
        from peagle.model.quant import drafter_quantization
        from peagle.model.speculation import resolve_speculation
        from peagle.model.tokenizer import Tokenizer

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
        tokenizer = Tokenizer.load(meta) if has_tokenizer else None
        spec, drafter = chosen.config, None
        if spec is not None and spec.uses_head:
            # the head looks its token rows up through the target's embedding: no copy of the table
            drafter = load_head(chosen.head_path, target_embeddings=target.embed_tokens, dtype=dtype, device=device)
            # the engine never trains it: pack its weights once for the CPU kernels (no-op elsewhere), in 8 bits
            # beside a block-quantized target
            drafter.pack_(drafter_quantization(spec.quantization, target.quantized))
            release_freed_memory()  # loading's float copies, before the caches are allocated above them
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
            self._make_room()
            touched, prefilled = self.prefill.step(self.running)
            if touched and on_first_tokens is not None:
                on_first_tokens([self._report(r) for r in touched if not r.finished])
            plan = self._plan([r for r in self.running if not r.finished and not r.prefilling])
            caught_up, behind = self.catch_up.before_drafting(self.running, plan)
            plan = plan.holding_back(behind)
            self.step_budget.end_prefill(prefilled, caught_up)
            if plan.windows:
                self._decode_step(plan)
            self.step_budget.end_step(decoded=bool(plan.windows))
            for req in dict.fromkeys(touched + [w.request for w in plan.windows]):
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
            if req.num_preemptions:  # it had run: what the policy and the proposer keep of it goes
                self._forget(req)
        for req in [r for r in self.running if r.request_id in aborted]:
            self._finish(req, "abort")
            reports[req.request_id] = self._report(req)
            self._retire_if_finished(req)

    def _admit(self) -> None:
        """Waiting requests take the free slots, in order, while the pool holds their first step beside the running
        requests' next (their prefill is budgeted step by step: prefill.py)."""
        caches = [c for c in (self.target_cache, self.drafter_cache) if c is not None]
        # blocks the running requests' next step needs, counted once and grown with each admission: thousands of
        # waiting requests would otherwise recount every running one per admission
        missing = [self._blocks_missing(c, self.running) for c in caches]
        while self.waiting and self.free_slots and all(
                self._fits(c, m + self._blocks_missing(c, [self.waiting[0]])) for c, m in zip(caches, missing)):
            req = self.waiting.popleft()
            req.slot = heapq.heappop(self.free_slots)
            self.running.append(req)
            missing = [m + self._blocks_missing(c, [req]) for c, m in zip(caches, missing)]
            if self.prefix_cache is not None and req.params.prompt_logprobs is None and not req.num_preemptions:
                self.prefix_cache.queries += len(req.prompt_ids)  # looked up once its prefill begins

    def _step_length(self, req: Request) -> int:
        """Positions (from 0) a request's forwards may write in its next step: a prefill chunk and the padded rows
        after it, or a decode step's widest window with forced tokens, and the drafter's rows past it."""
        if req.prefilling:
            return min(req.num_computed + self.max_num_batched_tokens, self.capacity)
        return min(req.num_tokens + self.k + self.tree_rows + self.beam_rows + self.max_forced_run + 1,
                   self.capacity)

    def _admission_length(self, req: Request) -> int:
        """Positions a waiting request needs room for to be admitted: its first step, or, preempted before, all it
        had and a decode step (else, readmitted at once as the newest, it would be the first to go again)."""
        if req.num_preemptions:
            return min(len(req.prefill_ids) + self.k + self.tree_rows + self.beam_rows + self.max_forced_run + 1,
                       self.capacity)
        return self._step_length(req)

    def _room_for(self, reqs: list[Request]) -> bool:
        """Whether the pools hold every request's next step."""
        return all(self._fits(c, self._blocks_missing(c, reqs)) for c in (self.target_cache, self.drafter_cache)
                   if c is not None)

    def _blocks_missing(self, cache: KVCache, reqs: list[Request]) -> int:
        """Blocks `cache` must add for these requests' next step (a waiting one's first)."""
        return sum(cache.blocks_missing(r.slot, self._step_length(r)) if r.slot >= 0 else
                   cache.blocks_for(self._admission_length(r)) for r in reqs)

    def _fits(self, cache: KVCache, missing: int) -> bool:
        """Whether `cache` can add `missing` blocks (counting blocks only the prefix cache holds, which it lets go of
        when asked)."""
        return missing <= cache.num_free_blocks or (self.prefix_cache is not None and missing <= cache.num_free_blocks
                                                    + self.prefix_cache.num_idle_blocks(cache))

    def _make_room(self) -> None:
        """While the running requests' next step does not fit the pools, the newest gives its blocks back
        (vLLM's recompute preemption): it waits at the head of the queue and, readmitted, computes again what it
        had (taking what the prefix cache still holds), then decodes on as if nothing happened."""
        while len(self.running) > 1 and not self._room_for(self.running):
            req = self.running.pop()
            self.prefix_reuse.store_drafter_entries(req)
            self._release(req)
            req.slot = -1
            req.num_preemptions += 1
            req.recompute_ids = req.prompt_ids + req.output_ids[:-1] if req.output_ids else None
            req.num_computed, req.blocks, req.unstored_features = 0, [], []
            req.backlog = DrafterBacklog()
            self.waiting.appendleft(req)
            self.num_preemptions += 1
            logger.info("peagle engine: request %s preempted (%d running, %d KV blocks free)", req.request_id,
                        len(self.running), self.target_cache.num_free_blocks)

    def _plan(self, reqs: list[Request]) -> StepPlan:
        """This step's windows: the proposer's model-free drafts (None: the head's, if any) and the number of drafts
        the policy gives each request (cutting a model-free draft where a longer window stops paying)."""
        if not reqs:
            return StepPlan([])
        drafts = self.proposer.score(reqs)
        ks = self.policy.choose([Candidate(r.request_id, r.params.max_tokens - len(r.output_ids), d)
                                 for r, d in zip(reqs, drafts)])
        if self.tree_depth:  # P-EAGLE drafts every depth in one pass: the tree shaper picks how deep each goes
            ks = [self.tree_depth if k and d is None and r.matcher is None else k for r, k, d in zip(reqs, ks, drafts)]
        return StepPlan([Window(r, k, d, GrammarWindow(r.matcher) if r.matcher is not None else None)
                         for r, k, d in zip(reqs, ks, drafts)])

    def _decode_step(self, plan: StepPlan) -> None:
        """Draft the windows, fit them to the grammars, verify every request's [x_n, window] in one target forward,
        then accept and commit each window and record its outcome."""
        started = self._step_clock()
        self.step_threads.start_step()
        self._draft_windows(plan)
        self._grammar_windows(plan)
        for w, logits, features in zip(plan.windows, *self._verify(plan)):
            self._accept(w, logits, features)
        self.step_threads.end_step((plan.rows, len(plan.head_windows), plan.head_k, plan.verifies_forced_tokens))
        # Timed after the backlogs (work earlier plain steps skipped, not this step's); not a step that verified
        # forced tokens after its drafts, whose layout the cost model does not describe.
        if not plan.verifies_forced_tokens:
            self.cost.observe(plan.rows, len(plan.head_windows), plan.head_k, self._step_clock() - started)

    def _draft_windows(self, plan: StepPlan) -> None:
        """Each drafting window's tree: the head's drafts (one forward for all its windows, at their widest K),
        shaped into a tree where trees are on (draft_tree.TreeShaper, one window at a time against the rows the
        step has so far), and the model-free drafts cut to their K, each a chain with its side leaves grafted on as
        far as they pay (TreeShaper.grow). Under a grammar the drafts were proposed under its mask (the head's) or
        are cut where it stops allowing them (a model-free draft), and a window keeps its chain: the grammar picked
        its drafts."""
        heads, head_k = plan.head_windows, plan.head_k
        made, candidates = [], None
        if heads:
            reqs = [w.request for w in heads]
            drafts, candidates = self.proposer.draft(reqs, torch.tensor([r.slot for r in reqs], device=self.device),
                                                     head_k, TREE_TOP_M if self.trees.enabled else 0,
                                                     [w.grammar for w in heads])
            made = drafts.tolist()
        rows = sum(1 + (w.k if w.by_head else len(w.draft.tokens[: w.k]) if w.k else 0) for w in plan.windows)
        seconds = (lambda n: self.policy.cost.predict(n, len(heads), head_k)) if self.policy.cost else None
        by_head = {id(w): j for j, w in enumerate(heads)}
        for w in plan.windows:
            if not w.k:
                continue
            j = by_head.get(id(w))
            if w.grammar is not None:
                tokens = w.grammar.proposed if j is not None else w.grammar.take(w.draft.tokens[: w.k])
                w.tree = DraftTree.chain(tokens)
            elif j is None:
                w.tree = DraftTree.chain(w.draft.tokens[: w.k])
                if w.draft.leaves and self.trees.sizes:  # its side leaves, as far as they pay
                    w.tree = self.trees.grow(w.tree, len(plan.windows) + sum(w.draft.survival[: w.k]),
                                             w.draft.branches(w.k), self.trees.price(rows - w.k, seconds))
                    rows += len(w.tree) - w.k
            elif candidates is None:
                w.tree = DraftTree.chain(made[j][: w.k])
            else:
                w.tree = self.trees.shape(candidates[j].cut(w.k), len(plan.windows), rows - w.k, seconds)
                rows += len(w.tree) - w.k

    def _grammar_windows(self, plan: StepPlan) -> None:
        """The forced tokens each constrained window verifies after its drafts (GrammarWindow.forced_run), in the
        same forward without being drafted, so a plain step of a constrained request can emit several tokens."""
        for w in plan.windows:
            if w.grammar is not None:
                room = w.request.params.max_tokens - len(w.request.output_ids) - 1 - w.drafted  # and the bonus
                w.forced = tuple(w.grammar.forced_run(min(self.max_forced_run, room)))

    def _verify(self, plan: StepPlan) -> tuple:
        """The target's forward over every request's window [x_n, tokens...] at positions n..n+K_b: per request,
        logits [K_b + 1, V] and features [K_b + 1, 3H]. One K for all: a [B, K + 1] batch. Different K, or a draft
        tree: every row its own batch entry ([sum (K_b + 1), 1]), so no request pays for a wider neighbour's rows
        (attention and the matrix kernels compute each row alone, so the layout never changes a row's result); a
        tree's rows are rotated as their depth and read their own branch (draft_tree.DraftTree.verify_keys)."""
        dev, windows = self.device, plan.windows
        slots = torch.tensor([w.request.slot for w in windows], device=dev)
        rows = [[w.request.last_token, *w.tokens] for w in windows]
        n = [w.request.num_tokens - 1 for w in windows]  # position of x_n, the newest token
        sizes = [len(r) for r in rows]
        trees = any(w.branches for w in windows)
        if len(set(sizes)) == 1 and not trees:
            positions = torch.tensor(n, device=dev)[:, None] + torch.arange(sizes[0], device=dev)[None, :]
            out = self.target(torch.tensor(rows, device=dev), BatchLayout.build(slots, positions), self.target_cache,
                              num_logits=None)
            return out.logits, out.features
        tokens = torch.tensor([t for r in rows for t in r], device=dev)[:, None]
        positions = torch.cat([p + torch.arange(size, device=dev) for p, size in zip(n, sizes)])[:, None]
        layout = BatchLayout.build(slots.repeat_interleave(torch.tensor(sizes, device=dev)), positions)
        if trees:
            rope, keys = [], []
            for w, p, size in zip(windows, n, sizes):
                tree = w.tree if w.branches else DraftTree.chain(w.tokens)
                r, k = tree.verify_keys(p)
                rope += r
                keys += k
            stride = max(map(len, keys))
            layout = BatchLayout.tree(layout.slots, positions, torch.tensor(rope, device=dev)[:, None], torch.tensor(
                [k + [0] * (stride - len(k)) for k in keys], dtype=torch.int32, device=dev))
        out = self.target(tokens, layout, self.target_cache, num_logits=None)
        return out.logits[:, 0].split(sizes), out.features[:, 0].split(sizes)

    def _accept(self, w: Window, logits: torch.Tensor, features: torch.Tensor) -> None:
        """Accept one window against the target's logits [len(w.tokens) + 1, V] (masked as its grammar's states
        allow), commit what it emits, and record its outcome. `features`: the target's at the window's positions,
        the drafter's next real rows and the prefix cache's next blocks. A tree's accepted branch is moved to the
        positions its tokens now hold, and its rows taken as a chain's."""
        req = w.request
        masks = w.grammar.masks() if w.grammar is not None else None
        if masks is not None:
            logits = req.matcher.mask_logits(logits, stack_bias(masks))
        path, emitted = self._verified_path(w, logits)
        if w.branches:
            n = req.num_tokens - 1
            moved = [(n + 1 + i, n + 1 + j) for j, i in enumerate(path) if i != j]
            if moved:
                self.target_cache.move(req.slot, *map(list, zip(*moved)))
            rows = [0] + [i + 1 for i in path]
            logits, features = logits[rows], features[rows]
        if self.drafter is not None:  # positions n..n+a are now verified: the drafter's next real rows
            req.backlog.append(emitted, features[: len(emitted)])
        before = len(req.output_ids)
        self._commit(req, emitted, logits, w.grammar)
        self.proposer.add_tokens(req, req.output_ids[before:])
        # Positions n..n+a now hold their final keys and values: those whose tokens were kept (a stop ends the
        # request, so nothing after it needs the chain) can be reused.
        kept = len(req.output_ids) - before
        if kept > 0:
            self.prefix_reuse.store_blocks(req, features[: min(kept, len(emitted) - 1) + 1])
        forced = count_forced(masks, kept) if masks is not None else 0
        self._record(w.outcome(path, emitted, forced, self.proposer.head_name))

    def _verified_path(self, w: Window, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """What a window accepts (its drafts' node indices) and emits: the accepted drafts, then the target's own
        token (a plain window: sampled)."""
        req = w.request
        if not w.tokens:
            return [], [self._sample_one(req, logits[0])]
        tree = w.tree if w.branches else DraftTree.chain(w.tokens)
        if req.params.greedy:
            return verify_greedy(tree, logits.argmax(-1).tolist())
        return verify_sampled(tree, target_probs(logits, req.params), req.generator)

    def _record(self, outcome: Outcome) -> None:
        """The one place a window's outcome is counted: the request's and the engine's statistics (steps by K,
        acceptance, forced tokens), its drafter's, and what its proposer or the policy learns all derive from it."""
        req = outcome.request
        for stats in (req.spec_stats, self.stats):
            stats.num_forced_tokens += outcome.forced
            if self.spec is not None:
                stats.record(outcome.drafted, outcome.accepted, outcome.depth)
        if self.spec is None:
            return
        if outcome.drafted:
            self.proposer_stats[outcome.proposer].record(outcome.drafted, outcome.accepted, outcome.depth)
        # the proposers' and the policy's estimates are of chains: what a tree's first children would have done
        if outcome.draft is not None:
            self.proposer.observe(req, outcome.draft, outcome.depth, outcome.chain_accepted, outcome.emitted)
        elif outcome.drafted:
            self.policy.observe(req.request_id, outcome.tree.head_depth, outcome.chain_accepted)
            self.trees.observe(outcome.tree, outcome.path)

    def _retire_if_finished(self, req: Request) -> None:
        if req.finished and req in self.running:
            self.prefix_reuse.store_drafter_entries(req)
            self.running.remove(req)
            self._release(req)
            req.finished_at = time.perf_counter()
            req.backlog.clear()
            self._forget(req)
            self.num_finished += 1

    def _forget(self, req: Request) -> None:
        self.policy.forget(req.request_id)
        self.proposer.finish(req)

    def _release(self, req: Request) -> None:
        """The request's cache slot, and the blocks it holds, go back."""
        for cache in (self.target_cache, self.drafter_cache):
            if cache is not None:
                cache.release(req.slot)
        heapq.heappush(self.free_slots, req.slot)

    def _first_token(self, req: Request, logits: torch.Tensor) -> int:
        """The token after a complete prompt (prefill.py), from its last row's logits: sampled and committed."""
        last = logits if req.matcher is None else req.matcher.mask_logits(logits)
        first = self._sample_one(req, last)
        req.first_token_at = time.perf_counter()
        self._commit(req, [first], last[None])
        return first

    def _sample_one(self, req: Request, logits: torch.Tensor) -> int:
        if req.params.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(target_probs(logits, req.params), 1, generator=req.generator))

    # -- output ------------------------------------------------------------------------------------------------
    def _commit(self, req: Request, tokens: list[int], logits: torch.Tensor,
                grammar: GrammarWindow | None = None) -> None:
        """Append tokens one by one, stopping exactly at EOS, a stop token, max_tokens or a stop string.
        logits[i] are the target's logits that tokens[i] was drawn from (for log-probabilities); `grammar`: the
        step's window on the request's grammar, settled against what was committed."""
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
        if grammar is not None:
            grammar.settle(req.output_ids[before:])
        elif req.matcher is not None:
            req.matcher.commit(req.output_ids[before:])
        if req.matcher is not None and req.matcher.error is not None and req.finished:
            # it ended on the end of sequence it was left with
            logger.warning("request %s: structured output stopped: %s", req.request_id, req.matcher.error)
            req.finish_reason = "abort"
        if p.logprobs is not None:
            kept = req.output_ids[before:]
            req.logprobs += token_logprobs(target_logprobs(logits[: len(kept)], p), kept, p.logprobs)
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
            num_prompt_tokens=len(req.prompt_ids), spec_stats=req.spec_stats, num_cached_tokens=req.num_cached_tokens,
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
