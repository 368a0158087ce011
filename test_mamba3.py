"""Specification of mamba3_minimal.py: the recurrence and its chunked form, the rotation view, the
discretization rules, the block, recurrent inference, and Mamba-3 checkpoints through pretrained.py.
Every oracle is written here in float64, from the equations (paper arXiv 2603.15569; the official
Mamba3 module at official main, e9594ce, and its tests' mamba3_siso_step_ref and mamba3_MIMO_step_ref;
the March 2026 release, 5235bdc, for A_activation = "softplus"), independently of the code under test."""

import json
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import mamba3_minimal as m3
import pretrained
import pscan
from mamba3_minimal import Mamba3Config, Mamba3LM
from test_mamba2 import LargestTensor


# ------------------------------------------------------------------------------------------------
# Oracles
# ------------------------------------------------------------------------------------------------

def pair_indices(N, S, pairing):
    """The entries of q and k that rotate together: SISO (2j, 2j+1), MIMO (j, j + N/2), j < S."""
    return [(2 * j, 2 * j + 1) if pairing == "adjacent" else (j, j + N // 2) for j in range(S)]


def turn(vec, angles, pairs):
    """Rotate each pair (m, n) of vec (..., N) by its angle, entry by entry."""
    out = vec.clone()
    for (m, n), phi in zip(pairs, angles):
        c, s = torch.cos(phi), torch.sin(phi)
        out[..., m] = vec[..., m] * c - vec[..., n] * s
        out[..., n] = vec[..., m] * s + vec[..., n] * c
    return out


def reference_mamba3(q, k, v, dt, adt, lam, theta, q_bias=None, k_bias=None, D=None, mimo_x=None,
                     state=None, pairing="adjacent"):
    """One batch row, one head, one token at a time, in float64:
    angle += Δ·θ (mod 2π); q̃, k̃ = rotated q + bias, k + bias; v_r = v ∘ mimo_x[r];
    h = α·h + β·Σ_r v_prev,r·k̃_prev,rᵀ + γ·Σ_r v_r·k̃_rᵀ;  y_r = h·q̃_r + D·v_r,
    α = exp(Δ·A), β = (1 − λ)·Δ·α, γ = λ·Δ; head j reads group j // (H/G)."""
    q, k, v, dt, adt, lam, theta = (t.double() for t in (q, k, v, dt, adt, lam, theta))
    b, L, R, G, N = q.shape
    H, P = v.shape[2:]
    S = theta.shape[-1]
    pairs = pair_indices(N, S, pairing)
    ys = [[None] * H for _ in range(b)]
    finals = [[None] * H for _ in range(b)]
    for i in range(b):
        for j in range(H):
            g = j // (H // G)
            qb = torch.zeros(R, N, dtype=torch.float64) if q_bias is None else q_bias[j].double()
            kb = torch.zeros(R, N, dtype=torch.float64) if k_bias is None else k_bias[j].double()
            scale = torch.ones(R, P, dtype=torch.float64) if mimo_x is None else mimo_x[j].double()
            if state is None:
                angle, h = torch.zeros(S, dtype=torch.float64), torch.zeros(P, N, dtype=torch.float64)
                k_prev, v_prev = torch.zeros(R, N, dtype=torch.float64), torch.zeros(P, dtype=torch.float64)
            else:
                angle, h, k_prev, v_prev = (state[0][i, j].double(), state[1][i, j].double(),
                                            state[2][i, :, j].double(), state[3][i, j].double())
            rows = []
            for t in range(L):
                angle = angle + dt[i, t, j] * theta[i, t, j]
                angle = angle - 2 * math.pi * torch.floor(angle / (2 * math.pi))
                q_t = turn(q[i, t, :, g] + qb, angle, pairs)  # (R, N)
                k_t = turn(k[i, t, :, g] + kb, angle, pairs)  # (R, N)
                alpha = torch.exp(adt[i, t, j])
                beta = (1 - lam[i, t, j]) * dt[i, t, j] * alpha
                gamma = lam[i, t, j] * dt[i, t, j]
                h = alpha * h
                for r in range(R):
                    h = h + beta * torch.outer(v_prev * scale[r], k_prev[r])
                    h = h + gamma * torch.outer(v[i, t, j] * scale[r], k_t[r])
                y_t = torch.stack([h @ q_t[r] + (0 if D is None else D[j].double() * v[i, t, j] * scale[r])
                                   for r in range(R)])  # (R, P)
                rows.append(y_t)
                k_prev, v_prev = k_t, v[i, t, j]
            ys[i][j] = torch.stack(rows)  # (L, R, P)
            finals[i][j] = (angle, h, k_prev, v_prev)
    y = torch.stack([torch.stack(row, dim=2) for row in ys])  # (b, L, R, H, P)
    final = (torch.stack([torch.stack([f[0] for f in row]) for row in finals]),
             torch.stack([torch.stack([f[1] for f in row]) for row in finals]),
             torch.stack([torch.stack([f[2] for f in row], dim=1) for row in finals]),
             torch.stack([torch.stack([f[3] for f in row]) for row in finals]))
    return y, final


def complex_reference(q, k, v, dt, adt, lam, theta, mimo_x=None, pairing="adjacent"):
    """The rotation view's other side: a complex state with A_t + iθ_t per rotated pair
    (m, n), fed with κ_k = k_m − i·k_n and read with Re(κ_q·g), κ_q = q_m + i·q_n; the other
    entries are a real state. No rotation anywhere; zero initial state, no biases, one group."""
    q, k, v, dt, adt, lam, theta = (t.double() for t in (q, k, v, dt, adt, lam, theta))
    b, L, R, _, N = q.shape
    H, P = v.shape[2:]
    S = theta.shape[-1]
    pairs = pair_indices(N, S, pairing)
    paired = {m for p in pairs for m in p}
    plain = [n for n in range(N) if n not in paired]
    y = torch.zeros(b, L, R, H, P, dtype=torch.float64)
    for i in range(b):
        for j in range(H):
            scale = torch.ones(R, P, dtype=torch.float64) if mimo_x is None else mimo_x[j].double()
            g = torch.zeros(S, P, dtype=torch.complex128)  # one complex state row per pair
            h = torch.zeros(len(plain), P, dtype=torch.float64)
            kin_prev = torch.zeros(R, S, dtype=torch.complex128)
            kreal_prev = torch.zeros(R, len(plain), dtype=torch.float64)
            v_prev = torch.zeros(P, dtype=torch.float64)
            for t in range(L):
                k_t, q_t = k[i, t, :, 0], q[i, t, :, 0]  # (R, N)
                kin = torch.stack([torch.complex(k_t[:, m], -k_t[:, n]) for m, n in pairs], dim=-1)  # (R, S)
                qin = torch.stack([torch.complex(q_t[:, m], q_t[:, n]) for m, n in pairs], dim=-1)  # (R, S)
                alpha_c = torch.exp(torch.complex(adt[i, t, j].expand(S), dt[i, t, j] * theta[i, t, j]))  # (S,)
                alpha = torch.exp(adt[i, t, j])
                sigma, gamma = (1 - lam[i, t, j]) * dt[i, t, j], lam[i, t, j] * dt[i, t, j]
                g = alpha_c[:, None] * g
                h = alpha * h
                for r in range(R):
                    g = g + (sigma * alpha_c[:, None] * kin_prev[r][:, None] * (v_prev * scale[r])
                             + gamma * kin[r][:, None] * (v[i, t, j] * scale[r]))
                    h = h + (sigma * alpha * kreal_prev[r][:, None] * (v_prev * scale[r])
                             + gamma * k_t[r, plain][:, None] * (v[i, t, j] * scale[r]))
                for r in range(R):
                    y[i, t, r, j] = (qin[r][:, None] * g).real.sum(0) + (q_t[r, plain][:, None] * h).sum(0)
                kin_prev, kreal_prev, v_prev = kin, k_t[:, plain], v[i, t, j]
    return y


def num_rope_angles(N, fraction):
    rotated = int(N * fraction)
    return (rotated - rotated % 2) // 2


def mamba3_inputs(b=2, L=13, H=4, P=3, G=2, N=8, R=1, S=2, seed=0, dtype=torch.float64, with_state=False):
    """Random inputs of the core: q, k, v, dt, adt, lam, theta, q_bias, k_bias, D, mimo_x, state."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    dt = F.softplus(rnd(b, L, H) - 1)
    A = -F.softplus(rnd(b, L, H)) - 0.05
    inputs = dict(q=rnd(b, L, R, G, N), k=rnd(b, L, R, G, N), v=rnd(b, L, H, P), dt=dt, adt=dt * A,
                  lam=torch.sigmoid(rnd(b, L, H)), theta=math.pi * torch.tanh(rnd(b, L, H, S)),
                  q_bias=rnd(H, R, N), k_bias=rnd(H, R, N), D=rnd(H),
                  mimo_x=None if R == 1 else rnd(H, R, P))
    if with_state:
        inputs["state"] = (torch.rand(b, H, S, generator=g, dtype=dtype) * 2 * math.pi, rnd(b, H, P, N),
                           rnd(b, R, H, N), rnd(b, H, P))
    return inputs


def assert_states_close(got, expected, atol=1e-11, rtol=1e-10):
    for name, a, e in zip(("angle", "ssm", "k", "v"), got, expected):
        if name == "angle":  # equal mod 2π: compare where the angle lands
            a, e = torch.stack([a.cos(), a.sin()]), torch.stack([e.cos(), e.sin()])
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------
# 1 and 3. The recurrence and the chunked form against the float64 loop
# ------------------------------------------------------------------------------------------------

CASES = [  # (L, chunk_size, H, G, N, R, rope_fraction, D, state, pairing)
    (1, 4, 2, 1, 8, 1, 0.5, True, False, "adjacent"),
    (1, 4, 2, 2, 8, 1, 1.0, True, True, "adjacent"),
    (7, 3, 4, 2, 8, 1, 0.5, True, True, "adjacent"),
    (13, 4, 4, 1, 8, 1, 1.0, False, False, "adjacent"),
    (13, 5, 4, 4, 6, 1, 1.0, True, True, "adjacent"),
    (16, 4, 2, 1, 8, 2, 0.5, True, True, "halves"),
    (11, 4, 4, 2, 8, 2, 1.0, False, True, "halves"),
    (9, 16, 2, 2, 8, 4, 0.5, True, True, "halves"),  # chunk longer than L
    (17, 8, 2, 1, 8, 4, 1.0, True, False, "halves"),
    (5, 2, 2, 1, 8, 1, 0.5, True, True, "halves"),  # MIMO's pairing at rank 1
]


def run_case(case, seed=0):
    L, T, H, G, N, R, frac, with_D, with_state, pairing = case
    inputs = mamba3_inputs(L=L, H=H, G=G, N=N, R=R, S=num_rope_angles(N, frac), seed=seed, with_state=with_state)
    if not with_D:
        inputs["D"] = None
    y, state = m3.mamba3_chunked(**inputs, pairing=pairing, chunk_size=T, return_state=True)
    y_ref, state_ref = reference_mamba3(**inputs, pairing=pairing)
    return y, state, y_ref, state_ref


@pytest.mark.parametrize("case", CASES, ids=[f"L{c[0]}-T{c[1]}-G{c[3]}-N{c[4]}-R{c[5]}-rope{c[6]}-D{int(c[7])}-"
                                             f"h0{int(c[8])}-{c[9]}" for c in CASES])
def test_chunked_form_matches_the_float64_loop_outputs_and_final_state(case):
    y, state, y_ref, state_ref = run_case(case)
    torch.testing.assert_close(y, y_ref, atol=1e-11, rtol=1e-10)
    assert_states_close(state, state_ref)


def test_a_sequence_shorter_than_a_chunk_is_one_chunk_of_its_own_length():
    # the official chunk_size is 64: a prompt of 5 tokens must not be padded to a 64-token chunk
    case = (5, 512, 2, 1, 8, 2, 0.5, True, True, "halves")
    with LargestTensor() as largest:
        y, state, y_ref, state_ref = run_case(case)
    torch.testing.assert_close(y, y_ref, atol=1e-11, rtol=1e-10)
    assert_states_close(state, state_ref)
    assert largest.numel < 512 * 512, largest.numel

def test_the_core_under_bf16_autocast_keeps_the_state_and_its_sums_in_fp32():
    # the training step on a GPU runs under bf16 autocast: its matmuls must not round the state
    case = (16, 4, 2, 1, 8, 2, 0.5, True, True, "halves")  # several chunks, MIMO, an initial state
    L, T, H, G, N, R, frac, _, _, pairing = case
    inputs = mamba3_inputs(L=L, H=H, G=G, N=N, R=R, S=num_rope_angles(N, frac), with_state=True)
    y_ref, state_ref = reference_mamba3(**inputs, pairing=pairing)
    fp32 = {k: (tuple(t.float() for t in v) if isinstance(v, tuple) else v if v is None else v.float())
            for k, v in inputs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, state = m3.mamba3_chunked(**fp32, pairing=pairing, chunk_size=T, return_state=True)
        y_loop, _ = m3.mamba3_sequential(**fp32, pairing=pairing)
    assert y.dtype == y_loop.dtype == torch.float32 and state[1].dtype == torch.float32
    for got in (y, y_loop):
        torch.testing.assert_close(got.double(), y_ref, atol=1e-4, rtol=1e-4)
    assert_states_close([t.double() for t in state], state_ref, atol=1e-4, rtol=1e-4)


def test_the_model_trains_and_generates_under_bf16_autocast():
    torch.manual_seed(0)
    model = m3.Mamba3LM(m3.Mamba3Config(d_model=32, n_layer=2, vocab_size=20, d_state=8, headdim=8, chunk_size=8))
    ids = torch.randint(0, 20, (2, 21))  # three chunks
    with torch.no_grad():
        expected = model.double()(ids)
    model.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
        logits.float().logsumexp(-1).mean().backward()
        prefill_logits, cache = model.prefill(ids[:, :20])
        step_logits = model.step(ids[:, 20], cache)
    assert all(t.dtype == torch.float32 for layer in cache for t in layer)
    for got, want in ((logits, expected), (prefill_logits, expected[:, :20]), (step_logits, expected[:, 20])):
        torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0.05)  # bf16 projections


def test_worst_float64_difference_over_the_random_cases_is_at_rounding_level():
    """Run with -s to print the figure: the worst |chunked - loop| over every case and 3 seeds."""
    worst = 0.0
    for case in CASES:
        for seed in range(3):
            y, state, y_ref, state_ref = run_case(case, seed)
            worst = max(worst, (y - y_ref).abs().max().item(), (state[1] - state_ref[1]).abs().max().item())
    print(f"\nworst float64 difference, chunked form vs the loop, over {3 * len(CASES)} cases: {worst:.2e}")
    assert worst < 1e-11


@pytest.mark.parametrize("case", [CASES[3], CASES[5]], ids=["siso", "mimo"])
def test_the_sequential_loop_and_the_step_match_the_reference(case):
    L, T, H, G, N, R, frac, with_D, with_state, pairing = case
    inputs = mamba3_inputs(L=L, H=H, G=G, N=N, R=R, S=num_rope_angles(N, frac), with_state=True)
    y, state = m3.mamba3_sequential(**inputs, pairing=pairing)
    y_ref, state_ref = reference_mamba3(**inputs, pairing=pairing)
    torch.testing.assert_close(y, y_ref, atol=1e-11, rtol=1e-10)
    assert_states_close(state, state_ref)


def test_one_step_by_hand():
    """b = H = P = G = R = 1, N = 2 (one pair), from a known state: every term by hand."""
    angle0, h0, k0, v0 = 0.3, torch.tensor([[0.5, -1.0]]), torch.tensor([0.2, 0.7]), 1.5
    dt, A, lam, theta, q, k, v, D = 0.4, -2.0, 0.25, 1.0, [1.0, 2.0], [3.0, -1.0], 2.0, 0.5
    phi = angle0 + dt * theta
    c, s = math.cos(phi), math.sin(phi)
    qr = [q[0] * c - q[1] * s, q[0] * s + q[1] * c]
    kr = [k[0] * c - k[1] * s, k[0] * s + k[1] * c]
    alpha = math.exp(dt * A)
    beta, gamma = (1 - lam) * dt * alpha, lam * dt
    h = [alpha * h0[0, n].item() + beta * v0 * k0[n].item() + gamma * v * kr[n] for n in range(2)]
    y = h[0] * qr[0] + h[1] * qr[1] + D * v
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    state = (t([[[angle0]]]), h0.double()[None, None], k0.double()[None, None, None], t([[[v0]]]))
    y_code, new = m3.mamba3_step(state, t([[[q]]]), t([[[k]]]), t([[[v]]]), t([[dt]]), t([[dt * A]]), t([[lam]]),
                                 t([[[theta]]]), D=t([D]))
    assert abs(y_code.item() - y) < 1e-12
    assert torch.allclose(new[1].flatten(), t(h), atol=1e-12)
    assert abs(new[0].item() - phi) < 1e-12


def test_chunked_gradients_match_the_loops_for_every_input():
    """d(loss)/d(each input and parameter) of the chunked form = that of the float64 oracle loop."""
    inputs = mamba3_inputs(L=9, H=2, G=1, N=8, R=2, S=2, with_state=True, seed=3)
    names = [n for n, t in inputs.items() if isinstance(t, torch.Tensor)] + ["angle0", "h0", "k0", "v0"]

    def grads(fn):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items() if isinstance(t, torch.Tensor)}
        state = tuple(t.detach().clone().requires_grad_(True) for t in inputs["state"])
        y, final = fn(**leaves, state=state)
        gen = torch.Generator().manual_seed(1)
        loss = (y * torch.randn(y.shape, generator=gen, dtype=y.dtype)).sum()
        loss = loss + sum((f * torch.randn(f.shape, generator=gen, dtype=f.dtype)).sum() for f in final[1:])
        return torch.autograd.grad(loss, list(leaves.values()) + list(state))

    got = grads(lambda **kw: m3.mamba3_chunked(**kw, pairing="halves", chunk_size=4, return_state=True))
    expected = grads(lambda **kw: reference_mamba3(**kw, pairing="halves"))
    for name, a, e in zip(names, got, expected):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-9, msg=lambda m: f"{name}: {m}")


def test_gradcheck_on_a_tiny_case():
    """Autograd's gradients of the chunked form against finite differences, every input at once
    (angles small enough that no sum crosses 2π, where the mod makes a jump)."""
    inputs = mamba3_inputs(b=1, L=5, H=2, P=2, G=1, N=4, R=2, S=1, with_state=True, seed=5)
    inputs["theta"] = inputs["theta"] * 0.1
    angle0 = torch.full((1, 2, 1), 1.0, dtype=torch.float64)
    names = ["q", "k", "v", "dt", "adt", "lam", "theta", "q_bias", "k_bias", "D", "mimo_x"]
    leaves = [inputs[n].detach().clone().requires_grad_(True) for n in names]
    state = [angle0.requires_grad_(True)] + [t.detach().clone().requires_grad_(True) for t in inputs["state"][1:]]

    def fn(*args):
        kw = dict(zip(names, args[:len(names)]))
        y, final = m3.mamba3_chunked(**kw, state=tuple(args[len(names):]), pairing="halves", chunk_size=2,
                                     return_state=True)
        return y, final[1]

    assert torch.autograd.gradcheck(fn, leaves + state, atol=1e-7, rtol=1e-6)


def test_chunks_carry_the_state_through_every_pscan_backend():
    inputs = mamba3_inputs(L=12, H=2, G=1, N=8, R=1, S=2, with_state=True, seed=2)
    y_ref, _ = reference_mamba3(**inputs)
    for backend in pscan.BACKENDS:
        y = m3.mamba3_chunked(**inputs, chunk_size=3, scan_backend=backend)
        torch.testing.assert_close(y, y_ref, atol=1e-11, rtol=1e-10, msg=lambda m: f"{backend}: {m}")


def test_fp32_and_bf16_inputs_are_computed_in_fp32_close_to_the_float64_loop():
    inputs = mamba3_inputs(L=40, H=2, G=1, N=8, R=2, S=2, with_state=True, seed=4)
    y_ref, _ = reference_mamba3(**inputs, pairing="halves")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        low = {n: (t.to(dtype) if isinstance(t, torch.Tensor) else tuple(s.to(dtype) for s in t))
               for n, t in inputs.items()}
        y, state = m3.mamba3_chunked(**low, pairing="halves", chunk_size=16, return_state=True)
        assert y.dtype == torch.float32 and all(s.dtype == torch.float32 for s in state)
        scale = y_ref.abs().max()
        assert (y.double() - y_ref).abs().max() / scale < tol, dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_chunked_form_and_model_match_the_float64_cpu_reference():
    inputs = mamba3_inputs(L=21, H=2, G=1, N=8, R=2, S=2, with_state=True, seed=8)
    y_ref, _ = reference_mamba3(**inputs, pairing="halves")
    on_gpu = {n: (t.float().cuda() if isinstance(t, torch.Tensor) else tuple(s.float().cuda() for s in t))
              for n, t in inputs.items()}
    y = m3.mamba3_chunked(**on_gpu, pairing="halves", chunk_size=8)
    torch.testing.assert_close(y.double().cpu(), y_ref, rtol=1e-4, atol=1e-4)
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(is_mimo=True, mimo_rank=2))).double().eval()
    ids = torch.randint(0, 29, (2, 19))
    expected = model(ids)
    model = model.float().cuda()
    torch.testing.assert_close(model(ids.cuda()).double().cpu(), expected, rtol=1e-4, atol=1e-4)
    logits, cache = model.prefill(ids[:, :10].cuda())
    steps = [model.step(ids[:, t].cuda(), cache) for t in range(10, 19)]
    torch.testing.assert_close(torch.stack(steps, 1).double().cpu(), expected[:, 10:], rtol=1e-4, atol=1e-4)


def test_a_long_sequence_keeps_the_angle_in_range_and_close_in_fp32():
    """After 4096 steps turning the same way the raw angle sum is about 5000 (an fp32 ulp of 5e-4
    there); the final angle is kept in [0, 2π) and within 1e-3 of the float64 sum mod 2π."""
    inputs = mamba3_inputs(b=1, L=4096, H=1, P=1, G=1, N=2, R=1, S=1, seed=6)
    inputs["theta"] = inputs["theta"].abs()
    low = {n: (t.float() if isinstance(t, torch.Tensor) else t) for n, t in inputs.items()}
    _, state = m3.mamba3_chunked(**low, chunk_size=64, return_state=True)
    assert 0 <= state[0].item() < 2 * math.pi
    exact = math.fmod((inputs["dt"][..., None] * inputs["theta"]).sum().item(), 2 * math.pi)
    assert abs(state[0].item() - exact) < 1e-3


def test_the_step_keeps_the_angle_in_0_2pi_equal_to_the_float64_sum_mod_2pi():
    """300 tokens turning the same way through mamba3_step (the loop runs it; so does generation):
    the raw sum of Δ·θ passes 2π many times, the state's angle stays in [0, 2π) and equals the sum
    mod 2π, in float64 to 1e-9 and in fp32 to 1e-4 (300 roundings at the size of 2π)."""
    inputs = mamba3_inputs(b=1, L=300, H=1, P=1, G=1, N=2, R=1, S=1, seed=6)
    inputs["theta"] = inputs["theta"].abs()
    exact = math.fmod((inputs["dt"][..., None] * inputs["theta"]).sum().item(), 2 * math.pi)
    assert (inputs["dt"][..., None] * inputs["theta"]).sum() > 20 * 2 * math.pi
    _, state = m3.mamba3_sequential(**inputs)
    assert 0 <= state[0].item() < 2 * math.pi
    assert abs(state[0].item() - exact) < 1e-9
    low = {n: (t.float() if isinstance(t, torch.Tensor) else t) for n, t in inputs.items()}
    _, state = m3.mamba3_sequential(**low)
    assert 0 <= state[0].item() < 2 * math.pi
    assert abs(state[0].item() - exact) < 1e-4


def test_a_long_sequence_in_fp32_matches_float64_in_its_outputs():
    """4096 tokens turning the same way in chunks of 64, fp32 against the float64 loop: the outputs
    to 1e-5 of their largest value (1.9e-6). The chunks' starts add up chunk turns reduced mod 2π;
    unreduced ones (about 47 rad a chunk in this test) round the starts at their size and shift every later
    chunk's angles: 6.7e-5."""
    inputs = mamba3_inputs(b=1, L=4096, H=1, P=1, G=1, N=2, R=1, S=1, seed=6)
    inputs["theta"] = inputs["theta"].abs()
    y_ref, _ = reference_mamba3(**inputs)
    low = {n: (t.float() if isinstance(t, torch.Tensor) else t) for n, t in inputs.items()}
    y = m3.mamba3_chunked(**low, chunk_size=64)
    assert (y.double() - y_ref).abs().max() / y_ref.abs().max() < 1e-5


# ------------------------------------------------------------------------------------------------
# 2. The rotation view and the discretization rules
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pairing,R,frac", [("adjacent", 1, 1.0), ("adjacent", 1, 0.5), ("halves", 2, 0.5),
                                            ("halves", 4, 1.0)])
