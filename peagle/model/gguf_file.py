"""A GGUF file's header and tensors, read directly from the mapped file.

The layout (llama.cpp's, version 2 and 3): magic `GGUF`, version, tensor count, key count; the key-value pairs (a
string key, a type, a value: scalar, string or array); one record per tensor (name, dimensions innermost first, type,
offset); then, aligned to `general.alignment` (32 by default), the tensors' bytes. Values that are not asked for are
stepped over, so a 262,144-token vocabulary costs a pass over its string lengths and nothing more. (The gguf
package's reader builds a numpy view for every value of every array: most of a minute for Gemma 3's vocabulary on a
busy machine, on every load. Its type tables are used here.)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUF value types (the format's numbering): fixed-size scalars, then strings and arrays.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # the ggml type's name ("Q4_K", "F32"), or "type N" for a number this gguf package does not know
    shape: tuple[int, ...]  # outermost first, as torch reads it (GGUF lists them innermost first)
    data: np.ndarray  # the stored bytes (uint8), a view of the mapped file


def read_metadata(path: str | Path, keys: set[str]) -> dict:
    """The values of `keys` from the file's key-value header (absent keys are left out); stops at the last key
    wanted. Raises ValueError for a file that is not GGUF or is cut short."""
    with _Cursor.open(path) as cur:
        out: dict = {}
        for _ in range(cur.header()):
            key = cur.string()
            value = cur.value(cur.u32(), keep=key in keys)
            if key in keys:
                out[key] = value
                if len(out) == len(keys):
                    break
        return out


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """Every tensor of the file, in its order, each with a view of its bytes. Raises ValueError for a file that is not
    GGUF, is cut short, or whose tensors do not fit in it."""
    import gguf

    with _Cursor.open(path) as cur:
        alignment = _DEFAULT_ALIGNMENT
        for _ in range(cur.header()):
            key = cur.string()
            value = cur.value(cur.u32(), keep=key == "general.alignment")
            if key == "general.alignment":
                alignment = int(value)
        records = []
        for _ in range(cur.n_tensors):
            name = cur.string()
            dims = [cur.u64() for _ in range(cur.u32())]
            kind, offset = cur.u32(), cur.u64()
            records.append((name, dims, kind, offset))
        start = -(-cur.pos // alignment) * alignment
        tensors = []
        for name, dims, kind, offset in records:
            try:
                ggml_type = gguf.GGMLQuantizationType(kind)
            except ValueError:
                tensors.append(GGUFTensor(name, f"type {kind}", tuple(reversed(dims)), cur.data[:0]))
                continue
            block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            count = int(np.prod(dims, dtype=np.int64))
            nbytes = count // block * type_size
            begin = start + offset
            if count % block or begin + nbytes > cur.size:
                raise ValueError(f"{path}: tensor {name} ({ggml_type.name}, {'x'.join(map(str, reversed(dims)))}) "
                                 f"needs bytes {begin}-{begin + nbytes} of a {cur.size}-byte file (truncated or "
                                 "corrupt file)")
            tensors.append(GGUFTensor(name, ggml_type.name, tuple(reversed(dims)), cur.data[begin:begin + nbytes]))
        return tensors


class _Cursor:
    """A read position in the mapped file; every read past its end raises ValueError."""

    def __init__(self, path: Path, data: np.ndarray):
        self.path, self.data, self.size = path, data, len(data)
        self.raw, self.pos, self.n_tensors = memoryview(data), 0, 0

    @classmethod
    def open(cls, path: str | Path) -> "_Cursor":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such GGUF file")
        if path.stat().st_size < 24:
            raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {path.stat().st_size} bytes")
        return cls(path, np.memmap(path, dtype=np.uint8, mode="r"))

    def __enter__(self) -> "_Cursor":
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.raw.release()
        if isinstance(error, (struct.error, UnicodeDecodeError, IndexError, OverflowError)):
            raise ValueError(f"{self.path} is not a readable GGUF file (truncated or corrupt?): "
                             f"{type(error).__name__} at byte {self.pos}: {error}") from error

    def header(self) -> int:
        """Checks magic and version, and returns the number of key-value pairs."""
        magic, version = bytes(self.raw[:4]), struct.unpack_from("<I", self.raw, 4)[0]
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{self.path} is not a GGUF file of version 2 or later (llama.cpp's format)")
        if version & 0xFFFF == 0:  # version 2 or 3 written big-endian (llama.cpp's s390x files)
            raise ValueError(f"{self.path} is a big-endian GGUF file: convert it on a little-endian machine "
                             "(llama.cpp's convert_hf_to_gguf.py without --bigendian)")
        self.n_tensors, n_kv = struct.unpack_from("<QQ", self.raw, 8)
        self.pos = 24
        return n_kv

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > self.size:
            raise struct.error(f"{size} bytes wanted, {self.size - self.pos} left")
        value = struct.unpack_from(fmt, self.raw, self.pos)[0]
        self.pos += size
        return value

    def u32(self) -> int:
        return self._unpack("<I")

    def u64(self) -> int:
        return self._unpack("<Q")

    def string(self, keep: bool = True) -> str | None:
        n = self.u64()
        end = self.pos + n
        if end > self.size:
            raise struct.error(f"a string of {n} bytes runs past the end")
        text = bytes(self.raw[self.pos:end]).decode("utf-8", errors="replace") if keep else None
        self.pos = end
        return text

    def value(self, kind: int, keep: bool):
        """One value of GGUF type `kind`; stepped over (None) unless `keep`."""
        if kind == _STRING:
            return self.string(keep)
        if kind == _ARRAY:
            item, n = self.u32(), self.u64()
            if item in _SCALARS:
                size = struct.calcsize(_SCALARS[item])
                if self.pos + n * size > self.size:
                    raise struct.error(f"an array of {n} values runs past the end")
                values = np.frombuffer(self.raw, _SCALARS[item], n, self.pos).tolist() if keep else None
                self.pos += n * size
                return values
            if keep:
                return [self.value(item, True) for _ in range(n)]
            if item == _STRING:  # a vocabulary: step over each string by its length alone
                raw, pos = self.raw, self.pos
                for _ in range(n):
                    pos += 8 + struct.unpack_from("<Q", raw, pos)[0]
                self.pos = pos
                if pos > self.size:
                    raise struct.error(f"an array of {n} strings runs past the end")
            else:
                for _ in range(n):
                    self.value(item, False)
            return None
        if kind not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind} at byte {self.pos} (corrupt file?)")
        return self._unpack(_SCALARS[kind])
