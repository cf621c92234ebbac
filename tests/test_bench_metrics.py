"""Benchmark arithmetic on hand-made timings: OTPS, TTFT/TPOT/ITL percentiles, acceptance, best-K ratios, targets,
and the table built from them."""
from __future__ import annotations

import math

import pytest

from peagle.bench.loadgen import parse_spec_metrics, spec_metrics_delta
from peagle.bench.metrics import (RequestResult, RunMetrics, best_k, distribution_ms, merge_spec, percentile, ratio,
                                  summarize)
from peagle.bench.report import build_report, evaluate_targets, markdown, otps_table


def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 90) == pytest.approx(3.7)  # numpy.percentile([1,2,3,4], 90)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_distribution_in_ms():
    d = distribution_ms([0.010, 0.020, 0.030])
    assert d["mean"] == pytest.approx(20.0) and d["median"] == pytest.approx(20.0)
    assert d["p99"] == pytest.approx(29.8)
    assert d["max"] == pytest.approx(30.0)
    assert distribution_ms([])["mean"] is None and distribution_ms([])["max"] is None


def test_tpot_of_one_request():
    r = RequestResult("a", output_tokens=5, ttft=0.2, latency=1.0)
    assert r.tpot == pytest.approx(0.2)  # (1.0 - 0.2) / (5 - 1)
    assert RequestResult("b", output_tokens=1, ttft=0.2, latency=0.2).tpot is None
    assert RequestResult("c", ok=False, output_tokens=5, ttft=0.2, latency=1.0).tpot is None


def test_summarize_hand_made_run():
    # Two requests in 2 s: 10 + 30 tokens -> 20 tok/s. One failure is counted but adds no tokens.
    a = RequestResult("a", prompt_tokens=7, output_tokens=10, ttft=0.1, latency=1.0, itl=[0.1] * 9)
    b = RequestResult("b", prompt_tokens=3, output_tokens=30, ttft=0.3, latency=1.8, itl=[0.05] * 29)
    c = RequestResult("c", ok=False, error="HTTP 500: boom", output_tokens=99, ttft=None, latency=0.5)
    m = summarize([a, b, c], 2.0, "baseline", 0, 2)
    assert m.otps == pytest.approx(20.0)
    assert m.total_output_tokens == 40 and m.total_input_tokens == 10
    assert m.num_requests == 3 and m.num_failed == 1 and m.errors == ["HTTP 500: boom"]
    assert m.request_throughput == pytest.approx(1.0)
    assert m.ttft_ms["mean"] == pytest.approx(200.0)
    # TPOT per request: a 0.1 s, b 1.5/29 s
    assert m.tpot_ms["mean"] == pytest.approx((100.0 + 1500.0 / 29) / 2, rel=1e-4)
    # ITL pooled over all gaps: 9 of 100 ms and 29 of 50 ms
    assert m.itl_ms["median"] == pytest.approx(50.0)
    assert m.itl_ms["p90"] == pytest.approx(percentile([100.0] * 9 + [50.0] * 29, 90))
    assert m.itl_ms["mean"] == pytest.approx((9 * 100 + 29 * 50) / 38, rel=1e-4)
    assert m.e2el_ms["median"] == pytest.approx(1400.0)
    assert m.acceptance is None


def test_acceptance_merges_like_vllm():
    s1 = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12, "accepted_per_position": [6, 4, 2]}
    s2 = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 8, "accepted_per_position": [5, 2, 1]}
    m = merge_spec([s1, s2, None])
    assert m["num_drafts"] == 20 and m["num_accepted_tokens"] == 20
    assert m["mean_acceptance_length"] == pytest.approx(2.0)  # 1 + 20 / 20
    assert m["acceptance_per_position"] == pytest.approx([0.55, 0.3, 0.15])
    assert m["acceptance_rate"] == pytest.approx(20 / 60, abs=1e-4)
    assert merge_spec([None, {"num_drafts": 0}]) is None


def test_prometheus_counter_delta():
    before = parse_spec_metrics('# HELP x\nvllm:spec_decode_num_drafts_total{model_name="m"} 5.0\n'
                                'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 15.0\n'
                                'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 3.0\n'
                                'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0\n'
                                'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0\n')
    after = parse_spec_metrics('vllm:spec_decode_num_drafts_total{model_name="m"} 15.0\n'
                               'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 45.0\n'
                               'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 18.0\n'
                               'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 10.0\n'
                               'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 6.0\n'
                               'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 2.0\n')
    d = spec_metrics_delta(before, after)
    assert d["num_drafts"] == 10 and d["num_accepted_tokens"] == 15
    assert d["accepted_per_position"] == [8, 5, 2]
    assert d["mean_acceptance_length"] == pytest.approx(2.5)
    assert spec_metrics_delta(after, after) is None


def test_best_k_and_ratio():
    assert best_k({3: 10.0, 7: 12.0, 11: 11.0}) == (7, 12.0)
    assert best_k({3: 12.0, 7: 12.0}) == (3, 12.0)  # ties: the smaller K
    assert best_k({3: None, 7: 0.0}) == (None, None)
    assert ratio(13.0, 10.0) == pytest.approx(1.3)
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


def _run(method, k, c, otps, accept_len=None):
    acc = None
    if accept_len is not None:
        acc = merge_spec([{"num_drafts": 100, "num_draft_tokens": 100 * k,
                           "num_accepted_tokens": round((accept_len - 1) * 100),
                           "accepted_per_position": [round((accept_len - 1) * 100)] + [0] * (k - 1)}])
    empty = distribution_ms([])
    return RunMetrics(method, k, c, 10, 0, 10.0, 100, int(otps * 10), otps, 1.0, empty, empty, empty, empty, acc)


