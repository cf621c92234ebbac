"""The suffix trie against a brute-force count over the raw sequences, its eviction bound, key isolation and
determinism (docs/design.md, "Suffix drafts")."""
import math
import random
import sys
import tracemalloc

import pytest

from peagle.engine.proposers.suffix_tree import NO_DRAFT, SuffixCache, SuffixTrie, _kids, _Node


def reference_draft(texts, context, depth, max_spec, factor, min_prob):
    """Count continuations in the raw sequences: the definition the trie must reproduce."""
    def occurrences(pattern):
        k = len(pattern)
        return [(s, j) for s in texts for j in range(len(s) - k + 1) if list(s[j:j + k]) == pattern]

    best = (0.0, 0, [])  # score, match_len, tokens
    for length in range(1, min(depth, len(context)) + 1):
        pattern = list(context[-length:])
        if not occurrences(pattern):
            break
        limit = min(max_spec, math.ceil(factor * length - 1e-9))
        tokens, cum, score = [], 1.0, 0.0
        while len(tokens) < limit and len(pattern) < depth:
            nexts = [s[j + len(pattern)] for s, j in occurrences(pattern) if j + len(pattern) < len(s)]
            if not nexts:
                break
            counts = {t: nexts.count(t) for t in nexts}
            t = min(counts, key=lambda x: (-counts[x], x))
            cum *= counts[t] / len(nexts)
            if cum < min_prob:
                break
            tokens.append(t)
            score += cum
            pattern.append(t)
        if tokens and (round(score, 9), length) > (round(best[0], 9), best[1]):
            best = (score, length, tokens)
    return best


def check_invariants(trie):
    """Every node's total is its children's counts; best is the most frequent child; counters are right."""
    nodes = leaves = dicts = 0
    stack = [trie.root]
    while stack:
        node = stack.pop()
        nodes += 1
        if node.children is None:
            assert node.only is None or node.best >= 0
        else:
            dicts += 1
            assert node.only is None
        counts = {t: (c.count if type(c) is _Node else 1) for t, c in _kids(node).items()}
        assert node.total == sum(counts.values())
        assert node.best == (min(counts, key=lambda t: (-counts[t], t)) if counts else -1)
        assert node.best_count == (counts[node.best] if counts else 0)
        for c in _kids(node).values():
            if type(c) is _Node:
                assert 0 < c.count <= max(node.count, c.count if node is trie.root else node.count)
                stack.append(c)
            else:
                leaves += 1
    assert (nodes, leaves, dicts) == (trie.num_nodes, trie.num_leaves, trie.num_dicts)


def random_text(rng, n, vocab):
    # runs of copied spans, so that long matches happen
    out = []
    while len(out) < n:
        if out and rng.random() < 0.5:
            j = rng.randrange(len(out))
            out += out[j:j + rng.randint(1, 8)]
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


@pytest.mark.parametrize("seed", range(6))
def test_own_drafts_match_brute_force_as_tokens_arrive(seed):
    rng = random.Random(seed)
    depth = rng.choice([3, 5, 8])
    cache = SuffixCache(max_tree_depth=depth)
    text = random_text(rng, 70, rng.choice([2, 4, 9]))
    cut = rng.randrange(1, 20)
    first = rng.randrange(0, cut + 1)  # the prompt may come in two pieces, as a chunked prefill indexes it
    cache.start_request("r", text[:first])
    if first < cut:
        cache.add_prompt_tokens("r", text[first:cut])
    pos = cut
    while pos < len(text):
        step = rng.randint(1, 4)
        cache.add_tokens("r", text[pos:pos + step])
        pos += step
        context = text[:pos]
        max_spec, factor, min_prob = rng.choice([1, 4, 16]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.5])
        draft = cache.speculate("r", max_spec, factor, min_prob)
        score, match_len, tokens = reference_draft([context], context, depth, max_spec, factor, min_prob)
        assert draft.tokens == tokens, (context, draft)
        assert draft.score == pytest.approx(score) and draft.match_len == match_len
        cum = 1.0
        for p in draft.probs:
            cum *= p
            assert cum >= min_prob
        assert len(draft.tokens) <= max_spec and len(draft.probs) == len(draft.tokens)
    check_invariants(cache._requests["r"].cursor.trie)


def test_prompt_tokens_come_before_the_output():
    cache = SuffixCache()
    cache.start_request("r", [1, 2])
    cache.add_prompt_tokens("r", [3])
    cache.add_tokens("r", [4])
    with pytest.raises(ValueError, match="prompt tokens must come first"):
        cache.add_prompt_tokens("r", [5])
    cache.stop_request("r")
    assert cache.num_cached_tokens == 1  # the output alone joins the shared trie


@pytest.mark.parametrize("seed", range(4))
def test_shared_drafts_match_brute_force_through_evictions(seed):
    rng = random.Random(100 + seed)
    depth = rng.choice([4, 6])
    cache = SuffixCache(max_tree_depth=depth, max_cached_requests=5, max_cached_tokens=120)
    vocab = rng.choice([3, 6])
    kept = []  # the outputs the shared trie should hold, oldest first
    for i in range(30):
        prompt, output = random_text(rng, rng.randint(0, 10), vocab), random_text(rng, rng.randint(1, 40), vocab)
        cache.start_request(f"q{i}", prompt)
        cache.add_tokens(f"q{i}", output)
        context = prompt + output
        draft = cache.speculate(f"q{i}", 8, 1.0, 0.0, use_shared=True)
        own = reference_draft([context], context, depth, 8, 1.0, 0.0)
        shared = reference_draft(kept, context, depth, 8, 1.0, 0.0) if kept else (0.0, 0, [])
        expect = shared if round(shared[0], 9) > round(own[0], 9) else own
        assert draft.tokens == expect[2]
        cache.stop_request(f"q{i}")
        kept.append(output)
        while len(kept) > 5 or sum(map(len, kept)) > 120:
            kept.pop(0)
        assert cache.num_cached_requests == len(kept) and cache.num_cached_tokens == sum(map(len, kept))
        check_invariants(cache._shared[""].trie)


