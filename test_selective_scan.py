"""Specification of the selective scan's hand-written backward (mamba_engine.py section 1,
_SelectiveScan): its forward and every gradient against a float64 loop differentiated by autograd,
for every eager backend and both forms (the CPU's and the GPU's, the latter run on the CPU here);
packed sequences; what it saves under bf16 autocast; second derivatives; torch.func; and that a
plain backward takes the lean path."""

import pytest
import torch
import torch.nn.functional as F

import mamba_engine as me
import mamba_minimal as mm
import pscan
from test_model import reference_selective_scan
from test_use import loop_conv

NAMES = ["x", "delta", "A", "B", "C", "D", "z", "h0"]
# the eager backends: the pscan.py scans selective_scan knows ("two_level" once pscan.py has it)
EAGER = [b for b in me.SCAN_BACKENDS if b in pscan.BACKENDS and b not in me.FUSED_BACKENDS]


# test_model.py's float64 loop of the paper's equations, differentiable by autograd: it gives the
# oracle's gradients and Hessians too
loop_scan = reference_selective_scan


@pytest.fixture(params=["cpu form", "gpu form"])
def form(request, monkeypatch):
    """_SelectiveScan's CPU form, or its GPU form run on the CPU (as on any other device)."""
    monkeypatch.setattr(me, "_gpu_form", lambda device: request.param == "gpu form")
    return request.param


def inputs(b=2, l=7, ed=5, n=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, ed, generator=g, dtype=dtype)
    delta = F.softplus(torch.randn(b, l, ed, generator=g, dtype=dtype))
    A = -torch.rand(ed, n, generator=g, dtype=dtype) * 3 - 0.1
    B, C = torch.randn(b, l, n, generator=g, dtype=dtype), torch.randn(b, l, n, generator=g, dtype=dtype)
    D, z = torch.randn(ed, generator=g, dtype=dtype), torch.randn(b, l, ed, generator=g, dtype=dtype)
    h0 = torch.randn(b, ed, n, generator=g, dtype=dtype)
    return [x, delta, A, B, C, D, z, h0]


def outputs_and_gradients(fn, args, seed=1):
    """fn(*args) -> (y, final state); returns them and the gradients of <y, gy> + <h, gh> with
    respect to every argument that is not None, for fixed random gy, gh."""
    args = [None if t is None else t.detach().clone().requires_grad_() for t in args]
    y, h = fn(*args)
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    gh = torch.randn(h.shape, generator=g, dtype=torch.float64).to(h.dtype)
    live = [t for t in args if t is not None]
    return y, h, torch.autograd.grad((y, h), live, (gy, gh))


def assert_matches_loop(args, tol, **kwargs):
    fast = lambda *a: me.selective_scan(*a, return_last_state=True, **kwargs)
    y, h, grads = outputs_and_gradients(fast, args)
    y_ref, h_ref, grads_ref = outputs_and_gradients(loop_scan, [None if t is None else t.double() for t in args])
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol, msg=f"{kwargs}: y")
    torch.testing.assert_close(h.double(), h_ref, rtol=tol, atol=tol, msg=f"{kwargs}: final state")
    names = [name for name, t in zip(NAMES, args) if t is not None]
    for name, got, want in zip(names, grads, grads_ref):
        torch.testing.assert_close(got.double(), want, rtol=10 * tol, atol=10 * tol,
                                   msg=f"{kwargs}: gradient wrt {name}")


OPTIONAL = {"all": (), "no D, no z": ("D", "z"), "no h0": ("h0",), "no D, z, h0": ("D", "z", "h0")}


@pytest.mark.parametrize("without", list(OPTIONAL))
@pytest.mark.parametrize("L", [1, 2, 7, 16])
@pytest.mark.parametrize("backend", EAGER)
def test_forward_and_every_gradient_match_the_float64_loop(form, backend, L, without):
    args = inputs(l=L)
    for name in OPTIONAL[without]:
        args[NAMES.index(name)] = None
    assert_matches_loop(args, 1e-10, backend=backend)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("backend", EAGER)
def test_one_or_two_states_per_channel_match_the_float64_loop(form, backend, n):
    # the trainer's CPU default has d_state 2; N = 1 leaves a size-1 dimension for broadcasts to get wrong
    assert_matches_loop(inputs(n=n), 1e-10, backend=backend)


