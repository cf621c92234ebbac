"""Suffix drafts: a depth-bounded suffix trie with counts over each request's prompt and output, and one shared
trie per cache key over recent finished requests' outputs (as suffix decoding, arXiv 2411.04975). The draft is the
most frequent continuation of the longest-scoring match of the context's last tokens (docs/design.md, "Suffix
drafts").

The trie holds every substring of at most `max_tree_depth` tokens of its sequences, each node counting the
occurrences of its string. Tails that occur once are not spelled out node by node: a *leaf* points into the sequence
that holds them, so a trie over novel text costs about one leaf per token, and a node is made only where two
occurrences share a string. Appending a token touches only the suffixes that sit on nodes (at most max_tree_depth of
them): O(depth) per committed token.
"""
from __future__ import annotations

import heapq
import math
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from peagle.config import (DEFAULT_SUFFIX_CACHED_REQUESTS, DEFAULT_SUFFIX_MIN_TOKEN_PROB, DEFAULT_SUFFIX_SPEC_FACTOR,
                           DEFAULT_SUFFIX_TREE_DEPTH)

MAX_CACHED_TOKENS = 200_000  # shared trees: output tokens kept (all keys together)
MAX_CACHED_BYTES = 64 * 2**20  # shared trees: their memory (memory_bytes' estimate, all keys together)


@dataclass(frozen=True)
class SuffixDraft:
    tokens: list[int]  # the proposed continuation, possibly empty
    probs: list[float]  # per token: count(child) / continuations of its parent, given the earlier ones accepted
    score: float  # expected number of accepted tokens: the sum of the running products of probs
    match_len: int  # length of the context suffix the draft continues (0 when there is no draft)
    # per token, where `alternatives` asked for them: the other continuations seen after the tokens before it,
    # (token, count, count / continuations), most frequent first (a draft tree's side leaves)
    others: tuple[tuple[tuple[int, int, float], ...], ...] = ()


NO_DRAFT = SuffixDraft([], [], 0.0, 0)


class _Node:
    """The string spelled by the path from the root. `count`: its occurrences; `total`: those followed by a token
    within the depth bound (the sum of the children's counts); `best`: the child with the highest count, lowest token
    id on ties (-1: none), and `best_count` its count. Most nodes have one child: it is kept in `only` (its token is
    `best`) and `children` is None until a second child comes, which saves a dict per node."""

    __slots__ = ("count", "total", "best", "best_count", "only", "children")

    def __init__(self, count: int) -> None:
        self.count = count
        self.total = 0
        self.best = -1
        self.best_count = 0
        self.only: _Node | tuple | None = None
        self.children: dict[int, _Node | tuple] | None = None


# A leaf is a tuple (seq, end, pos): the one occurrence below its parent continues as seq[pos:min(end, len(seq))]
# (end = the occurrence's start + max_tree_depth). A leaf over a live request's list grows as the list does.


def _count(child: _Node | tuple) -> int:
    return child.count if type(child) is _Node else 1


def _kids(node: _Node) -> dict[int, _Node | tuple]:
    """The node's children by token (a new dict when it keeps one child inline)."""
    if node.children is not None:
        return node.children
    return {} if node.only is None else {node.best: node.only}


def _set_best(node: _Node) -> None:
    kids = _kids(node)
    node.best = min(kids, key=lambda t: (-_count(kids[t]), t)) if kids else -1
    node.best_count = _count(kids[node.best]) if kids else 0