def test_rotated_real_state_equals_a_complex_diagonal_state(pairing, R, frac):
    N = 8
    inputs = mamba3_inputs(L=11, H=2, G=1, N=N, R=R, S=num_rope_angles(N, frac), seed=7)
    del inputs["q_bias"], inputs["k_bias"]
    D = inputs.pop("D")
    y = m3.mamba3_chunked(**inputs, pairing=pairing, chunk_size=4)
    y_complex = complex_reference(**inputs, pairing=pairing)
    assert D is not None  # the complex oracle has no skip: compare without it
    torch.testing.assert_close(y, y_complex, atol=1e-11, rtol=1e-10)


def test_rotation_keeps_the_norm_and_composes():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 8, dtype=torch.float64, generator=g)
    a, b = torch.rand(3, 2, dtype=torch.float64, generator=g), torch.rand(3, 2, dtype=torch.float64, generator=g)
    for pairing in m3.PAIRINGS:
        r = m3.rotate(t, a, pairing)
        torch.testing.assert_close(r.norm(dim=-1), t.norm(dim=-1))
        torch.testing.assert_close(m3.rotate(r, b, pairing), m3.rotate(t, a + b, pairing))
        # by hand: the first pair turned by a[:, 0], the untouched entries kept
        m, n = (0, 1) if pairing == "adjacent" else (0, 4)
        torch.testing.assert_close(r[:, m], t[:, m] * a[:, 0].cos() - t[:, n] * a[:, 0].sin())
        torch.testing.assert_close(r[:, 5:], t[:, 5:]) if pairing == "adjacent" else \
            torch.testing.assert_close(r[:, 6:], t[:, 6:])


