"""Specification of pscan.py: every backend agrees with a float64 loop written here, independently."""

import pytest
import torch

import pscan as ps

BACKENDS = {
    "sequential": ps.scan_sequential,
    "pscan": ps.pscan,
    "associative": ps.scan_associative,
}
LENGTHS = [1, 2, 3, 5, 7, 8, 9, 16, 17, 100, 1000, 1025]
REST_SHAPES = [(), (3,), (2, 4)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference(a, b, h0=None):
    """The recurrence exactly as written, one index at a time, in float64."""
    a, b = a.double(), b.double()
    h = torch.zeros_like(b[:, 0]) if h0 is None else h0.double()
    out = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


def make_inputs(B, L, rest, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand((B, L) + rest, generator=g, dtype=torch.float64)  # decaying, like exp(Δ·A)
    b = torch.randn((B, L) + rest, generator=g, dtype=torch.float64)
    h0 = torch.randn((B,) + rest, generator=g, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (a, b, h0)]


def test_loop_matches_hand_computed_values():
    a = torch.tensor([[0.5, 2.0, 0.0]])
    b = torch.tensor([[1.0, 1.0, 3.0]])
    h0 = torch.tensor([2.0])
    # h_0 = 0.5*2 + 1 = 2; h_1 = 2*2 + 1 = 5; h_2 = 0*5 + 3 = 3
    for fn in BACKENDS.values():
        assert fn(a, b, h0).tolist() == [[2.0, 5.0, 3.0]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rest", REST_SHAPES, ids=str)
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_float64_loop_forward_and_gradients(name, L, rest, device):
    a, b, h0 = make_inputs(2, L, rest, device=device)
    for with_h0 in (False, True):
        inputs = [t.clone().requires_grad_() for t in (a, b, h0)]
        start = inputs[2] if with_h0 else None
        h = BACKENDS[name](inputs[0], inputs[1], start)
        expected = reference(a, b, h0 if with_h0 else None)
        torch.testing.assert_close(h, expected, rtol=1e-10, atol=1e-10)
        ref_inputs = [t.clone().requires_grad_() for t in (a, b, h0)]
        ref = reference(ref_inputs[0], ref_inputs[1], ref_inputs[2] if with_h0 else None)
        grad_out = torch.randn_like(ref)
        wrt = inputs if with_h0 else inputs[:2]
        ref_wrt = ref_inputs if with_h0 else ref_inputs[:2]
        got = torch.autograd.grad(h, wrt, grad_out)
        want = torch.autograd.grad(ref, ref_wrt, grad_out)
        for g, w, what in zip(got, want, ["a", "b", "h0"]):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"grad wrt {what}")


@pytest.mark.parametrize("name", ["pscan", "associative"])
@pytest.mark.parametrize("L", [1, 2, 5, 8, 13])
def test_custom_backward_passes_gradcheck(name, L):
    a, b, h0 = make_inputs(2, L, (3,))
    inputs = [t.requires_grad_() for t in (a, b, h0)]
    assert torch.autograd.gradcheck(BACKENDS[name], inputs)
    assert torch.autograd.gradcheck(lambda a, b: BACKENDS[name](a, b), inputs[:2])


@pytest.mark.parametrize("name", BACKENDS)
def test_inputs_are_not_modified(name):
    for dtype in (torch.float32, torch.bfloat16):
        a, b, h0 = make_inputs(2, 37, (4,), dtype=dtype)
        inputs = [t.requires_grad_() for t in (a, b, h0)]
        before = [t.detach().clone() for t in inputs]
        grad_out = torch.randn(2, 37, 4, dtype=dtype)
        h = BACKENDS[name](*inputs)
        torch.autograd.grad(h, inputs, grad_out)
        for t, saved in zip(inputs, before):
            assert torch.equal(t.detach(), saved)


@pytest.mark.parametrize("name", BACKENDS)
def test_non_contiguous_inputs(name):
    a, b, h0 = make_inputs(3, 40, (6,))
    # (B, rest, L) transposed to (B, L, rest), and every other step of a longer sequence
    a_t = a.transpose(1, 2).contiguous().transpose(1, 2)
    b_s = torch.cat([b, b], dim=1)[:, ::2]
    assert not a_t.is_contiguous() and not b_s.is_contiguous()
    b_expected = b_s.contiguous()
    h0_s = torch.cat([h0, h0], dim=1)[:, ::2]
    torch.testing.assert_close(BACKENDS[name](a_t, b_s, h0_s), reference(a, b_expected, h0_s))


@pytest.mark.parametrize("name", BACKENDS)
def test_a_zero_forgets_and_a_one_accumulates(name):
    _, b, h0 = make_inputs(2, 33, (5,))
    zeros, ones = torch.zeros_like(b), torch.ones_like(b)
    torch.testing.assert_close(BACKENDS[name](zeros, b, h0), b)  # h_t = b_t
    expected = torch.cumsum(b, dim=1) + h0[:, None]  # h_t = h0 + b_0 + ... + b_t
    torch.testing.assert_close(BACKENDS[name](ones, b, h0), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", BACKENDS)
def test_half_inputs_accumulate_in_fp32(name, dtype):
    # 1000 steps of +0.01: a half-precision running sum stalls near 2 to 4 (0.01 falls below half
    # the spacing of representable values); an fp32 running sum reaches 10.
    a = torch.ones(1, 1000, 2, dtype=dtype)
    b = torch.full((1, 1000, 2), 0.01, dtype=dtype)
    h = BACKENDS[name](a, b)
    assert h.dtype == dtype
    expected = torch.cumsum(b.double(), dim=1)
    torch.testing.assert_close(h.double(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", BACKENDS)
def test_bf16_result_is_close_to_fp32(name):
    a, b, h0 = make_inputs(2, 300, (8,), dtype=torch.float32)
    a16, b16, h016 = a.bfloat16(), b.bfloat16(), h0.bfloat16()
    got = BACKENDS[name](a16, b16, h016).float()
    want = reference(a16, b16, h016).float()  # exact result for the rounded inputs
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    a16.requires_grad_()
    grad = torch.autograd.grad(BACKENDS[name](a16, b16, h016).sum(), a16)[0]
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad.float()).all()


def test_auto_matches_reference_with_and_without_grad():
    for rest in [(4,), (16, 16), (512, 16)]:
        a, b, h0 = make_inputs(1, 20, rest, dtype=torch.float32)
        torch.testing.assert_close(ps.scan(a, b, h0).double(), reference(a, b, h0), rtol=1e-5, atol=1e-5)
        ag = a.clone().requires_grad_()
        torch.testing.assert_close(ps.scan(ag, b, h0).double(), reference(a, b, h0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.zeros(2, 5, 3), torch.zeros(2, 4, 3)), "same shape"),
        ((torch.zeros(2, 0, 3), torch.zeros(2, 0, 3)), "at least 1"),
        ((torch.zeros(5), torch.zeros(5)), "at least 2 dims"),
        ((torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), torch.zeros(2, 4)), r"h0 must have shape"),
        ((torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), torch.zeros(3)), r"\(2, 3\)"),
        ((torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)), "floating"),
        ((torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.float64)), "dtype"),
        (([[1.0]], torch.zeros(1, 1)), "tensors"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "sequential", "pscan", "associative"])
def test_bad_input_raises_value_error_naming_the_expectation(backend, args, message):
    with pytest.raises(ValueError, match=message):
        ps.scan(*args, backend=backend)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="backend must be one of"):
        ps.scan(torch.zeros(1, 2), torch.zeros(1, 2), backend="cumsum")
