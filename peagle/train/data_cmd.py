"""`peagle data prepare`: conversations -> a training dataset (token ids + assistant loss mask) on disk.

    peagle data prepare --input conversations.jsonl --out data/mine
    peagle data prepare --input sharegpt --limit 2000 --regenerate --max-new-tokens 512 --out data/sharegpt-regen

With `--regenerate` every assistant turn is replaced by the target's own answer (self-distillation, as EAGLE-3,
SpecForge and speculators recommend), turn by turn so later turns see the regenerated earlier ones, in batches
through peagle's engine on a CPU (with speculative decoding when --speculative-config names a head) or, on a GPU
and for targets outside the engine's model families, through transformers' `generate()`, --batch-size
conversations at a time (REGEN_BATCH: a GPU answers hundreds at once for about the time of one). Finished
conversations are appended to OUT/regenerated.jsonl as they complete, so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from peagle import cli_args
from peagle.train.data import (DATA_META, HeldOutDataError, HeldOutGuard, build_rows, iter_conversations,
                               pack_rows, save_rows)

# answers a batch of chat prompts: (text, finished) per prompt; finished is False when max_new_tokens cut the answer
Generator = Callable[[list[list[dict]]], list[tuple[str, bool]]]

# Conversations regenerated together, by device: the engine's continuous batching on a CPU gains little past 16
# (docs/training.md, "Training on a GPU machine" has the answers a minute); a GPU's generate() step costs about the
# same for 256 rows as for one on a small target.
REGEN_BATCH = {"cpu": 16, "cuda": 256}


def register(name: str, parser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    p = sub.add_parser("prepare", help="render conversations into a training dataset (optionally regenerated)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True,
                   help="a .jsonl/.json file of conversations (OpenAI `messages` or ShareGPT `conversations`; a "
                        ".jsonl.gz is read gzip-compressed), or the built-in source `sharegpt`")
    p.add_argument("--out", required=True, help="output folder (a Hugging Face datasets folder + peagle_data.json)")
    p.add_argument("--target", default=None, help="target model whose chat template renders the data "
                                                 "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--limit", type=cli_args.positive_int, default=None, help="use at most this many conversations")
    p.add_argument("--max-seq-len", type=cli_args.positive_int, default=None,
                   help="truncate rendered conversations to this many tokens")
    p.add_argument("--pack-to", type=cli_args.positive_int, default=None,
                   help="join consecutive conversations into training rows of up to this many tokens (long "
                        "histories from short conversations; train with --max-seq-len at least this)")
    p.add_argument("--regenerate", action="store_true", help="replace every assistant turn with the target's answer")
    p.add_argument("--temperature", type=cli_args.temperature, default=0.0, help="regeneration temperature (0: greedy)")
    p.add_argument("--max-new-tokens", type=cli_args.positive_int, default=512, help="longest regenerated answer")
    p.add_argument("--batch-size", type=cli_args.positive_int, default=None,
                   help="conversations regenerated together [%s]" % ", ".join(f"{d}: {n}"
                                                                          for d, n in REGEN_BATCH.items()))
    p.add_argument("--speculative-config", default=None,
                   help="regenerate with speculative decoding: vLLM-style JSON naming a head (engine families only)")
    p.add_argument("--backend", choices=("auto", "engine", "transformers"), default="auto",
                   help="regeneration backend (auto: peagle's engine on a CPU when it supports the target, "
                        "transformers' batched generate() otherwise)")
    p.add_argument("--max-model-len", type=cli_args.positive_int, default=4096, help="regeneration context limit")
    p.add_argument("--max-num-seqs", type=cli_args.positive_int, default=16,
                   help="sequences the engine decodes at once")
    p.add_argument("--seed", type=cli_args.seed, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=run)


def run(args) -> int:
    from peagle.model.loading import load_tokenizer, resolve_model

    try:
        convs = iter_conversations(args.input)
        target_dir = resolve_model(args.target)
        tokenizer = load_tokenizer(target_dir)
        out = Path(args.out)
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        guard = HeldOutGuard()
        report: dict = {"refused": 0, "refused_examples": [], "empty": 0}
        kept = _guarded(convs, guard, report, args.limit)
        if args.regenerate:
            device = regen_device(args.device)
            gen = make_generator(target_dir, tokenizer, args.temperature, args.max_new_tokens,
                                 args.speculative_config, args.backend, args.max_model_len, args.seed, device,
                                 args.max_num_seqs)
            kept = regenerate(kept, gen, tokenizer, out / "regenerated.jsonl",
                              args.batch_size or REGEN_BATCH.get(torch_device_type(device), REGEN_BATCH["cpu"]),
                              args.max_model_len - args.max_new_tokens)
        rows = build_rows(kept, tokenizer, args.max_seq_len, None, report)  # fills `report`
        rows = list(pack_rows(rows, args.pack_to) if args.pack_to else rows)
        meta = save_rows(rows, out, {"source": str(args.input), "target": str(args.target or "embedded"),
                                     "target_dir": str(target_dir), "regenerated": bool(args.regenerate),
                                     "temperature": args.temperature if args.regenerate else None,
                                     "packed_to": args.pack_to,
                                     "refused": report["refused"], "refused_examples": report["refused_examples"],
                                     "skipped_without_supervised_tokens": report["empty"]})
    except (HeldOutDataError, FileNotFoundError, ValueError) as e:
        print(f"peagle data: {e}", file=sys.stderr)
        out = Path(args.out)
        if locals().get("created") and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # made for this run and still empty; a partial regeneration stays, to resume from
        return 2
    if report["refused"]:
        print(f"peagle data: refused {report['refused']} conversation(s) containing held-out evaluation prompts "
              f"(HumanEval / MT-Bench are what `peagle bench` measures acceptance on; training on them would inflate "
              f"it), e.g. {report['refused_examples'][0]}", file=sys.stderr)
    packed = f" rows of up to {args.pack_to} tokens" if args.pack_to else " conversations"
    print(f"peagle data: wrote {meta['num_rows']}{packed}, {meta['num_tokens']} tokens "
          f"({meta['num_supervised_tokens']} supervised) to {args.out} ({DATA_META} describes them)", file=sys.stderr)
    return 0


def _guarded(convs, guard: HeldOutGuard, report: dict, limit: int | None):
    n = 0
    for cid, msgs in convs:
        if limit is not None and n >= limit:
            return
        reason = guard.check(msgs)
        if reason:
            report["refused"] += 1
            if len(report["refused_examples"]) < 5:
                report["refused_examples"].append(f"{cid}: {reason}")
            continue
        n += 1
        yield cid, msgs


# ---------------------------------------------------------------------------------------------------------------
# regeneration
# ---------------------------------------------------------------------------------------------------------------
def engine_supports(target_dir: Path) -> bool:
    from peagle.model.loading import config_dir
    from peagle.model.target import TargetConfig

    try:
        TargetConfig.from_hf(json.loads((config_dir(Path(target_dir)) / "config.json").read_text()))
        return True
    except (ValueError, KeyError):
        return False


def regen_device(device: str | None) -> str:
    """--device, defaulting to cuda where a GPU is visible."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_device_type(device: str) -> str:
    return device.split(":")[0]


