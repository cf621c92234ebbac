"""The heads' campaign keeps its promises: the held-out split does not move as data grows, and a head is re-bundled
only when its benchmark acceptance clearly beats the bundled head's."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(method: str, mal: dict[str, float], k: int = 7) -> list[dict]:
    return [{"method": method, "k": kk, "dataset": d, "mean_acceptance_length": v - 0.01 * (k - kk)}
            for d, v in mal.items() for kk in (3, k)]


def test_rebundling_refuses_a_head_that_is_not_clearly_better():
    """Clearly better overall (+2% averaged over the sets) and worse nowhere."""
    bundle = script("bundle_head")
    old = rows("peagle", {"humaneval": 1.50, "mtbench": 1.40})
    assert bundle.not_better(rows("peagle", {"humaneval": 1.60, "mtbench": 1.45}), old, "peagle") == []
    assert bundle.not_better(rows("peagle", {"humaneval": 1.60, "mtbench": 1.41}), old, "peagle") == []
    why = bundle.not_better(rows("peagle", {"humaneval": 1.60, "mtbench": 1.39}), old, "peagle")
    assert why == ["mtbench: mean acceptance length 1.390 at K=7 is below the bundle's 1.400 at K=7"]
    why = bundle.not_better(rows("peagle", {"humaneval": 1.52, "mtbench": 1.41}), old, "peagle")
    assert len(why) == 1 and why[0].startswith("mean acceptance length +1.0% against the bundle's")
    assert bundle.not_better(rows("peagle", {"humaneval": 1.60}), old, "peagle") == [
        "mtbench: not measured for the new head"]
    assert bundle.not_better(rows("eagle3", {"humaneval": 9.0, "mtbench": 9.0}), old, "peagle") == [
        "the new acceptance file has no peagle rows"]


def measured(method: str, per_prompt: dict[str, list[list[int]]], k: int = 7) -> list[dict]:
    """acceptance.py's rows with each prompt's [drafting steps, accepted drafts]."""
    return [{"method": method, "k": k, "dataset": d, "per_prompt": counts,
             "mean_acceptance_length": 1 + sum(a for _, a in counts) / sum(n for n, _ in counts)}
            for d, counts in per_prompt.items()]


def test_rebundling_asks_per_prompt_counts_for_a_gain_clear_of_the_prompts_spread():
    """With each prompt's counts the gate asks for a gain above zero at 95% confidence over the prompts (a paired
    bootstrap), not for a fixed 2%: a small gain on every prompt is clear, the same gain from one prompt is not."""
    bundle = script("bundle_head")
    old_counts = {d: [[50 + i % 7, 25 + (i * 13) % 11] for i in range(60)] for d in ("humaneval", "mtbench")}
    old = measured("peagle", old_counts)
    everywhere = measured("peagle", {d: [[n, a + 1] for n, a in c] for d, c in old_counts.items()})
    gain = [r["mean_acceptance_length"] / o["mean_acceptance_length"] - 1 for r, o in zip(everywhere, old)]
    assert 0.005 < sum(gain) / 2 < bundle.MIN_GAIN  # below the fixed margin the files without counts need
    assert bundle.not_better(everywhere, old, "peagle") == []
    one_prompt = {d: [[n, a + (60 if i == 0 else 0)] for i, (n, a) in enumerate(c)] for d, c in old_counts.items()}
    lumpy = measured("peagle", one_prompt)
    assert [r["mean_acceptance_length"] for r in lumpy] == pytest.approx([r["mean_acceptance_length"] for r in everywhere])
    why = bundle.not_better(lumpy, old, "peagle")
    assert len(why) == 1 and "within the spread over prompts" in why[0]
    # a set that falls still refuses, however clear the other's gain
    worse_chat = measured("peagle", {"humaneval": everywhere[0]["per_prompt"],
                                     "mtbench": [[n, a - 1] for n, a in old_counts["mtbench"]]})
    assert bundle.not_better(worse_chat, old, "peagle")[0].startswith("mtbench: mean acceptance length")
    # the bound is reproducible (a fixed seed), so a round's gate gives the same answer when re-run
    new_rows, old_rows = bundle.deepest_rows(everywhere, "peagle"), bundle.deepest_rows(old, "peagle")
    assert bundle.gain_lower_bound(new_rows, old_rows) == bundle.gain_lower_bound(new_rows, old_rows) > 0


def test_bundle_head_refuses_without_a_measurement(tmp_path):
    head = ROOT / "peagle" / "heads" / "smollm2-135m-peagle"
    worse = tmp_path / "acceptance.json"
    worse.write_text(json.dumps(rows("peagle", {"humaneval": 1.0, "mtbench": 1.0})))
    for extra in ([], ["--acceptance", str(worse)]):
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bundle_head.py"), str(head), "x-should-not-exist",
                              *extra], cwd=ROOT, capture_output=True, text=True)
        assert run.returncode != 0 and ("--acceptance" in run.stderr or "not clearly better" in run.stderr)
        assert not (head.parent / "x-should-not-exist").exists()


def test_heldout_split_is_stable_as_data_grows(tmp_path):
    split = script("split_head_data")
    heldout = split.bundled_heldout_ids(str(ROOT / split.BUNDLED_DATA))
    assert len(heldout) == 32
    bundled = ROOT / split.BUNDLED_DATA
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps({"id": f"new-{i}", "messages": []}) + "\n" for i in range(50)))
    outs = []
    for inputs in ([bundled], [bundled, more]):
        train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "split_head_data.py"), "--inputs", *map(str, inputs),
                        "--train", str(train), "--heldout", str(held)], cwd=ROOT, check=True, capture_output=True)
        outs.append({json.loads(line)["id"] for line in held.read_text().splitlines()})
    assert outs[0] == outs[1] == heldout  # new conversations all train; the held-out rows stay the same


@pytest.mark.parametrize("prompt_set", ["humaneval", "mtbench"])
def test_benchmark_prompts_never_enter_the_regenerated_data(prompt_set):
    """The committed prompts and answers come from ShareGPT, installed packages' functions and the target's own
    questions: no HumanEval or MT-Bench prompt among them."""
    from peagle.bench.datasets import load_dataset
    from peagle.train.data import iter_json_records

    prompts = {p.text.strip()[:200] for p in load_dataset(prompt_set)}
    heads = ROOT / "data" / "heads"
    files = [heads / "smollm2-regenerated-3.jsonl.gz", heads / "prompts-code.jsonl.gz",
             heads / "prompts-multi.jsonl.gz", heads / "prompts-4.jsonl.gz", heads / "prompts-code-3.jsonl.gz",
             *heads.glob("prompts-self.jsonl.gz"), *heads.glob("prompts-5.jsonl.gz"),
             *heads.glob("smollm2-regenerated-code.jsonl.gz"), *heads.glob("smollm2-regenerated-multi.jsonl.gz"),
             *heads.glob("smollm2-regenerated-[45].jsonl.gz")]
    for path in files:
        for rec in iter_json_records(path):
            users = [m["content"] for m in rec["messages"] if m["role"] == "user"]
            assert not any(u.strip()[:200] in prompts for u in users)  # (a skipped prompt is recorded with none)


def test_benchmark_slices_measure_each_checkpoint_once_and_resume(tmp_path, monkeypatch):
    """The slice lane measures the bundled heads, every EVERY-th settled checkpoint and the finished head, each once
    and from a copy (the trainer prunes checkpoints); it counts the training tokens up to each step (a resumed run's
    repeated steps once), and a second pass after a kill measures only what is missing."""
    slices = script("campaign_slices")
    run = tmp_path / "peagle"

    def checkpoint(step: int):
        (run / f"checkpoint-{step}" / "head").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "head" / "config.json").write_text("{}")

    for step in (20, 40):
        checkpoint(step)
    logs = [{"step": s, "tokens": 100} for s in (1, 2, 3)] + [{"step": 3, "tokens": 100}] + \
           [{"step": s, "tokens": 10} for s in range(4, 81)]
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logs) + '{"step": 81, "tok')
    calls = []

    def fake(method, dataset, head):
        calls.append((method, dataset, Path(head).name))
        if len(calls) == 4:
            raise KeyboardInterrupt  # killed mid-pass
        if len(calls) == 5:
            raise RuntimeError("a measurement that fails is logged and tried again")
        return {"prompts": 2, "max_tokens": 8, "mean_acceptance_length": 1.5, "acceptance_per_position": [0.5, 0.0],
                "output_tokens": 16, "outputs_sha256": "same", "seconds": 0.1}

    monkeypatch.setattr(slices, "SETTLE_SECONDS", 3600)  # just written: not settled, not measured yet
    with pytest.raises(KeyboardInterrupt):
        slices.measure_pending(tmp_path, every=40, measure=fake)
    assert {c[2] for c in calls} == {"smollm2-135m-peagle", "smollm2-135m-eagle3"}  # the bundled heads only
    monkeypatch.setattr(slices, "SETTLE_SECONDS", 0)
    assert slices.measure_pending(tmp_path, every=40, measure=fake) == 2  # one failed: left for the next pass
    pe, he, mt = "peagle", "humaneval", "mtbench"
    assert calls[4:] == [(pe, he, "peagle-40"), (pe, mt, "peagle-40"), ("eagle3", mt, "smollm2-135m-eagle3")]
    assert (tmp_path / "slices" / "heads" / "peagle-40" / "config.json").exists()
    assert slices.measure_pending(tmp_path, every=40, measure=fake) == 1 and calls[-1] == (pe, he, "peagle-40")

    # the finished head (training_args.json is written last) at step 80, which is also an EVERY-th checkpoint
    checkpoint(80)
    (run / "config.json").write_text("{}")
    assert slices.final_step(run) is None and not slices.finished(tmp_path)
    (run / "training_args.json").write_text("{}")
    assert slices.final_step(run) == 80
    before = len(calls)
    assert slices.measure_pending(tmp_path, every=40, measure=fake) == 2 and len(calls) == before + 2
    assert not (tmp_path / "slices" / "heads" / "peagle-80" / "train_log.jsonl").exists()

    rows = slices.records(tmp_path / "slices" / "results.jsonl")
    assert sorted((r["method"], r["step"]) for r in rows if r["dataset"] == mt) == [
        ("eagle3", 0), ("peagle", 0), ("peagle", 40), ("peagle", 80)]
    assert next(r for r in rows if r["step"] == 40)["tokens_seen"] == 300 + 37 * 10
    assert slices.measure_pending(tmp_path, every=40, measure=fake) == 0
    assert "| P-EAGLE | 40 | 670 | 1.500 (0.500, 0.000) |" in slices.table(tmp_path)

    # a later round starts from this one's heads: it measures its own checkpoints but not the bundled heads again
    later = tmp_path / "round2"
    (later / "eagle3" / "checkpoint-40" / "head").mkdir(parents=True)
    (later / "eagle3" / "checkpoint-40" / "head" / "config.json").write_text("{}")
    before = len(calls)
    assert slices.measure_pending(later, every=40, measure=fake, bundled=False) == 2
    assert {c[2] for c in calls[before:]} == {"eagle3-40"} and not slices.finished(later)


def test_multi_turn_prompts_are_new_conversations_of_several_turns():
    """data/heads/prompts-multi.jsonl.gz (make_head_prompts.py --multi-turn): 2-4 user turns, each followed by a
    turn for the target to answer, first turns that no earlier prompt file asked, and ids no other file uses."""
    from peagle.train.data import iter_json_records

    heads = ROOT / "data" / "heads"
    earlier = [rec for name in ("prompts.jsonl.gz", "prompts-2.jsonl.gz", "prompts-3.jsonl.gz")
               for rec in iter_json_records(heads / name)]
    multi = list(iter_json_records(heads / "prompts-multi.jsonl.gz"))
    asked = {c["messages"][0]["content"] for c in earlier}
    assert len(multi) > 1000 and not {c["id"] for c in multi} & {c["id"] for c in earlier}
    assert len({c["messages"][0]["content"] for c in multi}) == len(multi)  # ShareGPT's repeats picked once
    for conv in multi:
        roles = [m["role"] for m in conv["messages"]]
        assert 2 <= len(roles) // 2 <= 4 and roles == ["user", "assistant"] * (len(roles) // 2)
        assert conv["messages"][0]["content"] not in asked


def test_acceptance_benchmark_measures_a_fixed_k(monkeypatch):
    """benchmarks/acceptance.py measures a head at a fixed K: the engine's adaptive default would pick K from this
    machine's timings (often none on a loaded CPU), and the campaign's slices and re-bundling gate compare K=7."""
    import sys

    from peagle.engine.engine import LLMEngine

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from acceptance import run_one

    asked = {}

    def from_pretrained(model, spec, **kw):
        asked.update(spec=spec, **kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(LLMEngine, "from_pretrained", from_pretrained)
    with pytest.raises(RuntimeError, match="stop here"):
        run_one("peagle", 5, "humaneval", "smollm2-135m-peagle", 1, 8, max_num_seqs=1, threads=1)
    assert asked["speculation_policy"] == "fixed" and asked["spec"]["num_speculative_tokens"] == 5


def conversations(path: Path, ids: list[str]) -> None:
    with open(path, "a") as f:
        for i in ids:
            f.write(json.dumps({"id": i, "messages": [{"role": "user", "content": i}]}) + "\n")


def test_a_pool_group_mixes_finished_files_in_a_fixed_order(tmp_path):
    """Finished files joined by "+" are shuffled together (so that no round past the group's start is one kind of
    conversation alone), the same way every time; held-out rows and lines before FIRST_LINE stay out, and the
    sources before the group keep their rows."""
    rounds_mod = script("campaign_rounds")
    first, code, chat = tmp_path / "first.jsonl", tmp_path / "code.jsonl", tmp_path / "chat.jsonl"
    conversations(first, ["a0", "a1"])
    conversations(code, [f"c{i}" for i in range(20)])
    conversations(chat, [f"m{i}" for i in range(20)])
    sources = [str(first), f"{code}:3+{chat}"]
    ids = [json.loads(line)["id"] for line in rounds_mod.pool(sources, {"m5"})]
    assert ids[:2] == ["a0", "a1"]
    assert sorted(ids[2:]) == sorted([f"c{i}" for i in range(2, 20)] + [f"m{i}" for i in range(20) if i != 5])
    assert ids == [json.loads(line)["id"] for line in rounds_mod.pool(sources, {"m5"})]  # a fixed order
    head = ids[2:12]  # the group's first rows mix both files rather than run through one
    assert any(i.startswith("c") for i in head) and any(i.startswith("m") for i in head)
    # a source whose answers have not begun adds nothing yet; a group's files must be there
    assert rounds_mod.pool([*sources, str(tmp_path / "later.jsonl")], {"m5"}) == rounds_mod.pool(sources, {"m5"})
    with pytest.raises(SystemExit, match="must be finished"):
        rounds_mod.pool([f"{code}+{tmp_path / 'later.jsonl'}"], set())


def test_mixed_prompt_files_keep_every_conversation_once(tmp_path):
    """scripts/mix_prompts.py: every conversation of the inputs once, in a seeded order; shared ids are refused."""
    a, b, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "out.jsonl"
    conversations(a, [f"a{i}" for i in range(10)])
    conversations(b, [f"b{i}" for i in range(10)])
    run = [sys.executable, str(ROOT / "scripts" / "mix_prompts.py"), "--inputs", str(a), str(b), "--out", str(out)]
    subprocess.run(run, check=True, capture_output=True)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted([f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)])
    assert ids[:10] != [f"a{i}" for i in range(10)]
    conversations(b, ["a3"])
    bad = subprocess.run(run, capture_output=True, text=True)
    assert bad.returncode != 0 and "share conversation ids" in bad.stderr


def test_campaign_rounds_move_past_their_rows_and_rebundle_only_a_better_head(tmp_path):
    """A round trains on the next ROWS conversations of the pool past the head's cursor (held-out ones never); the
    pool only grows at its end, so a row keeps its place; closing a round re-bundles its head only when it beats
    the bundled one measured on the same machine, records it once, and moves the cursor either way (the next round
    never repeats a round's rows, which from the same bundle and seed would repeat its result)."""
    rounds_mod = script("campaign_rounds")
    state, rounds = tmp_path / "campaign.json", tmp_path / "rounds"
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    conversations(first, [f"a{i}" for i in range(6)])
    conversations(second, ["skipped", "b0", "held", "b1"])
    sources, heldout = [str(first), f"{second}:2"], {"held", "a2"}
    assert [json.loads(line)["id"] for line in rounds_mod.pool(sources, heldout)] == [
        "a0", "a1", "a3", "a4", "a5", "b0", "b1"]

    one = rounds_mod.next_round("peagle", 4, rounds, sources, heldout, state)
    assert one.name == "rows-000000-000004"
    assert [json.loads(line)["id"] for line in (one / "train.jsonl").read_text().splitlines()] == [
        "a0", "a1", "a3", "a4"]
    assert rounds_mod.next_round("eagle3", 4, rounds, sources, heldout, state) == one  # same cursor: one folder

    (one / "peagle").mkdir()
    (one / "peagle" / "train_log.jsonl").write_text(
        "".join(json.dumps({"step": s, "tokens": 10}) + "\n" for s in (1, 2, 2, 3)) + '{"step": 4, "tok')
    (one / "peagle" / "eval.json").write_text(json.dumps({"accuracy_per_depth": [0.45, 0.2, 0.1, 0.05]}))
    (one / "teacher-cache").mkdir()
    better, baseline = tmp_path / "better.json", tmp_path / "baseline.json"
    better.write_text(json.dumps(rows("peagle", {"humaneval": 1.60, "mtbench": 1.50})))
    baseline.write_text(json.dumps(rows("peagle", {"humaneval": 1.50, "mtbench": 1.40})))
    bundled = []
    rec = rounds_mod.close_round("peagle", one, better, baseline, state, bundle_fn=lambda *a: bundled.append(a))
    assert bundled == [(one / "peagle", "smollm2-135m-peagle")] and rec["bundled"] and rec["why_not"] == []
    assert (rec["rows"], rec["steps"], rec["tokens"], rec["k"]) == ([0, 4], 3, 30, 7)
    assert rec["mean_acceptance_length"] == {"humaneval": 1.60, "mtbench": 1.50}
    assert rec["lm_head"] == "trained"  # no --freeze-lm-head in its training_args.json
    assert rec["heldout_accuracy"] == [0.45, 0.2, 0.1]  # the trainer's last held-out evaluation, depths 1-3
    assert (one / "teacher-cache").exists()  # EAGLE-3's cursor is still at this round: it will read the cache
    assert rounds_mod.close_round("peagle", one, better, baseline, state, bundle_fn=bundled.append) == rec
    assert len(bundled) == 1 and len(json.loads(state.read_text())["rounds"]) == 1  # closed twice, recorded once

    # a round begun at a head's cursor is resumed whatever ROWS is now
    assert rounds_mod.next_round("eagle3", 2, rounds, sources, heldout, state) == one

    # the pool is short of a second round of 4 until more answers arrive at a source's end
    assert rounds_mod.next_round("peagle", 4, rounds, sources, heldout, state) is None
    conversations(second, ["b2", "b3"])
    two = rounds_mod.next_round("peagle", 4, rounds, sources, heldout, state)
    assert two.name == "rows-000004-000008"
    assert [json.loads(line)["id"] for line in (two / "train.jsonl").read_text().splitlines()] == [
        "a5", "b0", "b1", "b2"]

    assert "| peagle | 0-4 | 3 | 30 | 30 | 7 | 1.600 / 1.500 (+6.7%) | 1.500 / 1.400 (+7.1%) | 0.450 / 0.200 | yes |" in \
        rounds_mod.table(json.loads(state.read_text()))

    # a round that is not clearly better is recorded and passed over, but not bundled
    (two / "peagle").mkdir()
    (two / "peagle" / "train_log.jsonl").write_text(json.dumps({"step": 1, "tokens": 5}) + "\n")
    (two / "peagle" / "training_args.json").write_text(json.dumps({"freeze_lm_head": True, "lr": 1.5e-4}))
    (two / "teacher-cache").mkdir()
    rec = rounds_mod.close_round("peagle", two, baseline, baseline, state, bundle_fn=bundled.append)
    assert not rec["bundled"] and len(rec["why_not"]) == 1 and len(bundled) == 1
    assert (rec["lm_head"], rec["lr"]) == ("frozen", 1.5e-4)  # what the round trained with
    assert json.loads(state.read_text())["trained_rows"] == {"peagle": 8, "eagle3": 0}
    assert not (two / "teacher-cache").exists()  # EAGLE-3 is not at this round: nobody reads its cache again
    with pytest.raises(SystemExit, match="cursor is at row 0"):  # EAGLE-3 closing a round it did not start at
        rounds_mod.close_round("eagle3", two, better, baseline, state, bundle_fn=bundled.append)

    # greedy outputs that differ between the heads on one machine are a losslessness bug, never a better head
    three = rounds_mod.next_round("eagle3", 4, rounds, sources, heldout, state)
    (three / "eagle3").mkdir()
    (three / "eagle3" / "train_log.jsonl").write_text(json.dumps({"step": 1, "tokens": 5}) + "\n")
    good, base = (rows("eagle3", {"humaneval": v, "mtbench": v}) for v in (1.9, 1.5))
    for r in good + base:
        r["outputs_sha256"] = "same"
    good[0]["outputs_sha256"] = "different"
    better.write_text(json.dumps(good))
    baseline.write_text(json.dumps(base))
    rec = rounds_mod.close_round("eagle3", three, better, baseline, state, bundle_fn=bundled.append)
    assert not rec["bundled"] and rec["why_not"] == [
        "the two heads' greedy outputs differ on one machine: a losslessness bug, not a better head"]


def test_a_round_continues_the_last_rounds_head_when_it_is_on_this_machine(tmp_path):
    """A round that did not clear the gate is not thrown away: the next round continues its head (bundled or not)
    while that head is on this machine; with none (a fresh machine, a first round) the bundle is the start. The
    record says where a round started and whether its rows were packed."""
    rounds_mod = script("campaign_rounds")
    state, rounds = tmp_path / "campaign.json", tmp_path / "rounds"
    src = tmp_path / "pool.jsonl"
    conversations(src, [f"c{i}" for i in range(8)])
    assert rounds_mod.start_head("peagle", rounds, state) == "smollm2-135m-peagle"
    one = rounds_mod.next_round("peagle", 4, rounds, [str(src)], set(), state)
    (one / "peagle.started_from").write_text("smollm2-135m-peagle\n")
    (one / "peagle").mkdir()
    (one / "peagle" / "train_log.jsonl").write_text(json.dumps({"step": 1, "tokens": 7}) + "\n")
    (one / "train-data").mkdir()
    (one / "train-data" / "peagle_data.json").write_text(json.dumps({"packed_to": 4096}))
    same = tmp_path / "same.json"
    same.write_text(json.dumps(rows("peagle", {"humaneval": 1.5, "mtbench": 1.4})))
    rec = rounds_mod.close_round("peagle", one, same, same, state, bundle_fn=lambda *a: None)
    assert not rec["bundled"] and (rec["started_from"], rec["packed_to"]) == ("smollm2-135m-peagle", 4096)
    # its head is not finished on disk (no weights): the bundle again
    assert rounds_mod.start_head("peagle", rounds, state) == "smollm2-135m-peagle"
    for name in ("model.safetensors", "training_args.json"):
        (one / "peagle" / name).write_text("x")
    assert rounds_mod.start_head("peagle", rounds, state) == str(one / "peagle")
    assert rounds_mod.start_head("eagle3", rounds, state) == "smollm2-135m-eagle3"  # each head its own line

    # the learning curve's x: the tokens along a round's line (a round from the bundle continues the last bundled)
    two = rounds_mod.next_round("peagle", 4, rounds, [str(src)], set(), state)
    (two / "peagle.started_from").write_text(str(one / "peagle") + "\n")
    (two / "peagle").mkdir()
    (two / "peagle" / "train_log.jsonl").write_text(json.dumps({"step": 1, "tokens": 5}) + "\n")
    better = tmp_path / "better.json"
    better.write_text(json.dumps(rows("peagle", {"humaneval": 1.7, "mtbench": 1.6})))
    rounds_mod.close_round("peagle", two, better, same, state, bundle_fn=lambda *a: None)
    recorded = json.loads(state.read_text())
    assert [seen for _, seen in rounds_mod.line_tokens(recorded, "peagle")] == [7, 12]
    recorded["rounds"].append({**recorded["rounds"][0], "rows": [8, 12], "tokens": 3})  # from the bundle again
    assert [seen for _, seen in rounds_mod.line_tokens(recorded, "peagle")] == [7, 12, 15]  # round two was bundled
    recorded["rounds"][1]["bundled"] = False
    assert [seen for _, seen in rounds_mod.line_tokens(recorded, "peagle")] == [7, 12, 3]  # nothing bundled before
    rounds_mod.plot(recorded, "peagle", tmp_path / "curve")
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_self_prompts_are_new_clean_questions_and_resume(tmp_path, one_thread):
    """The target's own questions (ShareGPT is used up): each ended by the target, ASCII, new against the excluded
    files and each other, none a benchmark prompt; a rerun with a larger --num appends after the last attempt and
    keeps what was there."""
    mod = script("make_self_prompts")
    from peagle.train.data import HeldOutGuard

    guard, seen = HeldOutGuard(), set()
    assert mod.keep("How do I bake sourdough bread at home?", True, seen, guard)
    assert not mod.keep("how do I bake   SOURDOUGH bread at home", True, seen, guard)  # the same words
    assert not mod.keep("What is the capital of France, and why?", False, seen, guard)  # cut by max_tokens
    assert not mod.keep("Qu'est-ce que c'est, café ?", True, seen, guard)  # not ASCII
    assert not mod.keep("Hi", True, seen, guard)  # too short
    from peagle.bench.datasets import load_dataset

    humaneval = load_dataset("humaneval", 1)[0].chat_messages()[-1]["content"]
    assert not mod.keep(humaneval, True, seen, guard)  # a benchmark prompt never becomes training data
    exclude = tmp_path / "earlier.jsonl"
    exclude.write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "An earlier question."}]}))
    out = tmp_path / "self.jsonl"
    argv = [sys.executable, str(ROOT / "scripts" / "make_self_prompts.py"), "--first-id", "100", "--batch", "4",
            "--exclude", str(exclude), "--out", str(out)]
    subprocess.run(argv + ["--num", "3"], check=True, capture_output=True)
    first = out.read_text().splitlines()
    with out.open("a") as f:
        f.write('{"id": "self-103", "attem')  # killed mid-line
    subprocess.run(argv + ["--num", "5"], check=True, capture_output=True)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert out.read_text().splitlines()[:3] == first
    assert [r["id"] for r in recs] == [f"self-{i}" for i in range(100, 105)]
    attempts = [r["attempt"] for r in recs]
    assert attempts == sorted(set(attempts))  # every attempt is sampled once, resumed after the last one
    questions = [r["messages"][0]["content"] for r in recs]
    assert len({mod.normalized(q) for q in questions}) == 5 and "an earlier question" not in map(mod.normalized,
                                                                                                   questions)
    assert all(r["messages"][1] == {"role": "assistant", "content": mod.PLACEHOLDER_ANSWER} for r in recs)


