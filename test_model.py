"""Specification of mamba_minimal.py and the engine that accelerates it (mamba_engine.py): the selective
scan, the model, recurrent inference, loading (pretrained.py). A model built by mamba_minimal runs the
lesson's code; the tests of the engine accelerate one explicitly."""

import copy
import functools
import importlib.util
import json
import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import mamba_engine as me
import mamba_minimal as mm
import pretrained
from mamba_minimal import MambaConfig, MambaLM

EAGER_BACKENDS = ["sequential", "pscan", "associative", "fused"]  # the engine's backends that run without compiling
TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def reference_selective_scan(x, delta, A, B, C, D=None, z=None, h0=None):
    """The paper's equations one token at a time in float64: h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t,
    y_t = C_t·h_t + D x_t, gated by SiLU(z_t). Returns y and the final state."""
    x, delta, A, B, C = (t.double() for t in (x, delta, A, B, C))
    b, l, ed = x.shape
    h = torch.zeros(b, ed, A.shape[1], dtype=torch.float64) if h0 is None else h0.double()
    ys = []
    for t in range(l):
        h = torch.exp(delta[:, t, :, None] * A) * h + delta[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]
        y = (h * C[:, t, None, :]).sum(-1)
        if D is not None:
            y = y + D.double() * x[:, t]
        if z is not None:
            y = y * F.silu(z[:, t].double())
        ys.append(y)
    return torch.stack(ys, 1), h


def scan_inputs(b=2, l=13, ed=6, n=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, ed, generator=g, dtype=dtype)
    delta = F.softplus(torch.randn(b, l, ed, generator=g, dtype=dtype))
    A = -torch.rand(ed, n, generator=g, dtype=dtype) * 3 - 0.1
    B = torch.randn(b, l, n, generator=g, dtype=dtype)
    C = torch.randn(b, l, n, generator=g, dtype=dtype)
    D = torch.randn(ed, generator=g, dtype=dtype)
    z = torch.randn(b, l, ed, generator=g, dtype=dtype)
    h0 = torch.randn(b, ed, n, generator=g, dtype=dtype)
    return [x, delta, A, B, C, D, z, h0]


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(d_model=32, n_layer=2, vocab_size=21, d_state=8)
    cfg.update(kw)
    return MambaLM(MambaConfig(**cfg))


# ------------------------------------------------------------------------------------------------
# the selective scan
# ------------------------------------------------------------------------------------------------

SCAN_CASES = [  # (backend, chunk_size, recompute)
    ("sequential", 16, False), ("pscan", 16, False), ("associative", 16, False),
    ("fused", 4, False), ("fused", 4, True), ("fused", 16, False), ("fused", 16, True),
    ("fused", 5, True), ("auto", 16, False), ("reference", 16, False),
]


def assert_matches_reference(L, tol=1e-10, **kwargs):
    """mamba_engine.selective_scan(**kwargs) against the float64 reference: y, the final state, and the
    gradients with respect to every input."""
    inputs = [t.requires_grad_() for t in scan_inputs(l=L)]
    y, h_last = me.selective_scan(*inputs, return_last_state=True, **kwargs)
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    y_ref, h_ref = reference_selective_scan(*ref_inputs)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(h_last, h_ref, rtol=tol, atol=tol)
    gy, gh = torch.randn_like(y_ref), torch.randn_like(h_ref)
    got = torch.autograd.grad((y, h_last), inputs, (gy, gh))
    want = torch.autograd.grad((y_ref, h_ref), ref_inputs, (gy, gh))
    for name, g, w in zip(["x", "delta", "A", "B", "C", "D", "z", "h0"], got, want):
        torch.testing.assert_close(g, w, rtol=10 * tol, atol=10 * tol, msg=f"L={L} {kwargs}: gradient wrt {name}")


@pytest.mark.parametrize("L", [1, 3, 13, 16, 21])
@pytest.mark.parametrize("backend, chunk_size, recompute", SCAN_CASES)
def test_selective_scan_matches_float64_reference(backend, chunk_size, recompute, L):
    assert_matches_reference(L, backend=backend, chunk_size=chunk_size, recompute=recompute)


@pytest.mark.parametrize("backend", ["sequential", "pscan", "associative", "auto"])
def test_selective_scan_reference_matches_the_float64_loop(backend):
    # the few-line reference of section 2 itself, as a reader meets it, before any dispatcher
    inputs = scan_inputs(l=13)
    y, h = mm.selective_scan_reference(*inputs, backend=backend)
    y_ref, h_ref = reference_selective_scan(*inputs)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)


def test_selective_scan_without_optional_inputs():
    x, delta, A, B, C, *_ = scan_inputs()
    y_ref, _ = reference_selective_scan(x, delta, A, B, C)
    for backend in EAGER_BACKENDS:
        torch.testing.assert_close(me.selective_scan(x, delta, A, B, C, backend=backend), y_ref)


@pytest.mark.parametrize("keep", ["D", "z", "neither"])
@pytest.mark.parametrize("recompute", [False, True])
def test_fused_gradients_without_skip_or_gate(keep, recompute):
    # the chunk applies D·x and the gate itself; each may be absent, and then gets no gradient
    x, delta, A, B, C, D, z, h0 = (t.requires_grad_() for t in scan_inputs(l=21))
    D, z = (D if keep == "D" else None), (z if keep == "z" else None)
    inputs = [t for t in (x, delta, A, B, C, D, z, h0) if t is not None]
    y = me.selective_scan(x, delta, A, B, C, D, z, h0, backend="fused", chunk_size=8, recompute=recompute)
    y_ref, _ = reference_selective_scan(x, delta, A, B, C, D, z, h0)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    gy = torch.randn_like(y_ref)
    for g, w in zip(torch.autograd.grad(y, inputs, gy), torch.autograd.grad(y_ref, inputs, gy)):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def test_selective_scan_half_inputs_keep_fp32_state():
    # bf16 inputs, computed in fp32: against float64 on the same (bf16-rounded) values, the state
    # is as exact as fp32 allows, and y errs only by its final rounding to bf16 (2^-8 relatively).
    # A state kept in bf16 would be off by about 2^-8 per step instead.
    x, delta, A, B, C, D, z, h0 = scan_inputs(dtype=torch.float32)
    args = [t.bfloat16() for t in (x, delta)] + [A] + [t.bfloat16() for t in (B, C, D, z)] + [h0]
    y_ref, h_ref = reference_selective_scan(*args)  # float64 of the very same values
    for backend in EAGER_BACKENDS:
        y, h = me.selective_scan(*args, backend=backend, return_last_state=True)
        assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
        torch.testing.assert_close(h.double(), h_ref, rtol=1e-5, atol=1e-5, msg=backend)
        assert ((y.double() - y_ref).abs() <= 2 ** -8 * y_ref.abs() + 1e-5).all(), backend


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.__setitem__(0, a[0][:, :, :-1]), r"A must have shape \(ED, N\) = \(5, N\)"),
        (lambda a: a.__setitem__(1, a[1][:, :-1]), r"delta must have shape \(2, 13, 6\)"),
        (lambda a: a.__setitem__(2, a[2][:, :-1]), r"B must have shape \(2, 13, 3\), got \(2, 13, 4\)"),
        (lambda a: a.__setitem__(3, a[3][..., :-1]), r"B must have shape \(2, 13, 4\)"),
        (lambda a: a.__setitem__(5, a[5][:-1]), r"D must have shape \(6,\)"),
        (lambda a: a.__setitem__(7, a[7][0]), r"h0 must have shape \(2, 6, 4\)"),
        (lambda a: a.__setitem__(0, a[0][0]), r"x must have shape \(b, L, ED\)"),
        (lambda a: a.__setitem__(0, a[0].tolist()), "x must be a tensor, got a list"),
    ],
)
def test_selective_scan_bad_shapes_raise(change, message):
    args = scan_inputs()
    change(args)
    with pytest.raises(ValueError, match=message):
        me.selective_scan(*args)


def test_compile_modes_choose_the_loop_over_chunks(monkeypatch):
    # which functions each mode hands to the compiler (here: runs them eagerly), and the fallback
    # for a torch whose compiler rejects the scan operator: warn once, then loop in Python
    asked, reject = [], False

    def pretend_compile(fn, compile, device):
        asked.append(fn.__name__ if compile else None)

        def rejected(*args):
            raise torch._dynamo.exc.Unsupported("scan is not supported")
        return rejected if fn is me._chunk_loop and reject else fn

    monkeypatch.setattr(me, "_maybe_compiled", pretend_compile)
    monkeypatch.setattr(me, "_compiled_loop_works", True)
    inputs, y_ref = scan_inputs(l=13), reference_selective_scan(*scan_inputs(l=13))[0]
    with torch.no_grad():
        for compile, wanted in ((True, ["_scan_chunk"]), ("loop", ["_chunk_loop"])):
            asked.clear()
            y = me.selective_scan(*inputs, compile=compile, chunk_size=4)
            torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
            assert asked == wanted, compile
    reject = True
    with torch.no_grad(), pytest.warns(UserWarning, match="compiling the loop over chunks failed"):
        y = me.selective_scan(*inputs, compile="loop", chunk_size=4)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    assert me._compiled_loop_works is False
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # not again
        me.selective_scan(*inputs, compile="loop", chunk_size=4)
    with pytest.raises(ValueError, match="compile must be one of"):
        me.selective_scan(*inputs, compile="fast")


