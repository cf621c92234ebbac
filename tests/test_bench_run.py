"""Short real benches on a tiny random chat model (SmolLM2's tokenizer, random weights) with untrained heads: the
offline path with every method, a `peagle serve` subprocess per configuration, and --url against a running server.
Each must produce a complete table, JSON and plots with positive numbers."""
from __future__ import annotations

import json

from peagle.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def _common(model, out, *extra):
    return ["bench", "--model", str(model), "--random-heads", "--num-prompts", "3", "--max-tokens", "8",
            "--threads", "1", "--no-progress", "--out", str(out), *extra]


def _check_outputs(out, expected_runs: int) -> dict:
    report = json.loads((out / "results.json").read_text())
    runs = report["runs"]
    assert len(runs) == expected_runs
    for r in runs:
        assert r["num_failed"] == 0, r["errors"]
        assert r["otps"] > 0 and r["total_output_tokens"] > 0 and r["duration"] > 0
        assert r["ttft_ms"]["mean"] > 0
        assert (r["cpu_otps"] is None) == (report["meta"]["mode"] == "url")  # a running server's CPU is not ours
        assert r["cpu_otps"] is None or r["cpu_otps"] > 0
        if r["method"] in ("eagle3", "peagle") and r["policy"] == "fixed":  # adaptive may take only plain steps
            assert r["acceptance"]["num_drafts"] > 0
            assert len(r["acceptance"]["acceptance_per_position"]) == r["k"]
    md = (out / "results.md").read_text()
    assert "## Output tokens/s" in md and "## Targets" in md
    assert ("UNTRAINED" in md) == any(h["untrained"] for h in report["meta"]["heads"].values())
    for name in ("otps_vs_concurrency", "tpot_vs_concurrency", *(
            ("acceptance_per_position", "acceptance_length") if report["acceptance"] else ())):
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 2000, name
    return report


def test_offline_bench_every_method(tiny_chat_llama, tmp_path, capsys, one_thread):
    out = tmp_path / "offline"
    assert main(_common(tiny_chat_llama, out, "--offline", "--concurrency", "1,2", "--k", "2,3,adaptive")) == 0
    # baseline x2, EAGLE-3 and P-EAGLE x (2 fixed K + adaptive) x 2 concurrencies, transformers x2, prompt lookup
    report = _check_outputs(out, 2 + 6 + 6 + 2 + 1)
    assert [row["concurrency"] for row in report["table"]] == [1, 2]
    assert all(row["peagle_vs_eagle3"] > 0 and row["peagle_vs_baseline"] > 0 for row in report["table"])
    assert {t["status"] for t in report["targets"][:2]} <= {"met", "missed"}
    assert report["targets"][2]["status"] == "not measured"  # no concurrency 8 here
    assert report["meta"]["heads"]["peagle"]["untrained"] is True
    adaptive = [t for t in report["targets"] if t["id"].endswith("_adaptive")]
    assert [t["concurrency"] for t in adaptive] == [1, 2, 1, 2]  # EAGLE-3, then P-EAGLE
    assert all(t["status"] in ("met", "missed") and t["ratio"] > 0 for t in adaptive)
    assert all(r["acceptance"]["mean_k"] <= 3 for r in report["runs"] if r["policy"] == "adaptive")
    table = (out / "results.md").read_text()
    for col in ("No speculation", "EAGLE-3 K=3", "P-EAGLE K=2", "P-EAGLE adaptive K<=3", "P-EAGLE / EAGLE-3 (best K)",
                "P-EAGLE / no spec (best K)", "P-EAGLE adaptive / best of (fixed K, no spec)",
                "transformers generate()", "transformers prompt lookup", "Drafts verified per decode step"):
        assert col in table, col


def test_server_per_configuration(tiny_chat_llama, tmp_path, one_thread):
    from peagle.bench.plan import TargetHolder, create_random_head

    # An EAGLE-3 head given as the P-EAGLE head: that server refuses to start, and the sweep goes on without it.
    head = create_random_head("eagle3", tiny_chat_llama, TargetHolder(), tmp_path / "eagle3-head")
    out = tmp_path / "served"
    assert main(_common(tiny_chat_llama, out, "--methods", "eagle3,peagle", "--k", "2,adaptive", "--concurrency",
                        "1,2", "--eagle3-head", str(head), "--peagle-head", str(head))) == 0
    report = _check_outputs(out, 4)
    assert report["meta"]["mode"] == "server"
    assert {r["method"] for r in report["runs"]} == {"eagle3"}
    assert [r["policy"] for r in report["runs"]] == ["fixed", "fixed", "adaptive", "adaptive"]
    for log in ("eagle3-k2.log", "eagle3-k2-adaptive.log"):
        assert (out / "logs" / log).read_text().count("listening on http://127.0.0.1:") == 1
    assert report["meta"]["server_startup_s"]["EAGLE-3 K=2"] > 0
    failed = [n for n in report["meta"]["notes"] if n.startswith("P-EAGLE K=2 was not measured")]
    assert failed and "parallel_drafting" in failed[0]
    assert "P-EAGLE K=2 was not measured" in (out / "results.md").read_text()


def test_url_of_a_running_server(tiny_chat_llama, tmp_path, one_thread):
    from peagle.bench.plan import TargetHolder, create_random_head
    from peagle.bench.loadgen import ServerProcess

    head = create_random_head("peagle", tiny_chat_llama, TargetHolder(), tmp_path / "head")
    spec = json.dumps({"model": str(head), "method": "eagle3", "num_speculative_tokens": 2,
                       "parallel_drafting": True})
    out = tmp_path / "url"
    # fixed K, so that every step drafts: under the server's default adaptive policy it may take only plain steps
    with ServerProcess(str(tiny_chat_llama), spec, 2, tmp_path / "server.log", threads=1,
                       extra_args=["--speculation-policy", "fixed"]) as server:
        assert main(["bench", "--url", server.url, "--model", str(tiny_chat_llama), "--num-prompts", "3",
                     "--max-tokens", "8", "--concurrency", "2", "--no-progress", "--out", str(out)]) == 0
    report = _check_outputs(out, 1)
    run = report["runs"][0]
    assert (run["method"], run["k"]) == ("peagle", 2)  # read from the server's /v1/models
    assert report["meta"]["heads"]["peagle"] == {"path": str(head), "untrained": True}