@pytest.mark.parametrize("backend", EAGER)
def test_fp32_forward_and_gradients_match_the_float64_loop(form, backend):
    # fp32 rounds at 6e-8; a few dozen rounded steps and sums stay well inside 1e-4
    assert_matches_loop(inputs(l=13, ed=16, n=4, dtype=torch.float32), 1e-5, backend=backend)


@pytest.mark.parametrize("backend", ["sequential", "pscan"])
def test_gradients_when_only_the_output_reaches_the_loss_match_the_float64_loop(form, backend):
    # in training the final state reaches no loss: its gradient arrives as None, not zeros
    args = [t.requires_grad_() for t in inputs(l=9)]
    g = torch.randn(2, 9, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(me.selective_scan(*args, backend=backend), args, g)
    want = torch.autograd.grad(loop_scan(*args)[0], args, g)
    for name, a, w in zip(NAMES, got, want):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10, msg=f"gradient wrt {name}")


def test_the_plain_backward_is_the_one_function_and_saves_two_state_tensors(form):
    # the lean path: autograd records one node for the whole scan (no per-step slices, no
    # broadcast-by-broadcast backward) and keeps two (b, L, ED, N) tensors, dA and h
    x, delta, A, B, C, D, z, h0 = (t.requires_grad_() for t in inputs(b=2, l=9, ed=5, n=3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = me.selective_scan(x, delta, A, B, C, D, z, h0, backend="pscan")
    assert type(y.grad_fn).__name__ == "_SelectiveScanBackward"
    assert {type(f).__name__ for f, _ in y.grad_fn.next_functions if f is not None} == {"AccumulateGrad"}
    assert sum(t.numel() == 2 * 9 * 5 * 3 for t in saved) == 2


def test_the_backward_gets_no_zero_tensors_for_the_states_it_passes_itself(form, monkeypatch):
    # the forward hands dA, h, y + D·x and SiLU(z) to the backward as extra outputs; a zero
    # "gradient" for each would be two more (b, L, ED, N) tensors at the backward's peak
    received = []
    backward = me._SelectiveScan.backward
    monkeypatch.setattr(me._SelectiveScan, "backward",
                        staticmethod(lambda ctx, *grads: received.extend(grads) or backward(ctx, *grads)))
    args = [t.requires_grad_() for t in inputs()]
    me.selective_scan(*args).sum().backward()
    assert len(received) == 6 and received[0] is not None
    assert all(g is None for g in received[1:])  # the final state reached no loss either


def test_a_plain_backward_never_takes_the_recorded_path(form, monkeypatch):
    def refuse(*args):
        raise AssertionError("the recorded (create_graph) path ran for a plain backward")
    monkeypatch.setattr(me, "_recorded_gradients", refuse)
    args = [t.requires_grad_() for t in inputs()]
    me.selective_scan(*args).sum().backward()
    assert all(t.grad is not None for t in args)


@pytest.mark.parametrize("backend, reverse", [("sequential", False), ("sequential", True), ("pscan", False),
                                              ("pscan", True), ("associative", True)])
def test_the_engines_scan_runs_in_place_where_its_docstring_says(backend, reverse):
    # _scan_in_place writes the states over h for the loop and pscan.py's trees (the backward's reverse
    # scan of "associative" runs the mirror-image tree too); only the other backends allocate
    g = torch.Generator().manual_seed(0)
    dA = torch.rand(2, 9, 3, 4, generator=g, dtype=torch.float64)  # (b, L, N, ED)
    x = torch.randn(2, 9, 3, 4, generator=g, dtype=torch.float64)
    want, state = x.clone(), torch.zeros(2, 3, 4, dtype=torch.float64)
    for t in (range(8, -1, -1) if reverse else range(9)):  # h_t = dA_t·h_{t-1} + x_t from the first step
        if reverse:  # h_t = dA_{t+1}·h_{t+1} + x_t, nothing after the last step
            decay = dA[:, t + 1] if t < 8 else 0
        else:
            decay = dA[:, t]
        state = decay * state + x[:, t]
        want[:, t] = state
    h = x.clone()
    out = me._scan_in_place(h, dA, backend, reverse)
    assert out.data_ptr() == h.data_ptr()
    torch.testing.assert_close(h, want, rtol=1e-12, atol=1e-12)


def test_the_accelerated_model_trains_through_the_function():
    model = me.accelerate(mm.MambaLM(mm.MambaConfig(d_model=16, n_layer=1, vocab_size=11, d_state=4)))
    seen, stack = set(), [model(torch.randint(0, 11, (2, 5))).sum().grad_fn]
    while stack:
        f = stack.pop()
        if f is not None and f not in seen:
            seen.add(f)
            stack.extend(g for g, _ in f.next_functions)
    nodes = {type(f).__name__ for f in seen}
    assert "_SelectiveScanBackward" in nodes
    assert "ExpBackward0" in nodes  # A = -exp(A_log), outside the scan
    assert "_CausalConvBackward" in nodes  # the conv, with its own backward


@pytest.mark.parametrize("engine", [True, False], ids=["accelerated", "the lesson's"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_buffer", [False, True])
def test_the_conv_backward_equals_the_float64_loop(packed, with_buffer, engine):
    # _CausalConv's hand-written gradients (and the lesson's shifted_sum under autograd) against
    # autograd through test_use.py's loop: for the input, the cache's buffer, the weights and the
    # bias, with and without packed sequences
    mixer = mm.MambaMixer(mm.MambaConfig(d_model=6, d_state=3)).double()
    if engine:
        me.accelerate(mixer)
    g = torch.Generator().manual_seed(0)
    b, L, ED, d = 2, 9, mixer.cfg.d_inner, mixer.cfg.d_conv
    x = torch.randn(b, L, ED, generator=g, dtype=torch.float64, requires_grad=True)
    buffer = torch.randn(b, ED, d, generator=g, dtype=torch.float64, requires_grad=True) if with_buffer else None
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1, 1]]) if packed else None
    grad_out = torch.randn(b, L, ED, generator=g, dtype=torch.float64)
    weight, bias = mixer.conv1d.weight, mixer.conv1d.bias
    leaves = [t for t in (x, buffer, weight, bias) if t is not None]

    got = mixer.causal_conv(x, buffer, seq_idx)
    got_grads = torch.autograd.grad(got, leaves, grad_out)
    expected = loop_conv(x, weight[:, 0], bias, seq_idx if packed else torch.zeros(b, L, dtype=torch.long), buffer)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    assert (got - expected).abs().max() < 1e-12
    for name, a, e in zip(["x", "buffer", "weight", "bias"], got_grads, expected_grads):
        assert (a - e).abs().max() < 1e-12, name


def test_the_conv_has_second_derivatives():
    mixer = mm.MambaMixer(mm.MambaConfig(d_model=4, d_state=2)).double()
    x = torch.randn(2, 6, mixer.cfg.d_inner, dtype=torch.float64, requires_grad=True)
    weight = mixer.conv1d.weight.detach().clone().requires_grad_()
    x_pad = lambda x: F.pad(x, (0, 0, mixer.cfg.d_conv - 1, 0))
    # the square makes the second derivative depend on both the input and the weights
    assert torch.autograd.gradgradcheck(lambda x, w: me._CausalConv.apply(x_pad(x), w[:, 0], None, None) ** 2,
                                        (x, weight))


@pytest.mark.parametrize("backend", EAGER)
def test_second_derivatives_equal_the_float64_loop(form, backend):
    # a Hessian differentiates the backward: it must be the loop's, never zeros
    x, delta, A, B, C, D, z, h0 = inputs(b=1, l=5, ed=2, n=2)

    def loss(scan):
        return lambda x, delta, A: scan(x, delta, A, B, C, D, z, h0)[0].pow(2).sum() + \
            scan(x, delta, A, B, C, D, z, h0)[1].pow(3).sum()

    fast = lambda *a: me.selective_scan(*a, backend=backend, return_last_state=True)
    got = torch.autograd.functional.hessian(loss(fast), (x, delta, A))
    want = torch.autograd.functional.hessian(loss(loop_scan), (x, delta, A))
    for got_row, want_row in zip(got, want):
        for g, w in zip(got_row, want_row):
            assert w.abs().max() > 0
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_a_gradient_penalty_differentiates_the_gradient():
    # create_graph=True, then a backward through the gradient: the pattern of a gradient penalty
    x, delta, A, B, C, D, z, h0 = inputs()
    grads = {}
    scans = {"fast": lambda *a: me.selective_scan(*a, backend="sequential"), "loop": lambda *a: loop_scan(*a)[0]}
    for name, scan in scans.items():
        xg = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(scan(xg, delta, A, B, C, D, z, h0).sin().sum(), xg, create_graph=True)
        (grads[name],) = torch.autograd.grad(g.pow(2).sum(), xg)
    torch.testing.assert_close(grads["fast"], grads["loop"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scan", ["selective_scan", "selective_scan_reference"])
def test_under_bf16_autocast_the_read_out_and_the_saved_states_stay_fp32(form, scan):
    # fp32 inputs under bf16 autocast: a matmul would run the read-out C·h in bf16 (relative error
    # about 2^-9 = 2e-3); kept in fp32 the outputs and gradients are as exact as fp32 allows
    args = inputs(b=2, l=16, ed=32, n=4, dtype=torch.float32)
    fn = {"selective_scan": lambda *a: me.selective_scan(*a, return_last_state=True),
          "selective_scan_reference": mm.selective_scan_reference}[scan]
    saved = []

    def recorded(*a):
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            return fn(*a)

    y, h, grads = outputs_and_gradients(recorded, args)
    y_ref, h_ref, grads_ref = outputs_and_gradients(loop_scan, [t.double() for t in args])
    for name, got, want in [("y", y, y_ref), ("h", h, h_ref)] + list(zip(NAMES, grads, grads_ref)):
        assert got.dtype == torch.float32, name
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5, name
    states = [t for t in saved if t.numel() == 2 * 16 * 32 * 4]
    assert states and all(t.dtype == torch.float32 for t in states)


def test_fused_is_the_fused_path_and_chunked_a_deprecated_name_for_it(monkeypatch):
    args = inputs(l=11)
    y_ref, h_ref = loop_scan(*args)
    calls = []
    fused = me.fused_selective_scan
    monkeypatch.setattr(me, "fused_selective_scan", lambda *a, **k: calls.append(1) or fused(*a, **k))
    y, h = me.selective_scan(*args, backend="fused", chunk_size=4, return_last_state=True)
    with pytest.warns(DeprecationWarning, match='use "fused"'):
        y_old, h_old = me.selective_scan(*args, backend="chunked", chunk_size=4, return_last_state=True)
    for got in (y, y_old):
        torch.testing.assert_close(got, y_ref, rtol=1e-10, atol=1e-10)
    for got in (h, h_old):
        torch.testing.assert_close(got, h_ref, rtol=1e-10, atol=1e-10)
    assert len(calls) == 2  # both went through the fused path
    assert me.chunked_selective_scan is fused
    assert "fused" in me.SCAN_BACKENDS and me.SCAN_BACKENDS is not pscan.BACKENDS
    me.accelerate(mm.MambaLM(mm.MambaConfig(d_model=8, n_layer=1)), backend="chunked")  # still accepted


def test_backends_selective_scan_does_not_know_raise_a_value_error():
    args = inputs()
    for backend in ("loop", "flash") + (() if "two_level" in pscan.BACKENDS else ("two_level",)):
        with pytest.raises(ValueError, match="backend must be one of"):
            me.selective_scan(*args, backend=backend)
        with pytest.raises(ValueError, match="backend must be one of"):
            me.accelerate(mm.MambaLM(mm.MambaConfig(d_model=8, n_layer=1)), backend=backend)


def loop_with_resets(x, delta, A, B, C, D, z, h0, reset):
    """The float64 loop with packed sequences: the state restarts from zero where reset is True,
    before that step's input."""
    h = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=torch.float64) if h0 is None else h0
    ys = []
    for t in range(x.shape[1]):
        h = h * (~reset[:, t, None, None])
        h = torch.exp(delta[:, t, :, None] * A) * h + delta[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]
        ys.append(((h * C[:, t, None, :]).sum(-1) + D * x[:, t]) * F.silu(z[:, t]))
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("backend", EAGER)
def test_packed_sequences_restart_the_state_as_the_float64_loop_does(form, backend):
    # reset: dA = 0 at a sequence's first step, so G_t and dLoss/d(Δ·A) stop there in the backward
    args = inputs(b=2, l=9)
    reset = torch.tensor([[False, False, True, False, False, False, True, True, False],
                          [False, False, False, False, True, False, False, False, False]])
    fast = lambda *a: me.selective_scan(*a, backend=backend, return_last_state=True, reset=reset)
    y, h, grads = outputs_and_gradients(fast, args)
    y_ref, h_ref, grads_ref = outputs_and_gradients(lambda *a: loop_with_resets(*a, reset), args)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)
    for name, got, want in zip(NAMES, grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"gradient wrt {name}")


def relative_errors_of_both_forms(delta, A, L=64, seed=3):
    """fp32: the larger relative error (norm) of the outputs and the final state against the
    float64 loop, for the CPU form and the GPU form."""
    args = inputs(b=2, l=L, ed=A.shape[0], n=A.shape[1], seed=seed, dtype=torch.float32)
    args[1], args[2] = delta, A
    y_ref, h_ref = loop_scan(*[t.double() for t in args])
    errors = {}
    for form in ("cpu", "gpu"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(me, "_gpu_form", lambda device: form == "gpu")
            y, h = me.selective_scan(*args, return_last_state=True)
        errors[form] = max(((y.double() - y_ref).norm() / y_ref.norm()).item(),
                           ((h.double() - h_ref).norm() / h_ref.norm()).item())
    return errors


def test_the_gpu_forms_decays_are_as_exact_as_exp_and_never_underflow():
    # The GPU form computes exp(Δ·A) as (e^(A/s))^(Δ·s) (mamba_engine.py, _gpu_forward). With
    # rates down to A = -64 (init: -1 to -16) and steps from 1e-3 to 20, as exact as the CPU
    # form's exp; down to A = -1000, within 1e-5 (e^A alone would underflow to 0 there, and
    # every such decay would be 0 or 1, an error of order 1)
    g = torch.Generator().manual_seed(3)
    delta = torch.exp(torch.empty(2, 64, 6).uniform_(-7, 3, generator=g))  # Δ from 1e-3 to 20
    usual = relative_errors_of_both_forms(delta, -torch.exp(torch.linspace(-2.3, 4.16, 8)).repeat(6, 1))
    assert usual["cpu"] < 3e-7 and usual["gpu"] < 2 * usual["cpu"] + 1e-7, usual
    extreme = relative_errors_of_both_forms(delta, -torch.exp(torch.linspace(-4.6, 6.9, 8)).repeat(6, 1))
    assert extreme["cpu"] < 3e-7 and extreme["gpu"] < 1e-5, extreme


def test_a_non_cpu_device_runs_the_gpu_form():
    # told apart by the layout of the saved states: (b, L, ED, N) in the GPU form, (b, L, N, ED) in
    # the CPU form; meta tensors stand for a GPU (no values, every shape)
    b, L, ed, n = 2, 5, 4, 3
    for device, shape in (("meta", (b, L, ed, n)), ("cpu", (b, L, n, ed))):
        args = [t.to(device).requires_grad_() for t in inputs(b=b, l=L, ed=ed, n=n)]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            y = me.selective_scan(*args)
        assert saved.count(shape) == 2, (device, saved)
        y.sum().backward()
        assert all(t.grad is not None and t.grad.shape == t.shape for t in args)


def test_auto_runs_the_loop_on_a_gpu_at_the_trainers_cuda_default():
    # the choice of `python -m bench roofline`: at (64, 768, 16) per step the loop's 4 passes per
    # scan cost less than the tree's 11, even at 255 kernels per scan; narrow steps keep the tree,
    # and so does any scan that autograd records (L steps in its graph)
    from train_shakespeare import DEFAULTS
    cuda = DEFAULTS["cuda"]
    width = cuda["batch_size"] * 2 * cuda["d_model"] * cuda["d_state"]
    gpu = torch.device("meta")
    assert pscan.backend_for(gpu, width, needs_grad=False) == "sequential"
    assert pscan.backend_for(gpu, width, needs_grad=True) == "pscan"
    assert pscan.backend_for(gpu, 1 * 2 * cuda["d_model"] * cuda["d_state"], needs_grad=False) == "pscan"
    a = torch.rand(cuda["batch_size"], 3, 2 * cuda["d_model"], cuda["d_state"], device="meta")
    assert pscan.choose_backend(a, a) == "sequential"


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap runs addcmul_ per sample
@pytest.mark.parametrize("backend", EAGER)
def test_torch_func_grad_and_vmap_equal_the_float64_loop(form, backend):
    x, delta, A, B, C, D, z, h0 = inputs()
    fast = lambda *a: me.selective_scan(*a, backend=backend, return_last_state=True)

    def loss(scan):
        return lambda x, delta, A: (scan(x, delta, A, B, C, D, z, h0)[0] ** 2).sum()

    got = torch.func.grad(loss(fast), argnums=(0, 1, 2))(x, delta, A)
    leaves = [t.clone().requires_grad_() for t in (x, delta, A)]
    want = torch.autograd.grad(loss(loop_scan)(*leaves), leaves)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"torch.func.grad wrt {name}")
    # vmap over three independent problems, and per-problem gradients (vmap of grad) over x
    problems = [inputs(seed=seed) for seed in range(3)]
    stacked = [torch.stack(ts) for ts in zip(*problems)]
    y, h = torch.func.vmap(fast)(*stacked)
    xs = stacked[0]
    per_x = torch.func.vmap(torch.func.grad(loss(fast)), in_dims=(0, None, None))(xs, delta, A)
    ones = torch.ones_like(x)
    per_vjp = torch.func.vmap(lambda x: torch.func.vjp(lambda x: fast(x, delta, A, B, C, D, z, h0)[0], x)[1](ones)[0])(xs)
    for i, problem in enumerate(problems):
        y_ref, h_ref = loop_scan(*problem)
        torch.testing.assert_close(y[i], y_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h[i], h_ref, rtol=1e-10, atol=1e-10)
        leaf = xs[i].clone().requires_grad_()
        (want_x,) = torch.autograd.grad(loss(loop_scan)(leaf, delta, A), leaf)
        torch.testing.assert_close(per_x[i], want_x, rtol=1e-10, atol=1e-10)
        (want_vjp,) = torch.autograd.grad(loop_scan(leaf, delta, A, B, C, D, z, h0)[0], leaf, ones)
        torch.testing.assert_close(per_vjp[i], want_vjp, rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("backend", EAGER)
def test_vmap_over_some_inputs_only_equals_the_float64_loop_per_problem(form, backend):
    # vmap mapping some inputs and not others (an ensemble over A, per-problem start states): where
    # the states would come out unmapped and a mapped A or h0 be written into them in place, the
    # call takes the reference's route
    args, other = inputs(), inputs(seed=1)  # x, delta, A, B, C, D, z, h0
    fast = lambda *a: me.selective_scan(*a, backend=backend, return_last_state=True)
    for mapped in [("A",), ("h0",), ("C", "h0"), ("z", "h0"), ("x", "A"), ("delta", "C")]:
        which = [name in mapped for name in NAMES]
        stacked = [torch.stack([t, o]) if m else t for t, o, m in zip(args, other, which)]
        y, h = torch.func.vmap(fast, in_dims=tuple(0 if m else None for m in which))(*stacked)
        for k in range(2):
            y_ref, h_ref = loop_scan(*(t[k] if m else t for t, m in zip(stacked, which)))
            torch.testing.assert_close(y[k], y_ref, rtol=1e-10, atol=1e-10, msg=f"y, {mapped} mapped")
            torch.testing.assert_close(h[k], h_ref, rtol=1e-10, atol=1e-10, msg=f"h, {mapped} mapped")


@pytest.mark.parametrize("backend", EAGER + ["fused", "reference"])
def test_forward_mode_ad_through_the_selective_scan_equals_the_float64_loops(form, backend):
    # the hand-written Functions have no forward-mode rule (torch.compile refuses a Function with a
    # jvp); under forward mode they run the code they replace, which torch differentiates op by op
    import torch.autograd.forward_ad as fwAD
    args = tuple(inputs())  # x, delta, A, B, C, D, z, h0
    tangents = tuple(torch.randn_like(t) for t in args)
    _, got = torch.func.jvp(lambda *a: me.selective_scan(*a, backend=backend, return_last_state=True), args, tangents)
    _, want = torch.func.jvp(loop_scan, args, tangents)
    for g, w in zip(got, want):  # the outputs' and the final state's tangents
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    with fwAD.dual_level():  # torch's other forward-mode API
        y = me.selective_scan(*(fwAD.make_dual(t, u) for t, u in zip(args, tangents)), backend=backend)
        torch.testing.assert_close(fwAD.unpack_dual(y).tangent, want[0], rtol=1e-10, atol=1e-10)


def test_forward_mode_ad_through_the_conv_equals_a_float64_loop():
    # the conv's Function has no forward-mode rule either: shifted_sum runs, whose tangent is the
    # conv of the tangents (linear in each of x and w), computed here by a loop over the taps
    g = torch.Generator().manual_seed(0)
    x_pad = torch.randn(2, 3 + 5, 8, generator=g, dtype=torch.float64)  # 3 inputs before the first token
    w, bias = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    dx, dw = torch.randn_like(x_pad), torch.randn_like(w)
    _, got = torch.func.jvp(lambda x_pad, w: me._CausalConv.apply(x_pad, w, bias, None), (x_pad, w), (dx, dw))
    want = sum(dx[:, k:k + 5] * w[:, k] + x_pad[:, k:k + 5] * dw[:, k] for k in range(4))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
