"""Specification of mamba2_minimal.py: SSD in its three forms, the block, recurrent inference, and
Mamba-2 checkpoints in both layouts through pretrained.py. Every oracle is written here in float64,
independently."""

import contextlib
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import mamba2_minimal as m2
import pretrained
import pscan
from mamba2_minimal import Mamba2Config, Mamba2LM

SCAN_BACKENDS = [b for b in pscan.BACKENDS if b != "auto"]


# ------------------------------------------------------------------------------------------------
# Oracles
# ------------------------------------------------------------------------------------------------

def reference_ssd(x, dt, A, B, C, D=None, h0=None):
    """The recurrence one token and one head at a time, in float64:
    h_t = exp(Δ_t·A_k)·h_{t-1} + Δ_t·x_t·B_tᵀ,  y_t = h_t·C_t + D_k·x_t, head k reading group k // (H/G)."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    per_group = H // G
    states = [torch.zeros(b, P, N, dtype=torch.float64) if h0 is None else h0[:, k].double() for k in range(H)]
    ys = torch.zeros(b, L, H, P, dtype=torch.float64)
    for t in range(L):
        for k in range(H):
            g = k // per_group
            states[k] = (torch.exp(dt[:, t, k] * A[k])[:, None, None] * states[k]
                         + dt[:, t, k, None, None] * x[:, t, k, :, None] * B[:, t, g, None, :])
            ys[:, t, k] = (states[k] * C[:, t, g, None, :]).sum(-1)
            if D is not None:
                ys[:, t, k] = ys[:, t, k] + D[k].double() * x[:, t, k]
    return ys, torch.stack(states, dim=1)


def ssd_inputs(b=2, L=13, H=4, P=3, G=2, N=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, L, H, P, generator=g, dtype=dtype)
    dt = F.softplus(torch.randn(b, L, H, generator=g, dtype=dtype) - 1)
    A = -torch.rand(H, generator=g, dtype=dtype) * 3 - 0.1
    B = torch.randn(b, L, G, N, generator=g, dtype=dtype)
    C = torch.randn(b, L, G, N, generator=g, dtype=dtype)
    D = torch.randn(H, generator=g, dtype=dtype)
    h0 = torch.randn(b, H, P, N, generator=g, dtype=dtype)
    return x, dt, A, B, C, D, h0


def outputs_and_gradients(fn, inputs):
    """fn(*inputs) -> (y, h_last) or y; returns the outputs and d(loss)/d(every input), the loss
    being a fixed random weighting of every output, so each output element gets its own weight."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    grads = torch.autograd.grad(loss, inputs)
    return [o.detach() for o in outs], grads


def assert_all_close(got, expected, atol=1e-10, rtol=1e-9, names=None):
    for i, (a, b) in enumerate(zip(got, expected)):
        name = names[i] if names else i
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


NAMES = ["x", "dt", "A", "B", "C", "D", "h0"]


# ------------------------------------------------------------------------------------------------
# 1-3. SSD: the loop, the quadratic form, the chunked form
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("G", [1, 2, 4])
def test_ssd_sequential_matches_the_per_head_reference(G):
    x, dt, A, B, C, D, h0 = ssd_inputs(G=G)
    y, h = m2.ssd_sequential(x, dt, A, B, C, D, h0, return_last_state=True)
    y_ref, h_ref = reference_ssd(x, dt, A, B, C, D, h0)
    assert_all_close([y, h], [y_ref, h_ref])


def test_one_step_by_hand():
    # one head, P = N = 1: h_0 = exp(Δ·A)·h0 + Δ·x·B, y_0 = h_0·C + D·x
    x, dt, A, B, C, D, h0 = 2.0, 0.5, -1.0, 3.0, 4.0, 0.25, 1.5
    h = math.exp(dt * A) * h0 + dt * x * B
    t = lambda v, shape: torch.full(shape, v, dtype=torch.float64)
    args = (t(x, (1, 1, 1, 1)), t(dt, (1, 1, 1)), t(A, (1,)), t(B, (1, 1, 1, 1)), t(C, (1, 1, 1, 1)))
    for y, h_last in (m2.ssd(*args, chunk_size=4, D=t(D, (1,)), h0=t(h0, (1, 1, 1, 1)), return_last_state=True),
                      m2.ssd_sequential(*args, D=t(D, (1,)), h0=t(h0, (1, 1, 1, 1)), return_last_state=True)):
        assert y.item() == pytest.approx(h * C + D * x, rel=1e-12)
        assert h_last.item() == pytest.approx(h, rel=1e-12)


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("L", [1, 6, 17])
def test_quadratic_form_matches_the_loop_forward_and_gradients(L, G):
    x, dt, A, B, C, D, _ = ssd_inputs(L=L, G=G)
    got = outputs_and_gradients(m2.ssd_quadratic, (x, dt, A, B, C, D))
    expected = outputs_and_gradients(lambda *a: reference_ssd(*a)[0], (x, dt, A, B, C, D))
    assert_all_close(got[0] + list(got[1]), expected[0] + list(expected[1]))


# (L, chunk_size, G): one partial chunk, exact multiples, several chunks with a partial last one
SHAPES = [(1, 4, 1), (5, 16, 2), (16, 4, 1), (13, 4, 2), (37, 8, 4), (37, 5, 2)]


@pytest.mark.parametrize("L,chunk_size,G", SHAPES)
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunked_ssd_matches_the_loop_forward_final_state_and_every_gradient(L, chunk_size, G, with_h0):
    x, dt, A, B, C, D, h0 = ssd_inputs(L=L, G=G)
    inputs = (x, dt, A, B, C, D, h0) if with_h0 else (x, dt, A, B, C, D)

    def chunked(*a):
        return m2.ssd(*a[:5], chunk_size=chunk_size, D=a[5], h0=a[6] if with_h0 else None,
                      return_last_state=True)

    got = outputs_and_gradients(chunked, inputs)
    expected = outputs_and_gradients(lambda *a: reference_ssd(*a), inputs)
    assert_all_close(got[0] + list(got[1]), expected[0] + list(expected[1]),
                     names=["y", "h_last"] + ["grad " + n for n in NAMES])


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns inside the with block."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
        return out