def test_a_failing_compiler_falls_back_to_eager_once_and_real_errors_still_raise(monkeypatch):
    # a call whose compiled version raises is made again eagerly: where that works, one warning
    # names the function and the error, and the function stays eager; where the eager call
    # raises too, the error is the caller's and comes out, with no warning and no fallback
    calls = []

    def broken_compile(fn, **options):
        def compiled(*args):
            calls.append("compiled")
            raise RuntimeError("InductorError: no working C++ compiler found\nmore lines")
        return compiled

    def double(x):
        if x.numel() == 0:
            raise ValueError("x is empty")
        calls.append("eager")
        return 2 * x

    monkeypatch.setattr(torch, "compile", broken_compile)
    f = me.CompiledOrEager(double, "double")
    with pytest.warns(me.CompileFallbackWarning, match=r"^torch.compile failed for double \(RuntimeError: "
                                                        r"InductorError: no working C\+\+ compiler found\); it runs "
                                                        r"eagerly from now on$"):
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per call
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    assert calls == ["compiled", "eager", "eager"]
    g = me.CompiledOrEager(double, "double")
    with warnings.catch_warnings(), pytest.raises(ValueError, match="x is empty"):
        warnings.simplefilter("error")
        g(torch.ones(0))
    assert not g.failed


def test_a_backward_that_fails_to_compile_fails_inside_the_call():
    # torch compiles a training graph's backward at the first backward, after the call has
    # returned; compile_backward_now moves that compile into the call, where a failure falls back
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd

    def broken(gm, example_inputs):
        raise RuntimeError("the backward's compiler failed")

    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: gm.forward, bw_compiler=broken)
    x = torch.randn(3, requires_grad=True)
    can_move = hasattr(functorch_config, "force_non_lazy_backward_lowering")  # torch >= 2.10
    for now in (True, False):
        torch._dynamo.reset()
        f = me.CompiledOrEager(lambda t: t.sin() * 2, "sin", compile_backward_now=now, backend=backend)
        assert f.compile_backward_now == (now and can_move)
        if f.compile_backward_now:
            with pytest.warns(me.CompileFallbackWarning, match="the backward's compiler failed"):
                y = f(x)
            (grad,) = torch.autograd.grad(y.sum(), x)
            torch.testing.assert_close(grad, 2 * x.detach().cos())
        else:  # torch's own order: the call returns, the backward raises
            with pytest.raises(Exception, match="the backward's compiler failed"):
                torch.autograd.grad(f(x).sum(), x)


def fresh_compiles(monkeypatch, compile_fn):
    """torch.compile replaced by compile_fn for the models' compiled functions, made anew."""
    import mamba2_minimal as m2
    monkeypatch.setattr(torch, "compile", compile_fn)
    monkeypatch.setattr(me, "_compiled", {})
    monkeypatch.setattr(m2, "_compiled_forward", functools.cache(m2._compiled_forward.__wrapped__))


def small_models():
    """Mamba-1 accelerated with its fused scan compiled and Mamba-2 with its mixer compiled (two
    chunks of 8 at L = 16), each with an eager twin of the same weights (Mamba-1's: the engine's
    default, the eager backend "auto")."""
    import mamba2_minimal as m2
    torch.manual_seed(0)
    m1 = MambaLM(MambaConfig(d_model=16, n_layer=2, vocab_size=21, d_state=4))
    m2_ = m2.Mamba2LM(m2.Mamba2Config(d_model=32, n_layer=2, vocab_size=21, d_state=8, headdim=16, chunk_size=8,
                                      compile_mixer=True))
    eager1, eager2 = copy.deepcopy(m1), copy.deepcopy(m2_)
    me.accelerate(m1, compile=True, chunk_size=4)
    me.accelerate(eager1)
    eager2.cfg.compile_mixer = False
    return [(m1, eager1), (m2_, eager2)]


def training_gradients(model, ids):
    model.zero_grad()
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_compiler_that_fails_at_the_evaluation_or_a_later_shape_leaves_the_run_eager(monkeypatch):
    # the compiler works for the first training step, then raises: the evaluation (Mamba-1's
    # chunk, run without autograd) or a training step at a new batch size (Mamba-2's mixer) runs
    # eagerly with one warning, with the eager model's numbers, and later calls stay eager
    failing = None

    def compile_until_told(fn, **options):
        def compiled(*args):
            if fn.__name__ == failing:
                raise RuntimeError("TritonError: out of shared memory")
            return fn(*args)
        return compiled

    fresh_compiles(monkeypatch, compile_until_told)
    ids = torch.randint(0, 21, (3, 17), generator=torch.Generator().manual_seed(1))
    for (model, eager), later in zip(small_models(), ("evaluation", "new batch")):
        failing = None
        for g, w in zip(training_gradients(model, ids), training_gradients(eager, ids)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        failing = "_scan_chunk" if later == "evaluation" else "_forward"
        with pytest.warns(me.CompileFallbackWarning, match="TritonError: out of shared memory"):
            if later == "evaluation":
                with torch.no_grad():
                    torch.testing.assert_close(model(ids), eager(ids), rtol=1e-5, atol=1e-6)
            else:
                got = training_gradients(model, ids[:2])
        if later == "new batch":
            for g, w in zip(got, training_gradients(eager, ids[:2])):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the first failure made the function eager: no more warnings
            training_gradients(model, ids)
            with torch.no_grad():
                model(ids[:2])


def test_without_fallback_a_compiler_error_is_raised_and_nothing_turns_eager(monkeypatch):
    # fallback=False: the caller has a better plan than running eagerly (where the compiled loop
    # over chunks fails, one compiled call per chunk), so the compiler's error comes out, no warning
    def broken_compile(fn, **options):
        def compiled(*args):
            raise RuntimeError("InductorError: no working C++ compiler found")
        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    f = me.CompiledOrEager(lambda x: 2 * x, "double", fallback=False)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="no working C\\+\\+ compiler"):
        warnings.simplefilter("error")
        f(torch.ones(2))
    assert not f.failed


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap loops over addcmul_
def test_torch_func_grad_and_vmap_through_the_conv_and_the_fused_scan_match_autograd():
    # torch.func.grad of a whole model through the causal conv's and the fused chunks' hand-written
    # backwards, and per-sample gradients (vmap of grad) of the fused scan and of the conv, against
    # plain autograd, sample by sample
    import mamba2_minimal as m2
    ids = torch.randint(0, 21, (2, 11), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    for model in (me.accelerate(tiny_model(), backend="fused", chunk_size=4).double(),
                  m2.Mamba2LM(m2.Mamba2Config(d_model=32, n_layer=2, vocab_size=21, d_state=8, headdim=16,
                                              chunk_size=4)).double()):
        params = {k: v.detach() for k, v in model.named_parameters()}
        got = torch.func.grad(lambda p: torch.func.functional_call(model, p, (ids,)).pow(2).mean())(params)
        model.zero_grad()
        model(ids).pow(2).mean().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)

    inputs = scan_inputs(b=3, l=7)

    def scan_loss(x, delta, A, B, C, D, z, h0, compile=False):  # one sample: a batch of 1 inside
        one = [t.unsqueeze(0) for t in (x, delta, B, C, z, h0)]
        y = me.selective_scan(*one[:2], A, *one[2:4], D, *one[4:], backend="fused", chunk_size=3, compile=compile)
        return y.pow(2).sum()

    batched = (0, 0, None, 0, 0, None, 0, 0)  # A and D are shared by the samples
    per_sample = torch.func.vmap(torch.func.grad(scan_loss, argnums=tuple(range(8))), in_dims=batched)(*inputs)
    with warnings.catch_warnings():  # compile=True under the transforms: its chunks run eagerly, not as a failure
        warnings.simplefilter("error", me.CompileFallbackWarning)
        compiled_loss = lambda *args: scan_loss(*args, compile=True)
        same = torch.func.vmap(torch.func.grad(compiled_loss, argnums=tuple(range(8))), in_dims=batched)(*inputs)
    for g, w in zip(same, per_sample):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    mixer = me.accelerate(tiny_model()).double().backbone.layers[0].mixer
    x_in = torch.randn(3, 9, mixer.cfg.d_inner, dtype=torch.float64)

    def conv_loss(x, w):  # one sample
        x_pad = F.pad(x.unsqueeze(0), (0, 0, mixer.cfg.d_conv - 1, 0))
        return me._CausalConv.apply(x_pad, w, mixer.conv1d.bias.detach(), None).pow(2).sum()
    w = mixer.conv1d.weight.detach()[:, 0, :]
    conv_per_sample = torch.func.vmap(torch.func.grad(conv_loss, argnums=(0, 1)), in_dims=(0, None))(x_in, w)
    for i in range(3):
        one = [t[i].detach().clone().requires_grad_() if d == 0 else t.detach().clone().requires_grad_()
               for t, d in zip(inputs, batched)]
        want = torch.autograd.grad(scan_loss(*one), one)
        for name, g, w_ in zip(["x", "delta", "A", "B", "C", "D", "z", "h0"], per_sample, want):
            torch.testing.assert_close(g[i], w_, rtol=1e-10, atol=1e-12, msg=f"sample {i}: {name}")
        x_i, w_i = x_in[i].clone().requires_grad_(), w.clone().requires_grad_()
        x_pad = F.pad(x_i.unsqueeze(0), (0, 0, mixer.cfg.d_conv - 1, 0))
        want = torch.autograd.grad(mm.shifted_sum(x_pad, w_i, mixer.conv1d.bias.detach()).pow(2).sum(), (x_i, w_i))
        for g, w_ in zip(conv_per_sample, want):
            torch.testing.assert_close(g[i], w_, rtol=1e-10, atol=1e-12)