def test_discretization_errors_shrink_at_each_rules_order():
    """h' = −h + cos(τ), h(0) = 0, solved exactly by h(τ) = (cos τ + sin τ − e^{−τ})/2. At τ = 2:
    halving Δ halves the error of Euler and exponential-Euler (order 1) and quarters the error of
    the exponential-trapezoidal rule with λ = 1/2 (order 2)."""
    end = 2.0
    exact = (math.cos(end) + math.sin(end) - math.exp(-end)) / 2
    orders = {}
    for rule in ("euler", "exponential_euler", "exponential_trapezoidal"):
        errors = []
        for n in (50, 100, 200, 400):
            dt = end / n
            h = 0.0
            for i in range(1, n + 1):
                h = m3.scalar_ode_step(rule, h, -1.0, dt, math.cos((i - 1) * dt), math.cos(i * dt))
            errors.append(abs(h - exact))
        orders[rule] = [math.log2(errors[i] / errors[i + 1]) for i in range(3)]
    assert all(0.9 < o < 1.1 for o in orders["euler"]), orders
    assert all(0.9 < o < 1.1 for o in orders["exponential_euler"]), orders
    assert all(1.9 < o < 2.1 for o in orders["exponential_trapezoidal"]), orders
    with pytest.raises(ValueError, match="rule must be"):
        m3.scalar_ode_step("midpoint", 0.0, -1.0, 0.1, 0.0, 0.0)