def test_a_sequence_shorter_than_a_chunk_is_one_chunk_of_its_own_length():
    # the official chunk_size is 256: a prompt of 5 tokens must not be padded to a 256 x 256 chunk
    x, dt, A, B, C, D, h0 = ssd_inputs(L=5, G=2)
    with LargestTensor() as largest:
        got = m2.ssd(x, dt, A, B, C, 512, D, h0, return_last_state=True)
    assert_all_close(got, reference_ssd(x, dt, A, B, C, D, h0))
    assert largest.numel < 512 * 512, largest.numel

def check_ssd_on_device(device):
    """Chunked SSD in fp32 on `device` against the float64 loop on the CPU: outputs, final state
    and every gradient, with h0, three chunks (the last one partial) and two groups."""
    inputs = [t.requires_grad_() for t in ssd_inputs(L=21, G=2)]  # float64, on the CPU
    moved = [t.detach().float().to(device).requires_grad_() for t in inputs]
    expected = reference_ssd(*inputs)
    got = m2.ssd(*moved[:5], 8, moved[5], moved[6], return_last_state=True)
    assert got[0].device.type == torch.device(device).type
    weights = [torch.randn_like(t) for t in expected]  # the same weighting of every output on both sides
    grads_expected = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, expected)), inputs)
    grads_got = torch.autograd.grad(sum((w.float().to(device) * t).sum() for w, t in zip(weights, got)), moved)
    assert_all_close([t.detach().double().cpu() for t in list(got) + list(grads_got)],
                     list(expected) + list(grads_expected), atol=1e-4, rtol=1e-4,
                     names=["y", "h_last"] + ["grad " + n for n in NAMES])


def test_chunked_ssd_in_fp32_on_the_cpu_matches_the_float64_loop():
    check_ssd_on_device("cpu")  # the CUDA test below, where every machine can run it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_chunked_ssd_and_model_match_the_float64_cpu_reference():
    check_ssd_on_device("cuda")
    torch.manual_seed(0)
    model = Mamba2LM(small_config()).double().eval()
    ids = torch.randint(0, 50, (2, 19))
    with torch.no_grad():
        expected = model(ids)  # float64 on the CPU, checked against the plain reference above
        got = model.float().cuda()(ids.cuda())
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("L,chunk_size", [(5, 16), (16, 16), (17, 16), (40, 8)])
def test_chunked_ssd_without_h0_or_final_state_matches_the_loop(L, chunk_size):
    # no h0 and no final state asked for: with one chunk (L <= chunk_size, the training case)
    # ssd returns after step 1; with several, steps 2-4 run without a carried-in state
    x, dt, A, B, C, D, _ = ssd_inputs(L=L, G=2)
    got = outputs_and_gradients(lambda *a: m2.ssd(*a[:5], chunk_size, a[5]), (x, dt, A, B, C, D))
    expected = outputs_and_gradients(lambda *a: reference_ssd(*a)[0], (x, dt, A, B, C, D))
    assert_all_close(got[0] + list(got[1]), expected[0] + list(expected[1]))


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_chunk_summaries_scan_through_every_pscan_backend(backend):
    x, dt, A, B, C, D, h0 = ssd_inputs(L=37, G=2)  # 10 chunks of 4: the scan across chunks matters
    got = outputs_and_gradients(lambda *a: m2.ssd(*a[:5], 4, a[5], a[6], True, scan_backend=backend),
                                (x, dt, A, B, C, D, h0))
    expected = outputs_and_gradients(lambda *a: reference_ssd(*a), (x, dt, A, B, C, D, h0))
    assert_all_close(got[0] + list(got[1]), expected[0] + list(expected[1]))


def test_chunked_ssd_in_fp32_and_bf16_is_computed_in_fp32():
    x, dt, A, B, C, D, h0 = ssd_inputs(L=40, G=2)
    y_ref, h_ref = reference_ssd(x, dt, A, B, C, D, h0)
    y, h = m2.ssd(*(t.float() for t in (x, dt, A, B, C)), 16, D.float(), h0.float(), True)
    assert y.dtype == h.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h.double(), h_ref, atol=1e-4, rtol=1e-4)
    y16, h16 = m2.ssd(x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), 16, D, h0, True)
    assert y16.dtype == torch.bfloat16 and h16.dtype == torch.float64  # the state keeps the widest dtype


def test_chunked_ssd_under_bf16_autocast_computes_the_state_in_fp32():
    # autocast runs matmuls in bf16 (on CUDA in every training step of the trainer); the chunk
    # states of step 2 would come out in bf16 next to fp32 decays, and sum in 8-bit mantissas
    inputs = [t.requires_grad_() for t in ssd_inputs(L=21, G=2)]  # three chunks of 8, the last partial; h0
    expected = reference_ssd(*inputs)
    moved = [t.detach().float().requires_grad_() for t in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m2.ssd(*moved[:5], 8, moved[5], moved[6], return_last_state=True)
    assert got[0].dtype == got[1].dtype == torch.float32
    weights = [torch.randn_like(t) for t in expected]  # backward outside autocast, as in training
    grads_expected = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, expected)), inputs)
    grads_got = torch.autograd.grad(sum((w.float() * t).sum() for w, t in zip(weights, got)), moved)
    assert_all_close([t.detach().double() for t in list(got) + list(grads_got)],
                     list(expected) + list(grads_expected), atol=1e-4, rtol=1e-4,
                     names=["y", "h_last"] + ["grad " + n for n in NAMES])


def test_final_state_owns_only_its_storage():
    x, dt, A, B, C, D, h0 = ssd_inputs(L=37)
    _, h = m2.ssd(x, dt, A, B, C, 4, D, h0, return_last_state=True)
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()


# ------------------------------------------------------------------------------------------------
# Segment sums: the stable form and the difference of two cumsums
# ------------------------------------------------------------------------------------------------

