"""Specification of pscan.py: every backend agrees with a float64 loop written here, independently."""

import re

import pytest
import torch

import pscan as ps

BACKENDS = {
    "sequential": ps.scan_sequential,
    "pscan": ps.pscan,
    "hillis_steele": ps.scan_hillis_steele,
    "two_level": ps.scan_two_level,  # chunks of 64: one chunk for short L, 17 at L = 1025
    "two_level_4": lambda a, b, h0=None: ps.scan_two_level(a, b, h0, chunk_size=4),  # many chunks, padding
    "associative": ps.scan_associative,
}
CUSTOM_BACKWARD = [name for name in BACKENDS if name != "sequential"]
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


def test_combine_rule_is_two_steps_in_one_and_associative():
    g = torch.Generator().manual_seed(1)
    s1, s2, s3 = [tuple(torch.randn(4, generator=g, dtype=torch.float64) for _ in range(2)) for _ in range(3)]
    h = torch.randn(4, generator=g, dtype=torch.float64)

    def apply(step, h):  # the step (a, b) is h -> a*h + b
        return step[0] * h + step[1]

    a12, b12 = ps._combine(s1, s2)
    torch.testing.assert_close(apply((a12, b12), h), apply(s2, apply(s1, h)), rtol=1e-12, atol=1e-12)
    left = ps._combine(ps._combine(s1, s2), s3)
    right = ps._combine(s1, ps._combine(s2, s3))
    for x, y in zip(left, right):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


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


@pytest.mark.parametrize("name", CUSTOM_BACKWARD)
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
@pytest.mark.parametrize("backend", ps.BACKENDS)
def test_bad_input_raises_value_error_naming_the_expectation(backend, args, message):
    with pytest.raises(ValueError, match=message):
        ps.scan(*args, backend=backend)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="backend must be one of"):
        ps.scan(torch.zeros(1, 2), torch.zeros(1, 2), backend="cumsum")


def test_chunked_is_a_deprecated_name_for_the_two_level_scan():
    a, b, h0 = make_inputs(2, 100, (3,))
    with pytest.warns(DeprecationWarning, match='use "two_level"'):
        h = ps.scan(a, b, h0, backend="chunked")
    for h in (h, ps.scan_chunked(a, b, h0, chunk_size=8)):
        torch.testing.assert_close(h, reference(a, b, h0), rtol=1e-10, atol=1e-10)
    with ps.count_combines() as by_alias, pytest.warns(DeprecationWarning):  # the same combines, not another scan
        ps.scan(a, b, h0, backend="chunked")
    with ps.count_combines() as by_name:
        ps.scan_two_level(a, b, h0)
    assert by_alias == by_name and len(by_alias) > 0


def test_unknown_or_bad_chunk_size_raises():
    a, b, _ = make_inputs(1, 8, ())
    for bad in (0, -3, 2.5, True, None):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            ps.scan_two_level(a, b, chunk_size=bad)


@pytest.mark.parametrize("name", BACKENDS)
def test_empty_batch_gives_empty_results_and_gradients(name):
    a, b, h0 = (t.requires_grad_() for t in (torch.rand(0, 9, 3), torch.randn(0, 9, 3), torch.randn(0, 3)))
    h = BACKENDS[name](a, b, h0)
    assert h.shape == (0, 9, 3)
    grads = torch.autograd.grad(h.sum(), (a, b, h0), allow_unused=True)
    assert [None if g is None else tuple(g.shape) for g in grads] == [(0, 9, 3), (0, 9, 3), (0, 3)]


