"""
mamba2_minimal.py: Mamba-2 (Dao & Gu, 2024, arXiv 2405.21060) in plain PyTorch, compatible with
the official checkpoints (state-spaces/mamba2-*) and with transformers' Mamba2ForCausalLM.

Mamba-1 (mamba_minimal.py) runs its recurrence one step at a time, or as a parallel scan over
tensors of shape (B, L, ED, N). Mamba-2 restricts A to a scalar per head. That one restriction
makes the recurrence equal to a matrix product, "attention" with a decay mask instead of a
softmax (state space duality, SSD), so most of the work becomes matmuls, which every device does
best; a scan is left only across chunks of the sequence. Sections, in the order of the idea:

    1. The SSD recurrence      ssd_sequential(): the loop over t, the oracle for everything below
    2. The quadratic form      segsum(), ssd_quadratic(): the same map as one masked matrix product
    3. Chunked SSD             ssd(): matmuls inside chunks, pscan.scan across chunks
    4. The model               Mamba2Config, the gated RMSNorm, the mixer, the block, the LM
    5. Recurrent inference     prefill, an O(1) step per token, generate (Mamba-1's sampling)
    6. Loading checkpoints     from_pretrained() for the official and the transformers layouts

Glossary (code name: paper symbol, meaning). Shape comments use the capital letters.

    b        batch size                                   (B in the shape comments)
    L        sequence length
    H        number of heads, nheads = d_ssm / headdim
    P        head dimension, headdim (a head's channels share one A and one Δ)
    G, N     ngroups and d_state: B and C are (B, L, G, N), shared by the H/G heads of a group
    x        the input of the SSM, per head                    (B, L, H, P)
    dt       Δ, the step size, one per token and head          (B, L, H)
    A        a negative scalar per head                        (H,)
    B, C     input and output projections of the state         (B, L, G, N)
    D        the skip y += D·x, per head                       (H,)
    h        the state of one head, a P x N matrix             (B, H, P, N)
    T        chunk_size, the length of one chunk in ssd()

Read mamba_minimal.py and pscan.py first: this file reuses their RMSNorm, causal conv, LM
wrapper, sampling and checkpoint helpers, and pscan.scan for the recurrence across chunks.
"""

import json
import math
import os
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import mamba_minimal as mm
import pscan
from mamba_minimal import RMSNorm, _at_least_fp32


# ------------------------------------------------------------------------------------------------
# 1. The SSD recurrence
# ------------------------------------------------------------------------------------------------
# Mamba-1's state is (ED, N) per token, with a decay exp(Δ·A) for each of the ED·N entries.
# Mamba-2 groups the channels into heads of P channels and gives each head ONE scalar A_h (A is
# a scalar times the identity, paper section 7) and one Δ per token. With the Euler step for B,
# as in Mamba-1, one head runs
#
#     h_t = exp(Δ_t·A_h)·h_{t-1} + Δ_t·x_t·B_tᵀ          h: (P, N), x_t: (P,), B_t: (N,)
#     y_t = h_t·C_t + D_h·x_t                             y_t: (P,)
#
# The decay is now a single number per head and step: that is what section 2 exploits. B and C
# are computed per token from the input, and G groups of them are shared by the H/G heads of
# each group (head k uses group k // (H/G)), like the key/value groups of grouped-query attention.