def test_the_hand_written_functions_trace_into_one_graph():
    # torch.compile cuts its graph at an autograd Function it cannot trace (one that defines a
    # jvp, an old-style forward(ctx, ...)) and at a call that returns a number, such as
    # torch.get_num_threads in pscan's "auto". Dynamo alone (the "eager" backend: seconds, no
    # code generated) with fullgraph=True, which raises at any break, with and without autograd
    import pscan
    from torch._dynamo.testing import CompileCounter
    lesson_mixer = tiny_model().backbone.layers[0].mixer
    mixer = me.accelerate(tiny_model()).backbone.layers[0].mixer
    x, delta, A, B, C, D, z, h0 = (t.float().requires_grad_() for t in scan_inputs(l=9))
    a, b = torch.rand(2, 9, 3, requires_grad=True), torch.randn(2, 9, 3, requires_grad=True)
    cases = {f"pscan.scan {backend}": lambda backend=backend: pscan.scan(a, b, backend=backend)
             for backend in pscan.BACKENDS}
    cases["causal conv"] = lambda: mixer.causal_conv(torch.randn(2, 9, mixer.cfg.d_inner))
    cases["the lesson's causal conv"] = lambda: lesson_mixer.causal_conv(torch.randn(2, 9, mixer.cfg.d_inner))
    cases["the lesson's selective scan"] = lambda: mm.selective_scan_reference(x, delta, A, B, C, D, z, h0)[0]
    cases["fused scan, recomputing backward"] = lambda: me.fused_selective_scan(x, delta, A, B, C, D, z, h0, 4)[0]
    # --compile inside --compile-model: the outer compile traces the chunk functions themselves
    cases["fused scan, compile=True"] = lambda: me.fused_selective_scan(x, delta, A, B, C, D, z, h0, 4,
                                                                        compile=True)[0]
    for name, fn in cases.items():
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        compiled().sum().backward()
        with torch.no_grad():
            compiled()
        assert counter.frame_count == 2, name  # one graph with autograd, one without


def test_selective_scan_unknown_backend_and_chunk_size_raise():
    args = scan_inputs()
    with pytest.raises(ValueError, match="backend must be one of"):
        me.selective_scan(*args, backend="cuda_kernel")
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        me.selective_scan(*args, backend="fused", chunk_size=0)


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------

def test_module_tree_has_the_official_names():
    model = tiny_model(n_layer=2)
    names = set(model.state_dict())
    for i in range(2):
        for leaf in ["norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias",
                     "mixer.x_proj.weight", "mixer.dt_proj.weight", "mixer.dt_proj.bias",
                     "mixer.A_log", "mixer.D", "mixer.out_proj.weight"]:
            assert f"backbone.layers.{i}.{leaf}" in names
    assert {"backbone.embedding.weight", "backbone.norm_f.weight", "lm_head.weight"} <= names
    assert model.backbone.embedding.weight.shape[0] == 24  # 21 padded to a multiple of 8


def test_every_backend_gives_the_same_logits_and_gradients():
    # the lesson's code first ("reference"), then each of the engine's backends
    model = tiny_model().double()
    ids = torch.randint(0, 21, (2, 19), generator=torch.Generator().manual_seed(1))
    results = []
    for backend in ["reference"] + EAGER_BACKENDS:
        me.accelerate(model, backend=backend)
        model.zero_grad()
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    for logits, grads in results[1:]:
        torch.testing.assert_close(logits, results[0][0], rtol=1e-10, atol=1e-10)
        for g, g0 in zip(grads, results[0][1]):
            torch.testing.assert_close(g, g0, rtol=1e-8, atol=1e-10)