# ------------------------------------------------------------------------------------------------
# Second derivatives and torch.func
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
def test_hessian_matches_float64_loop(name):
    # Hand check of the oracle: h = (a*h0 + b) for L = 1, loss = h^2 has d2/db2 = 2,
    # d2/da2 = 2*h0^2, d2/da db = 2*h0.
    one = [torch.tensor([[0.5]], dtype=torch.float64), torch.tensor([[1.0]], dtype=torch.float64),
           torch.tensor([3.0], dtype=torch.float64)]
    for fn in (reference, BACKENDS[name]):
        H = torch.autograd.functional.hessian(lambda a, b, h0: (fn(a, b, h0) ** 2).sum(), tuple(one))
        assert H[0][0].item() == 18.0 and H[1][1].item() == 2.0 and H[0][1].item() == 6.0
    a, b, h0 = make_inputs(1, 6, (2,))
    weight = torch.randn(1, 6, 2, dtype=torch.float64)

    def loss(fn):  # not quadratic in h, so the Hessian sees every second-order path
        return lambda a, b, h0: (weight * fn(a, b, h0) ** 3).sum()

    got = torch.autograd.functional.hessian(loss(BACKENDS[name]), (a, b, h0))
    want = torch.autograd.functional.hessian(loss(reference), (a, b, h0))
    for i in range(3):
        for j in range(3):
            assert want[i][j].abs().max() > 0.1
            torch.testing.assert_close(got[i][j], want[i][j], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", CUSTOM_BACKWARD)
def test_custom_backward_passes_gradgradcheck(name):
    a, b, h0 = (t.requires_grad_() for t in make_inputs(2, 9, (2,)))
    assert torch.autograd.gradgradcheck(BACKENDS[name], (a, b, h0))
    assert torch.autograd.gradgradcheck(lambda a, b: BACKENDS[name](a, b), (a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CUSTOM_BACKWARD)
def test_second_derivative_in_low_precision_is_close_to_float64(name, dtype):
    a, b, h0 = make_inputs(2, 50, (3,))
    v = torch.randn_like(a)

    def hvp(fn, dtype):  # Hessian-vector product of sum(h^2) wrt a, by double backward
        x = a.to(dtype).requires_grad_()
        g = torch.autograd.grad((fn(x, b.to(dtype), h0.to(dtype)).float() ** 2).sum(), x, create_graph=True)[0]
        return torch.autograd.grad((g.float() * v).sum(), x)[0].double()

    want = hvp(reference, torch.float64)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(hvp(BACKENDS[name], dtype), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap loops over addcmul_
@pytest.mark.parametrize("name", BACKENDS)
def test_torch_func_grad_jvp_vmap_match_float64_loop(name):
    a, b, h0 = make_inputs(2, 11, (3,))
    fn = BACKENDS[name]

    def loss(f):
        return lambda a, b, h0: (f(a, b, h0) ** 2).sum()

    for got, want in zip(torch.func.grad(loss(fn), argnums=(0, 1, 2))(a, b, h0),
                         torch.func.grad(loss(reference), argnums=(0, 1, 2))(a, b, h0)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    tangents = tuple(torch.randn_like(t) for t in (a, b, h0))
    got = torch.func.jvp(fn, (a, b, h0), tangents)
    want = torch.func.jvp(reference, (a, b, h0), tangents)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    stacked = [torch.stack([t, 2 * t]) for t in (a, b, h0)]  # an extra leading dim for vmap
    torch.testing.assert_close(torch.func.vmap(fn)(*stacked), torch.func.vmap(reference)(*stacked))
    g = torch.func.vmap(torch.func.grad(loss(fn), argnums=(0, 1, 2)))(*stacked)
    w = torch.func.vmap(torch.func.grad(loss(reference), argnums=(0, 1, 2)))(*stacked)
    torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", BACKENDS)
def test_vmap_over_any_of_a_b_h0_and_the_hessian_match_float64_loop(name):
    # vmap mapping some inputs and not others (a mapped a over one b, say), and torch.func.hessian,
    # a vmap over a jvp: the scans write in place, so both need the Function's own vmap rule
    a, b, h0 = make_inputs(2, 7, (3,))
    fn = BACKENDS[name]
    stacked = [torch.stack([t, t.flip(0) * 0.5]) for t in (a, b, h0)]  # (2, ...) each, two problems
    for dims in [(0, None, None), (None, 0, None), (None, None, 0), (0, None, 0), (None, 0, 0), (0, 0, None)]:
        args = [s if d == 0 else s[0] for s, d in zip(stacked, dims)]
        got = torch.func.vmap(fn, in_dims=dims)(*args)
        # the same problems with vmap's dimension second, where it has the batch's size
        moved = [t.movedim(0, 1) if d == 0 else t for t, d in zip(args, dims)]
        torch.testing.assert_close(torch.func.vmap(fn, in_dims=tuple(None if d is None else 1 for d in dims))(*moved),
                                   got, rtol=1e-12, atol=1e-12)
        for k in range(2):
            want = reference(*(t[k] if d == 0 else t for t, d in zip(args, dims)))
            torch.testing.assert_close(got[k], want, rtol=1e-12, atol=1e-12)
    a1, b1, h01 = a[:1, :5, :1], b[:1, :5, :1], h0[:1, :1]  # (1, 5, 1), (1, 1): a 6 x 6 Hessian

    def loss(f):
        return lambda a, h0: (f(a, b1, h0) ** 2).sum()

    want = torch.autograd.functional.hessian(loss(reference), (a1, h01))
    both = (0, 1)
    for got in (torch.func.hessian(loss(fn), argnums=both)(a1, h01),
                torch.func.jacfwd(torch.func.jacfwd(loss(fn), argnums=both), argnums=both)(a1, h01)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# The convolution view, the chunk's products, the choice of "auto"
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L", [1, 2, 7, 64, 301])
def test_time_invariant_scan_is_a_convolution(L):
    a, b, h0 = make_inputs(2, L, (3,))
    a_const = a[:, 0]  # (2, 3), the same at every step
    expected = reference(a_const.unsqueeze(1).expand_as(b), b, h0)
    torch.testing.assert_close(ps.scan_time_invariant(a_const, b, h0), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ps.scan_time_invariant(a_const, b), reference(a_const.unsqueeze(1).expand_as(b), b),
                               rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"a must have shape \(batch, \*rest\)"):
        ps.scan_time_invariant(a, b)


def test_the_convolution_takes_a_zero_or_negative_a():
    # the recurrence is defined for any a: a = 0 forgets every step (the kernel 1, 0, 0, ...), a < 0
    # alternates in sign; a kernel computed as exp(k·log a) would be NaN for both
    a = torch.tensor([[0.0, -0.5, -1.0, 1.5]], dtype=torch.float64)  # (1, 4)
    g = torch.Generator().manual_seed(0)
    b = torch.randn((1, 9, 4), generator=g, dtype=torch.float64)
    h0 = torch.randn((1, 4), generator=g, dtype=torch.float64)
    h = ps.scan_time_invariant(a, b, h0)
    torch.testing.assert_close(h, reference(a.unsqueeze(1).expand_as(b), b, h0), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h[..., 0], b[..., 0], rtol=1e-10, atol=1e-10)  # a = 0: h_t = b_t, by hand


@pytest.mark.parametrize("a_value", [0.5, 0.99, 0.9999, 0.99999, 1.0])
def test_the_convolution_is_within_a_hundred_eps_of_the_loop(a_value):
    # the bound scan_time_invariant's docstring states, at its hardest: a long sequence, a near 1,
    # ten random draws (the ratio to eps·max|h| has a tail: one draw in many lands far above the rest)
    a = torch.full((3,), a_value, dtype=torch.float64)
    for seed in range(10):
        b = torch.randn((3, 4096), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        expected = reference(a.unsqueeze(1).expand_as(b), b)
        error = (ps.scan_time_invariant(a, b) - expected).abs().max()
        assert error <= 100 * torch.finfo(torch.float64).eps * expected.abs().max(), seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_two_level_is_exact_when_the_chunk_product_underflows(dtype):
    # a = 0.01: the product over a 64-step chunk is 1e-128, zero in every float format. It only
    # scales the carried-in state, whose true contribution is that small: no NaN, no error.
    a, b, h0 = make_inputs(2, 300, (4,))
    a = torch.full_like(a, 0.01)
    a_, b_, h0_ = (t.to(dtype).requires_grad_() for t in (a, b, h0))
    h = ps.scan_two_level(a_, b_, h0_, chunk_size=64)
    want = reference(a_.detach(), b_.detach(), h0_.detach())  # exact for the rounded inputs
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(h.double(), want, rtol=tol, atol=tol)
    grads = torch.autograd.grad(h.float().sum(), (a_, b_, h0_))
    assert all(torch.isfinite(g.float()).all() for g in grads)
    # what the bound protects against: dividing by the same product, h_t = P_t * cumsum(b / P),
    # gives inf * 0 = NaN in this chunk
    P = torch.cumprod(a.float()[:, :64], dim=1)
    assert torch.isnan(P * torch.cumsum(b.float()[:, :64] / P, dim=1)).any()


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_auto_chooses_the_loop_only_for_wide_cpu_forward_passes_on_one_thread(one_thread):
    wide = make_inputs(1, 5, (ps.CPU_LOOP_MIN_WIDTH,), dtype=torch.float32)
    narrow = make_inputs(1, 5, (16,), dtype=torch.float32)
    assert ps.choose_backend(*wide) == "sequential"
    torch.set_num_threads(2)  # measured: with two threads pscan is ahead at every width
    assert ps.choose_backend(*wide) == "pscan"
    torch.set_num_threads(1)
    assert ps.choose_backend(*narrow) == "pscan"
    for i in range(3):  # a gradient wrt any input: the loop would record L autograd steps
        inputs = list(wide)
        inputs[i] = inputs[i].clone().requires_grad_()
        assert ps.choose_backend(*inputs) == "pscan"
        with torch.no_grad():
            assert ps.choose_backend(*inputs) == "sequential"
    meta = [t.to("meta") for t in wide]  # any other device: every step would be a launch
    assert ps.choose_backend(*meta) == "pscan"


def test_auto_runs_the_backend_it_chose(one_thread):
    # told apart by their depth: the loop runs L dependent levels, pscan about 2*log2(L)
    a, b, h0 = make_inputs(1, 64, (ps.CPU_LOOP_MIN_WIDTH,), dtype=torch.float32)
    with ps.count_combines() as levels:
        ps.scan(a, b, h0)
    assert len(levels) == 64
    with ps.count_combines() as levels:
        h = ps.scan(a.requires_grad_(), b, h0)
    assert len(levels) == 2 * 6 - 1 + 1  # the tree, and h0 folded into the first step
    torch.testing.assert_close(h.double(), reference(a, b, h0), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Work and depth, counted by the code, against the closed forms
# ------------------------------------------------------------------------------------------------

def brent_kung_work(L):  # each size n = L, L//2, L//4, ... > 1 runs n - 1 combines (n//2 up, (n-1)//2 down)
    return sum(n - 1 for n in iter_halves(L))


def brent_kung_depth(L):  # each size runs one up level, and a down level when (n-1)//2 > 0
    return sum(1 + (n >= 3) for n in iter_halves(L))


def iter_halves(L):
    while L > 1:
        yield L
        L //= 2


@pytest.mark.parametrize("L", [1, 2, 3, 8, 100, 1024, 1025, 4096])
def test_counted_work_and_depth_match_the_formulas(L):
    a, b, h0 = make_inputs(1, L, (), dtype=torch.float32)
    log = (L - 1).bit_length()  # ceil(log2 L)
    T = min(64, L)
    c = -(-L // T)
    formulas = {  # (work, depth) with h0 = None
        "sequential": (L, L),
        "pscan": (brent_kung_work(L), brent_kung_depth(L)),
        "hillis_steele": (sum(L - 2 ** k for k in range(log)), log),
        "two_level": (c * brent_kung_work(T) + (c - 1) + (c - 1) * T, brent_kung_depth(T) + (c - 1) + (c > 1)),
    }
    if L == 1024:  # the closed forms of pscan.py's sections 5 to 7
        assert formulas["pscan"] == (2 * L - 2 - 10, 2 * 10 - 1)
        assert formulas["two_level"] == (16 * (2 * T - 2 - 6) + 15 + 15 * T, 2 * 6 - 1 + 15 + 1)
        assert formulas["hillis_steele"] == (L * 10 - (L - 1), 10)
    for name, (work, depth) in formulas.items():
        for start, extra in ((None, 0), (h0, 1)):
            with ps.count_combines() as levels:
                ps.scan(a, b, start, backend=name)
            if name == "sequential":
                extra = 0  # the loop's first step takes h0 anyway
            assert (sum(levels), len(levels)) == (work + extra, depth + extra), (name, start is not None)


# ------------------------------------------------------------------------------------------------
# Structure of the backward: properties that change the cost, not the numbers
# ------------------------------------------------------------------------------------------------

def test_the_loop_records_no_per_step_slices_for_autograd():
    # indexing a[:, t] in the loop would make the backward write a zero tensor of the whole
    # sequence for every step (select_backward): quadratic in L. unbind has one backward for all
    a = torch.rand(1, 64, 4, requires_grad=True)
    b = torch.randn(1, 64, 4, requires_grad=True)
    with torch.profiler.profile() as prof:
        ps.scan_sequential(a, b).sum().backward()
    names = [e.name for e in prof.events()]
    assert names.count("aten::select_backward") <= 2, names.count("aten::select_backward")


def test_a_plain_backward_takes_the_lean_path(monkeypatch):
    # the recorded backward (for create_graph) gives the same numbers with more work and memory
    calls = []
    real = ps._backward_recorded
    monkeypatch.setattr(ps, "_backward_recorded", lambda *args: calls.append(1) or real(*args))
    a = torch.rand(2, 16, 3, requires_grad=True)
    b = torch.randn(2, 16, 3, requires_grad=True)
    ps.pscan(a, b).sum().backward()
    assert calls == []
    torch.autograd.grad(ps.pscan(a, b).pow(2).sum(), a, create_graph=True)
    assert calls == [1]  # and the recorded one for a second derivative


def test_pscans_backward_scans_in_place_without_flipped_copies():
    # section 8: pscan's backward runs the mirror-image tree on one copy of the gradient; the
    # backends without a reverse form flip copies of the gradient, of a and of the result, each the
    # size of the sequence (the same numbers, more memory traffic)
    def flips(scan):
        a = torch.rand(2, 16, 3, requires_grad=True)
        b = torch.randn(2, 16, 3, requires_grad=True)
        h = scan(a, b)
        with torch.profiler.profile() as prof:
            h.backward(torch.randn_like(h))
        return [e.name for e in prof.events()].count("aten::flip")

    assert flips(ps.scan_hillis_steele) == 3  # the profiler sees the copies where they are made
    assert flips(ps.pscan) == 0


@pytest.mark.parametrize("L", [1, 2, 3, 4, 5, 8, 13, 64, 100])
def test_the_tree_backwards_in_place_is_the_reverse_recurrence(L):
    # pscan section 8's mirror-image tree, which pscan's backward and mamba_engine.py's backward run:
    # g_t = a_{t+1}·g_{t+1} + x_t from the end, in place on a strided view, against the float64 loop
    # run on the time-reversed sequence
    a, x, _ = make_inputs(2, L, (3,))
    a_next = torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], dim=1)  # a_{t+1}, none after the last
    want = reference(a_next.flip(1), x.flip(1)).flip(1)
    buffer = torch.zeros(2, L, 3, 2, dtype=torch.float64)
    g = buffer[..., 0]  # a view with strides (6L, 6, 2): the engine scans its own strided buffers
    g.copy_(x)
    out = ps._brent_kung_reverse_(g, a[:, 1:])
    assert out.data_ptr() == buffer.data_ptr()  # in place
    torch.testing.assert_close(buffer[..., 0], want, rtol=1e-12, atol=1e-12)
    assert (buffer[..., 1] == 0).all()  # nothing written outside the view


# ------------------------------------------------------------------------------------------------
# The drawings of sections 5 and 8, computed by print_tree, against the drawings
# ------------------------------------------------------------------------------------------------

def test_the_tree_levels_are_the_drawings_of_sections_5_and_8():
    # every element's steps after each level, copied from the drawings (L = 8): section 5's up 0,
    # up 1, up 2, down 1, down 0, and section 8's mirror of it
    forward = [["0:1", "0:2", "2:3", "2:4", "4:5", "4:6", "6:7", "6:8"],
               ["0:1", "0:2", "2:3", "0:4", "4:5", "4:6", "6:7", "4:8"],
               ["0:1", "0:2", "2:3", "0:4", "4:5", "4:6", "6:7", "0:8"],
               ["0:1", "0:2", "2:3", "0:4", "4:5", "0:6", "6:7", "0:8"],
               ["0:1", "0:2", "0:3", "0:4", "0:5", "0:6", "0:7", "0:8"]]
    mirrored = [["0:2", "1:2", "2:4", "3:4", "4:6", "5:6", "6:8", "7:8"],
                ["0:4", "1:2", "2:4", "3:4", "4:8", "5:6", "6:8", "7:8"],
                ["0:8", "1:2", "2:4", "3:4", "4:8", "5:6", "6:8", "7:8"],
                ["0:8", "1:2", "2:8", "3:4", "4:8", "5:6", "6:8", "7:8"],
                ["0:8", "1:8", "2:8", "3:8", "4:8", "5:8", "6:8", "7:8"]]
    assert ps.tree_levels(8) == forward
    assert ps.tree_levels(8, reverse=True) == mirrored


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 13, 53])
def test_every_tree_level_holds_whole_runs_of_steps_and_ends_with_the_prefixes(n):
    # the forward tree: element t only ever takes in steps just before the ones it holds, and ends
    # with the prefix 0:t+1; the mirror: steps just after, ending with t:n (one element: no level)
    for reverse, holds, ends in ((False, lambda t, i, j: j == t + 1, lambda t: (0, t + 1)),
                                 (True, lambda t, i, j: i == t, lambda t: (t, n))):
        rows = ps.tree_levels(n, reverse)
        assert len(rows) == brent_kung_depth(n) == len(ps._level_names(n))
        for row in rows:  # one run of distinct steps each ("+" or "?" would mark a broken tree)
            assert all(re.fullmatch(r"\d+:\d+", label) and holds(t, *map(int, label.split(":")))
                       for t, label in enumerate(row)), row
        if rows:
            assert [tuple(map(int, label.split(":"))) for label in rows[-1]] == [ends(t) for t in range(n)]


def test_a_sum_that_is_not_one_run_of_distinct_steps_is_labelled_as_broken():
    # (sum of 2^t, count): what a tree that combined the wrong elements, or one twice, would hold
    assert ps._steps_held(0b0110, 2) == "1:3"
    assert ps._steps_held(0b0101, 2) == "0:1+2:3"  # steps 0 and 2, not 1
    assert ps._steps_held(0b0100, 2) == "2:3?"  # step 1 twice reads as step 2: the count tells
    assert ps._steps_held(0b1100, 3) == "2:4?"


def test_print_tree_prints_a_row_per_level_named_as_the_drawings(capsys):
    ps.print_tree(4)
    assert capsys.readouterr().out.splitlines() == [
        "t:            0     1     2     3",
        "start       0:1   1:2   2:3   3:4",
        "up 0        0:1   0:2   2:3   2:4",
        "up 1        0:1   0:2   2:3   0:4",
        "down 0      0:1   0:2   0:3   0:4"]
    assert ps._level_names(8) == ["up 0", "up 1", "up 2", "down 1", "down 0"]  # section 5's drawing
    ps.print_tree(53)  # two-digit steps and level numbers keep the columns
    assert {len(line) for line in capsys.readouterr().out.splitlines()} == {9 + 6 * 53}
    for bad in (0, 54, 8.0, True):
        with pytest.raises(ValueError, match="from 1 to 53"):
            ps.tree_levels(bad)
    for bad in ("no", 1, None):  # "no" would count as true, and print the mirror
        with pytest.raises(ValueError, match="reverse must be True or False"):
            ps.tree_levels(8, bad)


def test_segsum_refuses_what_is_not_a_floating_tensor_of_log_decays():
    for bad in (torch.tensor(1.0), torch.ones(3, dtype=torch.long), [0.1, 0.2]):
        with pytest.raises(ValueError, match=r"log_a must be a floating-point tensor of shape \(..., T\)"):
            ps.segsum(bad)
