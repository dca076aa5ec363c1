"""Bad input to flash_attn_func: a TypeError/ValueError naming the argument before anything
launches; without a GPU a RuntimeError. Runs on CPU (structure checks come first)."""
import pytest
import torch

import kernelgen


def t(*shape, dtype=torch.bfloat16, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((t(2, 8, 4, 64, dtype=torch.float32), t(2, 8, 4, 64), t(2, 8, 4, 64)), TypeError, "q must be float16 or bfloat16"),
        ((t(2, 8, 4, 64), t(2, 8, 4, 64, dtype=torch.float16), t(2, 8, 4, 64)), TypeError, "k has dtype"),
        ((t(2, 8, 4, 64), t(2, 8, 4, 64), t(2, 8, 4, 64, dtype=torch.float16)), TypeError, "v has dtype"),
        ((t(8, 4, 64), t(2, 8, 4, 64), t(2, 8, 4, 64)), ValueError, "q must have 4 dims"),
        ((t(2, 8, 4, 64), t(2, 8, 4, 64)[0], t(2, 8, 4, 64)), ValueError, "k must have 4 dims"),
        ((t(2, 8, 4, 80), t(2, 8, 4, 80), t(2, 8, 4, 80)), ValueError, "head_dim 80 is not supported"),
        ((t(2, 8, 4, 64), t(3, 8, 4, 64), t(3, 8, 4, 64)), ValueError, "batch sizes differ"),
        ((t(2, 8, 4, 64), t(2, 8, 4, 128), t(2, 8, 4, 128)), ValueError, "head_dim differs"),
        ((t(2, 8, 4, 64), t(2, 8, 4, 64), t(2, 9, 4, 64)), ValueError, "same seqlen"),
        ((t(2, 8, 6, 64), t(2, 8, 4, 64), t(2, 8, 4, 64)), ValueError, "multiple of k/v heads"),
        ((t(2, 8, 4, 64), t(2, 8, 2, 64), t(2, 8, 4, 64)), ValueError, "same number of heads"),
        ((t(2, 8, 4, 128)[..., ::2], t(2, 8, 4, 64), t(2, 8, 4, 64)), ValueError, "q must be contiguous in its last dim"),
        (("q", t(2, 8, 4, 64), t(2, 8, 4, 64)), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        kernelgen.flash_attn_func(*args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_no_gpu_is_a_clear_runtime_error():
    x = t(1, 8, 2, 64)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        kernelgen.flash_attn_func(x, x, x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_cpu_or_mixed_devices_on_gpu_machine():
    x = t(1, 8, 2, 64)
    g = x.cuda()
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        kernelgen.flash_attn_func(x, g, g)
    with pytest.raises(ValueError, match="k must be a CUDA tensor"):
        kernelgen.flash_attn_func(g, x, g)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="v is on"):
            kernelgen.flash_attn_func(g, g, g.to("cuda:1"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_bad_softmax_scale():
    g = t(1, 8, 2, 64, device="cuda")
    for bad in (0.0, -1.0, float("nan"), "x"):
        with pytest.raises(ValueError, match="softmax_scale"):
            kernelgen.flash_attn_func(g, g, g, softmax_scale=bad)


def test_misaligned_views_are_copied_into_aligned_storage():
    from kernelgen import ops

    base = torch.randn(2 * 8 * 4 * 64 + 4, dtype=torch.bfloat16)
    view = base[4:].view(2, 8, 4, 64)  # contiguous, but 8 bytes past a 16-byte boundary
    assert view.is_contiguous() and view.data_ptr() % 16 == 8
    fixed = ops._aligned(view)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, view)
    aligned = torch.randn(2, 8, 4, 64, dtype=torch.bfloat16)
    assert ops._aligned(aligned) is aligned