def direct_segment_sums(a):
    """[t, s] = a_{s+1} + ... + a_t summed term by term in float64; -inf above the diagonal."""
    T = a.shape[-1]
    out = torch.full((T, T), -math.inf, dtype=torch.float64)
    for t in range(T):
        for s in range(t + 1):
            out[t, s] = a[s + 1:t + 1].double().sum()
    return out


def segsum_by_difference(a):
    """The shortcut segsum avoids: S_t - S_s of the prefix sums S, -inf above the diagonal."""
    S = a.cumsum(-1)  # (..., T)
    causal = torch.ones(a.shape[-1], a.shape[-1], dtype=torch.bool).tril()
    return (S[..., :, None] - S[..., None, :]).masked_fill(~causal, -torch.inf)


def test_segsum_is_the_sum_over_each_segment():
    a = -torch.rand(9, dtype=torch.float64)
    torch.testing.assert_close(m2.segsum(a), direct_segment_sums(a), atol=1e-14, rtol=0)
    torch.testing.assert_close(segsum_by_difference(a), direct_segment_sums(a), atol=1e-14, rtol=0)
    batched = m2.segsum(torch.stack([a, 2 * a]))  # leading dims are batch dims
    torch.testing.assert_close(batched[1], direct_segment_sums(2 * a), atol=1e-14, rtol=0)


def test_differences_of_cumsums_cancel_catastrophically_in_long_low_precision_runs():
    # T = 2048 log-decays in (-1, 0): the prefix sums reach about -1000, where one fp32 ulp is 6e-5
    T = 2048
    a = -torch.rand(T, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = torch.exp(m2.segsum(a))  # float64, the mask M (segsum checked against direct sums above)
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def error(segsum_fn, dtype):
        return (torch.exp(segsum_fn(a.to(dtype)).double()) - exact)[causal].abs().max().item()

    errors = {(fn.__name__, str(dtype)): error(fn, dtype) for dtype in (torch.float32, torch.bfloat16)
              for fn in (m2.segsum, segsum_by_difference)}
    print("\nlargest error of the decay mask, T = 2048:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert errors["segsum", "torch.float32"] < 1e-6  # measured 3.3e-8
    assert errors["segsum_by_difference", "torch.float32"] > 1e-5  # measured 5.3e-5
    assert errors["segsum", "torch.bfloat16"] < 1e-2  # only a's own rounding to bf16: measured 2.5e-3
    assert errors["segsum_by_difference", "torch.bfloat16"] > 0.5  # noise: measured 0.98


def test_a_long_chunk_in_fp32_stays_accurate():
    # one chunk of 1024 steps: what the stable segsum buys inside ssd (by differences: 1.4e-5)
    x, dt, A, B, C, D, _ = ssd_inputs(b=1, L=1024, H=2, P=4, G=1, N=8)
    y_ref = reference_ssd(x, dt, A - 0.5, B, C)[0]  # the float64 loop written in this file
    y = m2.ssd(*(t.float() for t in (x, dt, A - 0.5, B, C)), chunk_size=1024)
    assert (y.double() - y_ref).abs().max() / y_ref.abs().max() < 1e-6


# ------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------

def _bad(change):
    x, dt, A, B, C, D, h0 = ssd_inputs(L=7, G=2)
    kw = dict(x=x, dt=dt, A=A, B=B, C=C, chunk_size=4, D=D, h0=h0)
    kw.update(change(kw))
    return kw


@pytest.mark.parametrize("change,message", [
    (lambda k: {"x": k["x"][0]}, r"x must have shape \(b, L, H, P\)"),
    (lambda k: {"x": k["x"][:, :0], "dt": k["dt"][:, :0], "B": k["B"][:, :0], "C": k["C"][:, :0]},
     "sequence length must be at least 1"),
    (lambda k: {"dt": k["dt"][:, :-1]}, r"dt must have shape \(2, 7, 4\)"),
    (lambda k: {"A": k["A"][:3]}, r"A must have shape \(4,\)"),
    (lambda k: {"B": k["B"][:, :, :1].expand(2, 7, 3, 5)}, "multiple of the number of groups G = 3"),
    (lambda k: {"B": k["B"][:, :5]}, r"B must have shape \(b, L, G, N\) = \(2, 7, G, N\)"),
    (lambda k: {"C": k["C"][..., :4]}, r"C must have shape \(2, 7, 2, 5\)"),
    (lambda k: {"D": k["D"][:2]}, r"D must have shape \(4,\)"),
    (lambda k: {"h0": k["h0"][..., :4]}, r"h0 must have shape \(2, 4, 3, 5\)"),
    (lambda k: {"chunk_size": 0}, "chunk_size must be a positive integer"),
    (lambda k: {"chunk_size": 2.0}, "chunk_size must be a positive integer"),
    (lambda k: {"x": k["x"].long()}, "x must be a floating-point tensor"),
    (lambda k: {"B": k["B"][:, :, :0], "C": k["C"][:, :, :0]}, "B and C must have at least one group G"),
])
def test_ssd_bad_inputs_raise_errors_that_name_the_expectation(change, message):
    with pytest.raises(ValueError, match=message):
        m2.ssd(**_bad(change))


def test_ssd_unknown_scan_backend_raises():
    x, dt, A, B, C, D, h0 = ssd_inputs()
    with pytest.raises(ValueError, match="scan_backend must be one of"):
        m2.ssd(x, dt, A, B, C, 4, scan_backend="blelloch")


# ------------------------------------------------------------------------------------------------
# 4. The block and the model
# ------------------------------------------------------------------------------------------------

def small_config(**kw):
    base = dict(d_model=32, n_layer=2, vocab_size=50, d_state=8, headdim=16, ngroups=2, chunk_size=8)
    base.update(kw)
    return Mamba2Config(**base)


def reference_mixer(mixer, u, p=None):
    """The official Mamba2 forward written out plainly in float64 from the module's weights (or
    from p, a dict of them under the state_dict's names, to take gradients with respect to):
    in_proj -> [z0, x0, z, xBC, dt], nn.Conv1d-style causal conv + SiLU, Δ = softplus(dt + dt_bias)
    clamped to dt_limit, the SSD loop, + D·x, y·SiLU(z) then RMSNorm per group, [SiLU(z0)·x0, y], out_proj."""
    cfg = mixer.cfg
    p = {k: v.double() for k, v in (p or mixer.state_dict()).items()}
    u = u.double()
    b, L, _ = u.shape
    d_inner, G, N = cfg.expand * cfg.d_model, cfg.ngroups, cfg.d_state
    d_ssm = cfg.d_ssm
    H = d_ssm // cfg.headdim
    d_mlp = d_inner - d_ssm
    zxbcdt = u @ p["in_proj.weight"].T + (p["in_proj.bias"] if cfg.bias else 0)
    z0, x0, z, xBC, dt = zxbcdt.split([d_mlp, d_mlp, d_ssm, d_ssm + 2 * G * N, H], dim=-1)
    conv = F.conv1d(xBC.transpose(1, 2), p["conv1d.weight"], p.get("conv1d.bias"),
                    padding=cfg.d_conv - 1, groups=xBC.shape[-1])[..., :L]
    x, B, C = F.silu(conv.transpose(1, 2)).split([d_ssm, G * N, G * N], dim=-1)
    delta = F.softplus(dt + p["dt_bias"]).clamp(*cfg.dt_limit)
    A = -torch.exp(p["A_log"])
    y, _ = reference_ssd(x.reshape(b, L, H, -1), delta, A, B.reshape(b, L, G, N), C.reshape(b, L, G, N), p["D"])
    y = y.reshape(b, L, d_ssm) * F.silu(z)
    y = y.reshape(b, L, G, -1)
    y = (y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + cfg.norm_epsilon)).reshape(b, L, d_ssm) * p["norm.weight"]
    if d_mlp:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    return y @ p["out_proj.weight"].T + (p["out_proj.bias"] if cfg.bias else 0)


def perturbed_mixer(cfg):
    """A float64 mixer whose parameters are moved off their init values, which hide mistakes."""
    torch.manual_seed(0)
    mixer = m2.Mamba2Mixer(cfg).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.05))
    return mixer


