"""
mamba3_minimal.py: Mamba-3 (Lahoti, Li, Chen, Wang, Bick, Kolter, Dao, Gu, 2026, arXiv 2603.15569)
in plain PyTorch, with the parameter names of the official module (mamba_ssm/modules/mamba3.py,
class Mamba3), so that its state_dict loads strictly.

Mamba-2 (mamba2_minimal.py) gave each head one decay per token and wrote x_t·B_tᵀ into the
state with the first-order (exponential-Euler) weight Δ_t (section 2). Mamba-3 changes three
things, each a lesson of the earlier files taken one step further:

  - exponential-trapezoidal discretization: the input enters the state through a trapezoid over
    the step, a data-dependent mix λ_t of the token before and the token now (section 2);
  - complex states as rotations: a complex, data-dependent A is the same as rotating B and C by
    an accumulated angle, RoPE whose angles the data choose (section 2);
  - MIMO: rank-R projections per head make the state update a small matmul instead of an outer
    product, more work per byte of state (sections 1 and 3).

There is no short convolution; A is data-dependent per token and head; B and C go through an
RMSNorm and get a learned per-head bias. Sections, in the order of the idea:

    1. The recurrence          mamba3_step(), mamba3_sequential(): one token, the loop (the oracle)
    2. Why these equations     scalar_ode_step() (Euler, exponential-Euler, exponential-trapezoidal),
                               rotate(): complex states as rotations of q and k
    3. The chunked form        mamba3_chunked(): matmuls inside chunks, pscan.scan across chunks
    4. The model               Mamba3Config, Mamba3Mixer (the official Mamba3 block), Mamba3LM
    5. Recurrent inference     the (angle, ssm, k, v) cache and an O(1) step per token (a note in Mamba3LM)
    Appendix                   the angle in fp32; input checks

This file knows no checkpoint layout: pretrained.py loads the official MambaLMHeadModel layout
into a Mamba3LM (pretrained.load("state-spaces/mamba3-siso-187m")), and pretrained.A_variant_losses
tells which A_activation a checkpoint was trained with (see Mamba3Config).

Glossary (code name: paper symbol, meaning). One name, one meaning. The SSM is written as linear
attention, as the official kernels are: the query q is the paper's C, the key k is B, the value
v is the head's input x.

    b        batch size
    L        sequence length
    H        number of heads, nheads = d_inner / headdim
    P        head dimension, headdim
    G, N     ngroups and d_state: q and k are (b, L, R, G, N), shared by the H/G heads of a group
    R        MIMO rank, mimo_rank (1: SISO, the plain outer-product update)
    S        number of rotated pairs, num_rope_angles = d_state·rope_fraction / 2
    T        chunk_size, the length of one chunk in mamba3_chunked()
    v        the SSM's input per head, in_proj's x (official V)          (b, L, H, P)
    q, k     C and B after their RMSNorm, before the per-head bias       (b, L, R, G, N);
             the state keeps the previous token's k after its bias and rotation, as k_prev
    dt       Δ, the step size, per token and head                         (b, L, H)
    adt      Δ·A, the log-decay per token and head (A < 0, per token)     (b, L, H)
    lam      λ = sigmoid(trap), the trapezoid's weight on the token now   (b, L, H)
    theta    θ = π·tanh(angles), the angular velocity of each pair        (b, L, H, S)
    angle    the accumulated angle Σ Δ·θ of each pair, kept in [0, 2π)    (b, H, S)
    h        the state of one head, a P x N matrix                        (b, H, P, N)
    alpha, beta, gamma   α_t = exp(Δ_t·A_t), β_t = (1 − λ_t)·Δ_t·α_t, γ_t = λ_t·Δ_t

Read mamba_minimal.py, pscan.py and mamba2_minimal.py first; this file does not import
mamba2_minimal.py. It reuses mamba_minimal.py's RMSNorm, Δ init and LM (MambaLM: prefill, step,
sampling, generate), pscan.py's scan across chunks and segsum (section 10 there, the segment sums
of Mamba-2), mamba_engine.py's compute-dtype helpers, and hybrid.py's backbone (the official
checkpoints have a gated MLP after every mixer) and the checks of its fields.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybrid
import mamba_minimal as mm
import pscan
from mamba_engine import _in_compute_dtype, _without_autocast
from mamba_minimal import RMSNorm, _at_least_fp32
from pscan import segsum

TWO_PI = 2 * math.pi
PAIRINGS = ("adjacent", "halves")


# ------------------------------------------------------------------------------------------------
# 1. The recurrence
# ------------------------------------------------------------------------------------------------
# One head, one token, the paper's recurrence (as the official Mamba3.step and the official tests'
# mamba3_siso_step_ref compute it; section 2 on which entries of q and k pair up, and on the mod 2π):
#
#     angle_t = angle_{t-1} + Δ_t·θ_t  (mod 2π)            one angle per rotated pair of q and k
#     q̃_t, k̃_t = q_t, k_t (plus their per-head bias) rotated by angle_t    (section 2)
#     h_t = α_t·h_{t-1} + β_t·v_{t-1}·k̃_{t-1}ᵀ + γ_t·v_t·k̃_tᵀ              h: (P, N)
#     y_t = h_t·q̃_t + D·v_t
#
# α_t = exp(Δ_t·A_t), β_t = (1 − λ_t)·Δ_t·α_t, γ_t = λ_t·Δ_t. Mamba-2 is the case λ = 1 without
# rotation: h_t = α_t·h_{t-1} + Δ_t·v_t·k_tᵀ. The β term reads the previous token's k and v,
# so the recurrent state is four tensors (angle, h, k̃_{t-1}, v_{t-1}), the official cache.
#
# MIMO of rank R: each head has R keys and queries per token, and R values v_{t,r} = v_t ∘ mimo_x[r]
# (a learned scale per channel and rank). The update sums R outer products, Σ_r v_{t,r}·k̃_{t,r}ᵀ:
# a (P, R) x (R, N) matmul instead of a (P, 1) x (1, N) outer product, R times the arithmetic on
# the same state (decode reads and writes h once per token whatever R is). Each
# rank reads its own output y_{t,r} = h_t·q̃_{t,r} + D·v_{t,r}; the mixer (section 4) gates and
# mixes the R outputs back into one with mimo_o. R = 1 with mimo_x = 1 is SISO.

def _per_head(t, bias, H):
    """q or k (..., R, G, N) -> (..., R, H, N): head j reads group j // (H/G), plus its bias (H, R, N)."""
    t = t.repeat_interleave(H // t.shape[-2], dim=-2)
    return t if bias is None else t + bias.transpose(0, 1).to(t.dtype)


def _values(v, mimo_x):
    """v (..., H, P) -> (..., R, H, P): the R values of each head, v ∘ mimo_x[r] (SISO: v itself)."""
    return v.unsqueeze(-3) if mimo_x is None else v.unsqueeze(-3) * mimo_x.transpose(0, 1).to(v.dtype)


@_without_autocast  # the state and its sums in fp32 even under bf16 autocast
def mamba3_step(state, q, k, v, dt, adt, lam, theta, q_bias=None, k_bias=None, D=None, mimo_x=None,
                pairing="adjacent"):
    """One token for every head at once (the loop below runs it over t; Mamba3Mixer.step runs it
    on the cache).

    Args:
        state: (angle (b, H, S), h (b, H, P, N), k (b, R, H, N), v (b, H, P)); k is the previous
               token's rotated key, v its input
        q, k:  (b, R, G, N)   this token's query and key (C and B), before the bias
        v:     (b, H, P)      this token's input
        dt, adt, lam: (b, H)  Δ, Δ·A and λ
        theta: (b, H, S)      angular velocities
        q_bias, k_bias: (H, R, N) or None;  D: (H,) or None;  mimo_x: (H, R, P) or None (SISO)
        pairing: "adjacent" (SISO) or "halves" (MIMO): which entries of q and k rotate together
    Returns:
        y (b, R, H, P), the new state (same layout)
    """
    angle, h, k_prev, v_prev = state
    H = v.shape[-2]
    angle = torch.remainder(angle + dt[..., None] * theta, TWO_PI)  # (b, H, S)
    q = rotate(_per_head(q, q_bias, H), angle.unsqueeze(-3), pairing)  # (b, R, H, N)
    k = rotate(_per_head(k, k_bias, H), angle.unsqueeze(-3), pairing)  # (b, R, H, N)
    alpha = torch.exp(adt)  # (b, H)
    beta = (1 - lam) * dt * alpha  # (b, H)
    gamma = lam * dt  # (b, H)
    vr, vr_prev = _values(v, mimo_x), _values(v_prev, mimo_x)  # (b, R, H, P) each
    # Σ_r v_r·k_rᵀ as one matmul over r: (b, H, P, R) @ (b, H, R, N)
    kv_now = vr.movedim(-3, -1) @ k.movedim(-3, -2)  # (b, H, P, N)
    kv_prev = vr_prev.movedim(-3, -1) @ k_prev.movedim(-3, -2)  # (b, H, P, N)
    h = alpha[..., None, None] * h + beta[..., None, None] * kv_prev + gamma[..., None, None] * kv_now
    y = (h @ q.movedim(-3, -1)).movedim(-1, -3)  # (b, R, H, P): y_r = h·q_r
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * vr
    return y, (angle, h, k, v)


@_without_autocast
def mamba3_sequential(q, k, v, dt, adt, lam, theta, q_bias=None, k_bias=None, D=None, mimo_x=None,
                      state=None, pairing="adjacent"):
    """The recurrence as a loop over t: slow, obviously right.

    Args: as mamba3_step, with a time axis after the batch: q, k (b, L, R, G, N), v (b, L, H, P),
        dt, adt, lam (b, L, H), theta (b, L, H, S); state as mamba3_step's, or None for zeros.
    Returns:
        y (b, L, R, H, P) and the final state, computed in fp32 at least (fp64 for fp64 inputs)
    """
    _check_mamba3_inputs(q, k, v, dt, adt, lam, theta, q_bias, k_bias, D, mimo_x, state, pairing)
    q, k, v, dt, adt, lam, theta = _in_compute_dtype(q, k, v, dt, adt, lam, theta)
    state = _initial_state(state, v, q.shape[2], q.shape[-1], theta.shape[-1])
    ys = []
    # unbind, not v[:, t]: see pscan.py section 1 (indexing makes the backward quadratic in L)
    for q_t, k_t, v_t, dt_t, adt_t, lam_t, theta_t in zip(*(t.unbind(1) for t in (q, k, v, dt, adt, lam, theta))):
        y_t, state = mamba3_step(state, q_t, k_t, v_t, dt_t, adt_t, lam_t, theta_t, q_bias, k_bias, D,
                                 mimo_x, pairing)
        ys.append(y_t)
    return torch.stack(ys, dim=1), state


def _initial_state(state, v, R, N, S):
    """The given (angle, h, k, v) in the compute dtype, or zeros (nothing seen yet)."""
    b, _, H, P = v.shape
    if state is None:
        return (v.new_zeros(b, H, S), v.new_zeros(b, H, P, N), v.new_zeros(b, R, H, N), v.new_zeros(b, H, P))
    return tuple(t.to(v.dtype) for t in state)


# ------------------------------------------------------------------------------------------------
# 2. Why these equations
# ------------------------------------------------------------------------------------------------
# Discretization. Take one scalar channel of the continuous SSM, h'(τ) = A·h(τ) + u(τ), with u the
# input (B·x). Over one step of length Δ the exact solution is
#
#     h(τ + Δ) = exp(Δ·A)·h(τ) + ∫_0^Δ exp((Δ − s)·A)·u(τ + s) ds
#
# and a rule is a way to approximate the integral from the inputs at the two ends of the step:
#
#     Euler                     h_t = (1 + Δ·A)·h_{t-1} + Δ·u_{t-1}             error O(Δ)
#     exponential-Euler         h_t = exp(Δ·A)·h_{t-1} + Δ·u_t                  error O(Δ)
#       (Mamba-1 and 2: "ZOH" for A, the decay exact; the integral as the box Δ·u_t)
#     exponential-trapezoidal   h_t = exp(Δ·A)·h_{t-1} + (1 − λ)·Δ·exp(Δ·A)·u_{t-1} + λ·Δ·u_t
#       the integrand at s = 0 is exp(Δ·A)·u_{t-1}, at s = Δ it is u_t: a trapezoid mixes the two.
#       λ = 1/2 is the trapezoid rule, error O(Δ²); λ = 1 is exponential-Euler again.
#
# The errors are global (at a fixed end time, after 1/Δ steps); each halving of Δ halves the error
# of the first two rules and quarters that of the third (test_mamba3.py checks it on an ODE with a
# known solution). Mamba-3 learns λ_t = sigmoid(trap_t) per token and head:
# a data-dependent trapezoid, with α, β, γ of section 1 its three coefficients.

def scalar_ode_step(rule, h, A, dt, u_prev, u_now, lam=0.5):
    """One step of h' = A·h + u by one of the three rules above; tensors or Python floats."""
    exp = torch.exp if isinstance(dt * A, torch.Tensor) else math.exp
    if rule == "euler":
        return (1 + dt * A) * h + dt * u_prev
    if rule == "exponential_euler":
        return exp(dt * A) * h + dt * u_now
    if rule == "exponential_trapezoidal":
        alpha = exp(dt * A)
        return alpha * h + (1 - lam) * dt * alpha * u_prev + lam * dt * u_now
    raise ValueError(f"rule must be 'euler', 'exponential_euler' or 'exponential_trapezoidal', got {rule!r}")


# Complex states as rotations. A real diagonal A can only decay; a complex one,
# A + iθ, also turns each state entry around the origin, which lets the model count and track
# parity-like features. Take one pair of state columns as one complex number. With a key pair
# (k_0, k_1) written κ_k = k_0 − i·k_1 and a query pair κ_q = q_0 + i·q_1 (the key conjugated, so
# that Re(κ_q·κ_k) = q_0·k_0 + q_1·k_1, the dot product a real state computes), the complex recurrence
#
#     g_t = exp(Δ_t·(A_t + iθ_t))·g_{t-1} + ... + γ_t·v_t·κ_{k,t},      y_t = Re(κ_{q,t}·g_t)
#
# gives, with φ_t = Σ_{s≤t} Δ_s·θ_s the accumulated angle, g_t = Σ_s w_{t,s}·e^{i(φ_t − φ_s)}·v_s·κ_{k,s}
# (w_{t,s} the real decays and trapezoid weights) and
#
#     Re(κ_{q,t}·e^{i(φ_t − φ_s)}·κ_{k,s}) = ⟨R(φ_t)·q_t, R(φ_s)·k_s⟩
#
# with R(φ) the 2x2 rotation by φ. So the complex state is a real state fed with keys rotated by
# their own φ_s and read with queries rotated by φ_t: RoPE, except that the angles are not the
# positions times fixed frequencies but a running sum of data-dependent increments Δ_s·θ_s. The
# state stays real and no complex arithmetic runs.
#
# The angle itself is the fourth part of the recurrent state, and only its value mod 2π matters
# to cos and sin. This file keeps it in [0, 2π) at every token, in the loop, the step and the
# chunked form, as the official forward kernels do (angle_dt in ops/triton/mamba3/angle_dt.py);
# the official Mamba3.step does not reduce it. The same outputs up to rounding, which the
# reduction keeps small in fp32 (the appendix, "The angle in fp32").
#
# Which entries pair up is a convention of the official kernels: the SISO path rotates adjacent
# entries (2j, 2j + 1), the MIMO path (Mamba3.step and the MIMO kernels) entries j and j + N/2
# (their `rotate_pairwise` flag; the official tests' mamba3_MIMO_step_ref pairs adjacent ones).
# Only the first S pairs rotate (rope_fraction of the state); the rest keep their phase.

def rotate(t, angle, pairing="adjacent"):
    """Rotate the first S pairs of t's last dim by angle. t (..., N), angle (..., S) broadcasting
    against t's leading dims -> (..., N). pairing "adjacent": pairs (2j, 2j+1); "halves": (j, j+N/2)."""
    S, N = angle.shape[-1], t.shape[-1]
    cos, sin = torch.cos(angle).to(t.dtype), torch.sin(angle).to(t.dtype)
    if pairing == "adjacent":
        pairs = t[..., :2 * S].unflatten(-1, (S, 2))  # (..., S, 2)
        t0, t1 = pairs[..., 0], pairs[..., 1]
        turned = torch.stack([t0 * cos - t1 * sin, t0 * sin + t1 * cos], dim=-1).flatten(-2)  # (..., 2S)
        return torch.cat([turned, t[..., 2 * S:]], dim=-1)
    half = N // 2
    t0, t1 = t[..., :S], t[..., half:half + S]
    return torch.cat([t0 * cos - t1 * sin, t[..., S:half], t0 * sin + t1 * cos, t[..., half + S:]], dim=-1)


# ------------------------------------------------------------------------------------------------
# 3. The chunked form
# ------------------------------------------------------------------------------------------------
# As for Mamba-2 (mamba2_minimal.py sections 2 and 3): cut the sequence into chunks of T tokens,
# compute each chunk's own contribution as a masked matrix product, and carry the state between
# chunks with pscan.scan. Two things are new.
#
# Rotations first. The angle φ_t is a cumulative sum, so every q_t and k_t can be rotated before
# anything else; after that, q and k are plain queries and keys (section 2).
#
# The trapezoid's two terms. Unroll h_t: the pair v_s·k_sᵀ enters the state at step s with weight
# γ_s, and again at step s+1 with β_{s+1} = α_{s+1}·σ_{s+1}, where σ_t = (1 − λ_t)·Δ_t; both then
# decay to t. So its weight in h_t is
#
#     exp(adt_{s+1} + ... + adt_t)·(γ_s + σ_{s+1})   for t > s,     γ_s   for t = s      (adt = Δ·A)
#
# and inside a chunk, from a zero state, y = (W ∘ Q·Kᵀ)·V with the (T, T) mask
#
#     W[t, s] = exp(adt_{s+1} + ... + adt_t)·(γ_s + σ_{s+1}) below the diagonal, γ_t on it, 0 above.
#
# (The official fwd reference builds the same from a mask with γ_s + σ_{s+1} everywhere and then
# subtracts σ_{t+1}·(q_t·k_t)·v_t; setting the diagonal directly subtracts nothing.) With rank R,
# position t becomes R rows (t, r): the mask is W with each entry repeated over an R x R block.
#
# Across chunks, what is carried is not h at a chunk's end e but g_e = h_e + σ_{e+1}·v_e·k_eᵀ: the
# last token's contribution that step e+1 will add, before α_{e+1} (which the carried state gets
# like every decay). Then chunk c's end value is g_c = exp(adt summed over chunk c)·g_{c-1} + E_c,
# E_c = Σ_s exp(adt_{s+1} + ... + adt_{T-1})·(γ_s + σ_{s+1})·v_s·k_sᵀ, a first-order recurrence over
# c, and y_t gains exp(adt_0 + ... + adt_t)·g_{c-1}·q_t (steps t = 0 .. T-1 inside a chunk). An
# initial state enters as g_{-1} = h0 + σ_0·v_prev·k_prevᵀ. At the sequence end there is no next
# token, σ_L = 0, so the last g is the final h exactly. Any L: the last chunk is padded with
# identity steps (Δ = 0, so α = 1 and β = γ = σ = 0), which change neither y nor the state.

@_without_autocast
def mamba3_chunked(q, k, v, dt, adt, lam, theta, q_bias=None, k_bias=None, D=None, mimo_x=None,
                   state=None, pairing="adjacent", chunk_size=64, return_state=False, scan_backend="auto",
                   reset=None):
    """Chunked Mamba-3: the same map as mamba3_sequential, with matmuls inside chunks.

    Args: as mamba3_sequential, plus
        chunk_size:   T, the length of a chunk; any L works
        return_state: also return the final (angle, h, k, v), each a tensor of its own
        scan_backend: pscan.scan's backend for the recurrence across chunks
        reset:        (b, L) bool or None: True where a new sequence starts (packed sequences): as
                      from a zero state, α = 0 there (so β = 0 too), and the angles start again at 0
    Returns:
        y (b, L, R, H, P) in fp32 at least (fp64 for fp64 inputs); with return_state also the state

    As in ssd (mamba2_minimal.py), a NaN or an infinity at position t also makes the earlier outputs
    of its chunk NaN (the zero weights of W multiply it); mamba3_sequential stays causal.
    """
    _check_mamba3_inputs(q, k, v, dt, adt, lam, theta, q_bias, k_bias, D, mimo_x, state, pairing, chunk_size)
    if scan_backend not in pscan.BACKENDS:
        raise ValueError(f"scan_backend must be one of {pscan.BACKENDS}, got {scan_backend!r}")
    if reset is not None and (not isinstance(reset, torch.Tensor) or reset.dtype != torch.bool
                              or tuple(reset.shape) != tuple(v.shape[:2])):
        raise ValueError(f"reset must be a bool tensor of shape (b, L) = {tuple(v.shape[:2])}, got "
                         f"{reset.dtype if isinstance(reset, torch.Tensor) else type(reset).__name__}")
    q, k, v, dt, adt, lam, theta = _in_compute_dtype(q, k, v, dt, adt, lam, theta)
    b, L, H, P = v.shape
    R, N, S, T = q.shape[2], q.shape[-1], theta.shape[-1], min(chunk_size, L)  # a shorter sequence: one chunk
    pad = -L % T
    n_chunks = (L + pad) // T
    if pad:  # identity steps: Δ = 0 (and Δ·A = 0), nothing read or written
        q, k, v, dt, adt, lam, theta = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
                                        for t in (q, k, v, dt, adt, lam, theta))
    if reset is not None:  # a new sequence: α = exp(-inf) = 0, and with it β = (1 − λ)·Δ·α = 0
        reset = F.pad(reset, (0, pad))  # (b, L')
        adt = torch.where(reset[..., None], -torch.inf, adt)

    # the accumulated angles, in exact arithmetic remainder(cumsum(Δ·θ), 2π) over the sequence; in
    # floating point a cumsum inside each chunk plus each chunk's start. The starts add up the
    # earlier chunks' turns, each reduced mod 2π first: their sum grows by at most 2π a chunk, not by
    # the raw turn of a chunk (which can be many times 2π), so it is rounded at a smaller size; it is
    # reduced again before it meets a chunk's cumsum
    turn = (dt[..., None] * theta).unflatten(1, (n_chunks, T))  # (b, c, T, H, S)  Δ·θ per token
    within = turn.cumsum(2)  # (b, c, T, H, S)
    chunk_turns = torch.remainder(within[:, :, -1], TWO_PI)  # (b, c, H, S)
    starts = F.pad(chunk_turns.cumsum(1), (0, 0, 0, 0, 1, 0))[:, :-1]  # (b, c, H, S)  earlier chunks
    if state is not None:
        starts = starts + state[0].to(starts.dtype).unsqueeze(1)
    angle = torch.remainder(within + torch.remainder(starts, TWO_PI).unsqueeze(2), TWO_PI)  # (b, c, T, H, S)
    angle = angle.flatten(1, 2)  # (b, L', H, S)
    if reset is not None:  # from the start of its sequence: subtract the angle of the token before it
        positions = torch.arange(angle.shape[1], device=v.device)
        start = torch.where(reset, positions, 0).cummax(1).values  # (b, L')  0 in the first sequence
        before = angle.gather(1, (start - 1).clamp(min=0)[..., None, None].expand_as(angle))  # (b, L', H, S)
        angle = torch.where((start > 0)[..., None, None], torch.remainder(angle - before, TWO_PI), angle)
    angle = angle.unsqueeze(2)  # (b, L', 1, H, S), broadcast over the ranks
    q = rotate(_per_head(q, q_bias, H), angle, pairing)  # (b, L', R, H, N)
    k = rotate(_per_head(k, k_bias, H), angle, pairing)  # (b, L', R, H, N)
    vr = _values(v, mimo_x)  # (b, L', R, H, P)

    # the trapezoid's weights: γ_s on the token now, σ_{s+1} for the step after it
    gamma = lam * dt  # (b, L', H)
    sigma = (1 - lam) * dt  # (b, L', H)
    sigma_next = F.pad(sigma[:, 1:], (0, 0, 0, 1))  # (b, L', H)  σ_{s+1}, 0 after the last token

    def chunks(t):  # (b, L', ...) -> (b, c, H, T, ...), heads before time
        return t.unflatten(1, (n_chunks, T)).movedim(3, 2) if t.dim() == 3 else \
            t.unflatten(1, (n_chunks, T)).movedim(-2, 2)

    adt_c = chunks(adt)  # (b, c, H, T)
    weight = chunks(gamma + sigma_next)  # (b, c, H, T)
    # positions (t, r) side by side: (b, c, H, T·R, ·)
    Q = chunks(q).flatten(3, 4)  # (b, c, H, T·R, N)
    K = chunks(k).flatten(3, 4)  # (b, c, H, T·R, N)
    V = chunks(vr).flatten(3, 4)  # (b, c, H, T·R, P)

    # 1. inside each chunk, from a zero state: y = (W ∘ Q·Kᵀ)·V
    below = torch.ones(T, T, dtype=torch.bool, device=v.device).tril(-1)
    W = torch.where(below, torch.exp(segsum(adt_c)) * weight[..., None, :], 0)  # (b, c, H, T, T)
    W = W + torch.diag_embed(chunks(gamma))  # γ_t on the diagonal
    if R > 1:
        W = W.repeat_interleave(R, dim=-2).repeat_interleave(R, dim=-1)  # (b, c, H, T·R, T·R)
    y = (W * (Q @ K.transpose(-1, -2))) @ V  # (b, c, H, T·R, P)

    # Steps 2-4 matter only when a state comes in, goes out, or crosses a chunk boundary
    if n_chunks > 1 or state is not None or return_state:
        # 2. each chunk's end value E_c from a zero state
        to_end = F.pad(adt_c[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))  # (b, c, H, T)  Σ adt_{s+1..T-1}
        w_end = (torch.exp(to_end) * weight).repeat_interleave(R, dim=-1)  # (b, c, H, T·R)
        ends = (V * w_end[..., None]).transpose(-1, -2) @ K  # (b, c, H, P, N)

        # 3. across chunks: g_c = exp(adt summed over chunk c)·g_{c-1} + E_c
        decay_from_start = torch.exp(adt_c.cumsum(-1))  # (b, c, H, T)  exp(adt_0 + ... + adt_t)
        chunk_decay = decay_from_start[..., -1, None, None].expand_as(ends)  # (b, c, H, P, N)
        g0 = None
        if state is not None:
            _, h0, k0, v0 = (t.to(v.dtype) for t in state)
            kv0 = _values(v0, mimo_x).movedim(-3, -1) @ k0.movedim(-3, -2)  # (b, H, P, N)  Σ_r v_r·k_rᵀ
            g0 = h0 + sigma[:, 0, :, None, None] * kv0  # (b, H, P, N)
        g = pscan.scan(chunk_decay, ends, g0, backend=scan_backend)  # (b, c, H, P, N)
        first = torch.zeros_like(g[:, :1]) if g0 is None else g0.unsqueeze(1)
        g_in = torch.cat([first, g[:, :-1]], dim=1)  # (b, c, H, P, N)  the value entering each chunk

        # 4. what the carried-in value adds to each output, decayed to its position
        y = y + (Q @ g_in.transpose(-1, -2)) * decay_from_start.repeat_interleave(R, dim=-1)[..., None]

    y = y.unflatten(3, (T, R)).movedim(2, 4).flatten(1, 2)[:, :L]  # (b, L, R, H, P)
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * vr[:, :L]
    if not return_state:
        return y
    # each a copy: a view would keep the whole sequence's tensors alive in the cache
    final = (angle[:, L - 1, 0], g[:, -1], k[:, L - 1], v[:, L - 1])
    return y, tuple(t.clone(memory_format=torch.contiguous_format) for t in final)