# ------------------------------------------------------------------------------------------------
# Input checks
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    (lambda kw: kw.update(v=kw["v"][0]), r"v must have shape \(b, L, H, P\)"),
    (lambda kw: kw.update(dt=kw["dt"][:, :-1]), "dt must have shape"),
    (lambda kw: kw.update(q=kw["q"][..., :1, :].repeat(1, 1, 1, 3, 1), k=kw["k"][..., :1, :].repeat(1, 1, 1, 3, 1)),
     "multiple of the number of groups"),
    (lambda kw: kw.update(theta=kw["theta"].repeat(1, 1, 1, 5)), "rotated pairs"),
    (lambda kw: kw.update(D=kw["D"][:1]), r"D must have shape \(4,\)"),
    (lambda kw: kw.update(state=kw["state"][:3]), r"state must be \(angle, ssm, k, v\)"),
    (lambda kw: kw.update(q=kw["q"].repeat(1, 1, 2, 1, 1), k=kw["k"].repeat(1, 1, 2, 1, 1), q_bias=None, k_bias=None,
                         state=None), "MIMO needs mimo_x"),
    (lambda kw: kw.update(v=kw["v"][:, :0], q=kw["q"][:, :0]), "at least 1"),
    (lambda kw: kw.update(lam=kw["lam"].long()), "lam must be a floating-point tensor"),
    (lambda kw: kw.update(pairing="diagonal"), "pairing must be one of"),
    (lambda kw: kw.update(chunk_size=0), "chunk_size must be a positive integer"),
])
def test_bad_inputs_raise_errors_that_name_the_expectation(change, message):
    kw = mamba3_inputs(L=5, H=4, G=2, N=8, R=1, S=2, with_state=True)
    kw.update(pairing="adjacent", chunk_size=4)
    change(kw)
    with pytest.raises(ValueError, match=message):
        m3.mamba3_chunked(**kw)