def reference_with_gradients(mixer, u):
    """reference_mixer in float64 on u's values, with a random weighting of its output and the
    gradients of that weighting with respect to u and every parameter (in named_parameters order)."""
    u64 = u.detach().double().requires_grad_()
    weights = {k: v.detach().double().requires_grad_() for k, v in mixer.state_dict().items()}
    expected = reference_mixer(mixer, u64, weights)
    grad_out = torch.randn_like(expected)
    names = [name for name, _ in mixer.named_parameters()]
    return expected, grad_out, torch.autograd.grad(expected, [u64] + [weights[n] for n in names], grad_out)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(ngroups=1, chunk_size=4, d_conv=3),
    dict(d_ssm=32, ngroups=1),  # a gated MLP on the other d_inner - d_ssm channels
    dict(dt_limit=(0.05, 0.5), bias=True, conv_bias=False, d_state=4),
])
def test_mixer_matches_a_plain_float64_reference(kw):
    mixer = perturbed_mixer(small_config(**kw))
    u = torch.randn(2, 19, mixer.cfg.d_model, dtype=torch.float64)
    torch.testing.assert_close(mixer(u), reference_mixer(mixer, u), atol=1e-10, rtol=1e-9)


@pytest.mark.compile
def test_compiled_mixer_matches_the_float64_reference_forward_and_every_gradient(monkeypatch):
    # chunks of 8 steps: L = 8, one chunk, the training case, then the same shape again, which
    # must compile nothing new; L = 5, one padded chunk; L = 19, three chunks, compiled as
    # separate graphs around the scan across chunks. Then fp32 over two chunks, the shape at
    # which steps 1 and 2 of ssd() in one compiled graph made a backward that corrupted memory
    # on torch 2.13's CPU compiler (hence ssd()'s graph break between them).
    compiled_calls = []
    real = m2._compiled_forward
    monkeypatch.setattr(m2, "_compiled_forward", lambda device: compiled_calls.append(device) or real(device))
    mixer = perturbed_mixer(small_config(compile_mixer=True))
    names = ["y", "u"] + [name for name, _ in mixer.named_parameters()]
    for i, (L, dtype) in enumerate([(8, torch.float64), (8, torch.float64), (5, torch.float64),
                                    (19, torch.float64), (16, torch.float32)]):
        mixer.to(dtype)
        u = torch.randn(2, L, 32, dtype=dtype, requires_grad=True)
        expected, grad_out, expected_grads = reference_with_gradients(mixer, u)
        again = i == 1 and hasattr(torch.compiler, "set_stance")  # set_stance: torch >= 2.6
        with torch.compiler.set_stance("fail_on_recompile") if again else contextlib.nullcontext():
            got = mixer(u)
            got_grads = torch.autograd.grad(got, [u] + list(mixer.parameters()), grad_out.to(dtype))
        tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-4)
        assert_all_close([t.double() for t in [got] + list(got_grads)], [expected] + list(expected_grads),
                         names=names, **tol)
    assert compiled_calls == ["cpu"] * 5  # every call went through torch.compile


def test_module_tree_and_shapes_follow_the_official_mamba2():
    cfg = small_config(d_model=48, headdim=24, ngroups=2, d_state=8)  # d_inner 96, 4 heads
    model = Mamba2LM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    H, conv_dim = 4, 96 + 2 * 2 * 8
    assert shapes["backbone.embedding.weight"] == (56, 48)  # 50 padded to a multiple of 8
    assert shapes["backbone.layers.0.norm.weight"] == (48,)
    assert shapes["backbone.layers.1.mixer.in_proj.weight"] == (2 * 96 + 2 * 2 * 8 + H, 48)
    assert shapes["backbone.layers.1.mixer.conv1d.weight"] == (conv_dim, 1, 4)
    assert shapes["backbone.layers.1.mixer.conv1d.bias"] == (conv_dim,)
    for name in ("dt_bias", "A_log", "D"):
        assert shapes[f"backbone.layers.1.mixer.{name}"] == (H,)
    assert shapes["backbone.layers.1.mixer.norm.weight"] == (96,)
    assert shapes["backbone.layers.1.mixer.out_proj.weight"] == (48, 96)
    assert shapes["backbone.norm_f.weight"] == (48,)
    assert model.lm_head.weight is model.backbone.embedding.weight


