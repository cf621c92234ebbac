"""Training P-EAGLE and EAGLE-3 drafter heads for any Hugging Face causal LM (DESIGN section 4).

data.py      conversations -> chat-template token ids + assistant loss mask; held-out benchmark guard
data_cmd.py  `peagle data prepare`
vocab.py     draft vocabulary (d2t / t2d)
cod.py       COD sampling, its attention mask, sequence partitioning, TTT element sets
teacher.py   the frozen target: features at the vLLM layer ids and the teacher distribution
losses.py    the training forward (P-EAGLE COD / EAGLE-3 TTT) and its loss
trainer.py   the loop: AdamW, warmup+cosine, checkpoints and exact resume, eval, DDP under torchrun
train_cmd.py `peagle train`
"""


def _limit_heap_fragmentation(threshold: int = 1 << 17) -> None:
    """Serve every allocation above `threshold` bytes with its own mmap (glibc on Linux), before torch loads.

    glibc raises its mmap threshold each time a large block is freed; tensors of a few MB then come from the heap and
    their pages are rarely returned, so the resident set creeps up segment after segment of a partitioned step
    (measured on an 8K-token step in 4 partitions: 4.4 GiB peak without this, 2.8 GiB with it). A fixed threshold keeps
    the resident set near what is live. It must run before torch starts its threads to take full effect; the
    `MALLOC_MMAP_THRESHOLD_` environment variable, when set, wins."""
    import os
    import sys

    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, int(threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


_limit_heap_fragmentation()