def test_self_prompts_resume_a_gzip_file_a_kill_cut_off(tmp_path):
    """A .gz --out (as committed) is appended to batch by batch; a kill inside a batch leaves a gzip member without
    its end, whose text up to the last flush reads back: resuming keeps those whole questions and rewrites the file
    whole."""
    import gzip

    mod = script("make_self_prompts")
    from peagle.train.data import iter_json_records, open_text

    out = tmp_path / "self.jsonl.gz"
    recs = [{"id": f"self-{i}", "attempt": i, "messages": [{"role": "user", "content": f"Question {i}?"}]}
            for i in range(4)]
    with open_text(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs[:2])
    with open_text(out, "a") as f:
        f.write(json.dumps(recs[2]) + "\n")
        f.flush()
        f.write(json.dumps(recs[3])[:20])
        f.flush()
        killed = out.read_bytes()  # what a kill here leaves
    out.write_bytes(killed)
    text = mod.read_kept(out)
    assert [json.loads(line) for line in text.splitlines()] == recs[:3]
    assert list(iter_json_records(out)) == recs[:3]
    with gzip.open(out, "rt", encoding="utf-8") as f:  # a whole gzip file again
        assert f.read() == text
    assert mod.read_kept(out) == text and mod.read_kept(tmp_path / "none.jsonl.gz") == ""


