"""peagle's GGUF reader (peagle/model/gguf_file.py) against the gguf package's: the same metadata values, the same
tensors byte for byte, under a non-default alignment, and a clear error for a file cut anywhere."""
import gguf
import numpy as np
import pytest

from peagle.model import gguf_file
from peagle.model.loading import embedded_gguf_path


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_uint32("llama.block_count", 3)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("test.flag", True)
    writer.add_string("test.text", "héllo, wörld")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "ü", ""])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((5, 8)).astype(np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", rng.integers(0, 256, (4, 2 * 34), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(8).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_and_tensors_equal_the_gguf_packages_reader(written):
    reference = gguf.GGUFReader(written)
    keys = {k for k in reference.fields if not k.startswith("GGUF.")}
    got = gguf_file.read_metadata(written, keys)
    assert got.keys() == keys
    for key in keys:
        want = reference.fields[key].contents()
        assert got[key] == (pytest.approx(want) if isinstance(want, float) else want), key
    tensors = gguf_file.read_tensors(written)
    assert [t.name for t in tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(tensors, reference.tensors):
        assert ours.type_name == theirs.tensor_type.name
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert np.array_equal(ours.data, np.asarray(theirs.data).reshape(-1).view(np.uint8)), ours.name


def test_the_embedded_files_tensors_equal_the_gguf_packages_reader():
    path = embedded_gguf_path()
    reference = {t.name: t for t in gguf.GGUFReader(path).tensors}
    tensors = gguf_file.read_tensors(path)
    assert len(tensors) == len(reference)
    for t in tensors:
        assert np.array_equal(t.data, np.asarray(reference[t.name].data).reshape(-1).view(np.uint8)), t.name


def test_a_file_cut_anywhere_is_a_clear_error(written):
    data = written.read_bytes()
    for cut in (0, 10, 30, 100, 200, len(data) // 2, len(data) - 60):  # the last tensor: 16 bytes padded to 64
        written.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated or corrupt|not a GGUF"):
            gguf_file.read_tensors(written)
    written.write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    with pytest.raises(ValueError, match="big-endian"):
        gguf_file.read_tensors(written)
    written.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_file.read_metadata(written, {"test.text"})
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        gguf_file.read_tensors(written.with_name("absent.gguf"))