def _train_a_few_steps(model, steps=5, seed=3):
    """AdamW on random packed rows: the losses of each step and the parameters after them."""
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.optim_groups(0.1), lr=1e-2)
    seq_idx = torch.tensor([[0] * 7 + [1] * 12, [0] * 19])  # a document boundary in the first row
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 21, (2, 19), generator=g)
        loss = F.cross_entropy(model(ids, seq_idx=seq_idx).flatten(0, 1)[:, :21], ids.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_accelerate_by_default_runs_the_engine_the_trainer_ran_before(monkeypatch):
    # the trainer's step is no slower than before: accelerate(model) with its defaults runs what
    # every model ran before the engine became opt-in, the eager backend "auto" under the hand-written
    # backward (no compile; chunks of 16 and the recomputing backward for the fused path) and
    # _CausalConv, with the numbers of the lesson's code: forward and every gradient in float64
    model = tiny_model().double()
    fast = me.accelerate(copy.deepcopy(model))
    asked = []
    scan = me.selective_scan
    monkeypatch.setattr(me, "selective_scan", lambda *a, **k: asked.append(k) or scan(*a, **k))
    ids = torch.randint(0, 21, (2, 19), generator=torch.Generator().manual_seed(1))
    results = []
    for m in (model, fast):
        logits = m(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        results.append((logits.detach(), [p.grad for p in m.parameters()], logits.grad_fn))
    assert len(asked) == 2 and all(k.pop("reset") is None for k in asked)
    assert asked[0] == asked[1] == dict(backend="auto", compile=False, chunk_size=16, recompute=True,
                                        return_last_state=True)
    assert all(layer.mixer.conv_fn == me._CausalConv.apply for layer in fast.backbone.layers)
    seen, stack = set(), [results[1][2]]
    while stack:
        f = stack.pop()
        if f is not None and f not in seen:
            seen.add(f)
            stack.extend(g for g, _ in f.next_functions)
    assert {"_SelectiveScanBackward", "_CausalConvBackward"} <= {type(f).__name__ for f in seen}
    (logits, grads, _), (fast_logits, fast_grads, _) = results
    torch.testing.assert_close(fast_logits, logits, rtol=1e-10, atol=1e-10)
    for g, g0 in zip(fast_grads, grads):
        torch.testing.assert_close(g, g0, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("engine", ["auto", "sequential", "fused"])
def test_the_model_as_built_trains_exactly_like_the_engine(engine):
    # the model as built runs mamba_minimal.py's sections 2 and 3 under autograd; the engine's
    # hand-written backwards and fused path must give the same losses and updates, step after step
    read = tiny_model().double()
    fast = me.accelerate(tiny_model(), backend=engine).double()
    read_losses, read_params = _train_a_few_steps(read)
    fast_losses, fast_params = _train_a_few_steps(fast)
    assert max(abs(a - b) for a, b in zip(read_losses, fast_losses)) < 1e-10
    for p, q in zip(read_params, fast_params):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


def calls_of(functions, run):
    """How many times each of `functions` (by name) is entered while run() runs: what a breakpoint
    in it would see, whatever name the caller reached it by."""
    codes = {f.__code__: name for name, f in functions.items()}
    calls = {name: 0 for name in functions}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            calls[codes[frame.f_code]] += 1
    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(before)
    return calls


def _forward_backward(model):
    F.cross_entropy(model(torch.randint(0, 21, (2, 9))).flatten(0, 1), torch.randint(0, 21, (18,))).backward()


def test_the_model_as_built_runs_the_lessons_functions_and_nothing_of_the_engine():
    # a breakpoint in mamba_minimal.py section 2's selective_scan_reference or section 3's
    # shifted_sum is reached, and mamba_engine.py's autograd Functions are never entered; accelerated,
    # the other way round
    functions = {"selective_scan_reference": mm.selective_scan_reference, "shifted_sum": mm.shifted_sum,
                 "_SelectiveScan": me._SelectiveScan.forward, "_CausalConv": me._CausalConv.forward,
                 "_RecomputedChunk": me._RecomputedChunk.forward, "selective_scan": me.selective_scan}
    lesson = calls_of(functions, lambda: _forward_backward(tiny_model()))
    assert lesson == dict(selective_scan_reference=2, shifted_sum=2, _SelectiveScan=0, _CausalConv=0,
                          _RecomputedChunk=0, selective_scan=0)  # two layers
    engine = calls_of(functions, lambda: _forward_backward(me.accelerate(tiny_model())))
    assert engine == dict(selective_scan_reference=0, shifted_sum=2, _SelectiveScan=2, _CausalConv=2,
                          _RecomputedChunk=0, selective_scan=2)  # _CausalConv's forward is shifted_sum
    # backend="reference" gives a model back the lesson's code
    back = calls_of(functions, lambda: _forward_backward(me.accelerate(me.accelerate(tiny_model()),
                                                                       backend="reference")))
    assert back == lesson


def test_the_model_as_built_scans_with_the_loop_not_autos_dispatch(monkeypatch):
    # the model as built scans with pscan.py section 1's loop, as the official selective_scan_ref
    # does, so a reader following its calls reads neither the parallel tree (sections 5 and 8) nor a
    # backend choice (pscan.py appendix C); "auto" would pick the tree for a training step here
    loops = []
    real_loop = mm.pscan.scan_sequential
    monkeypatch.setattr(mm.pscan, "scan_sequential", lambda *a: loops.append(1) or real_loop(*a))
    monkeypatch.setattr(mm.pscan, "_brent_kung_", lambda *a: pytest.fail("the tree ran"))
    monkeypatch.setattr(mm.pscan, "choose_backend", lambda *a: pytest.fail("auto's dispatch ran"))
    model = tiny_model()
    F.cross_entropy(model(torch.randint(0, 21, (2, 9))).flatten(0, 1), torch.randint(0, 21, (18,))).backward()
    assert len(loops) == 2  # two layers
    with torch.no_grad():
        x, delta = torch.randn(1, 5, 8), torch.rand(1, 5, 8)
        mm.selective_scan_reference(x, delta, -torch.rand(8, 3), torch.randn(1, 5, 3), torch.randn(1, 5, 3))
    assert len(loops) == 3
    # the tree is one argument away, for the reader of the parallel scan
    monkeypatch.undo()
    tree = []
    real_tree = mm.pscan._brent_kung_
    monkeypatch.setattr(mm.pscan, "_brent_kung_", lambda *a: tree.append(1) or real_tree(*a))
    mm.selective_scan_reference(x, delta, -torch.rand(8, 3), torch.randn(1, 5, 3), torch.randn(1, 5, 3),
                                backend="pscan")
    assert tree


def test_causality_changing_token_t_leaves_earlier_logits_unchanged():
    model = tiny_model().double()
    ids = torch.randint(0, 21, (1, 17), generator=torch.Generator().manual_seed(2))
    base = model(ids)
    for t in [0, 5, 16]:
        changed = ids.clone()
        changed[0, t] = (changed[0, t] + 1) % 21
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(out[:, t], base[:, t])


def _ks_distance(samples, cdf):
    """Kolmogorov-Smirnov distance between the samples' empirical CDF and a CDF (a function)."""
    s = samples.detach().double().flatten().sort().values
    n = s.numel()
    f = cdf(s)
    return max((torch.arange(1, n + 1, dtype=torch.float64) / n - f).max().item(),
               (f - torch.arange(n, dtype=torch.float64) / n).max().item())


def _uniform_cdf(lo, hi):
    return lambda s: ((s - lo) / (hi - lo)).clamp(0, 1)


# The KS distance of n samples from their own distribution stays below 1.95/sqrt(n) with
# probability 0.999; the seeds are fixed, so these tests are deterministic anyway.
def _ks_bound(n):
    return 1.95 / n ** 0.5


def test_official_initialization():
    cfg = dict(d_model=64, n_layer=3, d_state=16, dt_min=1e-3, dt_max=0.1, dt_init_floor=1e-4)
    model = tiny_model(**cfg)
    model.backbone._init_weights(3)  # the generic pass zeroes every Linear bias first; dt must survive it
    mixers = [layer.mixer for layer in model.backbone.layers]
    ed, r = 128, mixers[0].cfg.dt_rank
    # Δ's log-uniform start (it must survive the pass above, which zeroes every Linear bias) and
    # out_proj's depth scaling: test_reference.py, against their laws
    dt = F.softplus(torch.cat([m.dt_proj.bias for m in mixers]))  # a zeroed bias would give 0.69
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    # dt_proj.weight uniform in ±dt_rank^-0.5
    w = torch.cat([m.dt_proj.weight.flatten() for m in mixers])
    assert w.abs().max() <= r ** -0.5
    assert _ks_distance(w, _uniform_cdf(-r ** -0.5, r ** -0.5)) < _ks_bound(w.numel())
    for m in mixers:  # A = -(1, 2, ..., N) in every channel, D = 1
        torch.testing.assert_close(m.A_log, torch.arange(1, 17.0).log().repeat(ed, 1), rtol=0, atol=0)
        assert torch.equal(m.D, torch.ones(ed))
    # the embedding (the head tied to it) N(0, 0.02)
    assert model.lm_head.weight is model.backbone.embedding.weight
    emb = model.backbone.embedding.weight
    normal_cdf = lambda s: 0.5 * (1 + torch.erf(s / (0.02 * 2 ** 0.5)))  # noqa: E731
    assert _ks_distance(emb, normal_cdf) < _ks_bound(emb.numel())


def test_dt_min_equal_to_dt_max_starts_every_delta_there():
    # the log-uniform range [dt_min, dt_max] may be one point: every channel's Δ starts at it
    model = tiny_model(dt_min=0.01, dt_max=0.01)
    for layer in model.backbone.layers:
        dt = F.softplus(layer.mixer.dt_proj.bias.double())
        torch.testing.assert_close(dt, torch.full_like(dt, 0.01), rtol=1e-5, atol=0)


def test_optim_groups_exempt_A_log_D_norms_and_biases():
    model = tiny_model()
    decay, no_decay = model.optim_groups(0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    for n in names.values():
        if n.endswith(("A_log", ".D", "norm.weight", "norm_f.weight", ".bias")):
            assert n in no_decay_names, n
    assert "backbone.layers.0.mixer.in_proj.weight" in decay_names
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# ------------------------------------------------------------------------------------------------
# recurrent inference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len", [1, 3, 4, 9])
def test_prefill_then_steps_reproduce_the_parallel_forward(prompt_len):
    model = tiny_model(d_conv=4).eval()
    ids = torch.randint(0, 21, (3, 20), generator=torch.Generator().manual_seed(3))
    full = model(ids)
    logits, cache = model.prefill(ids[:, :prompt_len])
    torch.testing.assert_close(logits, full[:, :prompt_len], rtol=0, atol=1e-5)
    for t in range(prompt_len, ids.shape[1]):
        step_logits = model.step(ids[:, t], cache)
        torch.testing.assert_close(step_logits, full[:, t], rtol=0, atol=1e-5, msg=f"position {t}")


@pytest.mark.parametrize("config", [dict(d_conv=2), dict(d_conv=6, conv_bias=False, bias=True),
                                    dict(residual_in_fp32=False, tie_embeddings=False, expand=3, d_state=5)],
                         ids=["d_conv=2", "d_conv=6,biases", "no-fp32-residual,untied,expand=3"])
def test_recurrent_step_follows_the_forward_for_other_configs(config):
    model = tiny_model(**config).eval()
    ids = torch.randint(0, 21, (2, 12), generator=torch.Generator().manual_seed(9))
    full = model(ids)
    logits, cache = model.prefill(ids[:, :2])
    torch.testing.assert_close(logits, full[:, :2], rtol=0, atol=1e-5)
    for t in range(2, 12):
        torch.testing.assert_close(model.step(ids[:, t], cache), full[:, t], rtol=0, atol=1e-5)


def test_greedy_generate_equals_teacher_forced_argmax():
    model = tiny_model().eval()
    prompt = torch.randint(0, 21, (2, 5), generator=torch.Generator().manual_seed(4))
    out = model.generate(prompt, max_new_tokens=12, top_k=1)
    assert out.shape == (2, 17) and torch.equal(out[:, :5], prompt)
    teacher = model(out[:, :-1])[..., :21].argmax(-1)  # prediction for every next position
    assert torch.equal(teacher[:, 4:], out[:, 5:])
    streamed = torch.stack(list(model.generate_stream(prompt, 12, temperature=0.0)), dim=1)
    assert torch.equal(streamed, out[:, 5:])


def test_sampling_respects_top_k_and_top_p():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]).repeat(200, 1)
    g = torch.Generator().manual_seed(0)
    assert set(mm.sample_next(logits, top_k=2, generator=g).tolist()) <= {1, 2}
    # probabilities ~ (0.024, 0.474, 0.429, 0.009, 0.064): top_p 0.45 keeps token 1 alone,
    # top_p 0.9 needs tokens 1 and 2
    assert set(mm.sample_next(logits, top_p=0.45, generator=g).tolist()) == {1}
    assert set(mm.sample_next(logits, top_p=0.9, generator=g).tolist()) == {1, 2}
    assert len(set(mm.sample_next(logits, generator=g).tolist())) >= 3
    with pytest.raises(ValueError, match="top_p"):
        mm.sample_next(logits, top_p=1.5)


# ------------------------------------------------------------------------------------------------
# precision
# ------------------------------------------------------------------------------------------------

BF16_EPS = 2 ** -8  # bf16 keeps 8 significant bits: one rounding errs by at most this, relatively


def _relative_rms_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def test_bf16_autocast_and_bf16_weights_are_close_to_float64():
    # Each bf16 rounding errs by up to 2^-8 relatively; from the embedding to the logits there are
    # about a dozen of them in sequence (in_proj, conv, x_proj, dt_proj, the scan's output, the
    # gate, out_proj, the residual, per layer, then the head). Independent errors add in
    # quadrature, so the logits' relative RMS error is a small multiple of 2^-8 (measured:
    # 1.2-1.9x over four seeds); the bound 4x holds that with room. (The logits' spread is about
    # 0.13, so the former atol of 0.1 let through errors of most of the signal.)
    model = tiny_model().eval()
    ids = torch.randint(0, 21, (2, 33), generator=torch.Generator().manual_seed(5))
    ref = copy.deepcopy(model).double()(ids).detach()  # float64, the same (fp32) weights
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = model(ids)
    half = copy.deepcopy(model).to(torch.bfloat16).eval()
    cast = half(ids)
    ref_cast = copy.deepcopy(half).double()(ids).detach()  # float64, the same (bf16-rounded) weights
    for name, out, want in (("autocast", auto, ref), ("bf16 weights", cast, ref_cast)):
        assert torch.isfinite(out.float()).all()
        assert _relative_rms_error(out, want) < 4 * BF16_EPS, name
    assert half.backbone.layers[0].mixer.A_log.dtype == torch.bfloat16
    # the recurrent state stays fp32 after .to(bfloat16), and stepping still follows float64
    _, cache = half.prefill(ids[:, :10])
    assert cache[0][1].dtype == torch.float32
    step = half.step(ids[:, 10], cache)
    assert _relative_rms_error(step, ref_cast[:, 10]) < 4 * BF16_EPS


# ------------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------------

def _write_official(folder, model):
    cfg = model.cfg
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "d_model": cfg.d_model, "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size,
        "ssm_cfg": {"d_state": cfg.d_state}, "rms_norm": True, "residual_in_fp32": True,
        "fused_add_norm": True, "pad_vocab_size_multiple": 8}))
    torch.save(model.state_dict(), folder / "pytorch_model.bin")


