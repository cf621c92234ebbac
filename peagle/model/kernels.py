"""peagle's native CPU kernels (kernels.c): how they are built, which one runs, and the Python calls into them.

Decoding multiplies a handful of activation rows by every weight matrix, so a step costs about one read of the
weights. PyTorch's CPU bf16 `linear` reads them well below the memory's speed for few rows, and rounds a row
differently depending on how many rows share the call, which would make a verify window of K+1 rows disagree with a
one-row decode step and break greedy speculation's equality with plain decoding (docs/design.md, "Decoding step").
kernels.c streams weights packed once at load and computes every row with the same instructions whatever else is
in the batch (docs/performance.md has the numbers).

Matrix paths, fastest first, chosen from /proc/cpuinfo: "amx" (Intel Sapphire Rapids and later), "avx512-bf16"
(AMD Zen 4/5, Intel Sapphire Rapids and later), "avx2" (any x86-64 with AVX2 and FMA). Attention, RMSNorm and RoPE
use AVX2 on every machine. PEAGLE_CPU_KERNELS picks a path by name ("avx2", ...), or "off" for PyTorch's kernels.
Where no path applies (not x86-64, no AVX2, no C compiler), PyTorch runs and `summary()` says that greedy
speculation is then not bit-exact.

Which paths run is one frozen value, `KernelPaths`, made by one function, `resolve(choice, cpu flags, library)`,
once per process (`kernel_paths()`, on first use); every helper below (`matmul_path()`, `quant_path()`, ...) reads
it. The choice comes from PEAGLE_CPU_KERNELS, read only by `choice_from_environment()`, which `kernel_paths()`
calls: a process has one choice with one meaning ("auto" and unset alike) whether a `peagle` command or a Python
program using LLMEngine started it, and subprocess servers inherit it with the environment. No command-line flag
duplicates it, so there is nothing for the two to disagree about.

The library is compiled once per machine with the system C compiler (warnings on) into $PEAGLE_HOME/kernels and
loaded with ctypes. Every allocation in the C code is checked; a failure raises MemoryError here.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")  # one translation unit: it includes the per-instruction-set sources
SOURCES_DIR = Path(__file__).with_name("kernels")  # kernels/common.h, avx2.c, avx512.c, amx.c


def _sources() -> list[Path]:
    """Every file the build reads: kernels.c and what it includes (the build cache key covers them all)."""
    return [SOURCE, *sorted(p for p in SOURCES_DIR.iterdir() if p.suffix in (".c", ".h"))]


PATHS = ("amx", "avx512-bf16", "avx2")  # matrix paths, fastest first
_CPU_FLAGS_NEEDED = {
    "avx2": {"avx2", "fma"},
    "avx512-bf16": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
    "amx": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"},
    "avx512-vnni": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    "amx-int8": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"},
}
# Block-quantized weights' integer dot products (kernels/common.h, "Block-quantized weights"), fastest first; every
# path gives the same bits. "amx-int8" (kernels/amx.c): AMX tiles for products of 8 or more rows (verify windows
# of K >= 7, batched decode, prefill; every block format), VNNI's kernels for fewer rows.
QUANT_PATHS = ("amx-int8", "avx512-vnni", "avx2")
_QGEMM_PREFIX = {"amx-int8": "peagle_qgemm_amx_", "avx512-vnni": "peagle_qgemm_vnni_", "avx2": "peagle_qgemm_"}
# The block formats each quantized path runs, in kernels.c's order (a format's id is its index here).
QUANT_FORMATS = ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
# The formats whose products of many rows run on AMX tiles on the "amx-int8" path: all of them.
AMX_INT8_FORMATS = QUANT_FORMATS
_GEMM_SYMBOL = {"amx": "peagle_amx_gemm", "avx512-bf16": "peagle_gemm_avx512bf16", "avx2": "peagle_gemm_avx2"}
_FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-Wall", "-Wextra"]
# An older compiler may not know the AMX or AVX-512 BF16 intrinsics: then build without those sections.
_SECTION_FALLBACKS = ([], ["-DPEAGLE_NO_AMX"], ["-DPEAGLE_NO_AMX", "-DPEAGLE_NO_AVX512"])

@functools.cache
def _cpu_flags() -> frozenset[str]:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.split())


@functools.cache
def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it (what benchmarks and cached timings record), else the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_dir() -> Path:
    """Where the compiled library is kept: $PEAGLE_KERNELS_DIR, else $PEAGLE_HOME/kernels (the variable lets
    processes with homes of their own, such as tests' servers, share one build)."""
    from peagle.model.loading import peagle_home

    return Path(os.environ.get("PEAGLE_KERNELS_DIR") or peagle_home() / "kernels")


def _build(variant: tuple[str, ...] = (), sections: tuple[list[str], ...] = _SECTION_FALLBACKS,
           name: str = "peagle_kernels") -> Path | None:
    """Compile kernels.c (with `variant`'s extra flags) into build_dir(), once per source, flags and compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        print("peagle: no C compiler found (set CC); using PyTorch's CPU kernels", file=sys.stderr)
        return None
    # Read once: the key covers exactly what is compiled (a copy in the build's own folder), even while the sources
    # change under a running build.
    sources = {src.relative_to(SOURCE.parent): src.read_bytes() for src in _sources()}
    digest = hashlib.sha256()
    for rel, text in sources.items():
        digest.update(str(rel).encode() + b"\0" + text + b"\0")
    key = hashlib.sha256((digest.hexdigest() + " ".join([*_FLAGS, *variant]) + compiler).encode()).hexdigest()[:16]
    out_dir = build_dir()
    target = out_dir / f"{name}_{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"peagle: compiling the CPU kernels for this machine into {out_dir} (once per version of "
          "kernels.c and kernels/; a minute or two)", file=sys.stderr, flush=True)
    errors = ""
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        lib = Path(tmp) / "kernels.so"
        for rel, text in sources.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_bytes(text)
        # With OpenMP the library links libgomp.so.1, which resolves to the copy PyTorch already loaded, so both
        # share one thread pool. Without OpenMP support it still builds, single-threaded.
        for section_flags in sections:
            for omp in (["-fopenmp"], ["-Wno-unknown-pragmas"]):
                cmd = [compiler, *_FLAGS, *variant, *section_flags, *omp, str(Path(tmp) / SOURCE.name), "-o", str(lib),
                       "-lm"]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode == 0:
                    if r.stderr.strip():
                        print(f"peagle: kernel build warnings:\n{r.stderr.strip()[:2000]}", file=sys.stderr)
                    os.replace(lib, target)  # atomic: concurrent first uses each build, one wins
                    return target
                errors = r.stderr.strip()
    print(f"peagle: could not build the CPU kernels ({errors[:300]}); using PyTorch's", file=sys.stderr)
    return None


def _declare(lib) -> None:
    p, i, f, l, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long, ctypes.c_size_t
    gemm = ([p, l, p, p, l, i, i, i, i], i)
    signatures = {
        "peagle_panels_size": ([i, i], sz),
        "peagle_pack_panels": ([p, i, i, p, i], None),
        "peagle_gemm_avx2": gemm,
        "peagle_gemm_avx512bf16": gemm,
        "peagle_amx_init": ([], i),
        "peagle_amx_packed_size": ([i, i], sz),
        "peagle_amx_pack": ([p, i, i, p], None),
        "peagle_amx_gemm": gemm,
        "peagle_rms_norm_bf16": ([p, p, p, i, i, f], None),
        "peagle_rope_bf16": ([p, p, p, i, i, i, i], None),
        "peagle_silu_mul_bf16": ([p, p, i, i], None),
        "peagle_attention_bf16": ([p, l, p, p, l, p, p, p, p, i, i, i, i, i, f, i, i], i),
        "peagle_decoder_layer": ([p, p, p, i, i, p, p, p, p, p, i], i),
        "peagle_layer_from_input": ([p, p, i, p, p, i, i, p, p, p, p, p, i], i),
        "peagle_qpanels_size": ([i, i, i], sz),
        "peagle_qpack": ([i, p, i, i, p], None),
        **{prefix + fmt: gemm for prefix in _QGEMM_PREFIX.values() for fmt in QUANT_FORMATS},
        "peagle_qgemm_stack": gemm,
        "peagle_qgemm_amx_min_rows": ([i], i),
        "peagle_quantize_rows_q8": ([p, l, i, i, i, p, p, p], None),
        "peagle_qrows_bf16": ([i, p, i, i, p, i, p], i),
        "peagle_qrows_f32": ([i, p, i, i, p, i, p], i),
    }
    for name, (args, res) in signatures.items():
        if hasattr(lib, name):  # the AMX / AVX-512 sections may be compiled out
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    return lib


def _load() -> ctypes.CDLL | None:
    """The kernel library built for this machine (compiled on first use), or None where it cannot be built."""
    path = _build()
    return None if path is None else _open(path)


CHOICE_ENV = "PEAGLE_CPU_KERNELS"


def choice_from_environment() -> str:
    """PEAGLE_CPU_KERNELS's value ("auto" when unset): the one place the variable is read, by kernel_paths() when it
    resolves this process's paths, for a `peagle` command and for LLMEngine used from Python alike."""
    return os.environ.get(CHOICE_ENV, "auto")


@dataclass(frozen=True)
class KernelPaths:
    """Which kernels run: what resolve() decided from a choice, the CPU's flags and the library, never changed after
    (weights packed for one path must never meet another path's kernels)."""
    choice: str  # "auto", "off" or a matrix path of PATHS
    lib: ctypes.CDLL | None = None  # the loaded kernel library; None: PyTorch's kernels run
    matrix_paths: tuple[str, ...] = ()  # the matrix paths this machine and this build run, fastest first
    matmul: str | None = None  # the matrix path packed weights use by default
    attention: str | None = None  # how attention computes ("avx512-bf16" or "avx2", see attention_path())
    quant_paths: tuple[str, ...] = ()  # the block-quantized paths that run, fastest first
    quant: str | None = None  # the one block-quantized weights use by default
    amx_granted: bool = False  # whether the OS granted this process the AMX tile state (peagle_amx_init)


# Naming a matrix path keeps block products to its instruction set: avx2 everywhere (as on a Zen 3), avx512-bf16 off
# AMX tiles. "auto" and "amx" take the fastest block path.
_QUANT_PATHS_FOR = {"avx2": ("avx2",), "avx512-bf16": ("avx512-vnni", "avx2")}


def resolve(choice: str, flags: frozenset[str], load: Callable[[], ctypes.CDLL | None] = _load) -> KernelPaths:
    """The kernel paths for `choice` ("auto", "off" or "0" for PyTorch's kernels, or a matrix path of PATHS) on a
    CPU with /proc/cpuinfo `flags`, with the library `load()` gives (built only where a native path may run).
    ValueError for an unknown choice, or a path this machine cannot run (naming the ones it runs)."""
    choice = choice.strip().lower()
    choice = "off" if choice == "0" else choice
    if choice not in ("auto", "off", *PATHS):
        raise ValueError(f"{CHOICE_ENV}={choice!r} is not one of auto, off, {', '.join(PATHS)}")
    lib = None
    if choice != "off" and _CPU_FLAGS_NEEDED["avx2"] <= flags:
        try:
            lib = load()
        except OSError as e:
            print(f"peagle: CPU kernels unavailable ({e}); using PyTorch's", file=sys.stderr)
    granted = (lib is not None and "amx_tile" in flags and hasattr(lib, "peagle_amx_init")
               and bool(lib.peagle_amx_init()))  # False: the OS refused the tile state
    matrix = tuple(p for p in PATHS if lib is not None and _CPU_FLAGS_NEEDED[p] <= flags
                   and hasattr(lib, _GEMM_SYMBOL[p]) and (p != "amx" or granted))
    if choice in PATHS and choice not in matrix:
        raise ValueError(f"{CHOICE_ENV}={choice} cannot run on this machine; it runs: "
                         f"{', '.join(matrix) or 'none (PyTorch only)'}")
    if not matrix:  # PyTorch's kernels
        return KernelPaths(choice)
    matmul = choice if choice in PATHS else matrix[0]
    attention = "avx512-bf16" if matmul in ("amx", "avx512-bf16") else "avx2"  # attention_path() says why
    quant = tuple(p for p in QUANT_PATHS if _CPU_FLAGS_NEEDED[p] <= flags and hasattr(lib, _QGEMM_PREFIX[p] + "q4_0")
                  and (p != "amx-int8" or granted))
    default_quant = next(p for p in quant if p in _QUANT_PATHS_FOR.get(choice, QUANT_PATHS))
    return KernelPaths(choice, lib, matrix, matmul, attention, quant, default_quant, granted)


_lock = threading.Lock()
_resolved: KernelPaths | None = None  # this process's, set once by kernel_paths()


def kernel_paths() -> KernelPaths:
    """This process's kernel paths: resolved on first use from choice_from_environment() and this CPU (the library
    built then), the same value ever after. An error is not kept: the next call resolves again, and fails again."""
    global _resolved
    if _resolved is None:
        with _lock:
            if _resolved is None:
                _resolved = resolve(choice_from_environment(), _cpu_flags())
    return _resolved


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (ctypes), or None where no native path runs (built and loaded on first call)."""
    return kernel_paths().lib


# Tests only: the AVX-512 sections compiled against SIMDe's portable intrinsics (kernels.c, PEAGLE_EMULATE_AVX512).
# -O0 (after _FLAGS' -O3, so it wins): about 25 s to compile instead of over 10 minutes, and the same results (no
# fast-math, no contraction, no excess precision on x86-64); -Wno-psabi: SIMDe's 512-bit types pass by value.
# PEAGLE_EMULATE_AMX: the AMX int8 section's tile instructions in portable C too (kernels/amx.c; the bf16 AMX
# section is left out).
_EMULATION_FLAGS = ("-O0", "-mavx2", "-mfma", "-mf16c", "-DPEAGLE_EMULATE_AVX512", "-DPEAGLE_EMULATE_AMX",
                    "-Wno-psabi")


@functools.cache
def emulated_library():
    """A second build of the kernel library, for tests on CPUs without AVX-512 or AMX: its AVX-512 VNNI and BF16
    sections and its AMX int8 section (the same symbols) run SIMDe's and kernels/amx.c's portable definitions of
    the instructions, so their logic can be checked against AVX2 here. Slow, never used to run a model. None where
    SIMDe's headers (apt-get install libsimde-dev), a C compiler or AVX2 are missing; RuntimeError when it fails to build for another reason."""
    if not _CPU_FLAGS_NEEDED["avx2"] <= _cpu_flags():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    probe = subprocess.run([compiler, "-E", "-x", "c", "-", "-o", os.devnull], input="#include <simde/x86/avx512.h>\n",
                           capture_output=True, text=True) if compiler else None
    if probe is None or probe.returncode:
        return None
    path = _build(_EMULATION_FLAGS, ([],), "peagle_kernels_emulated")
    if path is None:
        raise RuntimeError("the emulated AVX-512 kernels failed to build (the errors are printed above)")
    return _open(path)


def available() -> bool:
    """Whether peagle's kernels run here (then attention, RMSNorm and RoPE are native, and at least "avx2")."""
    return library() is not None


def cpu_has(path: str) -> bool:
    """Whether this CPU has the instructions matrix path `path` needs (it then must run: a path the library failed
    to build is a broken install, not a slower machine)."""
    return _CPU_FLAGS_NEEDED[path] <= _cpu_flags()


def supported_paths() -> tuple[str, ...]:
    """The matrix paths this machine runs, fastest first (empty where only PyTorch runs)."""
    return kernel_paths().matrix_paths


def matmul_path() -> str | None:
    """The matrix path packed weights use by default, or None (PyTorch's F.linear)."""
    return kernel_paths().matmul


def attention_path() -> str | None:
    """How attention computes its scores and weighted values in this process, one way for every call (decode,
    verify and prefill rows must round alike): "avx512-bf16" (`vdpbf16ps`) where the matrix path in use has those
    instructions (AMX machines too; PEAGLE_CPU_KERNELS=avx2 forces both to avx2), else "avx2" (fp32 FMAs); None
    where no native path runs."""
    return kernel_paths().attention


def quant_paths() -> tuple[str, ...]:
    """The block-quantized weights' paths this machine runs, fastest first (empty where only PyTorch runs)."""
    return kernel_paths().quant_paths


def quant_path() -> str | None:
    """The path block-quantized weights use by default: the fastest, except that PEAGLE_CPU_KERNELS=avx2 keeps
    them on AVX2 too (one instruction set for everything, as on a Zen 3), and =avx512-bf16 keeps them off AMX."""
    return kernel_paths().quant


def qgemm_symbol(path: str, fmt: str) -> str:
    """The kernel library's function multiplying by `fmt` blocks on quantized-weight path `path`."""
    return _QGEMM_PREFIX[path] + fmt


def summary(device: torch.device | str = "cpu") -> dict:
    """What runs a model's forward on `device`, for generate stats, /v1/models, bench metadata and logs."""
    if torch.device(device).type != "cpu":
        return {"kernels": f"pytorch ({torch.device(device).type})", "greedy_bit_exact": False}
    path = matmul_path()
    return {"kernels": path or "pytorch", "greedy_bit_exact": path is not None}


def describe(device: torch.device | str = "cpu") -> str:
    """One line for logs and benchmark headers."""
    s = summary(device)
    if s["greedy_bit_exact"]:
        return f"peagle {s['kernels']} kernels: greedy speculation is bit-exact"
    return (f"{s['kernels']} kernels (no batch-invariant path here): greedy speculation may differ from plain "
            "decoding where two tokens are near-tied")


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel library, for bf16 CPU tensors that need no gradients on a machine where the kernels run; else
    None. Called several times per layer per step, so it is written for speed. The tensors are looked at first: a
    model on a GPU (or in fp32) never builds the library (a CUDA training run must not spend a minute compiling CPU
    kernels)."""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype is not torch.bfloat16 or not t.is_cpu or (grad and t.requires_grad):
            return None
    return (_resolved or kernel_paths()).lib


@dataclass
class PackedWeight:
    """A bf16 weight [N, K] packed once for one matrix path (a separate copy; the plain weight is untouched)."""
    data: torch.Tensor  # flat bf16
    out_features: int
    in_features: int
    path: str

    @classmethod
    def pack(cls, weight: torch.Tensor, path: str | None = None) -> "PackedWeight | None":
        """Pack for `path` (default: matmul_path()); None where packed weights do not apply (no native path,
        not a 2-D bf16 CPU tensor)."""
        path = path or matmul_path()
        if path is None or not (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2):
            return None
        if path not in supported_paths():
            raise ValueError(f"matrix path {path!r} does not run here; this machine runs {supported_paths()}")
        w = weight.detach().contiguous()
        N, K = w.shape
        lib = library()
        if path == "amx":
            data = torch.empty(lib.peagle_amx_packed_size(N, K), dtype=torch.bfloat16)
            lib.peagle_amx_pack(w.data_ptr(), N, K, data.data_ptr())
        else:
            data = torch.empty(lib.peagle_panels_size(N, K), dtype=torch.bfloat16)
            lib.peagle_pack_panels(w.data_ptr(), N, K, data.data_ptr(), torch.get_num_threads())
        return cls(data, N, K, path)

    format = "bf16"  # the weights' number format (peagle.model.quant has the block formats)

    def __post_init__(self) -> None:
        self.gemm = getattr(library(), _GEMM_SYMBOL[self.path])  # looked up once: packed_linear runs every step
        self.gemm_ptr = ctypes.cast(self.gemm, ctypes.c_void_p).value
        self.data_ptr = self.data.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * 2

    def unpack(self) -> torch.Tensor:
        """The bf16 weight [N, K] this was packed from, bit for bit (for a model that released its floats). Packing
        copies each element to its place and pads with zeros, so packing the elements' own numbers (counted from 1,
        16 bits at a time) says where each element went, whatever the path's layout."""
        N, K = self.out_features, self.in_features
        number = torch.arange(1, N * K + 1, dtype=torch.int64)
        where = torch.zeros_like(self.data, dtype=torch.int64)
        for shift in range(0, (N * K).bit_length(), 16):
            bits = ((number >> shift) & 0xFFFF).to(torch.int16).view(torch.bfloat16).view(N, K)
            placed = PackedWeight.pack(bits, self.path).data.view(torch.int16).to(torch.int64) & 0xFFFF
            where |= placed << shift
        del number
        element = where.nonzero().squeeze(1)
        weight = torch.empty(N * K, dtype=torch.bfloat16)
        weight[where[element] - 1] = self.data[element]
        return weight.view(N, K)