# ------------------------------------------------------------------------------------------------
# 4. The block and the model
# ------------------------------------------------------------------------------------------------

def small_config(**kw):
    base = dict(d_model=16, n_layer=2, vocab_size=29, d_state=8, headdim=8, ngroups=2, chunk_size=4)
    return Mamba3Config(**{**base, **kw})


def heavy_tail(x):
    """Official main's f, element by element: 1 + x for x ≥ 0, 1/(1 − x) for x < 0."""
    return torch.tensor([1 + v if v >= 0 else 1 / (1 - v) for v in x.flatten().tolist()],
                        dtype=torch.float64).view(x.shape)


def softplus(x):
    """The March 2026 release's f, element by element: log(1 + e^x)."""
    return torch.tensor([math.log1p(math.exp(v)) if v < 30 else v + math.log1p(math.exp(-v))
                         for v in x.flatten().tolist()], dtype=torch.float64).view(x.shape)


def reference_A(dd_A, A_activation, A_floor):
    """A = −f(dd_A), then min(A, −A_floor): official main's f, or the March release's softplus."""
    f = heavy_tail if A_activation == "heavy_tail" else softplus
    return torch.minimum(-f(dd_A.double()), torch.tensor(-A_floor, dtype=torch.float64))


def reference_mixer(mixer, u):
    """The official Mamba3.forward from its equations, in float64: in_proj split in the order
    [z, x, B, C, dd_dt, dd_A, trap, angles]; B, C RMSNorm (eps 1e-5); A = −f(dd_A) clamped at
    −A_floor, f official main's heavy tail (or softplus for A_activation = "softplus", the March
    release); Δ = softplus(dd_dt + dt_bias); λ = sigmoid(trap); θ = π·tanh(angles); the SSM (the
    oracle loop); per rank the optional per-head RMSNorm, the gate SiLU(z·mimo_z[r]); mimo_o over
    the ranks; out_proj."""
    cfg = mixer.cfg
    H, P, G, N = cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state
    R = cfg.mimo_rank if cfg.is_mimo else 1
    S = num_rope_angles(N, cfg.rope_fraction)
    sd = {k: v.double() for k, v in mixer.state_dict().items()}
    u = u.double()
    sizes = [cfg.d_inner, cfg.d_inner, R * G * N, R * G * N, H, H, H, S]
    z, x, B, C, dd_dt, dd_A, trap, angles = (u @ sd["in_proj.weight"].T).split(sizes, dim=-1)
    rms = lambda t, w: t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w  # noqa: E731
    k = rms(B.unflatten(-1, (R, G, N)), sd["B_norm.weight"])
    q = rms(C.unflatten(-1, (R, G, N)), sd["C_norm.weight"])
    A = reference_A(dd_A, cfg.A_activation, cfg.A_floor)
    dt = F.softplus(dd_dt + sd["dt_bias"])
    theta = (math.pi * torch.tanh(angles)).unsqueeze(-2).expand(*angles.shape[:-1], H, S)
    y, _ = reference_mamba3(q, k, x.unflatten(-1, (H, P)), dt, A * dt, torch.sigmoid(trap), theta,
                            sd["C_bias"], sd["B_bias"], sd["D"], sd.get("mimo_x"),
                            pairing="halves" if cfg.is_mimo else "adjacent")  # (b, L, R, H, P)
    zr = z.unflatten(-1, (H, P)).unsqueeze(2)  # (b, L, 1, H, P)
    if cfg.is_mimo:
        zr = zr * sd["mimo_z"].transpose(0, 1)
    if cfg.is_outproj_norm:
        y = rms(y, sd["norm.weight"].unflatten(0, (H, P)))
    y = y * zr * torch.sigmoid(zr)
    y = (y * sd["mimo_o"].transpose(0, 1)).sum(2) if cfg.is_mimo else y[:, :, 0]
    return y.flatten(-2) @ sd["out_proj.weight"].T