def test_official_initialization():
    torch.manual_seed(0)
    cfg = Mamba2Config(d_model=64, n_layer=9, vocab_size=50, headdim=4, A_init_range=(2, 5), dt_min=0.01,
                       dt_max=0.2, dt_init_floor=0.02)  # 32 heads
    model = Mamba2LM(cfg)
    A = torch.exp(torch.cat([layer.mixer.A_log for layer in model.backbone.layers]))  # 288 heads
    assert A.min() >= 2 and A.max() <= 5 and abs(A.mean().item() - 3.5) < 0.15  # uniform in A_init_range
    dt = F.softplus(torch.cat([layer.mixer.dt_bias for layer in model.backbone.layers]))
    assert dt.min() >= 0.02 - 1e-6 and dt.max() <= 0.2 + 1e-6
    # log-uniform in [0.01, 0.2], floored at 0.02: P(floor) = P(> 0.1) = log 2 / log 20 = 0.23
    at_floor = (dt < 0.02 + 1e-6).float().mean().item()
    assert abs(at_floor - 0.23) < 0.08 and abs((dt > 0.1).float().mean().item() - 0.23) < 0.08
    for layer in model.backbone.layers:
        mixer = layer.mixer
        assert torch.equal(mixer.D, torch.ones_like(mixer.D))
        bound = 1 / math.sqrt(mixer.out_proj.in_features)  # kaiming_uniform(a=√5), then / √n_layer
        w = mixer.out_proj.weight.abs().max()
        assert bound / 3 * 0.9 < w <= bound / 3
    emb = model.backbone.embedding.weight
    assert abs(emb.std().item() - 0.02) < 0.002


def test_optim_groups_exempt_A_log_D_dt_bias_norms_and_biases():
    model = Mamba2LM(small_config(bias=True))
    decay, no_decay = model.optim_groups(0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no = {names[id(p)].split(".")[-2] + "." + names[id(p)].split(".")[-1] for p in no_decay["params"]}
    yes = {names[id(p)] for p in decay["params"]}
    for expected in ("mixer.A_log", "mixer.D", "mixer.dt_bias", "norm.weight", "in_proj.bias",
                     "conv1d.bias", "out_proj.bias", "norm_f.weight"):
        assert expected in no, expected
    assert all(n.endswith(("in_proj.weight", "out_proj.weight", "conv1d.weight", "embedding.weight"))
               for n in yes), yes
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("kw, message", [
    (dict(dt_limit=(0.0, 1.0, 2.0)), r"dt_limit must be a pair of numbers \(low, high\), got \(0.0, 1.0, 2.0\)"),
    (dict(dt_limit=(0.2, 0.1)), r"dt_limit must be \(low, high\) with 0 <= low <= high"),  # clamped every Δ to 0.1
    (dict(dt_limit=None), "dt_limit must be a pair of numbers"),
    (dict(A_init_range=5), "A_init_range must be a pair of numbers"),
    (dict(A_init_range=(True, 16)), "A_init_range must be a pair of numbers"),  # a bool is no rate
    (dict(dt_limit=(0.0, False)), "dt_limit must be a pair of numbers"),
    # official Mamba2: A_init_range[0] > 0 and A_init_range[1] >= A_init_range[0]
    (dict(A_init_range=(0, 16)), r"A_init_range must be \(low, high\) with 0 < low <= high"),  # A = 0 never decays
    (dict(A_init_range=(16, 1)), r"A_init_range must be \(low, high\) with 0 < low <= high"),
    (dict(A_init_range=(1, float("inf"))), r"A_init_range must be \(low, high\) with 0 < low <= high < inf"),
    (dict(d_ssm=16.0), "d_ssm = 16.0 must be a multiple of headdim"),
    (dict(norm_epsilon=-1.0), "norm_epsilon must be positive"),  # NaN logits
    (dict(norm_epsilon=None), "norm_epsilon must be positive"),  # config.json's null: was a TypeError
    (dict(norm_epsilon="1e-5"), "norm_epsilon must be positive"),
])
def test_config_rejects_malformed_fields(kw, message):
    with pytest.raises(ValueError, match=message):
        small_config(**kw)


def test_a_pair_given_as_a_list_is_kept_as_a_tuple():
    # config.json holds lists; a config keeps its pairs as tuples whatever it was given, so that
    # a config read from JSON equals the same config written in code
    cfg = small_config(dt_limit=[0.0, 1.0], A_init_range=[2, 8])
    assert cfg.dt_limit == (0.0, 1.0) and cfg.A_init_range == (2, 8)
    assert cfg == small_config(dt_limit=(0.0, 1.0), A_init_range=(2, 8))


def test_config_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="must be a multiple of headdim"):
        small_config(headdim=24)
    with pytest.raises(ValueError, match="multiple of ngroups = 3"):
        small_config(ngroups=3)
    with pytest.raises(ValueError, match="Mamba2Config.d_state must be a positive integer"):
        small_config(d_state=0)
    with pytest.raises(ValueError, match="scan_backend must be one of"):
        small_config(scan_backend="fast")
    with pytest.raises(ValueError, match="compile_mixer must be True or False"):
        small_config(compile_mixer="yes")


def test_bf16_weights_run_close_to_fp32():
    torch.manual_seed(0)
    model = Mamba2LM(small_config())
    ids = torch.randint(0, 50, (2, 21))
    ref = model(ids)
    half = model.to(torch.bfloat16)(ids)
    assert half.dtype == torch.bfloat16
    assert (half.float() - ref).abs().max() < 0.05 * ref.abs().max()


# ------------------------------------------------------------------------------------------------
# 5. Recurrent inference
# ------------------------------------------------------------------------------------------------