def packed_linear(x: torch.Tensor, packed) -> torch.Tensor | None:
    """x [..., K] @ W^T for a packed W (a PackedWeight or a quant.QuantWeight), or None when the packed path does
    not apply (then use F.linear)."""
    if packed is None or _native(x) is None or x.shape[-1] != packed.in_features:
        return None
    K, N = packed.in_features, packed.out_features
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(*x.shape[:-1], N, dtype=torch.bfloat16)
    if M and packed.gemm(x2.data_ptr(), x2.stride(0), packed.data_ptr, y.data_ptr(), N, M, N, K,
                         torch.get_num_threads()):
        raise MemoryError(f"peagle {packed.path} matmul: could not allocate the {M}x{K} activation copy")
    return y


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm with the reference's bf16 rounding in one call, or None when the kernel does not apply."""
    lib = _native(x, weight)
    if lib is None or not weight.is_contiguous() or x.shape[-1] != weight.shape[0]:
        return None
    H = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    if xc.numel():
        lib.peagle_rms_norm_bf16(xc.data_ptr(), weight.data_ptr(), y.data_ptr(), xc.numel() // H, H, eps)
    return y


def rope_bf16_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> bool:
    """Rotate the first `heads` heads of x [B, T, heads_total, D] (contiguous) in place, cos/sin [B, T, D]; False
    (x untouched) when the kernel does not apply."""
    lib = _native(x, cos, sin)
    if lib is None or not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        return False
    B, T, heads_total, D = x.shape
    if cos.shape != (B, T, D) or sin.shape != (B, T, D):
        return False
    lib.peagle_rope_bf16(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), B * T, heads_total, heads, D)
    return True


