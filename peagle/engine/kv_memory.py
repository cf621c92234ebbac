"""How many blocks an engine's paged KV cache gets (docs/memory.md, "KV cache memory").

The pool's tensors are reserved, not written, at start: a block's pages are committed when a request first takes it,
so resident memory follows the tokens in flight and an idle server holds its weights and little else, whatever
--max-num-seqs is. The budget only bounds how far that can grow. Without one (--kv-cache-gb), the pool gets
DEFAULT_KV_MEMORY_FRACTION of the memory this process may still use at start (the machine's available memory, or less
under a cgroup limit), and never more than every slot's whole context needs. It must hold at least one request of the
longest context, so that every request the engine accepts can run."""
from __future__ import annotations

from pathlib import Path

DEFAULT_KV_MEMORY_FRACTION = 0.5  # of the memory available at start, when no --kv-cache-gb is given
_CGROUP = Path("/sys/fs/cgroup")


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = _CGROUP) -> int | None:
    """Memory this process may still commit: the kernel's MemAvailable, or less where a cgroup v2 limit
    (memory.max minus memory.current: a container's --memory) leaves less. None where neither is readable."""
    found = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int((cgroup / "memory.current").read_text())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def pool_blocks(bytes_per_block: int, every_slot_blocks: int, one_request_blocks: int,
                kv_cache_gb: float | None = None, available: int | None = None) -> int:
    """Blocks for the pool (the null block included): `kv_cache_gb` GiB of them, or the default share of `available`
    bytes (None: measured now), at most `every_slot_blocks`; ValueError, naming the fix, when that is fewer than
    `one_request_blocks`."""
    if kv_cache_gb is not None:
        budget, source = kv_cache_gb * 2**30, f"--kv-cache-gb {kv_cache_gb:g}"
    else:
        available = available_memory_bytes() if available is None else available
        if available is None:
            return every_slot_blocks
        budget = DEFAULT_KV_MEMORY_FRACTION * available
        source = f"{DEFAULT_KV_MEMORY_FRACTION:.0%} of the {available / 2**30:.1f} GiB available"
    blocks = min(every_slot_blocks, int(budget // bytes_per_block) + 1)
    if blocks < one_request_blocks:
        need = (one_request_blocks - 1) * bytes_per_block / 2**30
        raise ValueError(f"the KV cache ({source}) holds {blocks - 1} blocks, fewer than the {one_request_blocks - 1} "
                         f"one request of the longest context needs ({need:.2f} GiB); give --kv-cache-gb at least "
                         f"{need:.2f} or lower --max-model-len")
    return blocks