def float64_model(seed=0, **kw):
    torch.manual_seed(seed)
    model = Mamba2LM(small_config(**kw)).double().eval()
    with torch.no_grad():  # off the init values: D = 1 and tiny Δ hide mistakes
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "A_log", "D", "conv1d.bias")):
                p.add_(torch.randn_like(p) * 0.5)
    return model


@pytest.mark.parametrize("prompt_len", [1, 3, 4, 9, 16])
def test_prefill_then_steps_reproduce_the_parallel_forward(prompt_len):
    model = float64_model()
    ids = torch.randint(0, 50, (2, 24))
    with torch.no_grad():
        full = model(ids)  # (2, 24, V)
    logits, cache = model.prefill(ids[:, :prompt_len])
    torch.testing.assert_close(logits, full[:, :prompt_len], atol=1e-12, rtol=1e-10)
    for t in range(prompt_len, ids.shape[1]):
        torch.testing.assert_close(model.step(ids[:, t], cache), full[:, t], atol=1e-12, rtol=1e-10)


def test_prefill_under_bf16_autocast_follows_the_float64_loop(monkeypatch):
    # a prompt of three chunks: prefill asks ssd() for the final state, so steps 2-4 run
    model = float64_model()
    ids = torch.randint(0, 50, (2, 21), generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, cache = model.float().prefill(ids)
    assert all(ssm.dtype == torch.float32 for _, ssm in cache)

    def loop(x, dt, A, B, C, chunk_size, D=None, h0=None, return_last_state=False, scan_backend="auto"):
        y, h = reference_ssd(x, dt, A, B, C, D, h0)
        return (y, h) if return_last_state else y

    monkeypatch.setattr(m2, "ssd", loop)  # the oracle: the per-head float64 loop in every layer
    expected, expected_cache = model.double().prefill(ids)
    # bf16 matmuls around the SSD (in_proj, out_proj, the head) keep about 3 significant digits
    assert (logits.double() - expected).abs().max() < 0.03 * expected.abs().max()
    for (_, ssm), (_, ssm_ref) in zip(cache, expected_cache):
        assert (ssm.double() - ssm_ref).abs().max() < 0.03 * ssm_ref.abs().max()


@pytest.mark.parametrize("kw", [dict(ngroups=1, d_conv=2), dict(d_ssm=32, ngroups=1), dict(dt_limit=(0.1, 0.3))])
def test_recurrent_step_follows_the_forward_for_other_configs(kw):
    model = float64_model(**kw)
    ids = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        full = model(ids)
    _, cache = model.prefill(ids[:, :5])
    for t in range(5, 12):
        torch.testing.assert_close(model.step(ids[:, t], cache), full[:, t], atol=1e-12, rtol=1e-10)


def test_prefill_cache_owns_only_its_state():
    model = float64_model()
    cfg = model.cfg
    _, cache = model.prefill(torch.randint(0, 50, (2, 30)))
    assert len(cache) == cfg.n_layer
    for conv_state, ssm_state in cache:
        assert tuple(conv_state.shape) == (2, cfg.conv_dim, cfg.d_conv)
        assert tuple(ssm_state.shape) == (2, cfg.nheads, cfg.headdim, cfg.d_state)
        for t in (conv_state, ssm_state):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_step_rejects_a_cache_that_does_not_fit():
    model = float64_model()
    _, cache = model.prefill(torch.randint(0, 50, (2, 5)))
    token = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="cache must be a list of 2"):
        model.step(token, cache[:1])
    with pytest.raises(ValueError, match=r"conv_state must have shape \(3, 96, 4\)"):
        model.step(torch.zeros(3, dtype=torch.long), cache)
    bad = [cache[0], (cache[1][0], cache[1][1][..., :4])]
    with pytest.raises(ValueError, match=r"cache\[1\] ssm_state must have shape"):
        model.step(token, bad)
    with pytest.raises(ValueError, match=r"cache\[0\] conv_state must have shape"):
        model.step(token, [(cache[0][0][:, :5], cache[0][1]), cache[1]])
    with pytest.raises(ValueError, match="token ids must lie in"):
        model.step(torch.full((2,), 50), cache)
    with pytest.raises(ValueError, match=r"cache\[1\] conv_state shares its memory with cache\[0\]"):
        model.step(token, [cache[0], cache[0]])  # as [pair] * n_layer builds it: wrong logits, silently


def test_greedy_generate_equals_teacher_forced_argmax():
    model = float64_model()
    prompt = torch.randint(0, 50, (2, 6))
    out = model.generate(prompt, 12, top_k=1)
    assert out.shape == (2, 18) and torch.equal(out[:, :6], prompt)
    with torch.no_grad():
        logits = model(out[:, :-1])[..., :50]  # teacher-forced on the generated text
    assert torch.equal(out[:, 6:], logits[:, 5:].argmax(-1))
    streamed = torch.stack(list(model.generate_stream(prompt, 12, top_k=1)), dim=1)
    assert torch.equal(streamed, out[:, 6:])


# ------------------------------------------------------------------------------------------------
# Loading Mamba-2 checkpoints (pretrained.py)
# ------------------------------------------------------------------------------------------------

def write_checkpoint(folder, config, state_dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(state_dict, folder / "pytorch_model.bin")
    return str(folder)


OFFICIAL_CONFIG = {"d_model": 32, "d_intermediate": 0, "n_layer": 2, "vocab_size": 50,
                   "ssm_cfg": {"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": 2, "chunk_size": 8},
                   "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
                   "fused_add_norm": True, "pad_vocab_size_multiple": 16, "tie_embeddings": True}

HF_CONFIG = {"model_type": "mamba2", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 50,
             "num_heads": 4, "head_dim": 16, "state_size": 8, "n_groups": 2, "expand": 2, "conv_kernel": 4,
             "chunk_size": 8, "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
             "time_step_limit": [0.0, {"__float__": "Infinity"}], "rms_norm": True,
             "tie_word_embeddings": True, "residual_in_fp32": True}


def test_official_layout_loads_strictly_with_a_padded_vocab(tmp_path):
    torch.manual_seed(0)
    cfg = small_config(pad_vocab_size_multiple=16)  # the model OFFICIAL_CONFIG describes
    src = Mamba2LM(cfg).eval()
    assert src.lm_head.weight.shape[0] == 64
    folder = write_checkpoint(tmp_path / "official", OFFICIAL_CONFIG, src.state_dict())
    model = pretrained.load(folder, cls=Mamba2LM)
    assert model.cfg.ngroups == 2 and model.cfg.padded_vocab_size == 64
    for k, v in src.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    ids = torch.randint(0, 50, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), src(ids), atol=0, rtol=0)