# ------------------------------------------------------------------------------------------------
# 4. The model
# ------------------------------------------------------------------------------------------------
# The official MambaLMHeadModel picks its mixer by ssm_cfg["layer"]; with "Mamba3" it builds the
# Mamba3 module below, and the rest (embedding, pre-norm residual blocks with an fp32 residual
# stream, norm_f, tied head, mixer_seq_simple's init) is Mamba-1's, as in mamba2_minimal.py.
#
# A is data-dependent: in_proj gives each head a number dd_A per token, and A = -f(dd_A) with f
# positive, clamped to A ≤ -A_floor. Official main (since commit c69aaab, PR #962, "Stabilize
# data-dependent A with heavy-tail activation") takes for f the heavy-tail activation below; the
# March 2026 release (commit 5235bdc) took softplus. The two differ everywhere (f(0) = 1 against
# log 2) and most for negative dd_A, where softplus(x) ≈ e^x vanishes (4.5e-5 at x = -10, under
# the floor) and 1/(1 − x) only slowly (0.09 at -10): a decay rate that can shrink to nothing is
# what made training unstable at higher learning rates (the PR's report). Weights trained with one
# f give different outputs with the other, so the config names which: A_activation.

A_ACTIVATIONS = ("heavy_tail", "softplus")


def heavy_tail_activation(x):
    """f(x) = 1 + x for x ≥ 0 and 1/(1 − x) for x < 0: positive, continuous, slope 1 at 0 from
    both sides (official mamba_ssm/modules/mamba3.py, heavy_tail_activation). Each branch reads
    its own clamped copy of x, so that neither divides by zero where it is not used (a torch.where
    of the two would, and its gradient would be NaN there)."""
    return x.clamp(min=0) + 1 / (1 - x.clamp(max=0))