class SuffixTrie:
    """The depth-bounded suffix trie over some sequences; `insert` opens a sequence, `remove` takes one out."""

    def __init__(self, max_depth: int = DEFAULT_SUFFIX_TREE_DEPTH) -> None:
        if max_depth < 1:
            raise ValueError(f"max_tree_depth must be at least 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(0)
        self.num_nodes = 1
        self.num_leaves = 0
        self.num_dicts = 0  # nodes with two children or more

    def memory_bytes(self) -> int:
        """An upper estimate of the trie's own memory (not the sequences it points into), from its node and leaf
        counts: tests/test_suffix_tree.py holds it within 1.6x above tracemalloc's count."""
        return self.num_nodes * _NODE_BYTES + self.num_dicts * _DICT_BYTES + self.num_leaves * _LEAF_BYTES + \
            (self.num_nodes + self.num_leaves) * _SLOT_BYTES

    def insert(self, seq: Sequence[int]) -> _Cursor:
        """Add every suffix of `seq` (a list may keep growing: call the cursor's `advance` after appending)."""
        cursor = _Cursor(self, seq)
        cursor.advance()
        return cursor

    def remove(self, seq: Sequence[int]) -> None:
        """Take out a sequence added with `insert` (the same object, fully advanced)."""
        depth, dirty = self.max_depth, {}  # nodes whose best child lost count, by id: each recomputed once
        for start in range(len(seq)):
            node = self.root
            for pos in range(start, min(start + depth, len(seq))):
                t = seq[pos]
                node.total -= 1
                kids = node.children
                child = node.only if kids is None else kids[t]
                if node.best == t:
                    dirty[id(node)] = node
                if type(child) is not _Node:  # this occurrence's own leaf: its path ends here
                    _unlink(node, t)
                    self.num_leaves -= 1
                    break
                child.count -= 1
                if child.count == 0:  # walking on through the detached child keeps the node count right
                    _unlink(node, t)
                    self.num_nodes -= 1
                    self.num_dicts -= child.children is not None
                node = child
        for node in dirty.values():
            _set_best(node)

    def draft(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
              min_token_prob: float, alternatives: int = 0) -> SuffixDraft:
        """The best draft over every match length of the context's last tokens (with `alternatives`: up to that
        many other continuations per token)."""
        # A suffix present holds every shorter one, so the longest present is found by bisection.
        lo, hi = 0, min(self.max_depth, len(context))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._locate(context, mid) is None:
                hi = mid - 1
            else:
                lo = mid
        best, start = NO_DRAFT, None
        for bound, length in _by_bound(range(1, lo + 1), self.max_depth, max_spec_tokens, max_spec_factor):
            if (bound, length) > (round(best.score, 9), best.match_len):
                node, leaf, pos = self._locate(context, length)
                walked = _walk(node, leaf, pos, length, max_spec_tokens, max_spec_factor, min_token_prob)
                if _better(best, walked) is walked:
                    best, start = walked, (node, leaf, pos)
        return _noting_others(best, start, max_spec_tokens, max_spec_factor, min_token_prob, alternatives)

    def _locate(self, context: Sequence[int], length: int) -> tuple[_Node, tuple | None, int] | None:
        """Where the context's last `length` tokens end: a node, or a leaf and the position after them in its
        sequence; None when they occur nowhere."""
        node, leaf, pos = self.root, None, 0
        for i in range(len(context) - length, len(context)):
            t = context[i]
            if leaf is None:
                kids = node.children
                child = (node.only if t == node.best else None) if kids is None else kids.get(t)
                if child is None:
                    return None
                if type(child) is _Node:
                    node = child
                else:
                    leaf, pos = child, child[2] + 1
            elif pos < leaf[1] and pos < len(leaf[0]) and leaf[0][pos] == t:
                pos += 1
            else:
                return None
        return node, leaf, pos


class _Cursor:
    """Inserts one sequence's suffixes as its tokens arrive. `active`: the suffixes of the tokens so far that end on
    a node, with their start positions; a suffix that enters a leaf is that leaf's only occurrence, and the leaf
    grows with the sequence, so it needs no more work."""

    __slots__ = ("trie", "seq", "done", "active")

    def __init__(self, trie: SuffixTrie, seq: Sequence[int]) -> None:
        self.trie, self.seq, self.done = trie, seq, 0
        self.active: list[tuple[_Node, int]] = []

    def advance(self) -> None:
        trie, seq, depth, root, node_type = self.trie, self.seq, self.trie.max_depth, self.trie.root, _Node
        active = self.active
        for n in range(self.done, len(seq)):
            t = seq[n]
            active.append((root, n))
            moved = []
            deepest = n + 1 - depth  # a suffix that started here has reached the depth bound
            for node, start in active:
                node.total += 1
                kids = node.children
                child = (node.only if t == node.best else None) if kids is None else kids.get(t)
                if child is None:
                    child = (seq, start + depth, n)
                    if kids is not None:
                        kids[t] = child
                    elif node.only is None:
                        node.only = child
                    else:  # a second child
                        node.children = {node.best: node.only, t: child}
                        node.only = None
                        trie.num_dicts += 1
                    trie.num_leaves += 1
                    count = 1
                else:
                    if type(child) is node_type:
                        child.count += 1
                    else:  # two occurrences now share this string: the leaf's tail hangs below a new node
                        lseq, end, lpos = child
                        child = node_type(2)
                        if kids is None:
                            node.only = child
                        else:
                            kids[t] = child
                        trie.num_nodes += 1
                        q = lpos + 1
                        if q < end and q < len(lseq):
                            child.only = (lseq, end, q)
                            child.total = child.best_count = 1
                            child.best = lseq[q]
                        else:
                            trie.num_leaves -= 1
                    count = child.count
                    if start > deepest:
                        moved.append((child, start))
                if t == node.best or count > node.best_count or (count == node.best_count and t < node.best):
                    node.best, node.best_count = t, count
            active = moved
        self.active = active
        self.done = len(seq)

    def draft(self, max_spec_tokens: int, max_spec_factor: float, min_token_prob: float,
              alternatives: int = 0) -> SuffixDraft:
        """The best draft over the sequence's own earlier text: the active suffixes are exactly the matches that
        occurred before (a suffix in a leaf has no earlier occurrence)."""
        best = NO_DRAFT
        nodes = {self.done - start: node for node, start in self.active}
        for bound, length in _by_bound(nodes, self.trie.max_depth, max_spec_tokens, max_spec_factor):
            if (bound, length) > (round(best.score, 9), best.match_len):
                best = _better(best, _walk(nodes[length], None, 0, length, max_spec_tokens, max_spec_factor,
                                           min_token_prob))
        start = (nodes[best.match_len], None, 0) if best.tokens else None
        return _noting_others(best, start, max_spec_tokens, max_spec_factor, min_token_prob, alternatives)


def _unlink(node: _Node, token: int) -> None:
    if node.children is None:
        node.only = None
    else:
        del node.children[token]


def _limit(match_len: int, max_spec_tokens: int, max_spec_factor: float) -> int:
    return min(max_spec_tokens, math.ceil(max_spec_factor * match_len - 1e-9))


def _by_bound(lengths, depth: int, max_spec_tokens: int, max_spec_factor: float) -> list[tuple[int, int]]:
    """(bound, match length), highest bound first: a match's score is at most its draft's length (each token adds
    at most 1), so a match whose bound cannot beat the best draft so far (by `_better`'s rule) is not walked."""
    bounds = [(min(_limit(n, max_spec_tokens, max_spec_factor), depth - n), n) for n in lengths]
    return sorted(bounds, reverse=True)


def _better(a: SuffixDraft, b: SuffixDraft) -> SuffixDraft:
    """The higher score; on a tie (to 9 digits, so that summation order does not matter) the longer match; an empty
    draft never wins."""
    if not b.tokens:
        return a
    return b if (round(b.score, 9), b.match_len) > (round(a.score, 9), a.match_len) else a


def _noting_others(draft: SuffixDraft, start: tuple | None, max_spec_tokens: int, max_spec_factor: float,
                   min_token_prob: float, alternatives: int) -> SuffixDraft:
    """The chosen draft walked again from where it started (`start`: node, leaf, position), noting up to
    `alternatives` other continuations per token: once per draft, not for every match length tried."""
    if not alternatives or not draft.tokens:
        return draft
    return _walk(*start, draft.match_len, max_spec_tokens, max_spec_factor, min_token_prob, alternatives)


def _walk(node: _Node, leaf: tuple | None, pos: int, match_len: int, max_spec_tokens: int,
          max_spec_factor: float, min_token_prob: float, alternatives: int = 0) -> SuffixDraft:
    """Follow the most frequent child while the running probability stays at or above min_token_prob, noting up to
    `alternatives` other children of each node passed."""
    limit = _limit(match_len, max_spec_tokens, max_spec_factor)
    tokens: list[int] = []
    probs: list[float] = []
    others: list[tuple] = []
    cum, score = 1.0, 0.0
    while len(tokens) < limit:
        if leaf is None:
            if node.total == 0:
                break
            t = node.best
            child = node.only if node.children is None else node.children[t]
            p = node.best_count / node.total
            cum *= p
            if cum < min_token_prob:
                break
            tokens.append(t)
            probs.append(p)
            if alternatives:
                others.append(_others(node, alternatives))
            score += cum
            if type(child) is _Node:
                node = child
            else:
                leaf, pos = child, child[2] + 1
        else:  # one occurrence: its tokens follow with probability 1
            seq, end, _ = leaf
            k = min(limit - len(tokens), min(end, len(seq)) - pos)
            if k <= 0:
                break
            tokens.extend(seq[pos:pos + k])
            probs.extend([1.0] * k)
            if alternatives:
                others.extend([()] * k)
            score += cum * k
            pos += k
    return SuffixDraft(tokens, probs, score, match_len, tuple(others)) if tokens else NO_DRAFT


def _others(node: _Node, n: int) -> tuple[tuple[int, int, float], ...]:
    """Up to n children of a node besides its best, most frequent first (lowest token id on ties)."""
    if node.children is None:
        return ()
    top = heapq.nsmallest(n, ((-_count(c), t) for t, c in node.children.items() if t != node.best))
    return tuple((t, -c, -c / node.total) for c, t in top)


@dataclass
class _Request:
    seq: list[int]
    cursor: _Cursor
    key: str
    output_start: int  # where the output begins in seq


@dataclass
class _KeyTrie:
    trie: SuffixTrie
    outputs: int = 0


@dataclass
class SuffixCache:
    """Per-request suffix tries over prompt + output so far, and a shared trie per cache key (e.g. an API key) over
    the outputs (not the prompts) of that key's recent finished requests, bounded by max_cached_requests,
    max_cached_tokens and max_cached_bytes over all keys together (checked after each stop_request), evicted oldest
    first. A request drafts from its own trie and its own key's shared trie only, so no key's text is drafted into
    another key's answers. Aborted requests' outputs are dropped (a client cancelled them; they join no shared
    trie)."""

    max_tree_depth: int = DEFAULT_SUFFIX_TREE_DEPTH  # longest match + draft, in tokens
    max_cached_requests: int = DEFAULT_SUFFIX_CACHED_REQUESTS  # shared trees: finished outputs kept, oldest out first
    max_cached_tokens: int = MAX_CACHED_TOKENS
    max_cached_bytes: int = MAX_CACHED_BYTES
    _requests: dict[str, _Request] = field(default_factory=dict, repr=False)
    _shared: dict[str, _KeyTrie] = field(default_factory=dict, repr=False)
    _cached: OrderedDict = field(default_factory=OrderedDict, repr=False)  # n -> (key, output array), oldest first
    _num_stopped: int = 0
    _bytes: int = 0  # memory_bytes, kept as outputs come and go
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be at least 1, got {self.max_tree_depth}")
        if min(self.max_cached_requests, self.max_cached_tokens, self.max_cached_bytes) < 0:
            raise ValueError("max_cached_requests, max_cached_tokens and max_cached_bytes must be >= 0 (0 turns the "
                             "shared trees off)")

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    def start_request(self, request_id: str, prompt_ids: Sequence[int], cache_key: str = "") -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already started; stop or abort it first")
        seq = list(prompt_ids)
        cursor = SuffixTrie(self.max_tree_depth).insert(seq)
        self._requests[request_id] = _Request(seq, cursor, cache_key, len(seq))

    def num_tokens(self, request_id: str) -> int | None:
        """Tokens the request's trie holds (its prompt, then its output), or None when it is not started."""
        req = self._requests.get(request_id)
        return None if req is None else len(req.seq)

    def add_prompt_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """More of the prompt, before any output (a long prompt indexed a chunk at a time as it is prefilled)."""
        req = self._request(request_id)
        if req.output_start != len(req.seq):
            raise ValueError(f"request {request_id!r} already has output: prompt tokens must come first")
        req.seq.extend(token_ids)
        req.cursor.advance()
        req.output_start = len(req.seq)

    def add_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Committed output tokens, in order."""
        req = self._request(request_id)
        req.seq.extend(token_ids)
        req.cursor.advance()

    def stop_request(self, request_id: str) -> None:
        """The request is finished: its output joins its key's shared trie, and the oldest outputs (this one too,
        if it alone is over a bound) leave until every bound holds."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not started")
        output = array("i", req.seq[req.output_start:][:self.max_cached_tokens])
        if not output or min(self.max_cached_requests, self.max_cached_bytes) == 0:
            return
        shared = self._shared.get(req.key)
        if shared is None:
            shared = self._shared[req.key] = _KeyTrie(SuffixTrie(self.max_tree_depth))
            self._bytes += shared.trie.memory_bytes()
        before = shared.trie.memory_bytes()
        shared.trie.insert(output)
        shared.outputs += 1
        self._bytes += shared.trie.memory_bytes() - before + sys.getsizeof(output)
        self._num_stopped += 1
        self._cached[self._num_stopped] = (req.key, output)
        self.num_cached_tokens += len(output)
        while self._cached and (len(self._cached) > self.max_cached_requests
                                or self.num_cached_tokens > self.max_cached_tokens
                                or self._bytes > self.max_cached_bytes):
            self._evict_oldest()

    def abort_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def speculate(self, request_id: str, max_spec_tokens: int, max_spec_factor: float = DEFAULT_SUFFIX_SPEC_FACTOR,
                  min_token_prob: float = DEFAULT_SUFFIX_MIN_TOKEN_PROB, use_shared: bool = True,
                  alternatives: int = 0) -> SuffixDraft:
        """The better (higher score; the request's own on a tie) of the drafts from the request's own trie and its
        key's shared trie. A match of L tokens drafts at most min(max_spec_tokens, ceil(max_spec_factor * L)); with
        `alternatives`, each drafted token comes with up to that many other continuations seen there."""
        req = self._request(request_id)
        if max_spec_tokens <= 0:
            return NO_DRAFT
        best = req.cursor.draft(max_spec_tokens, max_spec_factor, min_token_prob, alternatives)
        shared = self._shared.get(req.key) if use_shared else None
        if shared is not None:
            other = shared.trie.draft(req.seq, max_spec_tokens, max_spec_factor, min_token_prob, alternatives)
            if round(other.score, 9) > round(best.score, 9):
                best = other
        return best

    def memory_bytes(self) -> int:
        """An estimate of the shared tries' memory: their nodes and leaves, and the cached outputs' arrays."""
        return self._bytes

    def _request(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not started (call start_request first)")
        return req

    def _evict_oldest(self) -> None:
        _, (key, output) = self._cached.popitem(last=False)
        shared = self._shared[key]
        before = shared.trie.memory_bytes()
        shared.trie.remove(output)
        shared.outputs -= 1
        self._bytes -= before - shared.trie.memory_bytes() + sys.getsizeof(output)
        self.num_cached_tokens -= len(output)
        if shared.outputs == 0:
            self._bytes -= shared.trie.memory_bytes()
            del self._shared[key]


# Sizes for memory_bytes: a node; a small children dict; a leaf tuple with its two position ints; per child, its token
# id's int object (an array hands out a new one per read).
_NODE_BYTES = sys.getsizeof(_Node(0))
_DICT_BYTES = sys.getsizeof({1: 1, 2: 2})
_LEAF_BYTES = sys.getsizeof((0, 0, 0)) + 2 * sys.getsizeof(10**6)
_SLOT_BYTES = sys.getsizeof(10**6)