def test_loading_in_bf16_keeps_A_log_and_D_in_fp32_and_rejects_bad_json(tmp_path):
    # as Mamba-1's loader: rounding A_log to bf16 would move every head's decay rate
    torch.manual_seed(0)
    src = Mamba2LM(small_config(pad_vocab_size_multiple=16))
    with torch.no_grad():
        for layer in src.backbone.layers:  # values that bf16 cannot hold exactly
            layer.mixer.A_log.copy_(torch.linspace(0.1234567, 2.7654321, layer.mixer.A_log.numel()))
    folder = write_checkpoint(tmp_path / "official", OFFICIAL_CONFIG, src.state_dict())
    model = pretrained.load(folder, dtype=torch.bfloat16, cls=Mamba2LM)
    for name, p in model.named_parameters():
        if name.endswith(("mixer.A_log", "mixer.D")):
            assert p.dtype == torch.float32 and torch.equal(p, src.state_dict()[name]), name
        else:
            assert p.dtype == torch.bfloat16, name
    (tmp_path / "official" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        pretrained.load(folder, cls=Mamba2LM)


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_layout_loads_without_padding_and_with_or_without_the_tied_head(tmp_path, tied):
    torch.manual_seed(0)
    cfg = small_config(pad_vocab_size_multiple=1, tie_embeddings=tied)
    src = Mamba2LM(cfg).eval()
    sd = {k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in src.state_dict().items()}
    if tied:
        del sd["lm_head.weight"]  # as model.safetensors leaves it out
    folder = write_checkpoint(tmp_path / "hf", dict(HF_CONFIG, tie_word_embeddings=tied), sd)
    model = pretrained.load(folder, cls=Mamba2LM)
    assert model.lm_head.weight.shape == (50, 32)  # never padded
    assert (model.lm_head.weight is model.backbone.embedding.weight) == tied
    ids = torch.randint(0, 50, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), src(ids), atol=0, rtol=0)


@pytest.mark.parametrize("change,message", [
    (lambda c: c["ssm_cfg"].update(layer="Mamba1"), "describes a Mamba-1 model; Mamba2LM loads Mamba-2"),
    (lambda c: c["ssm_cfg"].pop("layer"), "describes a Mamba-1 model; Mamba2LM loads Mamba-2"),
    (lambda c: c.update(d_intermediate=64), r"missing \['backbone.layers.0.mlp.fc1.weight'"),  # no MLP weights
    (lambda c: c.update(attn_layer_idx=[1]), "attn_cfg.num_heads must be a positive integer"),
    (lambda c: c["ssm_cfg"].update(D_has_hdim=True), "D_has_hdim = True is not supported"),
    (lambda c: c["ssm_cfg"].update(norm_before_gate=True), "norm_before_gate"),
    (lambda c: c["ssm_cfg"].update(rope=True), r"unsupported ssm_cfg fields.*rope"),
    (lambda c: c.pop("n_layer"), r"missing the fields \['n_layer'\]"),
    (lambda c: c.update(pad_vocab_size_multiple=8), r"backbone.embedding.weight has shape \(64, 32\)"),
    (lambda c: c["ssm_cfg"].update(dt_limit=[0, 1, 2]), r"dt_limit must be a pair of numbers"),
    (lambda c: c.update(ssm_cfg=["layer", "Mamba2"]), "ssm_cfg must be an object of fields, got a list"),
])
def test_bad_official_checkpoints_raise_errors_that_name_the_problem(tmp_path, change, message):
    torch.manual_seed(0)
    cfg = small_config(pad_vocab_size_multiple=16)
    config = json.loads(json.dumps(OFFICIAL_CONFIG))
    change(config)
    folder = write_checkpoint(tmp_path / "bad", config, Mamba2LM(cfg).state_dict())
    with pytest.raises(ValueError, match=message):
        pretrained.load(folder, cls=Mamba2LM)


def test_bad_transformers_checkpoints_and_missing_keys_raise(tmp_path):
    src = Mamba2LM(small_config(pad_vocab_size_multiple=1))
    sd = src.state_dict()
    mamba1 = {"model_type": "mamba", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 50, "state_size": 8}
    for config, message in [(mamba1, "describes a Mamba-1 model; Mamba2LM loads Mamba-2"),
                            (dict(HF_CONFIG, num_heads=3), r"num_heads \* head_dim = 3 \* 16 must equal"),
                            (dict(HF_CONFIG, rms_norm=False), "rms_norm: false"),
                            ({k: v for k, v in HF_CONFIG.items() if k != "head_dim"}, "missing the field head_dim")]:
        with pytest.raises(ValueError, match=message):
            pretrained.load(write_checkpoint(tmp_path / "hf_bad", config, sd), cls=Mamba2LM)
    partial = {k: v for k, v in sd.items() if not k.endswith("layers.1.mixer.dt_bias")}
    with pytest.raises(ValueError, match=r"missing \['backbone.layers.1.mixer.dt_bias'\]"):
        pretrained.load(write_checkpoint(tmp_path / "hf_partial", HF_CONFIG, partial), cls=Mamba2LM)


