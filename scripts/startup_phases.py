"""Where `peagle serve`'s start-up goes (docs/serving.md, "Restarts"): runs the command in this process with the
given arguments, prints one JSON line of [wall seconds, CPU seconds] per phase once uvicorn listens, and exits.
The three imports (torch with the engine, the server, the tokenizer's libraries) come first, explicitly (serve
makes them anyway, in this order), with full collections held as `peagle serve` holds them where the checkout
does; each phase includes the collections that ran in it. Run it twice or more: the first start of a new build
times the forwards it then remembers.

    PYTHONPATH=. python3 scripts/startup_phases.py --port 8011
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time

_marks: list[tuple[str, float, float]] = [("start", time.perf_counter(), time.process_time())]


def mark(name: str) -> None:
    _marks.append((name, time.perf_counter(), time.process_time()))


def timed(owner, name: str, label: str) -> None:
    """Mark the start and end of owner.name (a function or classmethod) as `label`."""
    fn = owner.__dict__[name]
    raw = fn.__func__ if isinstance(fn, classmethod) else fn

    @functools.wraps(raw)
    def wrapper(*args, **kwargs):
        mark("> " + label)
        try:
            return raw(*args, **kwargs)
        finally:
            mark(label)
    setattr(owner, name, classmethod(wrapper) if isinstance(fn, classmethod) else wrapper)


def phases() -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    begun: dict[str, tuple[float, float]] = {}
    for (_, t0, c0), (name, t, c) in zip(_marks, _marks[1:4]):
        out[name] = [round(t - t0, 2), round(c - c0, 2)]
    for name, t, c in _marks[4:-1]:
        if name.startswith("> "):
            begun[name[2:]] = (t, c)
            continue
        key = name if name not in out else name + " (baseline engine)"
        out[key] = [round(t - begun[name][0], 2), round(c - begun[name][1], 2)]
    out["listening"] = [round(_marks[-1][1] - _marks[-2][1], 2), round(_marks[-1][2] - _marks[-2][2], 2)]
    total = [_marks[-1][1] - _marks[0][1], _marks[-1][2]]
    listed = [v for k, v in out.items() if not k.startswith("of which")]
    other = [round(total[i] - sum(v[i] for v in listed), 2) for i in (0, 1)]
    out["other (Python itself, resolving the model, building the app)"] = other
    out["total"] = [round(t, 2) for t in total]
    return out


def main() -> None:
    argparse.ArgumentParser(usage="%(prog)s [peagle serve's arguments]", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_known_args()
    try:
        from peagle.serve.idle_gc import held_full_collections
    except ImportError:  # a checkout from before peagle serve held them
        held_full_collections = contextlib.nullcontext
    with held_full_collections():
        serve_with_marks()


def serve_with_marks() -> None:
    import peagle.engine.engine
    mark("import torch and peagle's engine")
    import uvicorn

    import peagle.serve.app  # noqa: F401
    mark("import the server (FastAPI, pydantic, uvicorn)")
    try:
        from peagle.model.tokenizer import Tokenizer, chat_template_environment
        chat_template_environment()  # jinja2, as the first chat request would
    except ImportError:  # a checkout from before peagle read tokenizers itself: transformers' tokenizer
        from transformers import AutoTokenizer  # noqa: F401
        Tokenizer = None
    mark("import the tokenizer's libraries")
    from peagle.model import checkpoint, loading, target

    timed(target.TargetModel, "from_pretrained", "target weights: load and pack")
    timed(target.TargetModel, "pack_", "of which packing for the kernels")
    if Tokenizer is not None:
        timed(Tokenizer, "load", "tokenizer")
    else:
        timed(loading, "load_tokenizer", "tokenizer")
    timed(checkpoint, "load_head", "head")
    timed(peagle.engine.engine.LLMEngine, "__init__", "engine (caches, remembered timings)")
    startup = uvicorn.Server.startup

    async def listening(self, *args, **kwargs):
        await startup(self, *args, **kwargs)
        mark("listening")
        print(json.dumps(phases()), flush=True)
        os._exit(0)
    uvicorn.Server.startup = listening
    from peagle.cli import main as peagle_main

    sys.exit(peagle_main(["serve", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
