"""`peagle bench`: output tokens/s against concurrency for no speculation, EAGLE-3 and P-EAGLE at several K
(docs/design.md, "Benchmark definitions"), with transformers' own `generate()` measured in the same run.

    datasets.py  prompt sets that load offline (HumanEval, MT-Bench, ShareGPT, custom JSONL, SPEED-Bench files)
    loadgen.py   the load generator: N clients over HTTP (streaming, like `vllm bench serve --max-concurrency N`),
                 the same clients on the engine directly (offline), and transformers' generate()
    metrics.py   OTPS, TTFT / TPOT / ITL percentiles, acceptance, best-K ratios
    report.py    the Markdown table in the P-EAGLE launch's format, JSON and PNG plots
    plan.py      what a run measures: prompts, configurations (method x K x speculation policy), heads
    run.py       the sweep over configurations and concurrencies, with a progress bar
    cli.py       the `peagle bench` command's options
"""