def _check_ssd_inputs(x, dt, A, B, C, D, h0, chunk_size=1):
    """Raise ValueError naming what was expected."""
    named = {"x": x, "dt": dt, "A": A, "B": B, "C": C}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must have shape (B, L, H, P), got {tuple(x.shape)}")
    b, L, H, P = x.shape
    if L == 0:
        raise ValueError(f"the sequence length must be at least 1, got x of shape {tuple(x.shape)}")
    if B.dim() != 4 or tuple(B.shape[:2]) != (b, L):
        raise ValueError(f"B must have shape (B, L, G, N) = ({b}, {L}, G, N), got {tuple(B.shape)}")
    G, N = B.shape[2:]
    if H % G != 0:
        raise ValueError(f"the number of heads H = {H} must be a multiple of the number of groups G = {G}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    expected = {"dt": (b, L, H), "A": (H,), "C": (b, L, G, N), "D": (H,), "h0": (b, H, P, N)}
    for name, t in (("dt", dt), ("A", A), ("C", C), ("D", D), ("h0", h0)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != expected[name]):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape {expected[name]}, got {got}")
    for name, t in list(named.items()) + [("D", D), ("h0", h0)]:
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on {x.device} like x, got {t.device}")


def ssd_sequential(x, dt, A, B, C, D=None, h0=None, return_last_state=False):
    """The SSD recurrence as a loop over t: slow, obviously right, the oracle of the tests.

    Args:
        x:  (B, L, H, P)   input, per head
        dt: (B, L, H)      step size Δ (after softplus), positive
        A:  (H,)           negative scalar per head
        B, C: (B, L, G, N) input and output projections, G groups
        D:  (H,) or None   skip connection
        h0: (B, H, P, N) or None for zeros
    Returns:
        y: (B, L, H, P) in x's dtype; with return_last_state also the final state (B, H, P, N)
    """
    _check_ssd_inputs(x, dt, A, B, C, D, h0)
    out_dtype = x.dtype
    x, dt, A, B, C = (_at_least_fp32(t) for t in (x, dt, A, B, C))
    H, G = x.shape[2], B.shape[2]
    B, C = (t.repeat_interleave(H // G, dim=2) for t in (B, C))  # (B, L, H, N): head k reads group k // (H/G)
    h = x.new_zeros(*x.shape[:1], *x.shape[2:], B.shape[-1]) if h0 is None else h0.to(x.dtype)  # (B, H, P, N)
    ys = []
    # unbind, not x[:, t]: see pscan.py section 2 (indexing makes the backward quadratic in L)
    for x_t, dt_t, B_t, C_t in zip(x.unbind(1), dt.unbind(1), B.unbind(1), C.unbind(1)):
        decay = torch.exp(dt_t * A)  # (B, H)
        h = decay[..., None, None] * h + (dt_t[..., None] * x_t)[..., None] * B_t[:, :, None, :]  # (B, H, P, N)
        ys.append((h @ C_t[..., None]).squeeze(-1))  # (B, H, P)  y_t = h_t·C_t
    y = torch.stack(ys, dim=1)  # (B, L, H, P)
    if D is not None:
        y = y + D.to(x.dtype)[:, None] * x
    return (y.to(out_dtype), h) if return_last_state else y.to(out_dtype)


# ------------------------------------------------------------------------------------------------
# 2. The quadratic (dual) form
# ------------------------------------------------------------------------------------------------
# Unroll the recurrence from h_{-1} = 0: each input s ≤ t reaches step t decayed by every step
# in between,
#
#     h_t = Σ_{s≤t} exp(a_{s+1} + ... + a_t)·Δ_s·x_s·B_sᵀ          a_k = Δ_k·A_h (a log-decay, ≤ 0)
#     y_t = h_t·C_t = Σ_{s≤t} exp(a_{s+1} + ... + a_t)·(C_t·B_s)·Δ_s·x_s
#
# For a sequence of T steps that is one matrix product (paper section 3, "state space duality"):
#
#     Y = (L ∘ C·Bᵀ)·(Δ·X)        L[t, s] = exp(a_{s+1} + ... + a_t) for s ≤ t, 0 above
#
# This is causal attention with queries C, keys B and values Δ·X, where the softmax is replaced
# by the decay mask L (1-semiseparable: every block below the diagonal has rank 1). It costs
# O(T²) instead of the loop's O(T), but it is three matmuls with no step-by-step dependency.
# Because A is one scalar per head, L is one (T, T) matrix per head; with Mamba-1's (ED, N)
# decays it would be one per channel and state entry, and there would be no matmul to win.
#
# The segment sums a_{s+1} + ... + a_t. With the prefix sums S_t = a_0 + ... + a_t they are
# S_t - S_s: one cumsum and one subtraction (segsum_by_difference below). Exact in exact
# arithmetic, but it subtracts two large numbers to get a small one: after t steps |S_t| grows
# like t·|a|, and a float with 24 bits (fp32) keeps only about 7 significant digits of it. For
# a short segment deep in a long sequence the difference loses those digits (catastrophic
# cancellation): in fp32, S ≈ -2000 has an ulp of 1.2e-4, so even a segment of zero length,
# whose decay must be exp(0) = 1 exactly, can come out as exp(±1e-4); in bf16 (ulp 8 at 2000)
# the result is noise. It is safe when the sums stay small: short chunks (T = 64..256) in fp32.
# segsum() avoids the subtraction altogether: it copies a into a (T, T) matrix, keeps the entries
# strictly below the diagonal, and takes the cumsum down each column, so entry (t, s) adds up
# exactly a_{s+1} .. a_t, starting from zero (the official ssd_minimal.py's `segsum`). It costs
# O(T²) additions, which the (T, T) mask needs anyway. test_mamba2.py measures both.

def segsum_by_difference(a):
    """a (..., T) -> (..., T, T): S_t - S_s below the diagonal, -inf above. Cheap, cancels in long runs."""
    T = a.shape[-1]
    S = a.cumsum(-1)  # (..., T)
    diff = S[..., :, None] - S[..., None, :]  # (..., T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()
    return diff.masked_fill(~causal, -torch.inf)


def segsum(a):
    """a (..., T) -> (..., T, T) with [t, s] = a_{s+1} + ... + a_t for s ≤ t (0 on the diagonal)
    and -inf above it, so that exp() of it is the decay mask L. No subtraction: see above."""
    T = a.shape[-1]
    below = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)  # s < t
    a_ts = a.unsqueeze(-1).expand(*a.shape, T)  # (..., T, T): entry (k, s) = a_k
    sums = a_ts.masked_fill(~below, 0).cumsum(-2)  # (..., T, T): Σ_{s<k≤t} a_k
    causal = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()  # s ≤ t
    return sums.masked_fill(~causal, -torch.inf)


# The same three matmuls serve section 3, where they run on every chunk at once. To make them
# batched matmuls we lay the heads out group-major: (..., G, H/G, T, P) for x and Δ, and
# (..., G, 1, T, N) for B and C, so a group's B and C broadcast over its heads without a copy.

def _head_major(t, G):
    """(..., T, H, P) -> (..., G, H/G, T, P): heads of a group side by side, time next to last."""
    *lead, T, H, P = t.shape
    return t.reshape(*lead, T, G, H // G, P).movedim(-4, -2)


def _head_major_scalar(t, G):
    """(..., T, H) -> (..., G, H/G, T)."""
    *lead, T, H = t.shape
    return t.reshape(*lead, T, G, H // G).movedim(-3, -1)


def _group_major(t):
    """(..., T, G, N) -> (..., G, 1, T, N): one matrix per group, broadcast over its heads."""
    return t.movedim(-3, -2).unsqueeze(-3)


def _time_major(y):
    """(..., G, H/G, T, P) -> (..., T, H, P), the inverse of _head_major."""
    y = y.movedim(-2, -4)  # (..., T, G, H/G, P)
    return y.reshape(*y.shape[:-3], y.shape[-3] * y.shape[-2], y.shape[-1])


def _quadratic(xdt, a, B, C):
    """Y = (L ∘ C·Bᵀ)·(Δ·X) from a zero state, batched over any leading dims.

    xdt: (..., G, H/G, T, P) = Δ·x;  a: (..., G, H/G, T) = Δ·A;  B, C: (..., G, 1, T, N)
    -> y: (..., G, H/G, T, P)
    """
    decay = torch.exp(segsum(a))  # (..., G, H/G, T, T)  the mask L, one per head
    scores = C @ B.transpose(-1, -2)  # (..., G, 1, T, T)   C_t·B_s, one per group
    return (decay * scores) @ xdt  # (..., G, H/G, T, P)


def ssd_quadratic(x, dt, A, B, C, D=None):
    """The whole sequence as one masked matrix product (section 2); arguments as ssd_sequential,
    from a zero state. O(L²) time and memory: for teaching and testing, and inside ssd()'s chunks."""
    _check_ssd_inputs(x, dt, A, B, C, D, None)
    out_dtype = x.dtype
    x, dt, A, B, C = (_at_least_fp32(t) for t in (x, dt, A, B, C))
    G = B.shape[2]
    xdt = _head_major(x * dt[..., None], G)  # (B, G, H/G, L, P)
    a = _head_major_scalar(dt * A, G)  # (B, G, H/G, L)
    y = _time_major(_quadratic(xdt, a, _group_major(B), _group_major(C)))  # (B, L, H, P)
    if D is not None:
        y = y + D.to(x.dtype)[:, None] * x
    return y.to(out_dtype)


# ------------------------------------------------------------------------------------------------
# 3. Chunked SSD
# ------------------------------------------------------------------------------------------------
# The loop is O(L) but sequential; the quadratic form is parallel but O(L²). Chunked SSD takes
# the best of both (paper section 6, the official ssd_minimal.py's `ssd_minimal_discrete`): cut
# the sequence into chunks of T steps and split each output into what its own chunk contributes
# and what arrives through the state carried in from earlier chunks.
#
#   1. inside each chunk, the quadratic form from a zero state: (T, T) matmuls, all chunks at once
#   2. each chunk's end state from a zero start: S_c = Σ_s exp(a_{s+1} + ... + a_T)·Δ_s·x_s·B_sᵀ
#   3. across chunks, the state entering chunk c+1 is h_c = exp(a_1 + ... + a_T)·h_{c-1} + S_c:
#      the first-order recurrence of pscan.py over the chunk index, run with pscan.scan
#      (h_{-1} = h0). There are only L/T steps, each a whole (H, P, N) state.
#   4. each chunk's output from its carried-in state: y_t += exp(a_1 + ... + a_t)·C_t·h_{c-1}
#
# Only step 3 is a recurrence, and it is T times shorter than the sequence. The official code
# runs it as a (L/T, L/T) quadratic form over chunks; pscan.scan does it in O(L/T).
#
# The decays within a chunk: step 4's prefix sums a_1 + ... + a_t are a plain cumsum, and step
# 2's suffix sums a_{t+1} + ... + a_T a reversed cumsum, so neither subtracts one cumsum from
# another (section 2). The official code takes step 2's as S_T - S_t, which is fine for T ≤ 256
# in fp32 too; the form here needs no such argument.
#
# Any L: the last chunk is padded with identity steps, Δ = 0, so exp(0·A) = 1 and Δ·x = 0: the
# state passes through unchanged (the final state is exact) and the padded outputs are dropped.

def ssd(x, dt, A, B, C, chunk_size, D=None, h0=None, return_last_state=False, scan_backend="auto"):
    """Chunked SSD: y = SSD(Δ, A, B, C)(x) + D·x.

    Args:
        x:  (B, L, H, P)   input, per head
        dt: (B, L, H)      step size Δ (after softplus), positive
        A:  (H,)           negative scalar per head
        B, C: (B, L, G, N) input and output projections, G groups (H a multiple of G)
        chunk_size:        T, the length of a chunk; any L works
        D:  (H,) or None   skip connection
        h0: (B, H, P, N) or None for zeros
        scan_backend:      pscan.scan's backend for the recurrence across chunks
    Returns:
        y: (B, L, H, P) in x's dtype; with return_last_state also the final state (B, H, P, N),
        computed in fp32 (fp64 for fp64 inputs), a tensor of its own (not a view of a larger one)
    """
    _check_ssd_inputs(x, dt, A, B, C, D, h0, chunk_size)
    if scan_backend not in pscan.BACKENDS:
        raise ValueError(f"scan_backend must be one of {pscan.BACKENDS}, got {scan_backend!r}")
    out_dtype = x.dtype
    x, dt, A, B, C = (_at_least_fp32(t) for t in (x, dt, A, B, C))
    b, L, H, P = x.shape
    G, N, T = B.shape[2], B.shape[3], chunk_size
    pad = -L % T
    if pad:  # identity steps: Δ = 0 (and x, B, C = 0, so nothing is read or written)
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    n_chunks = (L + pad) // T
    xdt = _head_major((x * dt[..., None]).reshape(b, n_chunks, T, H, P), G)  # (B, c, G, H/G, T, P)
    a = _head_major_scalar((dt * A).reshape(b, n_chunks, T, H), G)  # (B, c, G, H/G, T)  log-decays
    Bc = _group_major(B.reshape(b, n_chunks, T, G, N))  # (B, c, G, 1, T, N)
    Cc = _group_major(C.reshape(b, n_chunks, T, G, N))  # (B, c, G, 1, T, N)

    # 1. every chunk on its own, from a zero state
    y = _quadratic(xdt, a, Bc, Cc)  # (B, c, G, H/G, T, P)

    # 2. every chunk's end state from a zero state, each input decayed to the chunk's end
    decay_from_start = torch.exp(a.cumsum(-1))  # (B, c, G, H/G, T)  exp(a_1 + ... + a_t)
    to_end = F.pad(a[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))  # (B, c, G, H/G, T)  a_{t+1} + ... + a_T
    states = (xdt * torch.exp(to_end)[..., None]).transpose(-1, -2) @ Bc  # (B, c, G, H/G, P, N)

    # 3. across chunks: h_c = exp(a_1 + ... + a_T)·h_{c-1} + S_c, with pscan.scan over c
    chunk_decay = decay_from_start[..., -1, None, None].expand_as(states)  # (B, c, G, H/G, P, N)
    h_start = None if h0 is None else h0.to(x.dtype).reshape(b, G, H // G, P, N)  # (B, G, H/G, P, N)
    h = pscan.scan(chunk_decay, states, h_start, backend=scan_backend)  # (B, c, G, H/G, P, N)
    first = torch.zeros_like(h[:, :1]) if h_start is None else h_start.unsqueeze(1)
    h_in = torch.cat([first, h[:, :-1]], dim=1)  # (B, c, G, H/G, P, N)  the state entering each chunk

    # 4. what the carried-in state adds to each output, decayed to its position
    y = y + (Cc @ h_in.transpose(-1, -2)) * decay_from_start[..., None]  # (B, c, G, H/G, T, P)

    y = _time_major(y).reshape(b, n_chunks * T, H, P)[:, :L]  # (B, L, H, P)
    if D is not None:
        y = y + D.to(x.dtype)[:, None] * x[:, :L]
    y = y.to(out_dtype)
    if not return_last_state:
        return y
    # h[:, -1] is a view that would keep every chunk's state alive: copy the one we return
    h_last = h[:, -1].reshape(b, H, P, N).clone(memory_format=torch.contiguous_format)  # (B, H, P, N)
    return y, h_last