def _write_transformers(folder, model):
    cfg = model.cfg
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer, "vocab_size": cfg.padded_vocab_size,
        "state_size": cfg.d_state, "expand": 2, "conv_kernel": 4, "time_step_rank": cfg.dt_rank,
        "use_bias": False, "use_conv_bias": True, "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True, "residual_in_fp32": True}))
    sd = {k.replace("backbone.embedding.", "backbone.embeddings."): v
          for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    torch.save(sd, folder / "pytorch_model.bin")


def test_official_and_transformers_layouts_load_strictly_with_identical_logits(tmp_path):
    model = tiny_model(seed=7).eval()
    ids = torch.randint(0, 21, (2, 11), generator=torch.Generator().manual_seed(6))
    expected = model(ids)
    _write_official(tmp_path / "official", model)
    _write_transformers(tmp_path / "hf", model)
    a = pretrained.load(str(tmp_path / "official"))
    b = pretrained.load(str(tmp_path / "hf"))
    for loaded in (a, b):
        assert loaded.lm_head.weight is loaded.backbone.embedding.weight
        torch.testing.assert_close(loaded(ids), expected, rtol=0, atol=0)


def test_bad_checkpoints_raise_errors_that_name_the_problem(tmp_path):
    model = tiny_model()
    _write_official(tmp_path / "ok", model)
    # a config.json missing a field
    bad_cfg = tmp_path / "no_layers"
    bad_cfg.mkdir()
    (bad_cfg / "config.json").write_text(json.dumps({"d_model": 32, "vocab_size": 21}))
    with pytest.raises(ValueError, match=r"missing the fields \['n_layer'\]"):
        pretrained.load(str(bad_cfg))
    # missing and unexpected keys
    sd = torch.load(tmp_path / "ok" / "pytorch_model.bin")
    del sd["backbone.layers.1.mixer.D"]
    sd["backbone.layers.1.mixer.E"] = torch.zeros(3)
    torch.save(sd, tmp_path / "ok" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"missing \['backbone.layers.1.mixer.D'\].*unexpected \['backbone.layers.1.mixer.E'\]"):
        pretrained.load(str(tmp_path / "ok"))
    # a shape that does not match the config
    (tmp_path / "ok" / "config.json").write_text(json.dumps({"d_model": 32, "n_layer": 2, "vocab_size": 40,
                                                            "ssm_cfg": {"d_state": 8}}))
    torch.save(model.state_dict(), tmp_path / "ok" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"backbone.embedding.weight has shape \(24, 32\)"):
        pretrained.load(str(tmp_path / "ok"))
    # neither a folder nor a hub id we can fetch
    with pytest.raises((FileNotFoundError, OSError), match="config.json|not a folder|huggingface"):
        pretrained.load(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="Mamba-1 only"):
        pretrained.config_from_dict({"d_model": 8, "n_layer": 1, "vocab_size": 5, "ssm_cfg": {"layer": "Mamba2"}})


@pytest.mark.parametrize(
    "ids, message",
    [
        (torch.tensor([[1, 2, 21]]), r"\[0, 21\)"),
        (torch.tensor([[-1, 2]]), r"\[0, 21\)"),
        (torch.tensor([1, 2, 3]), r"shape \(b, L\)"),
        (torch.zeros(1, 0, dtype=torch.long), "empty"),
        (torch.tensor([[1.0, 2.0]]), "integer"),
    ],
)
def test_bad_token_ids_raise(ids, message):
    with pytest.raises(ValueError, match=message):
        tiny_model()(ids)


def test_bad_config_and_accelerate_arguments_raise():
    with pytest.raises(ValueError, match="d_model must be a positive integer"):
        MambaConfig(d_model=0)
    model = tiny_model()
    with pytest.raises(ValueError, match="backend must be one of"):
        me.accelerate(model, backend="fast")
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 0"):
        me.accelerate(model, chunk_size=0)
    with pytest.raises(ValueError, match="compile must be one of"):
        me.accelerate(model, compile="always")
    with pytest.raises(ValueError, match="recompute must be True or False, got 'no'"):
        me.accelerate(model, recompute="no")
    with pytest.raises(ValueError, match="'reference' runs the lesson's code, compile runs the fused path"):
        me.accelerate(model, backend="reference", compile=True)
    with pytest.raises(ValueError, match="accelerate runs Mamba-1's mixers"):
        me.accelerate(torch.nn.Linear(2, 2))
    assert "scan_fn" not in vars(model.backbone.layers[0].mixer)  # a refused call changed nothing
    for eps in (0, -1, float("nan"), "1e-5"):
        with pytest.raises(ValueError, match="norm_epsilon must be a positive number"):
            MambaConfig(norm_epsilon=eps)


# ------------------------------------------------------------------------------------------------
# the compiled path (tens of seconds of compiling; deselect with -m "not compile")
# ------------------------------------------------------------------------------------------------

@pytest.mark.compile
def test_compiled_chunked_scan_matches_float64_reference():
    # one chunk shape (B=2, T=4, ED=6, N=4) for every case, so Inductor compiles each graph once;
    # L = 3 is shorter than a chunk and L = 10 is not a multiple of it
    for L in (3, 10):
        for recompute in (False, True):
            assert_matches_reference(L, tol=1e-9, compile=True, chunk_size=4, recompute=recompute)
    with torch.no_grad():  # forward only: compile="loop" compiles the loop over chunks too
        for L in (10, 3):  # 3 chunks, then 1 (a size of 1 is a graph of its own)
            y, h = me.selective_scan(*scan_inputs(l=L), compile="loop", chunk_size=4, return_last_state=True)
            y_ref, h_ref = reference_selective_scan(*scan_inputs(l=L))
            torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(h, h_ref, rtol=1e-9, atol=1e-9)
            assert _owns_exactly_its_bytes(h)
    if TORCH_VERSION >= (2, 7):  # older torch cannot compile the scan operator and loops in Python
        assert me._compiled_loop_works
    if hasattr(torch.compiler, "set_stance"):  # torch >= 2.6
        # a new length, so a new number of chunks, runs the code compiled above in both modes
        with torch.compiler.set_stance("fail_on_recompile"):
            with torch.no_grad():
                y = me.selective_scan(*scan_inputs(l=30), compile="loop", chunk_size=4)
            torch.testing.assert_close(y, reference_selective_scan(*scan_inputs(l=30))[0], rtol=1e-9, atol=1e-9)
            assert_matches_reference(21, tol=1e-9, compile=True, chunk_size=4, recompute=True)
        # in the model, a padded length and an unpadded one (B, C, z then strided slices) share
        # one graph too
        model = me.accelerate(tiny_model(), chunk_size=4).eval()
        ids = torch.randint(0, 21, (2, 19), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            expected = [model(ids), model(ids[:, :16])]
            me.accelerate(model, compile="loop", chunk_size=4)
            got = [model(ids)]
            with torch.compiler.set_stance("fail_on_recompile"):
                got.append(model(ids[:, :16]))
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                               reason="needs a CUDA GPU"))]


@pytest.mark.compile
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_training_then_evaluation_then_a_smaller_batch_compile_nothing_new(device):
    # the trainer's order under bf16 autocast: two training steps, an evaluation, its smaller last
    # batch. Everything compiles at the first step: Mamba-1's evaluation runs the chunk graph its
    # training forward compiled, with the batch a dynamic size; Mamba-2's mixer is compiled for
    # training and runs eagerly without autograd. The numbers are the eager twin's.
    counters = torch._dynamo.utils.counters
    ids = torch.randint(0, 21, (3, 17), generator=torch.Generator().manual_seed(4)).to(device)
    for model, eager in small_models():
        model.to(device)
        eager.to(device)
        with torch.autocast(device, dtype=torch.bfloat16), warnings.catch_warnings():
            warnings.simplefilter("error", me.CompileFallbackWarning)  # the compiler works: no fallback
            got = training_gradients(model, ids)
            graphs = counters["stats"]["unique_graphs"]
            training_gradients(model, ids)
            with torch.no_grad():
                evaluated = [model(ids), model(ids[:2])]
            assert counters["stats"]["unique_graphs"] == graphs, type(model).__name__
            want = training_gradients(eager, ids)
            with torch.no_grad():
                expected = [eager(ids), eager(ids[:2])]
        scale = max(w.abs().max().item() for w in want)  # bf16 matmuls: an error relative to the largest gradient
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * scale)
        for g, w in zip(evaluated, expected):
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * w.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_a_training_step_under_bf16_autocast_is_close_to_float64(device):
    # as the trainer trains on a GPU: the forward under bf16 autocast, the loss in fp32, backward,
    # fused AdamW. Against the same step in float64 on the CPU: the loss and every gradient (as a
    # relative norm), for each architecture; Adam's first step moves each weight by at most lr
    import mamba2_minimal as m2
    import mamba3_minimal as m3
    from gpt_minimal import GPTConfig, TinyGPT
    ids = torch.randint(0, 21, (4, 33), generator=torch.Generator().manual_seed(5))
    small = dict(d_model=32, n_layer=2, vocab_size=21)
    makers = {"mamba": lambda: MambaLM(MambaConfig(**small, d_state=8)),
              "mamba, accelerated": lambda: me.accelerate(MambaLM(MambaConfig(**small, d_state=8))),
              "mamba2": lambda: m2.Mamba2LM(m2.Mamba2Config(**small, d_state=8, headdim=16, chunk_size=16)),
              "mamba3": lambda: m3.Mamba3LM(m3.Mamba3Config(**small, d_state=8, headdim=16, chunk_size=16)),
              "gpt": lambda: TinyGPT(GPTConfig(d_model=32, n_layer=2, n_head=4, vocab_size=21, block_size=32))}
    for arch, make in makers.items():
        results = []
        for where, dtype, autocast in ((device, torch.float32, True), ("cpu", torch.float64, False)):
            torch.manual_seed(0)
            model = make().to(where, dtype)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0, fused=True)
            x = ids.to(where)
            with torch.autocast(where, dtype=torch.bfloat16, enabled=autocast):
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits[..., :21].float().flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            grads = [p.grad.double().cpu() for p in model.parameters()]
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            moved = [(p.detach() - p0).abs().max().item() for p, p0 in zip(model.parameters(), before)]
            results.append((loss.item(), grads, moved))
        (loss, grads, moved), (loss64, grads64, _) = results
        assert abs(loss - loss64) < 2e-3 * loss64, arch
        for (name, _), g, w, m in zip(make().named_parameters(), grads, grads64, moved):
            assert (g - w).norm() <= 0.1 * w.norm(), f"{arch}: {name}"  # bf16 matmuls: up to 5% on a CPU
            assert 0 < m <= 1e-2 * (1 + 1e-5), f"{arch}: {name} moved by {m}"  # Adam: lr·g/(|g| + eps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", EAGER_BACKENDS)