def make_generator(target_dir: Path, tokenizer, temperature: float = 0.0, max_new_tokens: int = 512,
                   speculative_config: str | None = None, backend: str = "auto", max_model_len: int = 4096,
                   seed: int = 0, device: str | None = None, max_num_seqs: int = 16) -> Generator:
    """A function answering a batch of chat prompts with the target: peagle's engine for its model families (with
    speculation when a speculative config is given) on a CPU, transformers' batched generate() on a GPU and for
    other families (peagle's engine is built for CPUs: a GPU answers many conversations at a time faster through
    generate())."""
    on_cpu = torch_device_type(regen_device(device)) == "cpu"
    use_engine = backend == "engine" or (backend == "auto" and on_cpu and engine_supports(target_dir))
    if use_engine:
        try:
            from peagle.engine import LLMEngine, SamplingParams
        except ImportError as e:
            if backend == "engine":
                raise
            print(f"peagle data: engine unavailable ({e}); regenerating with transformers", file=sys.stderr)
        else:
            engine = LLMEngine.from_pretrained(str(target_dir), speculative_config=speculative_config,
                                               max_model_len=max_model_len, device=device,
                                               max_num_seqs=max_num_seqs)
            counter = [0]

            def gen_engine(prompts: list[list[dict]]) -> list[tuple[str, bool]]:
                params = []
                for _ in prompts:
                    counter[0] += 1
                    params.append(SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                                 seed=None if temperature == 0 else seed * 1_000_003 + counter[0]))
                return [(o.text, o.finish_reason != "length") for o in engine.generate(prompts, params)]

            gen_engine.backend = "engine"  # type: ignore[attr-defined]
            return gen_engine
    if speculative_config:
        print("peagle data: speculative decoding needs peagle's engine; regenerating without it", file=sys.stderr)
    return _hf_generator(target_dir, tokenizer, temperature, max_new_tokens, seed, device)