@dataclass
class Mamba3Config:
    """Field names and defaults follow the official Mamba3 module at official main (e9594ce) and
    MambaConfig (config_mamba.py).

    A_activation is not an official argument: "heavy_tail" (the default) computes A as official
    main does, "softplus" as the March 2026 release did, for weights trained with that code.
    Which of the two the published checkpoints (the state-spaces/mamba3-* models on the Hugging
    Face hub) were trained with is written neither in their config.json nor in their weights, and
    cannot be checked without downloading them: pretrained.A_variant_losses runs a checkpoint
    both ways on text the caller tokenizes, and the variant it was trained with gives the clearly
    lower loss.
    """
    d_model: int
    n_layer: int
    vocab_size: int
    d_state: int = 128
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    rope_fraction: float = 0.5
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    A_floor: float = 1e-4
    A_activation: str = "heavy_tail"  # or "softplus": the March 2026 release's A (see above)
    is_outproj_norm: bool = False
    is_mimo: bool = False
    mimo_rank: int = 4  # used only with is_mimo (the official module sets the rank to 1 otherwise)
    chunk_size: int = 64
    norm_epsilon: float = 1e-5
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    residual_in_fp32: bool = True
    # the official MambaLMHeadModel's block fields (hybrid.py section 1): an MLP after each mixer,
    # attention layers in place of some mixers, LayerNorm instead of RMSNorm
    d_intermediate: int = 0
    attn_layer_idx: list = field(default_factory=list)
    attn_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True
    scan_backend: str = "auto"  # how to run it: pscan.scan's backend across chunks
    # An ablation, off in every official model: True sets every angle θ to 0, so the state never
    # rotates and stays real, Mamba-3 without its complex states (tasks/state_tracking.py). The
    # angle projection stays in in_proj: the parameters and checkpoints are unchanged.
    rotations_off: bool = False

    def __post_init__(self):
        for name in ("d_model", "n_layer", "vocab_size", "d_state", "expand", "headdim", "ngroups",
                     "mimo_rank", "chunk_size", "pad_vocab_size_multiple"):
            value = getattr(self, name)
            if not mm._is_positive_int(value):
                raise ValueError(f"Mamba3Config.{name} must be a positive integer, got {value!r}")
        for name in ("is_outproj_norm", "is_mimo", "tie_embeddings", "residual_in_fp32", "rotations_off"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Mamba3Config.{name} must be True or False, got {getattr(self, name)!r}")
        if self.d_inner % self.headdim:
            raise ValueError(f"d_inner = expand * d_model = {self.d_inner} must be a multiple of headdim = "
                             f"{self.headdim}")
        if self.nheads % self.ngroups:
            raise ValueError(f"the number of heads d_inner / headdim = {self.nheads} must be a multiple of "
                             f"ngroups = {self.ngroups}")
        if self.rope_fraction not in (0.5, 1.0):
            raise ValueError(f"rope_fraction must be 0.5 or 1.0 (as in the official module), got {self.rope_fraction!r}")
        if self.d_state % 2 or self.num_rope_angles < 1:
            raise ValueError(f"d_state must be even and leave at least one rotated pair at rope_fraction "
                             f"{self.rope_fraction}, got d_state = {self.d_state}")
        mm.check_dt_init(self)
        if not mm._is_positive_number(self.norm_epsilon):  # -1 or NaN: every norm, so every logit, NaN
            raise ValueError(f"Mamba3Config.norm_epsilon must be a positive number, got {self.norm_epsilon!r}")
        if not mm._is_positive_number(self.A_floor):
            raise ValueError(f"A_floor must be positive (A <= -A_floor keeps every step decaying), got {self.A_floor!r}")
        if self.A_activation not in A_ACTIVATIONS:
            raise ValueError(f"Mamba3Config.A_activation must be one of {A_ACTIVATIONS} (\"heavy_tail\": official "
                             f"main; \"softplus\": the March 2026 release), got {self.A_activation!r}")
        if self.scan_backend not in pscan.BACKENDS:
            raise ValueError(f"Mamba3Config.scan_backend must be one of {pscan.BACKENDS}, got {self.scan_backend!r}")
        hybrid._check_hybrid_fields(self)

    @property
    def d_inner(self):
        return self.expand * self.d_model

    @property
    def nheads(self):
        return self.d_inner // self.headdim

    @property
    def rank(self):
        """R: mimo_rank with is_mimo, else 1."""
        return self.mimo_rank if self.is_mimo else 1

    @property
    def num_rope_angles(self):
        """S: the rotated pairs, d_state·rope_fraction rounded down to an even count, halved."""
        rotated = int(self.d_state * self.rope_fraction)
        return (rotated - rotated % 2) // 2

    @property
    def padded_vocab_size(self):
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m


class Mamba3Mixer(nn.Module):
    """The Mamba-3 block (the official `Mamba3` module, named `mixer` in the tree).

    u ─ in_proj ─┬─ z ─────────────────────────────────────────────────────────────────┐
                 ├─ x ───────────────────────────────── v ─┐                           │
                 ├─ B, C ─ RMSNorm ─────────────────── k, q ┤                           │
                 ├─ dd_dt ─ softplus(· + dt_bias) ───── Δ ──┤                           │
                 ├─ dd_A ─ −f(·), ≤ −A_floor ────────── A ──┼─ Mamba-3 SSM (+D·v) ─ ·SiLU(z)
                 ├─ trap ─ sigmoid ──────────────────── λ ──┤   (optional per-head RMSNorm
                 └─ angles ─ π·tanh ─────────────────── θ ──┘    first) ─ out_proj

    Everything the SSM reads comes from in_proj, per token: Δ, A, λ and the angular velocities
    θ as well as v, k, q. f is the heavy-tail activation of official main (or softplus, the March
    2026 release's, with A_activation = "softplus"; see heavy_tail_activation). B and C are
    normalized (RMSNorm over N) and then get a learned bias per head and rank, initialised to 1.
    With MIMO, z is lifted to R gates by mimo_z, and mimo_o mixes the R gated outputs back into
    one per head.
    """

    def __init__(self, cfg: Mamba3Config):
        super().__init__()
        self.cfg = cfg
        H, G, N, R, P = cfg.nheads, cfg.ngroups, cfg.d_state, cfg.rank, cfg.headdim
        # in_proj's output, in the official order: [z, x, B, C, dd_dt, dd_A, trap, angles]
        self.split_sizes = [cfg.d_inner, cfg.d_inner, R * G * N, R * G * N, H, H, H, cfg.num_rope_angles]
        self.in_proj = nn.Linear(cfg.d_model, sum(self.split_sizes), bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.B_bias = nn.Parameter(torch.empty(H, R, N))
        self.C_bias = nn.Parameter(torch.empty(H, R, N))
        self.B_norm = RMSNorm(N, eps=1e-5)  # the official module fixes eps = 1e-5 for these norms
        self.C_norm = RMSNorm(N, eps=1e-5)
        if cfg.is_mimo:
            self.mimo_x = nn.Parameter(torch.empty(H, R, P))
            self.mimo_z = nn.Parameter(torch.empty(H, R, P))
            self.mimo_o = nn.Parameter(torch.empty(H, R, P))
        self.D = nn.Parameter(torch.empty(H))
        if cfg.is_outproj_norm:
            self.norm = RMSNorm(cfg.d_inner, eps=1e-5)  # per head: see _finish
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=False)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self):
        """The official init: Δ log-uniform in [dt_min, dt_max], floored, stored through the inverse
        softplus in dt_bias; B and C biases 1; D = 1; mimo_x = mimo_o = 1/R and mimo_z = 1, so that
        at the start the R ranks average to a SISO head whose skip D is divided by R."""
        cfg, H, R = self.cfg, self.cfg.nheads, self.cfg.rank
        self.dt_bias.copy_(mm.dt_bias_init(H, cfg))
        self.B_bias.fill_(1.0)
        self.C_bias.fill_(1.0)
        self.D.fill_(1.0)
        if cfg.is_mimo:
            self.mimo_x.fill_(1.0 / R)
            self.mimo_z.fill_(1.0)
            self.mimo_o.fill_(1.0 / R)

    @property
    def pairing(self):
        return "halves" if self.cfg.is_mimo else "adjacent"

    def _ssm_inputs(self, zxbc):
        """in_proj's output (..., sum of split_sizes) -> z, and the SSM's inputs in fp32 at least:
        v (..., H, P), q, k (..., R, G, N), dt, adt, lam (..., H), theta (..., H, S)."""
        cfg = self.cfg
        H, P, G, N, R = cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state, cfg.rank
        z, x, B, C, dd_dt, dd_A, trap, angles = zxbc.split(self.split_sizes, dim=-1)
        k = self.B_norm(B.unflatten(-1, (R, G, N)))  # (..., R, G, N)
        q = self.C_norm(C.unflatten(-1, (R, G, N)))  # (..., R, G, N)
        # A = -f(dd_A), then clamped: A ≤ -A_floor < 0, so every step decays (official Mamba3.forward)
        f = heavy_tail_activation if cfg.A_activation == "heavy_tail" else F.softplus
        A = (-f(_at_least_fp32(dd_A))).clamp(max=-cfg.A_floor)  # (..., H)
        dt = F.softplus(_at_least_fp32(dd_dt) + _at_least_fp32(self.dt_bias))  # (..., H)  Δ
        lam = torch.sigmoid(_at_least_fp32(trap))  # (..., H)
        theta = math.pi * torch.tanh(_at_least_fp32(angles))  # (..., S), the same for every head
        if cfg.rotations_off:  # the ablation: no turn at any token
            theta = torch.zeros_like(theta)
        theta = theta.unsqueeze(-2).expand(*theta.shape[:-1], H, theta.shape[-1])  # (..., H, S)
        return z, x.unflatten(-1, (H, P)), q, k, dt, A * dt, lam, theta

    def _ssm_parameters(self):
        cfg = self.cfg
        return dict(q_bias=_at_least_fp32(self.C_bias), k_bias=_at_least_fp32(self.B_bias),
                    D=_at_least_fp32(self.D), mimo_x=_at_least_fp32(self.mimo_x) if cfg.is_mimo else None,
                    pairing=self.pairing)

    def _finish(self, y, z):
        """y (..., R, H, P) from the SSM, z (..., d_inner) -> (..., d_model): per rank the optional
        RMSNorm (per head, official is_outproj_norm) and the gate SiLU(z·mimo_z[r]), then mimo_o mixes
        the ranks (SISO: the one rank), then out_proj."""
        cfg = self.cfg
        H, P = cfg.nheads, cfg.headdim
        z = _at_least_fp32(z).unflatten(-1, (H, P)).unsqueeze(-3)  # (..., 1, H, P)
        if cfg.is_mimo:
            z = z * self.mimo_z.transpose(0, 1).to(z.dtype)  # (..., R, H, P)
        if cfg.is_outproj_norm:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.norm.eps)  # (..., R, H, P)
            y = y * _at_least_fp32(self.norm.weight).to(y.dtype).unflatten(0, (H, P))
        y = y * F.silu(z.to(y.dtype))  # (..., R, H, P)
        if cfg.is_mimo:
            y = (y * self.mimo_o.transpose(0, 1).to(y.dtype)).sum(-3)  # (..., H, P)
        else:
            y = y.squeeze(-3)  # (..., H, P)
        return self.out_proj(y.flatten(-2).to(self.out_proj.weight.dtype))  # (..., d_model)

    def forward(self, u, want_cache=False, cache=None, seq_idx=None, attention_mask=None):
        """u: (b, L, d_model) -> (b, L, d_model); with want_cache also the layer's (angle, ssm, k, v).
        cache: start from this layer's (angle, ssm, k, v); seq_idx and attention_mask (b, L) as
        MambaLM.forward takes them, checked there."""
        z, v, q, k, dt, adt, lam, theta = self._ssm_inputs(self.in_proj(u))
        if attention_mask is not None:  # padding: identity steps (Δ = 0), and v = 0 for the next β term
            keep = attention_mask[..., None]  # (b, L, 1)
            dt, adt, v = dt * keep, adt * keep, v * keep[..., None]
        reset = None if seq_idx is None else F.pad(seq_idx.diff(dim=1) != 0, (1, 0))  # (b, L)
        y = mamba3_chunked(q, k, v, dt, adt, lam, theta, **self._ssm_parameters(), state=cache,
                           chunk_size=self.cfg.chunk_size, return_state=want_cache,
                           scan_backend=self.cfg.scan_backend, reset=reset)  # (b, L, R, H, P)
        y, state = y if want_cache else (y, None)
        out = self._finish(y, z)  # (b, L, d_model)
        return (out, state) if want_cache else out

    def cache_spec(self, batch):
        """What prefill's cache holds for this layer, as (name, shape, what the dims are, dtype):
        the official (angle, ssm, k, v), all in the state's dtype, fp32 at least."""
        cfg = self.cfg
        H, P, N, R, S = cfg.nheads, cfg.headdim, cfg.d_state, cfg.rank, cfg.num_rope_angles
        dtype = _at_least_fp32(self.dt_bias).dtype
        return (("angle", (batch, H, S), "batch, nheads, num_rope_angles", dtype),
                ("ssm", (batch, H, P, N), "batch, nheads, headdim, d_state", dtype),
                ("k", (batch, R, H, N), "batch, mimo_rank, nheads, d_state", dtype),
                ("v", (batch, H, P), "batch, nheads, headdim", dtype))

    def step(self, u, cache):
        """One token (the official Mamba3.step without its kernels). u: (b, d_model);
        cache = (angle, ssm, k, v), updated in place. -> (b, d_model)"""
        z, v, q, k, dt, adt, lam, theta = self._ssm_inputs(self.in_proj(u))
        dtype = cache[1].dtype
        y, new = mamba3_step(tuple(cache), q.to(dtype), k.to(dtype), v.to(dtype), dt.to(dtype), adt.to(dtype),
                             lam.to(dtype), theta.to(dtype), **self._ssm_parameters())  # section 1's step
        for old, t in zip(cache, new):
            old.copy_(t)
        return self._finish(y, z)  # (b, d_model)