def test_cuda_matches_the_float64_cpu_reference(backend):
    inputs = scan_inputs(l=37, dtype=torch.float32)
    y_ref, h_ref = reference_selective_scan(*inputs)
    y, h = me.selective_scan(*[t.cuda() for t in inputs], backend=backend, return_last_state=True)
    torch.testing.assert_close(y.double().cpu(), y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h.double().cpu(), h_ref, rtol=1e-4, atol=1e-4)
    model = tiny_model().eval()
    ids = torch.randint(0, 21, (2, 19), generator=torch.Generator().manual_seed(8))
    me.accelerate(model, backend=backend)
    expected = model.double()(ids)
    got = model.float().cuda()(ids.cuda())
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.compile
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compiled_paths_match_the_float64_cpu_reference():
    inputs = scan_inputs(l=37, dtype=torch.float32)
    y_ref, h_ref = reference_selective_scan(*inputs)
    for compile, recompute in ((True, True), (True, False), ("loop", False)):
        cuda_inputs = [t.cuda().requires_grad_(compile is True) for t in inputs]
        with torch.set_grad_enabled(compile is True):
            y, h = me.selective_scan(*cuda_inputs, compile=compile, recompute=recompute, return_last_state=True)
        torch.testing.assert_close(y.detach().double().cpu(), y_ref, rtol=1e-4, atol=1e-4, msg=str(compile))
        torch.testing.assert_close(h.detach().double().cpu(), h_ref, rtol=1e-4, atol=1e-4, msg=str(compile))
        if compile is True:  # gradients against float64 autograd through the reference
            ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
            y64, h64 = reference_selective_scan(*ref_inputs)
            gy = torch.randn_like(y64)
            got = torch.autograd.grad(y, cuda_inputs, gy.float().cuda())
            want = torch.autograd.grad(y64, ref_inputs, gy)
            for g, w in zip(got, want):
                torch.testing.assert_close(g.double().cpu(), w.double(), rtol=1e-3, atol=1e-3)
    if TORCH_VERSION >= (2, 7):  # compile="loop" compiled its loop, and did not fall back to per-chunk calls
        assert me._compiled_loop_works, "compile='loop' fell back to one compiled call per chunk on CUDA"


# ------------------------------------------------------------------------------------------------
# issue 10: the cache, the checkpoints' dtypes and layouts, clear errors
# ------------------------------------------------------------------------------------------------

def _owns_exactly_its_bytes(t):
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("backend", ["reference"] + EAGER_BACKENDS)
def test_final_state_and_cache_own_exactly_their_bytes(backend):
    # a view h[:, -1] of the (B, L, ED, N) states would keep every state of the prompt alive
    x, delta, A, B, C, D, z, h0 = scan_inputs(l=40)
    _, h_last = me.selective_scan(x, delta, A, B, C, D, z, h0, backend=backend, return_last_state=True)
    assert _owns_exactly_its_bytes(h_last), backend
    for prompt_len in (2, 40):  # shorter and longer than d_conv
        model = me.accelerate(tiny_model(), backend=backend).eval()
        ids = torch.randint(0, 21, (2, prompt_len), generator=torch.Generator().manual_seed(0))
        _, cache = model.prefill(ids)
        for conv_state, ssm_state in cache:
            assert _owns_exactly_its_bytes(conv_state) and _owns_exactly_its_bytes(ssm_state), backend


def overlapping_states(cache):
    """Both layers' SSM states carved out of one buffer, one element apart: different addresses,
    shared memory (fuzz N9), so a step would write one layer's state into the other's."""
    shape = cache[0][1].shape
    buffer = torch.zeros(2 * cache[0][1].numel())
    first, second = buffer[:-1].view(-1)[:shape.numel()], buffer[1:].view(-1)[:shape.numel()]
    cache[0] = (cache[0][0], first.view(shape).copy_(cache[0][1]))
    cache[1] = (cache[1][0], second.view(shape))


@pytest.mark.parametrize("spoil, message", [
    (lambda c: c.pop(), r"list of 2 \(conv_state, ssm_state\) pairs"),
    (lambda c: c.__setitem__(1, c[1][:1]), r"cache\[1\] must be a \(conv_state, ssm_state\) pair"),
    (lambda c: c.__setitem__(1, (c[1][0], c[1][1][:1])), r"cache\[1\] ssm_state must have shape \(2, 64, 8\)"),
    (lambda c: c.__setitem__(1, (c[1][0][..., :3], c[1][1])), r"cache\[1\] conv_state must have shape \(2, 64, 4\)"),
    (lambda c: c.__setitem__(1, (c[1][0], c[1][1].double())), r"ssm_state must be torch.float32"),
    (lambda c: c.__setitem__(1, (c[1][0].half(), c[1][1])), r"conv_state must be torch.float32"),
    (lambda c: c.__setitem__(1, c[0]), r"cache\[1\] conv_state shares its memory with cache\[0\] conv_state"),
    (lambda c: c.__setitem__(1, (c[1][0], c[1][1][:1].expand(2, -1, -1))), r"cache\[1\] ssm_state repeats one row"),
    (overlapping_states, r"cache\[1\] ssm_state shares its memory with cache\[0\] ssm_state"),
], ids=["layers", "pair", "ssm-batch", "conv-width", "ssm-dtype", "conv-dtype", "shared", "expanded", "overlap"])
def test_step_checks_its_cache_before_touching_it(spoil, message):
    model = tiny_model().eval()
    ids = torch.randint(0, 21, (2, 6), generator=torch.Generator().manual_seed(0))
    _, cache = model.prefill(ids)
    spoil(cache)
    before = [[t.clone() for t in layer_cache] for layer_cache in cache]
    with pytest.raises(ValueError, match=message):
        model.step(ids[:, -1], cache)
    for layer_cache, saved in zip(cache, before):  # nothing was advanced, not even layer 0
        for t, s in zip(layer_cache, saved):
            assert torch.equal(t, s)


def test_step_refuses_a_cache_for_another_batch_size():
    # a cache for one sequence would broadcast silently over a batch of three
    model = tiny_model().eval()
    _, cache = model.prefill(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"conv_state must have shape \(3, 64, 4\).*batch of 3"):
        model.step(torch.tensor([4, 5, 6]), cache)


def carved_from_one_buffer(cache, gap):
    """Every state of the cache copied into views of one flat buffer, layer 1's before layer 0's;
    `gap` elements between one view's last element and the next view's first (-1: the views share
    exactly one element). Returns the new cache."""
    tensors = [t for pair in cache for t in pair]
    order = [2, 3, 0, 1]  # layer 1's conv_state and ssm_state first: the check must look both ways
    sizes = [tensors[i].numel() for i in order]
    buffer = torch.zeros(sum(sizes) + gap * (len(sizes) - 1) + 1)
    views, start = {}, 0
    for i, size in zip(order, sizes):
        views[i] = buffer[start:start + size].view(tensors[i].shape).copy_(tensors[i])
        start += size + gap
    return [(views[0], views[1]), (views[2], views[3])]


def test_step_takes_states_carved_side_by_side_from_one_buffer():
    # a server may keep every layer's states in one allocation: views that touch but do not
    # overlap are separate memory, and step must accept them and compute what it computes on clones
    model = tiny_model().eval()
    ids = torch.randint(0, 21, (2, 6), generator=torch.Generator().manual_seed(0))
    _, cache = model.prefill(ids)
    carved = carved_from_one_buffer(cache, gap=0)
    expected = model.step(ids[:, -1], cache)
    torch.testing.assert_close(model.step(ids[:, -1], carved), expected, rtol=0, atol=0)
    for (conv, ssm), (conv_carved, ssm_carved) in zip(cache, carved):
        assert torch.equal(conv, conv_carved) and torch.equal(ssm, ssm_carved)


def test_step_refuses_states_that_share_a_single_element():
    # the smallest overlap: the last element of one view is the first of the next
    model = tiny_model().eval()
    ids = torch.randint(0, 21, (2, 6), generator=torch.Generator().manual_seed(0))
    _, cache = model.prefill(ids)
    carved = carved_from_one_buffer(cache, gap=-1)
    with pytest.raises(ValueError, match=r"cache\[0\] ssm_state shares its memory with cache\[0\] conv_state"):
        model.step(ids[:, -1], carved)