def perturbed(model):
    """Move every parameter off its initial value, so that a test sees each one matter."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


MIXER_CONFIGS = {"siso": dict(), "rope1": dict(rope_fraction=1.0, ngroups=1), "outproj_norm": dict(is_outproj_norm=True),
                 "mimo1": dict(is_mimo=True, mimo_rank=1), "mimo2": dict(is_mimo=True, mimo_rank=2),
                 "mimo4_norm": dict(is_mimo=True, mimo_rank=4, is_outproj_norm=True),
                 "A_floor": dict(A_floor=0.5),  # the clamp acts on 23 of the 88 values of A
                 "softplus": dict(A_activation="softplus"),
                 "softplus_mimo2_norm": dict(A_activation="softplus", is_mimo=True, mimo_rank=2, is_outproj_norm=True)}


@pytest.mark.parametrize("kw", MIXER_CONFIGS.values(), ids=MIXER_CONFIGS.keys())
def test_mixer_matches_the_official_equations_in_float64(kw):
    torch.manual_seed(0)
    mixer = perturbed(m3.Mamba3Mixer(small_config(**kw)).double())
    u = torch.randn(2, 11, 16, dtype=torch.float64)
    torch.testing.assert_close(mixer(u), reference_mixer(mixer, u), atol=1e-10, rtol=1e-9)


def test_the_two_A_activations_give_different_mixers():
    """The same weights under official main's A and the March release's: the outputs must differ
    (both are checked against their own equations above)."""
    torch.manual_seed(0)
    mixer = perturbed(m3.Mamba3Mixer(small_config()).double())
    other = m3.Mamba3Mixer(small_config(A_activation="softplus")).double()
    other.load_state_dict(mixer.state_dict())
    u = torch.randn(2, 11, 16, dtype=torch.float64)
    assert (mixer(u) - other(u)).abs().max() > 1e-2


def test_heavy_tail_activation_by_hand():
    x = torch.tensor([-3.0, -1.0, 0.0, 0.5, 2.0, 1.0], dtype=torch.float64, requires_grad=True)
    y = m3.heavy_tail_activation(x)
    torch.testing.assert_close(y, torch.tensor([0.25, 0.5, 1.0, 1.5, 3.0, 2.0], dtype=torch.float64))
    (grad,) = torch.autograd.grad(y.sum(), x)
    # d/dx 1/(1 - x) = 1/(1 - x)²; 1 for x > 0; finite at x = 1, where 1/(1 - x) has its pole
    torch.testing.assert_close(grad[[0, 1, 3, 4, 5]], torch.tensor([1 / 16, 0.25, 1.0, 1.0, 1.0], dtype=torch.float64))


@pytest.mark.parametrize("A_activation", m3.A_ACTIVATIONS)
def test_A_is_clamped_at_minus_A_floor(A_activation):
    """dd_A of -1e6 .. 1e4 through the mixer: A = −f(dd_A) where f(dd_A) ≥ A_floor, −A_floor below.
    With A_floor 0.05 the clamp acts for dd_A < -19 (heavy tail) or < -2.97 (softplus)."""
    mixer = m3.Mamba3Mixer(small_config(A_floor=0.05, A_activation=A_activation)).double()
    H = mixer.cfg.nheads
    dd_A = torch.tensor([[-1e6, -30.0, -9.0, -3.5], [-1.0, 0.0, 3.0, 1e4]], dtype=torch.float64)[:, :H]
    zxbc = torch.zeros(2, sum(mixer.split_sizes), dtype=torch.float64)
    start = sum(mixer.split_sizes[:5])  # [z, x, B, C, dd_dt] come before dd_A
    zxbc[:, start:start + H] = dd_A
    *_, dt, adt, _, _ = mixer._ssm_inputs(zxbc)
    expected = reference_A(dd_A, A_activation, 0.05)
    assert (expected[0, :2] == -0.05).all() and expected[1, 3] < -1e3  # the clamp acts, and not on large dd_A
    torch.testing.assert_close(adt / dt, expected, rtol=1e-12, atol=0)


def test_module_tree_and_shapes_follow_the_official_mamba3():
    """Names and shapes of the official Mamba3 (d_in_proj = 2·d_inner + 2·N·G·R + 3·H + S) inside
    MambaLMHeadModel, for SISO and for MIMO with the output norm."""
    for kw, R in ((dict(), 1), (dict(is_mimo=True, mimo_rank=4, is_outproj_norm=True), 4)):
        cfg = small_config(**kw)
        H, N, G, P, S = 4, 8, 2, 8, 2
        expected = {
            "in_proj.weight": (2 * 32 + 2 * N * G * R + 3 * H + S, 16), "dt_bias": (H,), "B_bias": (H, R, N),
            "C_bias": (H, R, N), "B_norm.weight": (N,), "C_norm.weight": (N,), "D": (H,), "out_proj.weight": (16, 32)}
        if R > 1:
            expected.update({"mimo_x": (H, R, P), "mimo_z": (H, R, P), "mimo_o": (H, R, P), "norm.weight": (32,)})
        model = Mamba3LM(cfg)
        sd = model.state_dict()
        for i in range(2):
            got = {k[len(f"backbone.layers.{i}.mixer."):]: tuple(v.shape) for k, v in sd.items()
                   if k.startswith(f"backbone.layers.{i}.mixer.")}
            assert got == expected
        assert set(k for k in sd if "layers" not in k) == {"backbone.embedding.weight", "backbone.norm_f.weight",
                                                           "lm_head.weight"}
        assert sd["backbone.embedding.weight"].shape == (32, 16)  # 29 padded to a multiple of 8


def test_official_initialization():
    torch.manual_seed(0)
    cfg = small_config(is_mimo=True, mimo_rank=4, d_model=64, headdim=4, ngroups=1)
    mixer = Mamba3LM(cfg).backbone.layers[0].mixer
    dt = F.softplus(mixer.dt_bias)
    assert dt.min() >= cfg.dt_min * 0.999 and dt.max() <= cfg.dt_max * 1.001
    assert dt.log().std() > 0.5  # log-uniform over [1e-3, 0.1], not a constant
    for name, value in (("B_bias", 1.0), ("C_bias", 1.0), ("D", 1.0), ("mimo_x", 0.25), ("mimo_z", 1.0),
                        ("mimo_o", 0.25)):
        assert torch.all(getattr(mixer, name) == value), name
    assert mixer.in_proj.bias is None and mixer.out_proj.bias is None


def test_optim_groups_exempt_biases_norms_D_and_the_mimo_scales():
    model = Mamba3LM(small_config(is_mimo=True, mimo_rank=2))
    decay, no_decay = model.optim_groups(0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted({names[id(p)].split(".")[-2] + "." + names[id(p)].split(".")[-1] for p in decay["params"]}) == \
        ["embedding.weight", "in_proj.weight", "out_proj.weight"]
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_config_rejects_what_the_official_module_refuses():
    for kw, message in ((dict(rope_fraction=0.25), "rope_fraction must be 0.5 or 1.0"),
                        (dict(headdim=7), "multiple of headdim"), (dict(ngroups=3), "multiple of ngroups"),
                        (dict(d_state=2), "at least one rotated pair"), (dict(is_mimo=1), "True or False"),
                        (dict(A_floor=0.0), "A_floor must be positive"), (dict(mimo_rank=0), "positive integer"),
                        (dict(norm_epsilon=-1.0), "norm_epsilon must be a positive number"),  # NaN logits
                        (dict(norm_epsilon=float("nan")), "norm_epsilon must be a positive number"),
                        (dict(norm_epsilon=None), "norm_epsilon must be a positive number"),
                        (dict(A_activation="exp"), r"A_activation must be one of \('heavy_tail', 'softplus'\)")):
        with pytest.raises(ValueError, match=message):
            small_config(**kw)


def test_bf16_weights_keep_the_official_fp32_parameters_and_run_close_to_fp32():
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(is_mimo=True, mimo_rank=2)))
    ids = torch.randint(0, 29, (2, 12))
    ref = model(ids)
    m3.cast_parameters(model, torch.bfloat16)
    mixer = model.backbone.layers[0].mixer
    for name in ("dt_bias", "B_bias", "C_bias", "D", "mimo_x", "mimo_z", "mimo_o"):
        assert getattr(mixer, name).dtype == torch.float32, name
    assert mixer.in_proj.weight.dtype == torch.bfloat16
    got = model(ids).float()
    assert (got - ref).abs().max() / ref.abs().max() < 0.05


# ------------------------------------------------------------------------------------------------
# 5. Recurrent inference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(is_mimo=True, mimo_rank=2, is_outproj_norm=True)], ids=["siso", "mimo"])
def test_prefill_then_50_steps_reproduce_the_parallel_forward(kw):
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(**kw))).double()
    ids = torch.randint(0, 29, (2, 57))
    full = model(ids)
    logits, cache = model.prefill(ids[:, :7])
    outs = [logits]
    for t in range(7, 57):
        outs.append(model.step(ids[:, t], cache).unsqueeze(1))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-10, rtol=1e-9)


def test_prefill_cache_owns_exactly_its_bytes():
    model = Mamba3LM(small_config(is_mimo=True, mimo_rank=2))
    _, cache = model.prefill(torch.randint(0, 29, (3, 20)))
    b, H, P, N, R, S = 3, 4, 8, 8, 2, 2
    expected = 4 * (b * H * S + b * H * P * N + b * R * H * N + b * H * P)  # fp32
    for layer_cache in cache:
        assert [tuple(t.shape) for t in layer_cache] == [(b, H, S), (b, H, P, N), (b, R, H, N), (b, H, P)]
        assert sum(t.untyped_storage().nbytes() for t in layer_cache) == expected


def test_step_rejects_a_cache_that_does_not_fit():
    model = Mamba3LM(small_config())
    _, cache = model.prefill(torch.randint(0, 29, (2, 5)))
    with pytest.raises(ValueError, match="cache must be a list of 2"):
        model.step(torch.tensor([1, 2]), cache[:1])
    with pytest.raises(ValueError, match=r"cache\[0\] angle must have shape \(3, 4, 2\)"):
        model.step(torch.tensor([1, 2, 3]), cache)
    bad = [list(c) for c in cache]
    bad[1][2] = bad[1][2].double()
    with pytest.raises(ValueError, match=r"cache\[1\] k must be torch.float32"):
        model.step(torch.tensor([1, 2]), bad)
    # step writes every state in place: layers that share one state would mix their updates
    with pytest.raises(ValueError, match=r"cache\[1\] angle shares its memory with cache\[0\]"):
        model.step(torch.tensor([1, 2]), [cache[0]] * 2)
    before = [t.clone() for t in cache[0]]
    with pytest.raises(ValueError, match="repeats one row in memory"):
        model.step(torch.tensor([1, 2]), [cache[0], tuple(t[:1].expand_as(t) for t in cache[1])])
    assert all(torch.equal(a, b) for a, b in zip(before, cache[0]))  # refused before writing anything


def test_batched_greedy_generate_equals_each_row_alone():
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(is_mimo=True, mimo_rank=2))).double()
    prompts = torch.randint(0, 29, (3, 6))
    together = model.generate(prompts, 12, top_k=1)
    for i in range(3):
        alone = model.generate(prompts[i:i + 1], 12, top_k=1)
        assert torch.equal(together[i:i + 1], alone)
    # and greedy decoding is the teacher-forced argmax of the parallel forward
    logits = model(together[:, :-1])[:, 5:, :29]
    assert torch.equal(logits.argmax(-1), together[:, 6:])


# ------------------------------------------------------------------------------------------------
# Loading Mamba-3 checkpoints (pretrained.py)
# ------------------------------------------------------------------------------------------------

def write_official_checkpoint(folder, model, ssm_cfg=None, **top):
    """A folder in the official MambaLMHeadModel layout, written by hand from the config."""
    cfg = model.cfg
    top = dict(dict(d_intermediate=0), **top)
    d = dict(d_model=cfg.d_model, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size,
             ssm_cfg=ssm_cfg or dict(layer="Mamba3", d_state=cfg.d_state, headdim=cfg.headdim, ngroups=cfg.ngroups,
                                     rope_fraction=cfg.rope_fraction, is_mimo=cfg.is_mimo, mimo_rank=cfg.mimo_rank,
                                     is_outproj_norm=cfg.is_outproj_norm, chunk_size=cfg.chunk_size),
             attn_layer_idx=[], attn_cfg={}, rms_norm=True, residual_in_fp32=True, fused_add_norm=True,
             pad_vocab_size_multiple=cfg.pad_vocab_size_multiple, tie_embeddings=True, **top)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(d, f)
    torch.save(model.state_dict(), os.path.join(folder, "pytorch_model.bin"))


def test_official_layout_round_trips_strictly(tmp_path):
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(is_mimo=True, mimo_rank=2, is_outproj_norm=True)))
    write_official_checkpoint(tmp_path, model)
    loaded = pretrained.load(str(tmp_path), cls=Mamba3LM)
    assert loaded.cfg.is_mimo and loaded.cfg.mimo_rank == 2 and loaded.cfg.is_outproj_norm
    ids = torch.randint(0, 29, (2, 9))
    assert torch.equal(loaded(ids), model(ids))
    half = pretrained.load(str(tmp_path), dtype=torch.bfloat16, cls=Mamba3LM)
    assert half.backbone.layers[0].mixer.B_bias.dtype == torch.float32
    assert half.backbone.layers[0].mixer.out_proj.weight.dtype == torch.bfloat16


def test_the_published_layout_loads_bf16_weights_strictly(tmp_path):
    """As official MambaLMHeadModel.save_pretrained writes a model trained in bf16: config.json
    holds exactly MambaConfig's fields, the weights are bf16 and include the tied lm_head."""
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(is_mimo=True, mimo_rank=2, pad_vocab_size_multiple=16)))
    model.bfloat16().float()  # every weight a bf16 value
    config = dict(d_model=16, d_intermediate=0, n_layer=2, vocab_size=29,
                  ssm_cfg=dict(layer="Mamba3", d_state=8, headdim=8, ngroups=2, is_mimo=True, mimo_rank=2,
                               chunk_size=4),
                  attn_layer_idx=[], attn_cfg={}, rms_norm=True, residual_in_fp32=True, fused_add_norm=True,
                  pad_vocab_size_multiple=16, tie_embeddings=True)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    torch.save({k: v.bfloat16() for k, v in model.state_dict().items()}, tmp_path / "pytorch_model.bin")
    loaded = pretrained.load(str(tmp_path), cls=Mamba3LM)
    assert loaded.lm_head.weight.shape == (32, 16) and loaded.lm_head.weight is loaded.backbone.embedding.weight
    ids = torch.randint(0, 29, (2, 9))
    assert torch.equal(loaded(ids), model(ids))


