"""The teacher on the engine's forward (peagle's CPU kernels) gives what transformers' forward gives, up to bf16
rounding: the same features, labels and argmax a head is trained on."""
import torch

from peagle.train.teacher import Teacher
from tests.conftest import needs_native_kernels


# Decided on the CPU's instructions, as every hardware skip here: on any x86-64 CPU with AVX2 (Intel with AMX, AMD
# Zen 4, AMD Zen 3) the kernels must run, so a teacher that fell back to transformers there fails instead of skipping.
@needs_native_kernels
def test_native_teacher_matches_transformers(tiny_llama, one_thread):
    native, hf = Teacher(tiny_llama), Teacher(tiny_llama, native=False)
    assert hf.target is None and native.target is not None
    used = torch.arange(0, 512, 3)
    native.used = hf.used = used
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(0))
    f_n, l_n, a_n = native(ids)
    f_h, l_h, a_h = hf(ids)
    assert f_n.shape == f_h.shape == (300, 3 * 64) and l_n.shape == l_h.shape == (300, used.numel())
    assert f_n.dtype == f_h.dtype == l_n.dtype == torch.bfloat16
    rel = ((f_n.float() - f_h.float()).norm(dim=-1) / f_h.float().norm(dim=-1)).max()
    assert rel < 0.03, f"features differ by {rel:.3f} relative"
    assert (l_n.float() - l_h.float()).abs().max() < 0.1 * l_h.float().abs().max()
    assert (a_n == a_h).float().mean() > 0.95
    assert torch.equal(native.input_embeddings(), hf.input_embeddings())
    assert torch.equal(native.output_embeddings(), hf.output_embeddings())
    assert torch.equal(native.final_norm_weight(), hf.final_norm_weight())