def _hf_generator(target_dir, tokenizer, temperature, max_new_tokens, seed, device) -> Generator:
    import torch
    from transformers import AutoModelForCausalLM

    from peagle.model.loading import transformers_source

    device = regen_device(device)
    model = AutoModelForCausalLM.from_pretrained(**transformers_source(Path(target_dir)),
                                                 dtype=torch.bfloat16).to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(seed)

    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    stops = set(gen_eos) if isinstance(gen_eos, list) else ({gen_eos} if gen_eos is not None else set())
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)

    @torch.no_grad()
    def gen_hf(prompts: list[list[dict]]) -> list[tuple[str, bool]]:
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        enc = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(len(e) for e in enc)
        ids = torch.full((len(enc), width), pad, dtype=torch.long)
        attn = torch.zeros((len(enc), width), dtype=torch.long)
        for i, e in enumerate(enc):  # left padding, so every row continues from its own end
            ids[i, width - len(e):] = torch.tensor(e)
            attn[i, width - len(e):] = 1
        kw = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
                             pad_token_id=pad, **kw)
        res = []
        for row in out.cpu():
            new = row[width:].tolist()
            finished = any(t in stops for t in new)
            res.append((tokenizer.decode(new, skip_special_tokens=True), finished))
        return res

    gen_hf.backend = "transformers"  # type: ignore[attr-defined]
    return gen_hf


def regenerate(convs, gen: Generator, tokenizer, progress: Path, batch_size: int = 16,
               max_prompt_tokens: int | None = None):
    """Yield (id, messages) with every assistant turn replaced by `gen`'s answer. Conversations already in
    `progress` (JSONL) are taken from it; new ones are appended as they finish."""
    done: dict[int, dict] = {}
    if progress.exists():
        with open(progress, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by an interruption
                done[int(rec["index"])] = rec
        if done:
            print(f"peagle data: resuming regeneration, {len(done)} conversation(s) already done", file=sys.stderr)
    pending: list[tuple[int, str, list[dict]]] = []
    with open(progress, "a", encoding="utf-8") as f:
        def flush():
            finished = _regenerate_batch(pending, gen, tokenizer, max_prompt_tokens)
            for (i, cid, _), msgs in zip(pending, finished):
                rec = {"index": i, "id": cid, "messages": msgs}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                f.flush()
                done[i] = rec
            pending.clear()
            return finished

        for i, (cid, msgs) in enumerate(convs):
            if i in done:
                if done[i]["messages"]:
                    yield done[i]["id"], done[i]["messages"]
                continue
            pending.append((i, cid, msgs))
            if len(pending) >= batch_size:
                for (j, c, _), m in zip(list(pending), flush()):
                    if m:
                        yield c, m
        if pending:
            for (j, c, _), m in zip(list(pending), flush()):
                if m:
                    yield c, m


def _regenerate_batch(batch, gen: Generator, tokenizer, max_prompt_tokens: int | None) -> list[list[dict]]:
    """Turn by turn over a batch of conversations; a conversation whose prompt grows past the limit is cut before
    that turn (and dropped when nothing is left)."""
    out = [[] for _ in batch]
    cursor = [0] * len(batch)
    active = set(range(len(batch)))
    while active:
        prompts, who = [], []
        for b in sorted(active):
            msgs = batch[b][2]
            j = cursor[b]
            while j < len(msgs) and msgs[j]["role"] != "assistant":
                out[b].append(dict(msgs[j]))
                j += 1
            cursor[b] = j
            if j >= len(msgs):
                active.discard(b)
                continue
            if max_prompt_tokens is not None:
                text = tokenizer.apply_chat_template(out[b], tokenize=False, add_generation_prompt=True)
                if len(tokenizer(text, add_special_tokens=False)["input_ids"]) > max_prompt_tokens:
                    active.discard(b)
                    continue
            prompts.append([dict(m) for m in out[b]])
            who.append(b)
        if not prompts:
            break
        answers = gen(prompts)
        for b, answer in zip(who, answers):
            text, finished = answer if isinstance(answer, tuple) else (answer, True)
            text = text.strip()
            if not text:
                active.discard(b)
                continue
            # Cut by --max-new-tokens: kept with its end-of-turn token unsupervised (the target did not stop there).
            # The conversation goes on: the next question after a cut answer is still the target's to answer, and
            # stopping there would leave few multi-turn histories (most answers reach a budget of a few hundred).
            out[b].append({"role": "assistant", "content": text, **({} if finished else {"truncated": True})})
            cursor[b] += 1
    # a conversation must end on a regenerated assistant turn
    cleaned = []
    for msgs in out:
        while msgs and msgs[-1]["role"] != "assistant":
            msgs.pop()
        cleaned.append(msgs if any(m["role"] == "assistant" for m in msgs) else [])
    return cleaned