def test_forward_reads_an_expanded_cache_a_prompt_shared_by_a_batch():
    # forward(cache=) reads the cache and never writes it, so a prompt's cache expand()ed over a
    # batch (one copy in memory) is a valid start for several continuations; only step, which
    # writes in place, needs memory of its own per row
    model = tiny_model().double().eval()
    g = torch.Generator().manual_seed(3)
    prompt, continuations = torch.randint(0, 21, (1, 5), generator=g), torch.randint(0, 21, (3, 4), generator=g)
    with torch.no_grad():
        _, cache = model.prefill(prompt)
        shared = [tuple(t.expand(3, *t.shape[1:]) for t in pair) for pair in cache]
        got = model(continuations, cache=shared)
        for row in range(3):  # the oracle: the prompt and one continuation in one pass
            whole = model(torch.cat([prompt, continuations[row:row + 1]], dim=1))
            torch.testing.assert_close(got[row], whole[0, 5:], rtol=0, atol=1e-12)


def test_loading_in_bf16_keeps_A_log_and_D_fp32_and_adds_the_dt_bias_in_fp32(tmp_path):
    model = tiny_model(seed=3)
    _write_official(tmp_path / "ckpt", model)
    half = pretrained.load(str(tmp_path / "ckpt"), dtype=torch.bfloat16)
    for name, p in half.named_parameters():
        if name.endswith(("A_log", "mixer.D")):  # fp32 and bit-equal to the checkpoint's values
            assert p.dtype == torch.float32 and torch.equal(p, model.state_dict()[name]), name
        else:
            assert p.dtype == torch.bfloat16, name
    assert all(p.dtype == torch.float64 for p in
               pretrained.load(str(tmp_path / "ckpt"), dtype=torch.float64).parameters())
    # Δ = softplus(W·dt + bias). The bias lies near -2..-7 and bf16 keeps 8 significant bits, so a
    # bias added in bf16 moves Δ's argument by up to 2^-8·7 ≈ 0.03. Added in fp32 (the official
    # kernel's delta_bias), only the bf16 product W·dt is rounded: an error of at most about
    # 2^-8·|W|·|dt|, tiny here since the input is small.
    mixer = half.backbone.layers[0].mixer
    x = (0.01 * torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))).bfloat16()
    with torch.no_grad():
        delta = mixer._ssm_inputs(x)[0]
        dt = mixer.x_proj(x)[..., :mixer.cfg.dt_rank].double()  # the input of dt_proj
    W, bias = mixer.dt_proj.weight.double(), mixer.dt_proj.bias.double()
    want = F.softplus(dt @ W.T + bias)  # float64, from the same bf16 values
    bound = 2 ** -7 * (dt.abs() @ W.abs().T) + 1e-6 * want
    assert ((delta.double() - want).abs() <= bound).all()


def test_transformers_layout_keeps_its_vocabulary_unpadded(tmp_path):
    # a transformers fine-tune with added tokens: vocab 100, not a multiple of 8, saved as is
    model = tiny_model(seed=2, vocab_size=100, pad_vocab_size_multiple=1).eval()
    _write_transformers(tmp_path / "hf", model)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["pad_vocab_size_multiple"] = 8  # left over from a conversion: transformers ignores it
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    loaded = pretrained.load(str(tmp_path / "hf"))
    assert loaded.backbone.embedding.weight.shape == (100, 32)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    # the official layout keeps padding to pad_vocab_size_multiple
    official = tiny_model(seed=2, vocab_size=100)
    _write_official(tmp_path / "official", official)
    assert pretrained.load(str(tmp_path / "official")).backbone.embedding.weight.shape == (104, 32)


def test_config_reads_dt_init_use_fast_path_and_d_intermediate():
    official = {"d_model": 32, "n_layer": 1, "vocab_size": 21,
                "ssm_cfg": {"d_state": 8, "dt_init": "constant", "use_fast_path": False}}
    cfg = pretrained.config_from_dict(official)
    assert cfg.dt_init == "constant"
    torch.manual_seed(0)
    weight = MambaLM(cfg).backbone.layers[0].mixer.dt_proj.weight  # the official "constant" init
    assert torch.equal(weight, torch.full_like(weight, cfg.dt_rank ** -0.5))
    assert pretrained.config_from_dict(dict(official, ssm_cfg={"dt_init": "random"})).dt_init == "random"
    assert pretrained.config_from_dict(dict(official, d_intermediate=128)).d_intermediate == 128  # test_hybrid.py
    with pytest.raises(ValueError, match="d_intermediate must be an integer >= 0"):
        pretrained.config_from_dict(dict(official, d_intermediate=-128))
    assert pretrained.config_from_dict(dict(official, d_intermediate=0)).d_model == 32
    with pytest.raises(ValueError, match="dt_init must be 'random' or 'constant'"):
        MambaConfig(dt_init="normal")


def test_generate_reads_the_token_values_once_not_per_token(monkeypatch):
    # reading min/max of the ids waits for a GPU: once for the prompt, never per generated token
    model = tiny_model().eval()
    reads = []
    check = mm._check_ids
    monkeypatch.setattr(mm, "_check_ids", lambda ids, rank, v, read: (read and reads.append(ids.shape)) or
                        check(ids, rank, v, read))
    prompt = torch.randint(0, 21, (2, 5), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, max_new_tokens=6, top_k=1)
    assert reads == [(2, 5)]
    assert torch.equal(out[:, 5:], model(out[:, :-1])[:, 4:, :21].argmax(-1))  # still the greedy tokens
    _, cache = model.prefill(prompt)
    with pytest.raises(ValueError, match=r"\[0, 21\)"):  # a direct step on CPU ids still checks them
        model.step(torch.tensor([3, 21]), cache)


def test_a_training_forward_off_the_cpu_reads_no_token_values(monkeypatch):
    # on a GPU, reading min/max of the ids in every forward waits for the device once per step;
    # the meta device stands in for it (its tensors have no values: a read would raise)
    reads = []
    check = mm._check_ids
    monkeypatch.setattr(mm, "_check_ids", lambda ids, rank, v, read: (read and reads.append(ids.device.type)) or
                        check(ids, rank, v, read))
    with torch.device("meta"):
        model = tiny_model()
        ids = torch.zeros(2, 5, dtype=torch.long)
    logits = model(ids)
    logits.sum().backward()
    assert logits.shape == (2, 5, 24) and reads == []
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 21\), got min 0 and max 21"):
        tiny_model()(torch.tensor([[0, 3, 21]]))  # CPU ids are still checked in every forward
    assert reads == ["cpu"]


def test_more_bad_checkpoints_raise_errors_that_name_the_problem(tmp_path, monkeypatch):
    model = tiny_model()
    # a path that does not exist is "not found", never handed to the hub as a repo id
    monkeypatch.chdir(tmp_path)
    for missing in (str(tmp_path / "typo"), "./typo", "../typo", "~/typo-mamba", "runs/typo/ckpt"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            pretrained.load(missing)
    # config.json that is not an object, or not JSON
    _write_official(tmp_path / "ok", model)
    for text, message in (("[1, 2]", "JSON object.*got a list"), ("{'d_model': 32", "not valid JSON")):
        (tmp_path / "ok" / "config.json").write_text(text)
        with pytest.raises(ValueError, match=message):
            pretrained.load(str(tmp_path / "ok"))
    # a truncated download
    _write_official(tmp_path / "cut", model)
    data = (tmp_path / "cut" / "pytorch_model.bin").read_bytes()
    (tmp_path / "cut" / "pytorch_model.bin").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="pytorch_model.bin could not be read.*truncated"):
        pretrained.load(str(tmp_path / "cut"))