# Parameters the official module creates in fp32 whatever the model's dtype: the step size's
# bias, the B and C biases, D and the MIMO projections. In bf16 they would round the decays, the
# per-head offsets and the skip: keep them fp32 when casting a model to half precision.
_FP32_PARAMETERS = ("mixer.dt_bias", "mixer.B_bias", "mixer.C_bias", "mixer.D", "mixer.mimo_x",
                    "mixer.mimo_z", "mixer.mimo_o")


def cast_parameters(model, dtype):
    """model.to(dtype), except the parameters the official module keeps fp32 (under fp16/bf16)."""
    for name, p in model.named_parameters():
        keep_fp32 = name.endswith(_FP32_PARAMETERS) and dtype in (torch.float16, torch.bfloat16)
        p.data = p.data.to(torch.float32 if keep_fp32 else dtype)
    return model


class Mamba3LM(mm.MambaLM):
    """The language model, module tree as the official MambaLMHeadModel with Mamba3 mixers:
    backbone.embedding, backbone.layers.{i}.norm, backbone.layers.{i}.mixer.{in_proj, dt_bias,
    B_bias, C_bias, B_norm, C_norm, D, out_proj (, mimo_x, mimo_z, mimo_o, norm)}, backbone.norm_f,
    lm_head.

    From MambaLM, unchanged: forward (logits (b, L, padded_vocab)), prefill, step, generate,
    generate_stream and the official init (mixer_seq_simple's _init_weights, in the backbone and
    MambaLM, then reset_ssm_parameters).
    """
    backbone_cls = hybrid.HybridMamba  # the official checkpoints have a GatedMLP after every mixer

    def __init__(self, cfg: Mamba3Config):
        super().__init__(cfg, mixer_cls=Mamba3Mixer)

    def optim_groups(self, weight_decay):
        """AdamW parameter groups: the matrices (embedding, in_proj, out_proj) decay; dt_bias, D,
        norms, the B and C biases and the MIMO scales (per-channel offsets and scales) do not."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if p.dim() < 2 or name.endswith(("B_bias", "C_bias", "mimo_x", "mimo_z", "mimo_o")):
                no_decay.append(p)
            else:
                decay.append(p)
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    # --------------------------------------------------------------------------------------------
    # 5. Recurrent inference
    # --------------------------------------------------------------------------------------------
    # A layer's memory of the past is four small tensors, the official cache: the accumulated
    # angles (b, H, S), the state h (b, H, P, N), and the last token's rotated keys (b, R, H, N) and
    # input (b, H, P), which the next step's β term needs. No conv buffer: Mamba-3 has no
    # convolution. prefill (MambaLM's: forward with want_cache) runs the chunked form over the
    # prompt and returns the four; each further token is one O(1) step, section 1's mamba3_step on
    # the cache (Mamba3Mixer.step). MambaLM's step, generate and generate_stream run unchanged, and
    # prefill(ids, cache=cache) continues a cache: mamba3_chunked starts from its four tensors.


# ------------------------------------------------------------------------------------------------
# Appendix: the angle in fp32
# ------------------------------------------------------------------------------------------------
# Section 2 keeps every angle mod 2π. The official Mamba3.step does not: its rotary kernel
# (apply_rotary_qk_inference_fwd in ops/triton/mamba3/mamba3_mimo_rotary_step.py) stores
# angle + π·tanh(·)·Δ as it is, so during generation the stored fp32 angle grows by up to π·Δ per
# token, and every later step rounds at its size (an fp32 ulp is 4.9e-4 at 5,000 rad). Reduced, a
# step rounds at the size of 2π (an ulp of 4.8e-7). The two give the same outputs up to that
# rounding, since cos and sin are periodic. One error the reduction cannot remove: fp32's 2π is
# 1.7e-7 above the true one, so each wrap lowers the absolute angle by that much, about 1e-3 rad
# after 65,536 tokens turning 0.7 rad each; the outputs see only differences of angles, whose
# share is the wraps between the two tokens.


# ------------------------------------------------------------------------------------------------
# Appendix: input checks
# ------------------------------------------------------------------------------------------------

def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_mamba3_inputs(q, k, v, dt, adt, lam, theta, q_bias, k_bias, D, mimo_x, state, pairing, chunk_size=1):
    """Raise ValueError naming what was expected."""
    named = {"q": q, "k": k, "v": v, "dt": dt, "adt": adt, "lam": lam, "theta": theta}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if v.dim() != 4:
        raise ValueError(f"v must have shape (b, L, H, P), got {tuple(v.shape)}")
    b, L, H, P = v.shape
    if L == 0:
        raise ValueError(f"the sequence length must be at least 1, got v of shape {tuple(v.shape)}")
    if q.dim() != 5 or tuple(q.shape[:2]) != (b, L):
        raise ValueError(f"q must have shape (b, L, R, G, N) = ({b}, {L}, R, G, N), got {tuple(q.shape)}")
    R, G, N = q.shape[2:]
    if H % G:
        raise ValueError(f"the number of heads H = {H} must be a multiple of the number of groups G = {G}")
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}, got {pairing!r}")
    if theta.dim() != 4:
        raise ValueError(f"theta must have shape (b, L, H, S), got {tuple(theta.shape)}")
    S = theta.shape[-1]
    if N % 2 or not 1 <= S <= N // 2:
        raise ValueError(f"need an even d_state N and 1 <= S <= N/2 rotated pairs, got N = {N}, S = {S}")
    if not mm._is_positive_int(chunk_size):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    expected = {"k": (b, L, R, G, N), "dt": (b, L, H), "adt": (b, L, H), "lam": (b, L, H),
                "theta": (b, L, H, S), "q_bias": (H, R, N), "k_bias": (H, R, N), "D": (H,), "mimo_x": (H, R, P)}
    given = {**named, "q_bias": q_bias, "k_bias": k_bias, "D": D, "mimo_x": mimo_x}
    for name, shape in expected.items():
        t = given[name]
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape):
            raise ValueError(f"{name} must have shape {shape}, got {_shape(t)}")
    if mimo_x is None and R != 1:
        raise ValueError(f"q and k have rank R = {R}: MIMO needs mimo_x of shape ({H}, {R}, {P})")
    if state is not None:
        shapes = ((b, H, S), (b, H, P, N), (b, R, H, N), (b, H, P))
        if not isinstance(state, (tuple, list)) or len(state) != 4 or any(
                not isinstance(t, torch.Tensor) or tuple(t.shape) != s for t, s in zip(state, shapes)):
            got = [_shape(t) for t in state] if isinstance(state, (tuple, list)) else type(state).__name__
            raise ValueError(f"state must be (angle, ssm, k, v) of shapes {list(shapes)}, got {got}")
    for name, t in given.items():
        if t is not None and t.device != v.device:
            raise ValueError(f"{name} must be on {v.device} like v, got {t.device}")