@pytest.mark.parametrize("G", [1, 2])
def test_logits_equal_transformers_mamba2_on_the_same_weights(tmp_path, G):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    hf_cfg = transformers.Mamba2Config(num_heads=4, head_dim=16, hidden_size=32, state_size=8, num_hidden_layers=2,
                                       vocab_size=50, n_groups=G, chunk_size=8, expand=2, tie_word_embeddings=G == 1)
    hf = transformers.Mamba2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # off the init values
        for name, p in hf.named_parameters():
            if name.endswith(("dt_bias", "A_log", ".D", "norm.weight")):
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path)  # model.safetensors, without the tied head
    model = pretrained.load(str(tmp_path), cls=Mamba2LM)
    ids = torch.randint(0, 50, (2, 21))  # 21: a partial last chunk
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(model(ids), expected, atol=2e-5, rtol=1e-4)


def test_mamba1_loader_refuses_a_mamba2_checkpoint(tmp_path):
    import mamba_minimal as mm
    cfg = small_config(pad_vocab_size_multiple=16)
    folder = write_checkpoint(tmp_path / "official", OFFICIAL_CONFIG, Mamba2LM(cfg).state_dict())
    with pytest.raises(ValueError, match="describes a Mamba-2 model; MambaLM loads Mamba-1"):
        pretrained.load(folder, cls=mm.MambaLM)
    with pytest.raises(ValueError, match=r"asks for Mamba2; load it with pretrained.load \(Mamba2LM\)"):
        pretrained.config_from_dict(OFFICIAL_CONFIG)
    hf = write_checkpoint(tmp_path / "hf", HF_CONFIG, Mamba2LM(cfg).state_dict())
    with pytest.raises(ValueError, match="describes a Mamba-2 model; MambaLM loads Mamba-1"):
        pretrained.load(hf, cls=mm.MambaLM)
    with pytest.raises(ValueError, match=r"Mamba-2 model .* load it with pretrained.load \(Mamba2LM\)"):
        pretrained.config_from_dict(HF_CONFIG)


def test_dt_limit_clamps_both_ends():
    # a limit that no Δ reaches cannot show a missing clamp: these raw values fall below, inside
    # and above (0.05, 0.2)
    mixer = m2.Mamba2Mixer(small_config(dt_limit=(0.05, 0.2)))  # 4 heads
    with torch.no_grad():
        mixer.dt_bias.zero_()
    raw = [-50.0, -2.0, 0.0, 50.0]
    softplus = [math.log1p(math.exp(v)) for v in raw]  # 2e-22, 0.127, 0.693, 50
    expected = [min(max(v, 0.05), 0.2) for v in softplus]
    assert mixer._delta(torch.tensor([raw])).flatten().tolist() == pytest.approx(expected, rel=1e-6)


def test_transformers_config_names_map_to_their_fields():
    """The twin of Mamba-1's test: a transformers Mamba2Config dict with every value distinct (and
    time_step_limit off its default), so a name mapped to the wrong field, or not mapped, shows."""
    d = {"model_type": "mamba2", "hidden_size": 48, "num_hidden_layers": 3, "vocab_size": 40, "state_size": 6,
         "expand": 3, "conv_kernel": 5, "head_dim": 9, "num_heads": 16, "n_groups": 2, "chunk_size": 7,
         "time_step_min": 0.002, "time_step_max": 0.05, "time_step_floor": 0.0003, "time_step_limit": [0.01, 0.2],
         "use_bias": True, "use_conv_bias": False, "layer_norm_epsilon": 1e-4, "residual_in_fp32": False,
         "tie_word_embeddings": True}
    expected = dict(d_model=48, n_layer=3, vocab_size=40, d_state=6, expand=3, d_conv=5, headdim=9, ngroups=2,
                    chunk_size=7, dt_min=0.002, dt_max=0.05, dt_init_floor=0.0003, dt_limit=(0.01, 0.2), bias=True,
                    conv_bias=False, norm_epsilon=1e-4, residual_in_fp32=False, tie_embeddings=True)
    assert set(pretrained._MAMBA2_HF_FIELDS) == set(d) - {"model_type", "num_heads"}  # every mapped name is in d
    cfg = pretrained.mamba2_config_from_dict(d)
    assert {k: getattr(cfg, k) for k in expected} == expected


def test_transformers_own_config_keeps_its_time_step_limit():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Mamba2Config(num_heads=4, head_dim=16, hidden_size=32, state_size=8, num_hidden_layers=2,
                                   vocab_size=50, n_groups=2, time_step_limit=(0.01, 0.2))
    assert pretrained.mamba2_config_from_dict(json.loads(hf.to_json_string())).dt_limit == (0.01, 0.2)


def test_a_non_finite_input_poisons_its_chunk_and_later_ones_but_no_earlier_chunk():
    # ssd's docstring: an inf at t reaches every output of t's chunk (0·inf in the masked product),
    # and later outputs through the state; earlier chunks stay as they were, and the loop stays causal
    x, dt, A, B, C, D, _ = ssd_inputs(b=2, L=13, seed=4)
    poisoned = x.clone()
    poisoned[0, 7, 1, 0] = float("inf")  # row 0, position 7: chunk 1 of [0-4], [5-9], [10-12]
    y = m2.ssd(poisoned, dt, A, B, C, 5, D)
    clean = m2.ssd(x, dt, A, B, C, 5, D)
    assert torch.equal(y[0, :5], clean[0, :5]) and torch.equal(y[1], clean[1])
    assert y[0, 5:7].isnan().any()  # before t, inside its chunk: the documented poisoning
    loop = m2.ssd_sequential(poisoned, dt, A, B, C, D)
    assert torch.isfinite(loop[0, :7]).all() and not torch.isfinite(loop[0, 7]).all()


@pytest.mark.parametrize("field, value", [("dt_limit", None), ("dt_limit", 5), ("A_init_range", 5),
                                          ("A_init_range", "1, 16")])
def test_a_config_json_pair_that_is_not_a_pair_is_refused_by_name(field, value):
    # fuzz N7: these reached tuple() and raised TypeError ('NoneType' object is not iterable)
    d = {"d_model": 16, "n_layer": 1, "vocab_size": 11, "ssm_cfg": {"layer": "Mamba2", "headdim": 8, field: value}}
    with pytest.raises(ValueError, match=rf"Mamba2Config.{field} must be a pair of numbers \(low, high\)"):
        pretrained.mamba2_config_from_dict(d)