def test_a_float64_checkpoint_loads_in_float64_without_rounding(tmp_path):
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(is_mimo=True, mimo_rank=2)).double())  # digits beyond fp32
    write_official_checkpoint(tmp_path, model)
    loaded = pretrained.load(str(tmp_path), dtype=torch.float64, cls=Mamba3LM)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert b.dtype == torch.float64 and torch.equal(a, b), name


def test_safetensors_without_the_tied_head_loads(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config()))
    write_official_checkpoint(tmp_path, model)
    os.remove(os.path.join(tmp_path, "pytorch_model.bin"))
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    safetensors.save_file(sd, os.path.join(tmp_path, "model.safetensors"))
    ids = torch.randint(0, 29, (2, 9))
    assert torch.equal(pretrained.load(str(tmp_path), cls=Mamba3LM)(ids), model(ids))


class RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("change,message", [
    (lambda folder, sd: open(os.path.join(folder, "config.json"), "w").write("{not json"), "is not valid JSON"),
    (lambda folder, sd: sd.pop("backbone.layers.0.mixer.B_bias"), "missing"),
    (lambda folder, sd: sd.update({"backbone.layers.1.mixer.D": torch.ones(5)}), r"has shape \(5,\)"),
    (lambda folder, sd: sd.update({"backbone.layers.0.mixer.A_log": torch.ones(4)}), "unexpected"),
    (lambda folder, sd: sd.update({"extra": RunsCode()}), "could not be read"),
])
def test_bad_checkpoints_are_refused_with_clear_errors(tmp_path, change, message):
    model = Mamba3LM(small_config())
    write_official_checkpoint(tmp_path, model)
    sd = model.state_dict()
    change(str(tmp_path), sd)
    torch.save(sd, os.path.join(tmp_path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match=message):
        pretrained.load(str(tmp_path), cls=Mamba3LM)


# The official Mamba3 constructor's arguments and defaults, copied by hand from
# mamba_ssm/modules/mamba3.py at official main (e9594ce), and MambaConfig's (models/config_mamba.py)
# and MixerModel's (norm_epsilon) LM fields: the contract the config follows.
OFFICIAL_MAMBA3_ARGUMENTS = dict(d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, dt_min=0.001,
                                 dt_max=0.1, dt_init_floor=1e-4, A_floor=1e-4, is_outproj_norm=False, is_mimo=False,
                                 mimo_rank=4, fuse_pregate_headwise_norm=True, chunk_size=64, dropout=0.0,
                                 layer_idx=None, n_layer=None, device=None, dtype=None)
OFFICIAL_KERNEL_ONLY = {"fuse_pregate_headwise_norm", "dropout", "layer_idx", "n_layer", "device", "dtype"}
OFFICIAL_LM_DEFAULTS = dict(residual_in_fp32=True, pad_vocab_size_multiple=8, tie_embeddings=True, norm_epsilon=1e-5)


def test_mamba3_config_defaults_are_the_official_modules():
    cfg = Mamba3Config(d_model=64, n_layer=1, vocab_size=10)
    for name, value in OFFICIAL_MAMBA3_ARGUMENTS.items():
        if name not in OFFICIAL_KERNEL_ONLY:
            assert getattr(cfg, name) == value, name
    for name, value in OFFICIAL_LM_DEFAULTS.items():
        assert getattr(cfg, name) == value, name
    assert cfg.A_activation == "heavy_tail"  # official main's A
    assert pretrained._MAMBA3_IGNORED == OFFICIAL_KERNEL_ONLY
    assert pretrained._MAMBA3_SSM_FIELDS == set(OFFICIAL_MAMBA3_ARGUMENTS) - OFFICIAL_KERNEL_ONLY


def test_every_official_ssm_cfg_field_reaches_the_config(tmp_path):
    """Each official field off its default in ssm_cfg, with the kernel-only arguments (accepted,
    ignored) and this file's A_activation: the loaded config holds every value."""
    fields = dict(d_state=8, expand=4, headdim=8, ngroups=2, rope_fraction=1.0, dt_min=0.002, dt_max=0.05,
                  dt_init_floor=2e-4, A_floor=0.03, is_outproj_norm=True, is_mimo=True, mimo_rank=2, chunk_size=8,
                  A_activation="softplus")
    assert all(fields[k] != v for k, v in OFFICIAL_MAMBA3_ARGUMENTS.items() if k in fields)
    assert set(fields) - {"A_activation"} == set(OFFICIAL_MAMBA3_ARGUMENTS) - OFFICIAL_KERNEL_ONLY
    kernel_only = dict(fuse_pregate_headwise_norm=False, dropout=0.1, layer_idx=5, n_layer=9, device="cuda:0",
                       dtype="bfloat16")
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(**fields)))
    write_official_checkpoint(tmp_path, model, ssm_cfg=dict(layer="Mamba3", **fields, **kernel_only))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every field is known: none is called ignored (A_activation is not)
        loaded = pretrained.load(str(tmp_path), cls=Mamba3LM)
    for name, value in fields.items():
        assert getattr(loaded.cfg, name) == value, name
    assert loaded.cfg.n_layer == 2 and loaded.lm_head.weight.dtype == torch.float32  # kernel-only: ignored
    ids = torch.randint(0, 29, (2, 9))
    assert torch.equal(loaded(ids), model(ids))