def silu_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [..., 2I] = [gate, up] in one call, or None when the kernel does not apply."""
    I = gate_up.shape[-1] // 2
    lib = _native(gate_up)
    if lib is None or I % 8 or not gate_up.is_contiguous():
        return None
    y = torch.empty(*gate_up.shape[:-1], I, dtype=torch.bfloat16)
    lib.peagle_silu_mul_bf16(gate_up.data_ptr(), y.data_ptr(), gate_up.numel() // (2 * I), I)
    return y


def _rows_evenly_strided(t: torch.Tensor) -> bool:
    """[B, T, heads, D] with heads contiguous and row (b, t) at b * T * stride(1) + t * stride(1)."""
    return t.stride(3) == 1 and t.stride(2) == t.shape[3] and t.stride(0) == t.shape[1] * t.stride(1)


class _PagedKV(ctypes.Structure):
    """kernels.c's peagle_kv: one layer's paged cache (layers.LayerKV)."""
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("tables", ctypes.c_void_p),
                ("num_slots", ctypes.c_int), ("max_blocks", ctypes.c_int), ("block_size", ctypes.c_int),
                ("num_blocks", ctypes.c_int), ("key_offset", ctypes.c_int), ("keys", ctypes.c_void_p),
                ("keys_stride", ctypes.c_int)]


def paged_kv(k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, key_offset: int = 0,
             keys: torch.Tensor | None = None) -> _PagedKV | None:
    """The kernels' view of a layer's paged cache: pools k, v [num_blocks, nkv, block_size, D] and block tables
    [num_slots, max_blocks] (int32), or None where the kernels cannot read it. `keys` [rows, stride] (int32): where
    each query row of the forwards that read this view finds its keys, when not at positions 0..its own (a draft
    tree: common.h's peagle_kv)."""
    if not (_native(k, v) is not None and k.is_contiguous() and v.is_contiguous() and k.shape == v.shape
            and tables.dtype == torch.int32 and tables.is_contiguous()):
        return None
    if keys is not None and not (keys.dtype == torch.int32 and keys.is_contiguous() and keys.dim() == 2):
        return None
    num_blocks, _, block_size, _ = k.shape
    return _PagedKV(k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.shape[0], tables.shape[1], block_size,
                    num_blocks, key_offset, keys.data_ptr() if keys is not None else None,
                    keys.shape[1] if keys is not None else 0)


def attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv, slots: torch.Tensor,
                   positions: torch.Tensor, path: str | None = None) -> torch.Tensor | None:
    """Write k, v [B, T, nkv, D] into the paged cache `kv` (layers.LayerKV) at each row's slot and positions, then
    causal attention of q [B, T, nh, D]: row (b, t) attends to keys 0..positions[b, t] of slot slots[b]. Each row is
    computed alone, so the result never depends on T or B (batch invariance) nor on which blocks hold the keys.
    path: "avx2" or "avx512-bf16" (default attention_path()). None (nothing written) when the kernel does not
    apply."""
    lib = _native(q, k, v)
    if lib is None or kv.native is None:
        return None
    path = path or attention_path()
    runs = [p for p in ("avx512-bf16", "avx2") if p in supported_paths()]
    if path not in runs:
        raise ValueError(f"attention path {path!r} does not run here; this machine runs {', '.join(runs)}")
    B, T, nh, D = q.shape
    nkv = kv.k.shape[1]
    if kv.k.shape[3] != D or D % 8 or D > 256 or nh % nkv or k.shape != (B, T, nkv, D) or v.shape != k.shape:
        return None
    q = q if _rows_evenly_strided(q) else q.contiguous()
    if not (_rows_evenly_strided(k) and _rows_evenly_strided(v) and k.stride(1) == v.stride(1)):
        k, v = k.contiguous(), v.contiguous()
    slots = slots.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    if positions.shape != (B, T) or slots.shape != (B,):
        return None
    out = torch.empty(B, T, nh, D, dtype=torch.bfloat16)
    rc = lib.peagle_attention_bf16(q.data_ptr(), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(1),
                                    ctypes.byref(kv.native), slots.data_ptr(), positions.data_ptr(), out.data_ptr(),
                                    B, T, nh, nkv, D, D ** -0.5, torch.get_num_threads(), int(path == "avx512-bf16"))
    _check_paged(rc, kv, "attention")
    return out