def test_mixed_prompt_files_read_and_write_gzip(tmp_path):
    """mix_prompts.py on .gz files (as committed) gives the lines it gives on plain ones."""
    from peagle.train.data import open_text

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    conversations(a, [f"a{i}" for i in range(10)])
    conversations(b, [f"b{i}" for i in range(10)])
    for p in (a, b):
        with open_text(f"{p}.gz", "w") as f:
            f.write(p.read_text())
    outs = []
    for suffix in ("", ".gz"):
        out = tmp_path / f"out.jsonl{suffix}"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "mix_prompts.py"), "--inputs", f"{a}{suffix}",
                        f"{b}{suffix}", "--out", str(out)], check=True, capture_output=True)
        with open_text(out) as f:
            outs.append(f.read())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 20


def test_draft_vocab_variant_keeps_trained_rows_and_loads(tmp_path):
    """The vocabulary experiment's head: every token it keeps has its trained row, the mapping is consistent, and
    the engine's loader takes it."""
    import torch
    from safetensors.torch import load_file

    from peagle.model.checkpoint import load_head
    from peagle.model.heads import resolve_head
    from peagle.train.vocab import used_ids

    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Sort a list."},
                                                     {"role": "assistant", "content": f"Use sorted(xs) or xs.sort() {i}"
                                                                                      " zebra quokka axolotl"}]}) + "\n"
                            for i in range(40)))
    head = Path(resolve_head("smollm2-135m-peagle", None, "peagle"))
    old = load_file(head / "model.safetensors")
    for mode, size in (("add", 8200), ("reselect", 8192)):
        out = tmp_path / mode
        subprocess.run([sys.executable, str(ROOT / "scripts" / "draft_vocab_variant.py"), "--head", str(head),
                        "--data", str(data), "--mode", mode, "--size", str(size), "--out", str(out)], check=True,
                       capture_output=True)
        new = load_file(out / "model.safetensors")
        old_ids, new_ids = used_ids(old["d2t"]), used_ids(new["d2t"])
        assert new_ids.numel() == size and bool((new_ids[1:] > new_ids[:-1]).all())
        assert torch.equal(new["t2d"].nonzero().flatten(), new_ids)
        both = torch.isin(new_ids, old_ids)
        if mode == "add":
            assert bool(torch.isin(old_ids, new_ids).all())
        assert torch.equal(new["lm_head.weight"][both], old["lm_head.weight"][torch.isin(old_ids, new_ids)])
        table = torch.zeros(old["t2d"].numel(), old["lm_head.weight"].shape[1], dtype=torch.bfloat16)  # compact head
        assert load_head(out, target_embeddings=table).config.draft_vocab_size == size