def test_A_variant_losses_are_each_variants_cross_entropy(tmp_path):
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(is_mimo=True, mimo_rank=2))).double()
    ids = torch.randint(0, 29, (3, 17))
    losses = pretrained.A_variant_losses(model, ids)
    assert model.cfg.A_activation == "heavy_tail"  # left as it was
    for variant in m3.A_ACTIVATIONS:
        other = Mamba3LM(small_config(is_mimo=True, mimo_rank=2, A_activation=variant)).double()
        other.load_state_dict(model.state_dict())
        log_p = torch.log_softmax(other(ids)[:, :-1, :29], dim=-1)  # (3, 16, 29): the padding's 3 left out
        expected = -log_p.gather(-1, ids[:, 1:, None]).mean().item()
        assert abs(losses[variant] - expected) < 1e-9 * expected, variant
    write_official_checkpoint(tmp_path, model.float())
    from_folder = pretrained.A_variant_losses(str(tmp_path), ids)
    assert all(abs(from_folder[v] - losses[v]) < 1e-4 for v in m3.A_ACTIVATIONS)


@pytest.mark.parametrize("trained_with", m3.A_ACTIVATIONS)
def test_A_variant_losses_name_the_variant_a_model_was_built_with(trained_with):
    """Text sampled from a model is likelier under the model's own A (the expected gap is the mean
    KL divergence between the two predictions, 0.04 to 0.07 nats on these random weights)."""
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(A_activation=trained_with))).double()
    text = model.generate(torch.randint(0, 29, (8, 1)), 100, generator=torch.Generator().manual_seed(1))
    losses = pretrained.A_variant_losses(model, text)
    other = next(v for v in m3.A_ACTIVATIONS if v != trained_with)
    assert losses[trained_with] < losses[other] - 0.02, losses


@pytest.mark.parametrize("ids,message", [
    (torch.ones(2, 5), "integer tensor of shape"), (torch.ones(5, dtype=torch.long), "integer tensor of shape"),
    (torch.ones(2, 1, dtype=torch.long), "L >= 2"), (torch.ones(0, 4, dtype=torch.long), "b >= 1"),
    (torch.full((1, 4), 29), r"in \[0, vocab_size = 29\)"),
])
def test_A_variant_losses_refuse_what_is_not_token_ids(ids, message):
    with pytest.raises(ValueError, match=message):
        pretrained.A_variant_losses(Mamba3LM(small_config()), ids)
    with pytest.raises(ValueError, match="load_kwargs apply to a path only"):
        pretrained.A_variant_losses(Mamba3LM(small_config()), torch.ones(1, 3, dtype=torch.long), dtype=torch.bfloat16)


@pytest.mark.parametrize("ssm_cfg,message", [
    (dict(layer="Mamba2", d_state=8), "describes a Mamba-2 model; Mamba3LM loads Mamba-3"),
    (dict(layer="Mamba3", d_state=8, rope_fraction=0.3), "rope_fraction must be 0.5 or 1.0"),
])
def test_configs_that_are_not_this_model_are_refused(tmp_path, ssm_cfg, message):
    write_official_checkpoint(tmp_path, Mamba3LM(small_config()), ssm_cfg=dict(ssm_cfg, headdim=8, ngroups=2))
    with pytest.raises(ValueError, match=message):
        pretrained.load(str(tmp_path), cls=Mamba3LM)


def test_ssm_cfg_fields_the_official_module_ignores_are_ignored_with_a_warning(tmp_path):
    # the official Mamba3 takes **kwargs and drops what it does not know (a Mamba-2 config's d_conv,
    # say): the same model loads, and the warning names the fields
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config()))
    write_official_checkpoint(tmp_path, model, ssm_cfg=dict(layer="Mamba3", d_state=8, headdim=8, ngroups=2,
                                                            chunk_size=4, d_conv=4, not_a_field=1))
    with pytest.warns(UserWarning, match=r"ssm_cfg fields \['d_conv', 'not_a_field'\] are not Mamba3 arguments"):
        loaded = pretrained.load(str(tmp_path), cls=Mamba3LM)
    ids = torch.randint(0, 29, (2, 9))
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)


def test_the_published_layout_with_an_mlp_after_every_mixer_loads_strictly(tmp_path):
    # the state-spaces/mamba3-* checkpoints put the official GatedMLP after every mixer
    # (d_intermediate > 0: norm2, mlp.fc1, mlp.fc2); a config that asks for it with weights that lack
    # it fails the strict key check by name
    torch.manual_seed(0)
    model = perturbed(Mamba3LM(small_config(d_intermediate=48)))
    write_official_checkpoint(tmp_path, model, d_intermediate=48)
    loaded = pretrained.load(str(tmp_path), cls=Mamba3LM)
    ids = torch.randint(0, 29, (2, 9))
    assert loaded.cfg.d_intermediate == 48 and torch.equal(loaded(ids), model(ids))
    write_official_checkpoint(tmp_path, Mamba3LM(small_config()), d_intermediate=48)
    with pytest.raises(ValueError, match=r"missing \['backbone.layers.0.mlp.fc1.weight'"):
        pretrained.load(str(tmp_path), cls=Mamba3LM)


def test_a_non_finite_input_poisons_its_chunk_and_later_ones_but_no_earlier_chunk():
    # mamba3_chunked's docstring, as ssd's: an inf at t makes earlier outputs of its chunk NaN; earlier
    # chunks and other rows stay as they were, the loop stays causal
    inputs = mamba3_inputs(b=2, L=13, seed=4)
    poisoned = dict(inputs, v=inputs["v"].clone())
    poisoned["v"][0, 7, 1, 0] = float("inf")  # row 0, position 7: chunk 1 of [0-4], [5-9], [10-12]
    y = m3.mamba3_chunked(**poisoned, chunk_size=5)
    clean = m3.mamba3_chunked(**inputs, chunk_size=5)
    assert torch.equal(y[0, :5], clean[0, :5]) and torch.equal(y[1], clean[1])
    assert y[0, 5:7].isnan().any()
    loop, _ = m3.mamba3_sequential(**poisoned)
    assert torch.isfinite(loop[0, :7]).all() and not torch.isfinite(loop[0, 7]).all()