def _sweep():
    return [_run("baseline", 0, 1, 10.0), _run("baseline", 0, 8, 40.0),
            _run("eagle3", 3, 1, 18.0, 1.9), _run("eagle3", 7, 1, 20.0, 2.0),
            _run("eagle3", 3, 8, 50.0, 1.9), _run("eagle3", 7, 8, 45.0, 2.0),
            _run("peagle", 3, 1, 24.0, 2.4), _run("peagle", 7, 1, 27.0, 2.9),
            _run("peagle", 3, 8, 55.0, 2.4), _run("peagle", 7, 8, 49.0, 2.9),
            _run("transformers", 0, 1, 8.0)]


def test_best_k_ratios_in_report():
    report = build_report(_sweep(), {"dataset": "humaneval"})
    c1, c8 = report["table"]
    assert c1["best_k"] == {"peagle": 7, "eagle3": 7}
    assert c1["peagle_vs_eagle3"] == pytest.approx(27 / 20) and c1["peagle_vs_baseline"] == pytest.approx(2.7)
    assert c8["best_k"] == {"peagle": 3, "eagle3": 3}
    assert c8["peagle_vs_eagle3"] == pytest.approx(1.1) and c8["peagle_vs_baseline"] == pytest.approx(55 / 40)
    table = otps_table(report)
    assert "| 1 | 10.0 | 18.0 | **20.0** | 24.0 | **27.0** | 1.35x (K=7 vs K=7) | 2.70x (K=7) | 8.0 |" in table
    assert "transformers generate()" in table.splitlines()[0]


def test_targets_met_and_missed():
    targets = {t["id"]: t for t in evaluate_targets(_sweep(), "humaneval")}
    assert targets["c1_peagle_vs_eagle3"]["status"] == "met"  # 1.35 >= 1.3
    assert targets["c1_peagle_vs_baseline"]["status"] == "met"  # 2.7 >= 2.5
    assert targets["c8_peagle_vs_eagle3"]["status"] == "met"
    slow = [r for r in _sweep() if r.method != "peagle"] + [_run("peagle", 3, 1, 21.0, 1.05),
                                                            _run("peagle", 3, 8, 40.0, 1.05)]
    targets = {t["id"]: t for t in evaluate_targets(slow, "mtbench")}
    assert targets["c1_peagle_vs_eagle3"]["status"] == "missed"
    assert "acceptance length is 1.05" in targets["c1_peagle_vs_eagle3"]["why"]
    assert "defined on HumanEval" in targets["c1_peagle_vs_eagle3"]["why"]
    only_c1 = [r for r in _sweep() if r.concurrency == 1]
    assert {t["id"]: t for t in evaluate_targets(only_c1, "humaneval")}["c8_peagle_vs_eagle3"]["status"] == \
        "not measured"


def test_markdown_has_every_section():
    text = markdown(build_report(_sweep(), {"dataset": "humaneval", "heads": {
        "peagle": {"path": "/h/p", "untrained": True}}}), {"otps_vs_concurrency": "otps_vs_concurrency.png"})
    for needle in ("## Output tokens/s", "## Targets", "Mean acceptance length", "Per-position acceptance",
                   "## Latency", "UNTRAINED", "![otps_vs_concurrency](otps_vs_concurrency.png)", "**met**"):
        assert needle in text, needle


def test_adaptive_against_the_better_of_best_fixed_k_and_no_speculation():
    def adaptive(c, otps, mean_k):
        run = _run("peagle", 7, c, otps, 1.5)
        run.policy, run.acceptance["mean_k"] = "adaptive", mean_k
        return run

    # c=1: speculation wins (best fixed 27.0), adaptive keeps 26.5 (0.98x); c=8: plain decoding is close to the best
    # fixed K (55.0), adaptive reaches only 52.0 (0.945x).
    runs = _sweep() + [adaptive(1, 26.5, 5.1), adaptive(8, 52.0, 0.4)]
    report = build_report(runs, {"dataset": "mtbench"})
    c1, c8 = report["table"]
    assert c1["best_k"]["peagle"] == 7 and c8["best_k"]["peagle"] == 3  # adaptive runs are not a fixed K
    assert c1["adaptive_vs_best_otps"] == {"peagle": pytest.approx(26.5 / 27, abs=1e-4)}
    targets = {t["id"]: t for t in report["targets"]}
    assert targets["c1_peagle_adaptive"]["status"] == "met" and targets["c8_peagle_adaptive"]["status"] == "missed"
    assert targets["c8_peagle_adaptive"]["against"] == "P-EAGLE K=3"
    assert "0.40 drafts per step" in targets["c8_peagle_adaptive"]["why"]
    table = otps_table(report)
    assert "P-EAGLE adaptive K<=7" in table and "| 0.98x |" in table and "| 0.95x |" in table
    assert "Drafts verified per decode step" in markdown(report)


def test_request_body_from_load_settings():
    from peagle.bench.datasets import BenchPrompt
    from peagle.bench.loadgen import LoadSettings, request_body

    prompt = BenchPrompt("p", "hi")
    assert request_body(prompt, LoadSettings(max_tokens=8), 3) == {
        "max_tokens": 8, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}]}
    settings = LoadSettings(max_tokens=8, temperature=0.7, seed=10, chat=False, model="m", ignore_eos=True,
                            cache_salt="run-c4")
    body = request_body(prompt, settings, 3)
    assert body["seed"] == 13 and body["prompt"] == "hi" and "messages" not in body  # request i: seed + i
    assert body["model"] == "m" and body["ignore_eos"] is True and body["temperature"] == 0.7
    assert body["cache_salt"] == "run-c4"
