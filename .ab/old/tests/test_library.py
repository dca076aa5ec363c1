"""kernelgen's torch.library ops: fake implementations (CPU, fake CUDA tensors), and on a GPU:
opcheck, autograd through flash_attn_func, torch.compile(fullgraph=True), CUDA-graph capture."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kernelgen
from kernelgen import library  # noqa: F401  (registers the ops)
from kernelgen.reference import attention_ref, max_error, rounding_allowance

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fake_shapes_propagate_without_a_gpu():
    with FakeTensorMode():
        q = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 300, 2, 64, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.kernelgen.flash_attn_fwd(q, k, k, True, 0.125, False)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
        dq, dk, dv = torch.ops.kernelgen.flash_attn_bwd(out, q, k, k, out, lse, True, 0.125, False)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_fake_implementation_validates():
    with FakeTensorMode():
        q = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 300, 3, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="multiple of k/v heads"):
            torch.ops.kernelgen.flash_attn_fwd(q, k, k, False, 0.125, False)
        k = torch.empty(2, 300, 2, 64, dtype=torch.float16, device="cuda")
        with pytest.raises(TypeError, match="k has dtype"):
            torch.ops.kernelgen.flash_attn_fwd(q, k, k, False, 0.125, False)
        out = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(2, 8, 100, device="cuda")
        bad = torch.empty(2, 99, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 300, 2, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="dout must match out"):
            torch.ops.kernelgen.flash_attn_bwd(bad, q, k, k, out, lse, False, 0.125, False)


def _inputs(dtype=torch.bfloat16, requires_grad=True):
    torch.manual_seed(0)
    q = torch.randn(2, 333, 8, 64, device="cuda", dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(2, 257, 4, 64, device="cuda", dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(2, 257, 4, 64, device="cuda", dtype=dtype, requires_grad=requires_grad)
    return q, k, v


@gpu
@pytest.mark.gpu
def test_opcheck():
    q, k, v = _inputs()
    torch.library.opcheck(torch.ops.kernelgen.flash_attn_fwd.default, (q, k, v, True, 0.125, False))
    out, lse = torch.ops.kernelgen.flash_attn_fwd(q.detach(), k.detach(), v.detach(), True, 0.125, False)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.kernelgen.flash_attn_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, True, 0.125, False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_autograd_matches_reference(causal):
    q, k, v = _inputs()
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    out = kernelgen.flash_attn_func(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*ref_inputs, causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout.float())
    pt_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    pt, _ = attention_ref(*pt_inputs, causal=causal, upcast=False)
    pt_grads = torch.autograd.grad(pt, pt_inputs, dout)
    for name, g, g_ref, g_pt in zip("qkv", grads, ref_grads, pt_grads):
        err, err_pt = max_error(g, g_ref), max_error(g_pt, g_ref)
        assert err <= 2 * err_pt + rounding_allowance(g_ref.to(q.dtype)), (name, err, err_pt)


@gpu
@pytest.mark.gpu
def test_torch_compile_fullgraph():
    q, k, v = _inputs()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)

        def forward(self, q, k, v):
            return self.proj(kernelgen.flash_attn_func(q, k, v, causal=True)).float().square().mean()

    model = Block()
    compiled = torch.compile(model, fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    expected = model(q.detach(), k.detach(), v.detach())
    assert torch.allclose(loss.detach(), expected, rtol=1e-2, atol=1e-3)
    assert q.grad is not None and torch.isfinite(q.grad).all()


@gpu
@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    q, k, v = _inputs()
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def step():
        out = kernelgen.flash_attn_func(q, k, v, causal=True)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step()  # warm-up: compiles and loads everything outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    for a, b in zip(captured, fresh):
        assert torch.allclose(a, b, rtol=0, atol=0) or max_error(a, b) < 1e-2
    assert not all(torch.equal(a, b) for a, b in zip(captured, eager)), "replay used the new inputs"


@gpu
@pytest.mark.gpu
def test_capture_refuses_to_compile(monkeypatch):
    from kernelgen import api, ops

    q = torch.randn(1, 77, 2, 96, device="cuda", dtype=torch.float16)
    for module, name in ((api, "_MEMO"), (ops, "_KERNELS"), (ops, "_PLANS")):
        monkeypatch.setattr(module, name, {})
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="capture"):
        with torch.cuda.graph(graph):
            kernelgen.flash_attn_func(q, q, q, causal=True)


@gpu
@pytest.mark.gpu
def test_a_training_step_reuses_its_launch_plans(monkeypatch):
    """Under autograd the forward runs as the library op: a repeated shape must not be checked,
    planned or looked up again (host time per step matters at short sequences)."""
    from kernelgen import ops

    q, k, v = _inputs()
    kernelgen.flash_attn_func(q, k, v, causal=True).sum().backward()

    def fail(*args, **kwargs):
        raise AssertionError("a repeated call planned or validated again")

    monkeypatch.setattr(ops, "_plan", fail)
    monkeypatch.setattr(ops, "_check_inputs", fail)
    q2, k2, v2 = _inputs()
    kernelgen.flash_attn_func(q2, k2, v2, causal=True).sum().backward()
    torch.cuda.synchronize()
    assert q2.grad is not None and torch.isfinite(q2.grad).all()