def test_removing_every_sequence_empties_the_trie():
    rng = random.Random(7)
    trie = SuffixTrie(5)
    seqs = [random_text(rng, rng.randint(1, 50), 3) for _ in range(12)]
    for s in seqs:
        trie.insert(s)
    check_invariants(trie)
    for s in rng.sample(seqs, len(seqs)):
        trie.remove(s)
        check_invariants(trie)
    assert (trie.num_nodes, trie.num_leaves, _kids(trie.root)) == (1, 0, {})


def exact_memory_bytes(cache):
    return sum(s.trie.memory_bytes() for s in cache._shared.values()) + \
        sum(sys.getsizeof(out) for _, out in cache._cached.values())


@pytest.mark.parametrize("bounds", [dict(max_cached_requests=40, max_cached_tokens=3000),
                                    dict(max_cached_bytes=400_000)])
def test_eviction_bounds_memory(bounds):
    """A stream of 1,000 requests (under 3 keys) through small bounds: each holds after every request, and the
    memory stays flat (`benchmarks/micro.py suffix` runs 10,000 at the default bounds)."""
    rng = random.Random(3)
    cache = SuffixCache(max_tree_depth=12, **bounds)
    peak_early = peak_late = 0
    for i in range(1000):
        cache.start_request(str(i), random_text(rng, 20, 500), cache_key=str(i % 3))
        cache.add_tokens(str(i), random_text(rng, rng.randint(1, 150), 500))
        cache.stop_request(str(i))
        assert cache.num_cached_requests <= bounds.get("max_cached_requests", 10**9)
        assert cache.num_cached_tokens <= bounds.get("max_cached_tokens", 10**9)
        assert cache.memory_bytes() == exact_memory_bytes(cache) <= bounds.get("max_cached_bytes", 10**9)
        if i < 200:
            peak_early = max(peak_early, cache.memory_bytes())
        else:
            peak_late = max(peak_late, cache.memory_bytes())
    assert peak_late < 1.3 * peak_early
    assert not cache._requests


def test_memory_estimate_is_close_to_measured():
    rng = random.Random(11)
    outputs = [random_text(rng, 200, 2000) for _ in range(60)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = SuffixCache(max_tree_depth=16)
    for i, out in enumerate(outputs):
        cache.start_request(str(i), [])
        cache.add_tokens(str(i), out)
        cache.stop_request(str(i))
    measured = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 1.0 <= cache.memory_bytes() / measured < 1.6, (cache.memory_bytes(), measured)  # an upper estimate


def test_one_keys_text_is_never_drafted_for_another():
    secret = list(range(1000, 1030))
    cache = SuffixCache()
    cache.start_request("a", [1, 2, 3], cache_key="alice")
    cache.add_tokens("a", secret)
    cache.stop_request("a")
    for key, expect in (("bob", []), ("", []), ("alice", secret[3:6])):
        cache.start_request(key + "-r", [7, 8], cache_key=key)
        cache.add_tokens(key + "-r", secret[:3])
        draft = cache.speculate(key + "-r", 8)  # 3 tokens matched: 3 drafted at max_spec_factor 1
        assert draft.tokens == expect, key
        cache.abort_request(key + "-r")
    # a key's outputs reach only its own trie; aborted requests join none
    assert set(cache._shared) == {"alice"} and cache.num_cached_requests == 1


def test_drafts_are_deterministic_and_ties_go_to_the_lowest_token():
    def run():
        rng = random.Random(5)
        cache = SuffixCache(max_tree_depth=8)
        cache.start_request("r", random_text(rng, 30, 5))
        drafts = []
        for _ in range(40):
            cache.add_tokens("r", [rng.randrange(5)])
            drafts.append(cache.speculate("r", 6, 1.0, 0.0))
        return drafts
    first = run()
    assert first == run() and any(d.tokens for d in first)
    cache = SuffixCache(max_tree_depth=6)
    cache.start_request("r", [1, 9, 1, 4])  # after "1": 9 once, 4 once
    cache.add_tokens("r", [1])
    draft = cache.speculate("r", 1, 1.0, 0.0)
    assert draft.tokens == [4] and draft.probs == [0.5] and draft.match_len == 1


def test_limits_on_draft_length():
    cache = SuffixCache(max_tree_depth=24)
    text = list(range(40))
    cache.start_request("r", text + text[:4])
    assert cache.speculate("r", 16, 1.0).tokens == text[4:8]  # 4 matched tokens allow 4 at factor 1
    assert cache.speculate("r", 16, 2.0).tokens == text[4:12]
    assert cache.speculate("r", 3, 2.0).tokens == text[4:7]
    assert cache.speculate("r", 0) == NO_DRAFT


def test_bad_use_names_the_problem():
    cache = SuffixCache()
    with pytest.raises(KeyError, match="not started"):
        cache.add_tokens("nope", [1])
    cache.start_request("r", [1])
    with pytest.raises(ValueError, match="already started"):
        cache.start_request("r", [1])
    with pytest.raises(ValueError, match="max_tree_depth"):
        SuffixCache(max_tree_depth=0)