def _check_paged(rc: int, kv, what: str) -> None:
    if rc == -2:
        n = kv.native
        raise IndexError(f"peagle {what}: a slot, position or block lies outside this cache (slots [0, {n.num_slots}),"
                         f" positions [0, {n.max_blocks * n.block_size - n.key_offset}), and every block a row reads "
                         "handed out)")
    if rc:
        raise MemoryError(f"peagle {what}: could not allocate scratch memory")


class _LayerWeights(ctypes.Structure):
    """kernels.c's peagle_layer: one decoder layer's weights and shapes."""
    _fields_ = [("gemm_qkv", ctypes.c_void_p), ("gemm_o", ctypes.c_void_p), ("gemm_gate_up", ctypes.c_void_p),
                ("gemm_down", ctypes.c_void_p), ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("H", ctypes.c_int), ("I", ctypes.c_int), ("nh", ctypes.c_int),
                ("nkv", ctypes.c_int), ("D", ctypes.c_int), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("attention_dpbf16", ctypes.c_int)]


class NativeDecoderLayer:
    """A Llama decoder layer (RMSNorm, fused q/k/v, RoPE, attention over the per-row cache, o, residual, RMSNorm,
    fused gate/up, SiLU, down, residual) in one native call: the same kernels in the same order as layers.py's
    DecoderLayer, so the bits are identical, without a dozen Python-level calls per layer per step."""

    def __init__(self, input_norm: torch.Tensor, post_norm: torch.Tensor, qkv, o, gate_up, down, num_heads: int,
                 num_kv_heads: int, head_dim: int, eps: float):
        """qkv, o, gate_up, down: each a PackedWeight or a quant.QuantWeight (a layer may mix formats)."""
        self._keep = (input_norm, post_norm, qkv, o, gate_up, down)  # the pointers below stay valid
        self._weights = _LayerWeights(qkv.gemm_ptr, o.gemm_ptr, gate_up.gemm_ptr, down.gemm_ptr, input_norm.data_ptr(),
                                      post_norm.data_ptr(), qkv.data_ptr, o.data_ptr, gate_up.data_ptr, down.data_ptr,
                                      o.out_features, down.in_features, num_heads, num_kv_heads, head_dim, eps,
                                      head_dim ** -0.5, int(attention_path() == "avx512-bf16"))
        self._ref = ctypes.byref(self._weights)
        self._lib = library()

    @staticmethod
    def applies(packed: list, head_dim: int, intermediate: int) -> bool:
        """Whether the native layer can run these (bias-free, all packed for one native call each) weights."""
        return (all(getattr(p, "gemm_ptr", None) for p in packed) and head_dim % 8 == 0 and head_dim <= 256
                and intermediate % 8 == 0)

    @classmethod
    def for_layers(cls, layers: list, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                   eps: float) -> "list[NativeDecoderLayer] | None":
        """One native layer per packed layers.DecoderLayer (the target's, the drafter's), or None when any of them
        cannot run natively (then all run as modules)."""
        packed = [[la.self_attn.qkv.packed, la.self_attn.o_packed, la.mlp.gate_up.packed, la.mlp.down_packed]
                  for la in layers]
        if not all(cls.applies(p, head_dim, intermediate) for p in packed):
            return None
        return [cls(la.input_layernorm.weight, la.post_attention_layernorm.weight, *p, num_heads, num_kv_heads,
                    head_dim, eps) for la, p in zip(layers, packed)]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, slots: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] contiguous bf16; cos/sin [B, T, D]; kv a layers.LayerKV; slots [B] and positions [B, T]
        contiguous int64."""
        B, T, _ = x.shape
        y = torch.empty_like(x)
        rc = self._lib.peagle_decoder_layer(self._ref, x.data_ptr(), y.data_ptr(), B, T, cos.data_ptr(),
                                            sin.data_ptr(), ctypes.byref(kv.native), slots.data_ptr(),
                                            positions.data_ptr(), torch.get_num_threads())
        _check_paged(rc, kv, "decoder layer")
        return y

    def from_input(self, attn_in: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer with its attention input given: attention over attn_in [B, T, Kin] (the drafter's fusion layer:
        its normed embedding and normed feature side by side), added to residual [B, T, H], then the MLP half.
        Both contiguous bf16; the rest as in __call__."""
        B, T, K = attn_in.shape
        y = torch.empty_like(residual)
        rc = self._lib.peagle_layer_from_input(self._ref, attn_in.data_ptr(), K, residual.data_ptr(), y.data_ptr(),
                                               B, T, cos.data_ptr(), sin.data_ptr(), ctypes.byref(kv.native),
                                               slots.data_ptr(), positions.data_ptr(), torch.get_num_threads())
        _check_paged(rc, kv, "decoder layer")
        return y