def test_weights_files_that_are_not_state_dicts_raise_errors_that_name_the_problem(tmp_path):
    model = tiny_model()
    for name, content, message in [
        ("list", [1, 2, 3], "pytorch_model.bin must hold a dict of tensor name -> tensor .* got a list"),
        ("tensor", torch.zeros(3), "must hold a dict .* got a Tensor"),
        ("float", {**model.state_dict(), "backbone.layers.1.mixer.D": 1.0},
         r"must hold only tensors; not tensors: \['backbone.layers.1.mixer.D'\]"),
    ]:
        _write_official(tmp_path / name, model)
        torch.save(content, tmp_path / name / "pytorch_model.bin")
        with pytest.raises(ValueError, match=message):
            pretrained.load(str(tmp_path / name))
    with pytest.raises(ValueError, match="needs a folder or a hub id .* got NoneType"):
        pretrained.load(None)
    config = json.loads((tmp_path / "list" / "config.json").read_text())
    for ssm_cfg in (["d_state", 8], "d_state=8"):
        (tmp_path / "list" / "config.json").write_text(json.dumps(dict(config, ssm_cfg=ssm_cfg)))
        with pytest.raises(ValueError, match="ssm_cfg must be an object of fields"):
            pretrained.load(str(tmp_path / "list"))
    if importlib.util.find_spec("safetensors") is not None:
        from safetensors.torch import save_file
        _write_official(tmp_path / "cut_st", model)
        (tmp_path / "cut_st" / "pytorch_model.bin").unlink()
        sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
        save_file(sd, str(tmp_path / "cut_st" / "model.safetensors"))
        data = (tmp_path / "cut_st" / "model.safetensors").read_bytes()
        (tmp_path / "cut_st" / "model.safetensors").write_bytes(data[:len(data) // 2])
        with pytest.raises(ValueError, match="model.safetensors could not be read.*truncated"):
            pretrained.load(str(tmp_path / "cut_st"))


def _shard(folder, model, fmt, save):
    """model's weights as two shards of format fmt and their index, in folder."""
    names = list(model.state_dict())
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.{fmt}"
        save({k: model.state_dict()[k].clone() for k in part}, str(folder / shard))
        weight_map.update({k: shard for k in part})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_a_sharded_checkpoint_loads_with_identical_logits(tmp_path, fmt):
    # transformers' save_pretrained splits a model above max_shard_size into files listed by an index
    if fmt == "safetensors":
        save = pytest.importorskip("safetensors.torch").save_file
    else:
        save = torch.save
    model = tiny_model(seed=5).eval()
    ids = torch.randint(0, 21, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = model(ids)
    _write_official(tmp_path / "sharded", model)
    (tmp_path / "sharded" / "pytorch_model.bin").unlink()
    _shard(tmp_path / "sharded", model, fmt, save)
    loaded = pretrained.load(str(tmp_path / "sharded"))
    torch.testing.assert_close(loaded(ids), expected, rtol=0, atol=0)


def test_with_both_formats_the_readable_one_loads_whole_or_sharded(tmp_path, monkeypatch):
    # safetensors first where the package is installed, sharded or not (a repository converted
    # after a .bin release keeps both); without it, the .bin, sharded or not
    save_file = pytest.importorskip("safetensors.torch").save_file
    ids = torch.randint(0, 21, (1, 7), generator=torch.Generator().manual_seed(1))
    st_model, bin_model = tiny_model(seed=5).eval(), tiny_model(seed=6).eval()
    _write_official(tmp_path / "a", bin_model)  # a whole pytorch_model.bin ...
    _shard(tmp_path / "a", st_model, "safetensors", save_file)  # ... and safetensors shards
    torch.testing.assert_close(pretrained.load(str(tmp_path / "a"))(ids), st_model(ids), rtol=0, atol=0)
    _write_official(tmp_path / "b", bin_model)  # a whole model.safetensors and .bin shards
    (tmp_path / "b" / "pytorch_model.bin").unlink()
    _shard(tmp_path / "b", bin_model, "bin", torch.save)
    save_file({k: v for k, v in st_model.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "b" / "model.safetensors"))
    torch.testing.assert_close(pretrained.load(str(tmp_path / "b"))(ids), st_model(ids), rtol=0, atol=0)
    monkeypatch.setattr(pretrained, "_safetensors_installed", lambda: False)
    for folder in ("a", "b"):
        torch.testing.assert_close(pretrained.load(str(tmp_path / folder))(ids), bin_model(ids),
                                   rtol=0, atol=0)


def test_the_head_is_tied_only_when_the_config_says_so(tmp_path):
    # a tied config and a file whose lm_head differs from the embedding: refuse, never overwrite
    model = tiny_model(tie_embeddings=False)
    _write_official(tmp_path / "tied", model)  # its config.json leaves tie_embeddings at true
    with pytest.raises(ValueError, match="lm_head.weight differs from backbone.embedding.weight"):
        pretrained.load(str(tmp_path / "tied"))
    # an untied config and a file without lm_head.weight: a missing key, not a silent tie
    _write_transformers(tmp_path / "untied", tiny_model())  # stores no lm_head.weight
    cfg = json.loads((tmp_path / "untied" / "config.json").read_text())
    (tmp_path / "untied" / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=False)))
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        pretrained.load(str(tmp_path / "untied"))
    # an untied checkpoint loads untied, with its own head
    (tmp_path / "tied" / "config.json").write_text(json.dumps(
        dict(json.loads((tmp_path / "tied" / "config.json").read_text()), tie_embeddings=False)))
    loaded = pretrained.load(str(tmp_path / "tied"))
    assert loaded.lm_head.weight is not loaded.backbone.embedding.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(top_k=0), "top_k must be an integer >= 1"),
    (dict(top_p=float("nan")), r"top_p must lie in \(0, 1\]"),
])
def test_bad_sampling_arguments_raise_before_any_work(kwargs, message):
    model = tiny_model().eval()
    model.prefill = None  # generate must refuse before it reads the prompt
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=3, **kwargs)
    with pytest.raises(ValueError, match=message):
        mm.sample_next(torch.zeros(1, 5), **kwargs)


def test_compile_decode_makes_generate_call_the_compiled_step_once_per_new_token(monkeypatch):
    # torch.compile stood in for by a wrapper that counts its calls: compile_decode returns the model,
    # whose generate then takes every token after the first from the compiled step, with the tokens
    # of the eager step
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *a: calls.append(1) or fn(*a))
    eager = tiny_model().eval()
    model = copy.deepcopy(eager)
    assert me.compile_decode(model) is model
    prompt = torch.randint(0, 21, (2, 5), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, max_new_tokens=6, top_k=1)
    assert len(calls) == 5 and torch.equal(out, eager.generate(prompt, max_new_tokens=6, top_k=1))


@pytest.mark.parametrize("backend", EAGER_BACKENDS + ["auto"])
def test_selective_scan_refuses_mixed_float64_and_float32(backend):
    for i in range(8):  # any one input in float32, the others float64
        args = scan_inputs()
        args[i] = args[i].float()
        with pytest.raises(ValueError, match="all float64 or all at most float32"):
            me.selective_scan(*args, backend=backend)
    args = scan_inputs()
    args[1] = args[1].long()
    with pytest.raises(ValueError, match="delta must be a floating-point tensor"):
        me.selective_scan(*args, backend=backend)


def test_top_k_keeps_exactly_k_tokens():
    # probabilities ~ (0.02, 0.37, 0.34, 0.01, 0.05, 0.21): top 3 are tokens 1, 2 and 5; 300
    # draws see each of the three (the rarest, 0.21 renormalized to 0.23, is missed with
    # probability 0.77^300)
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0, 2.4]]).repeat(300, 1)
    g = torch.Generator().manual_seed(0)
    for k, kept in ((1, {1}), (2, {1, 2}), (3, {1, 2, 5})):
        assert set(mm.sample_next(logits, top_k=k, generator=g).tolist()) == kept, k


def test_second_derivatives_match_the_float64_reference():
    # a Hessian differentiates the backward itself: plain autograd through the chunks, the
    # recomputing backward (which then records its chunk's gradients) and the eager path must
    # all give the float64 loop's Hessian, never zeros. A is shared by every chunk, and reaches
    # a chunk through the state carried in as well: its Hessian sees a chunk that counts that path twice
    x, delta, A, B, C, D, z, h0 = scan_inputs(b=1, l=5, ed=2, n=2)
    want = torch.autograd.functional.hessian(
        lambda x, A: reference_selective_scan(x, delta, A, B, C, D, z, h0)[0].pow(2).sum(), (x, A))
    for kwargs in (dict(backend="fused", chunk_size=2, recompute=False), dict(backend="sequential"),
                   dict(backend="fused", chunk_size=2, recompute=True)):
        got = torch.autograd.functional.hessian(
            lambda x, A: me.selective_scan(x, delta, A, B, C, D, z, h0, **kwargs).pow(2).sum(), (x, A))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=str(kwargs))


# ------------------------------------------------------------------------------------------------
# Precision and sampling properties that only show off their defaults (bf16 weights, temperature
# other than 1)
# ------------------------------------------------------------------------------------------------

def one_layer_model(arch):
    """A one-layer fp32 Mamba ("mamba") or Mamba-2 ("mamba2"), the same weights every call."""
    torch.manual_seed(0)
    if arch == "mamba":
        return MambaLM(MambaConfig(d_model=32, n_layer=1, vocab_size=21, d_state=8))
    import mamba2_minimal as m2
    return m2.Mamba2LM(m2.Mamba2Config(d_model=32, n_layer=1, vocab_size=21, d_state=8, headdim=16))


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_A_is_computed_in_fp32_in_a_bf16_model(arch):
    # exp in bf16 would round every decay rate to 8 bits (up to 2^-9 relative): a change that the
    # bf16 model's logits, compared at bf16 tolerance, cannot show
    model = one_layer_model(arch)
    mixer = model.to(torch.bfloat16).backbone.layers[0].mixer
    assert mixer.A_log.dtype == torch.bfloat16
    A = mixer.A
    assert A.dtype == torch.float32
    expected = [-math.exp(v) for v in mixer.A_log.double().flatten().tolist()]
    assert A.flatten().double().tolist() == pytest.approx(expected, rel=1e-6)


def test_temperature_divides_the_logits(monkeypatch):
    seen = []
    real = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda probs, n, generator=None: seen.append(probs) or real(probs, n))
    mm.sample_next(torch.tensor([[0.0, 1.0, 2.0]]), temperature=0.5)
    weights = [math.exp(v / 0.5) for v in (0.0, 1.0, 2.0)]  # softmax(logits / T), by hand
    assert seen[0].flatten().tolist() == pytest.approx([w / sum(weights) for w in weights], rel=1e-6)


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_the_residual_stream_is_fp32_in_a_bf16_model(arch):
    # as the official Block with residual_in_fp32 (the default): the sum h + mixer(norm(h)) of many
    # layers is kept in fp32 even when the weights are bf16
    model = one_layer_model(arch)
    block = model.to(torch.bfloat16).backbone.layers[0]
    h = torch.randn(1, 5, 32).bfloat16()
    with torch.no_grad():
        out = block(h)
        mixed = block.mixer(block.norm(h))
    assert out.dtype == torch.float32
    assert torch.equal(out, h.float() + mixed.float())  # the bf16 input is widened before the sum
