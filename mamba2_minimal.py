"""
mamba2_minimal.py: Mamba-2 (Dao & Gu, 2024, arXiv 2405.21060) in plain PyTorch, compatible with
the official checkpoints (state-spaces/mamba2-*) and with transformers' Mamba2ForCausalLM.

Mamba-1 (mamba_minimal.py) runs its recurrence one step at a time, or as a parallel scan over
tensors of shape (b, L, ED, N). Mamba-2 restricts A to a scalar per head. That one restriction
makes the recurrence equal to a matrix product, "attention" with a decay mask instead of a
softmax (state space duality, SSD), so most of the work becomes matmuls, which every device does
best; a scan is left only across chunks of the sequence. Sections, in the order of the idea:

    1. The SSD recurrence      ssd_step(), ssd_sequential(): one step, the loop over t (the oracle)
    2. The quadratic form      ssd_quadratic(): the same map as one masked matrix product
    3. Chunked SSD             ssd(): matmuls inside chunks, pscan.scan across chunks
    4. The model               Mamba2Config, the gated RMSNorm, the mixer (opt-in torch.compile), the LM
    5. Recurrent inference     prefill, an O(1) step per token, generate (a note in Mamba2LM)
    Appendix: input checks

This file knows no checkpoint layout: pretrained.py loads the official and the transformers
checkpoints into a Mamba2LM, e.g. pretrained.load("state-spaces/mamba2-130m").

Glossary (code name: paper symbol, meaning). One name, one meaning, as in mamba_minimal.py:
B is always the input matrix, never the batch.

    b        batch size
    L        sequence length
    H        number of heads, nheads = d_ssm / headdim
    P        head dimension, headdim (a head's channels share one A and one Δ)
    G, N     ngroups and d_state: B and C are (b, L, G, N), shared by the H/G heads of a group
    x        the input of the SSM, per head                    (b, L, H, P)
    dt       Δ, the step size after softplus, per token/head   (b, L, H)
    dt_raw   in_proj's Δ output, before dt_bias and softplus   (b, L, H)
    A        a negative scalar per head                        (H,)
    adt      Δ·A, the log-decay ≤ 0; exp(adt) is pscan.py's a  (b, L, H)
    B, C     input and output projections of the state         (b, L, G, N)
    D        the skip y += D·x, per head (never d_model)       (H,)
    h        the state of one head, a P x N matrix             (b, H, P, N)
    M        the decay mask of the quadratic form, per head    (T, T)
    T, K     chunk_size (the length of one chunk in ssd()) and the number of chunks

Read mamba_minimal.py and pscan.py first: this file reuses mamba_minimal.py's RMSNorm, causal conv,
LM (MambaLM: prefill, step, sampling, generate) and Δ init, pscan.segsum (pscan.py section 10) for
the decay mask and pscan.scan for the recurrence across chunks. It also needs mamba_engine.py (the
conv's written-out backward, the compile fallback, the compute-dtype helpers) and hybrid.py (the
backbone with the official configs' MLP and attention layers, and the checks of their fields).
"""

import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybrid
import mamba_engine as eng
import mamba_minimal as mm
import pscan
from mamba_engine import _in_compute_dtype, _without_autocast
from mamba_minimal import RMSNorm, _at_least_fp32
from pscan import segsum


# ------------------------------------------------------------------------------------------------
# 1. The SSD recurrence
# ------------------------------------------------------------------------------------------------
# Mamba-1's state is (ED, N) per token, with a decay exp(Δ·A) for each of the ED·N entries.
# Mamba-2 groups the channels into heads of P channels and gives each head ONE scalar A_h (A is
# a scalar times the identity, paper section 5.1) and one Δ per token. With Mamba-1's first-order
# term Δ·B for B̄ (exponential-Euler, as mamba3_minimal.py section 2 names it), one head runs
#
#     h_t = exp(Δ_t·A_h)·h_{t-1} + Δ_t·x_t·B_tᵀ          h: (P, N), x_t: (P,), B_t: (N,)
#     y_t = h_t·C_t + D_h·x_t                             y_t: (P,)
#
# The decay is now a single number per head and step: that is what section 2 exploits. B and C
# are computed per token from the input, and G groups of them are shared by the H/G heads of
# each group (head j uses group j // (H/G)): the paper's grouped-value attention (§7.2), where a
# group's heads share its queries C and keys B and each head has its own values x (grouped-query
# attention shares keys and values instead).

@_without_autocast
def ssd_step(h, x_t, dt_t, A, B_t, C_t):
    """One step of the recurrence for every head at once: the loop below runs it over t, and
    Mamba2Mixer.step runs it on the cache, one token at a time.
    h (b, H, P, N), x_t (b, H, P), dt_t (b, H), A (H,), B_t and C_t (b, H, N) -> (h_t, y_t (b, H, P))"""
    decay = torch.exp(dt_t * A)  # (b, H)
    h = decay[..., None, None] * h + (dt_t[..., None] * x_t)[..., None] * B_t[:, :, None, :]  # (b, H, P, N)
    return h, (h @ C_t[..., None]).squeeze(-1)  # y_t = h_t·C_t


@_without_autocast
def ssd_sequential(x, dt, A, B, C, D=None, h0=None, return_last_state=False):
    """The SSD recurrence as a loop over t: slow, obviously right, the oracle of the tests.

    Args:
        x:  (b, L, H, P)   input, per head
        dt: (b, L, H)      step size Δ (after softplus), positive
        A:  (H,)           negative scalar per head
        B, C: (b, L, G, N) input and output projections, G groups
        D:  (H,) or None   skip connection
        h0: (b, H, P, N) or None for zeros
    Returns:
        y: (b, L, H, P) in x's dtype; with return_last_state also the final state (b, H, P, N)
    """
    _check_ssd_inputs(x, dt, A, B, C, D, h0)
    out_dtype = x.dtype
    x, dt, A, B, C = _in_compute_dtype(x, dt, A, B, C)
    H, G = x.shape[2], B.shape[2]
    B, C = (t.repeat_interleave(H // G, dim=2) for t in (B, C))  # (b, L, H, N): head j reads group j // (H/G)
    h = x.new_zeros(*x.shape[:1], *x.shape[2:], B.shape[-1]) if h0 is None else h0.to(x.dtype)  # (b, H, P, N)
    ys = []
    # unbind, not x[:, t]: indexing would make the backward quadratic in L (pscan.py section 1)
    for x_t, dt_t, B_t, C_t in zip(x.unbind(1), dt.unbind(1), B.unbind(1), C.unbind(1)):
        h, y_t = ssd_step(h, x_t, dt_t, A, B_t, C_t)  # (b, H, P, N), (b, H, P)
        ys.append(y_t)
    y = torch.stack(ys, dim=1)  # (b, L, H, P)
    if D is not None:
        y = y + D.to(x.dtype)[:, None] * x
    return (y.to(out_dtype), h) if return_last_state else y.to(out_dtype)


# ------------------------------------------------------------------------------------------------
# 2. The quadratic (dual) form
# ------------------------------------------------------------------------------------------------
# Unroll the recurrence from h_{-1} = 0: each input s ≤ t reaches step t decayed by every step
# in between,
#
#     h_t = Σ_{s≤t} exp(adt_{s+1} + ... + adt_t)·Δ_s·x_s·B_sᵀ       adt_t = Δ_t·A_h ≤ 0, a log-decay
#     y_t = h_t·C_t = Σ_{s≤t} exp(adt_{s+1} + ... + adt_t)·(C_t·B_s)·Δ_s·x_s
#
# (pscan.py's multiplier a_t is exp(adt_t).) For a sequence of T steps that is one matrix
# product (paper sections 3 to 5, "state space duality"):
#
#     Y = (M ∘ C·Bᵀ)·(Δ·X)        M[t, s] = exp(adt_{s+1} + ... + adt_t) for s ≤ t, 0 above
#
# This is causal linear attention with queries C, keys B and values Δ·X (the official
# mamba2_simple.py: "X, B, C correspond to V, K, Q"), with the softmax replaced by the decay
# mask M (1-semiseparable: every block below the diagonal has rank 1). It costs O(T²) instead of
# the loop's O(T), but it is two matmuls and a mask with no step-by-step dependency. Because A
# is one scalar per head, M is one (T, T) matrix per head. Mamba-1 is the same linear attention
# with a decay per channel and state entry: one mask for each of its ED·N entries, and no matmul
# to win.
#
# The segment sums adt_{s+1} + ... + adt_t. With the prefix sums S_t = adt_0 + ... + adt_t they are
# S_t - S_s: one cumsum and one subtraction. Exact in exact arithmetic, but it subtracts two large
# numbers to get a small one: after t steps |S_t| grows like t·|adt|, and a float with 24 bits
# (fp32) keeps only about 7 significant digits of it. For a short segment deep in a long sequence
# the difference loses those digits (catastrophic cancellation): in fp32, S ≈ -1000 has an ulp of
# 6e-5, so a one-step segment adt_t comes out as adt_t ± 6e-5 however small adt_t is; in bf16 (ulp 4
# at 1000) the result is noise. On T = 2048 steps with adt_t uniform in (-1, 0), the largest error
# of the decay mask is 5.3e-5 by differences against 3.3e-8 by segsum in fp32, and 0.98 against
# 2.5e-3 in bf16 (`python -m pytest -q -s test_mamba2.py -k cancel` prints them). Differences are
# safe while the sums stay small: short chunks (T ≤ 256) in fp32. segsum (pscan.py section 10,
# shared with mamba3_minimal.py, the official ssd_minimal.py's) sums every entry from zero: it
# copies adt into a (T, T) matrix, keeps the entries strictly below the diagonal, and takes the
# cumsum down each column, so entry (t, s) adds up exactly adt_{s+1} .. adt_t. It costs O(T²)
# additions, which the (T, T) mask needs anyway.

# The same two matmuls and mask serve section 3, where they run on every chunk at once. To make
# them batched matmuls, time goes next to last and the heads are split by group:
# (..., G, H/G, T, P) for x and Δ, and (..., G, 1, T, N) for B and C, so a group's B and C
# broadcast over its heads without a copy.

def _heads_by_group(t, G):
    """(..., T, H, P) -> (..., G, H/G, T, P): heads of a group side by side, time next to last."""
    *lead, T, H, P = t.shape
    return t.reshape(*lead, T, G, H // G, P).movedim(-4, -2)


def _heads_by_group_scalar(t, G):
    """(..., T, H) -> (..., G, H/G, T)."""
    *lead, T, H = t.shape
    return t.reshape(*lead, T, G, H // G).movedim(-3, -1)


def _groups_over_heads(t):
    """(..., T, G, N) -> (..., G, 1, T, N): one matrix per group, broadcast over its heads."""
    return t.movedim(-3, -2).unsqueeze(-3)


def _time_major(y):
    """(..., G, H/G, T, P) -> (..., T, H, P), the inverse of _heads_by_group."""
    y = y.movedim(-2, -4)  # (..., T, G, H/G, P)
    return y.reshape(*y.shape[:-3], y.shape[-3] * y.shape[-2], y.shape[-1])


def _quadratic(xdt, adt, B, C):
    """Y = (M ∘ C·Bᵀ)·(Δ·X) from a zero state, batched over any leading dims.

    xdt: (..., G, H/G, T, P) = Δ·x;  adt: (..., G, H/G, T) = Δ·A, log-decays;  B, C: (..., G, 1, T, N)
    -> y: (..., G, H/G, T, P)
    """
    decay = torch.exp(segsum(adt))  # (..., G, H/G, T, T)  the mask M, one per head
    scores = C @ B.transpose(-1, -2)  # (..., G, 1, T, T)   C_t·B_s, one per group
    return (decay * scores) @ xdt  # (..., G, H/G, T, P)


@_without_autocast
def ssd_quadratic(x, dt, A, B, C, D=None):
    """The whole sequence as one masked matrix product (section 2); arguments as ssd_sequential,
    from a zero state. O(L²) time and memory: for teaching and testing, and inside ssd()'s chunks."""
    _check_ssd_inputs(x, dt, A, B, C, D, None)
    out_dtype = x.dtype
    x, dt, A, B, C = _in_compute_dtype(x, dt, A, B, C)
    G = B.shape[2]
    xdt = _heads_by_group(x * dt[..., None], G)  # (b, G, H/G, L, P)
    adt = _heads_by_group_scalar(dt * A, G)  # (b, G, H/G, L)  log-decays
    y = _time_major(_quadratic(xdt, adt, _groups_over_heads(B), _groups_over_heads(C)))  # (b, L, H, P)
    if D is not None:
        y = y + D.to(x.dtype)[:, None] * x
    return y.to(out_dtype)


# ------------------------------------------------------------------------------------------------
# 3. Chunked SSD
# ------------------------------------------------------------------------------------------------
# The loop is O(L) but sequential; the quadratic form is parallel but O(L²). Chunked SSD takes
# the best of both (paper section 6, the official ssd_minimal.py's `ssd_minimal_discrete`): cut
# the sequence into K chunks of T steps and split each output into what its own chunk
# contributes and what arrives through the state carried in from earlier chunks. Within a chunk
# the steps are t = 0 .. T-1, as in section 2; chunk k ends in the state h_k, and h_{-1} = h0.
#
#   1. inside each chunk, the quadratic form from a zero state: (T, T) matmuls, all chunks at once
#   2. each chunk's end state from a zero start: E_k = Σ_s exp(adt_{s+1} + ... + adt_{T-1})·Δ_s·x_s·B_sᵀ
#   3. across chunks, h_k = exp(adt_0 + ... + adt_{T-1})·h_{k-1} + E_k: the first-order recurrence of
#      pscan.py over the chunk index (its multiplier the chunk's whole decay), run with
#      pscan.scan. There are only K = L/T steps, each a whole (H, P, N) state.
#   4. each chunk's output from its carried-in state: y_t += exp(adt_0 + ... + adt_t)·h_{k-1}·C_t
#
# Only step 3 is a recurrence, and it is T times shorter than the sequence. ssd_minimal.py
# runs it as one more quadratic form, over chunks (K² work), the official Triton kernels as a
# loop over chunks; pscan.scan does it in O(K) work, as a loop or as a tree (pscan.py).
#
# The decays within a chunk: step 4's prefix sums adt_0 + ... + adt_t are a plain cumsum, and step
# 2's suffix sums adt_{t+1} + ... + adt_{T-1} a reversed cumsum, so neither subtracts one cumsum from
# another (section 2). ssd_minimal.py takes step 2's as S_{T-1} - S_t, which is fine for T ≤ 256
# in fp32 too; ssd() needs no such argument.
#
# Any L: the last chunk is padded with identity steps, Δ = 0, so exp(0·A) = 1 and Δ·x = 0: the
# state passes through unchanged (the final state is exact) and the padded outputs are dropped.

@_without_autocast
def ssd(x, dt, A, B, C, chunk_size, D=None, h0=None, return_last_state=False, scan_backend="auto",
        reset=None):
    """Chunked SSD: y = SSD(Δ, A, B, C)(x) + D·x.

    Args:
        x:  (b, L, H, P)   input, per head
        dt: (b, L, H)      step size Δ (after softplus), positive
        A:  (H,)           negative scalar per head
        B, C: (b, L, G, N) input and output projections, G groups (H a multiple of G)
        chunk_size:        T, the length of a chunk; any L works
        D:  (H,) or None   skip connection
        h0: (b, H, P, N) or None for zeros
        scan_backend:      pscan.scan's backend for the recurrence across chunks
        reset: (b, L) bool or None: True where a new sequence starts (packed sequences); the
               decay of that step is 0, so the state before it is forgotten (pscan.py section 3)
    Returns:
        y: (b, L, H, P) in x's dtype; with return_last_state also the final state (b, H, P, N),
        computed in fp32 (fp64 for fp64 inputs), a tensor of its own (not a view of a larger one)

    A NaN or an infinity at position t also makes the earlier outputs of its chunk NaN, in the heads
    that read it: the masked-out (zero) weights of (M ∘ C·Bᵀ) still multiply it, and 0·NaN and 0·inf
    are NaN. ssd_sequential, a loop, stays causal. Other rows of the batch are not touched.
    """
    _check_ssd_inputs(x, dt, A, B, C, D, h0, chunk_size)
    if scan_backend not in pscan.BACKENDS:
        raise ValueError(f"scan_backend must be one of {pscan.BACKENDS}, got {scan_backend!r}")
    if reset is not None and (not isinstance(reset, torch.Tensor) or reset.dtype != torch.bool
                              or tuple(reset.shape) != tuple(x.shape[:2])):
        raise ValueError(f"reset must be a bool tensor of shape (b, L) = {tuple(x.shape[:2])}, got "
                         f"{reset.dtype if isinstance(reset, torch.Tensor) else type(reset).__name__}")
    out_dtype = x.dtype
    x, dt, A, B, C = _in_compute_dtype(x, dt, A, B, C)
    b, L, H, P = x.shape
    G, N, T = B.shape[2], B.shape[3], min(chunk_size, L)  # a shorter sequence: one chunk, unpadded
    pad = -L % T
    if pad:  # identity steps: Δ = 0 (and x, B, C = 0, so nothing is read or written)
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    n_chunks = (L + pad) // T  # K
    adt = dt * A  # (b, L', H)  log-decays
    if reset is not None:  # the decay exp(adt) = 0: nothing of the earlier sequence reaches this one
        adt = torch.where(F.pad(reset, (0, pad))[..., None], -torch.inf, adt)
    xdt = _heads_by_group((x * dt[..., None]).reshape(b, n_chunks, T, H, P), G)  # (b, K, G, H/G, T, P)
    adt = _heads_by_group_scalar(adt.reshape(b, n_chunks, T, H), G)  # (b, K, G, H/G, T)
    Bc = _groups_over_heads(B.reshape(b, n_chunks, T, G, N))  # (b, K, G, 1, T, N)
    Cc = _groups_over_heads(C.reshape(b, n_chunks, T, G, N))  # (b, K, G, 1, T, N)

    # 1. every chunk on its own, from a zero state
    y = _quadratic(xdt, adt, Bc, Cc)  # (b, K, G, H/G, T, P)

    # Steps 2-4 matter only when a state is carried into some chunk or is asked for: with one
    # chunk, no h0 and no final state (training with L = chunk_size) step 1 is the whole answer.
    if n_chunks > 1 or h0 is not None or return_last_state:
        _cpu_graph_break(x)  # compiled on a CPU only: a torch 2.13 workaround (section 4)
        # 2. every chunk's end state E_k from a zero state, input t decayed by adt_{t+1} + ... + adt_{T-1}
        decay_from_start = torch.exp(adt.cumsum(-1))  # (b, K, G, H/G, T)  exp(adt_0 + ... + adt_t)
        to_end = F.pad(adt[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))  # (b, K, G, H/G, T)
        states = (xdt * torch.exp(to_end)[..., None]).transpose(-1, -2) @ Bc  # (b, K, G, H/G, P, N)

        # 3. across chunks: h_k = exp(adt_0 + ... + adt_{T-1})·h_{k-1} + E_k, with pscan.scan over k
        chunk_decay = decay_from_start[..., -1, None, None].expand_as(states)  # (b, K, G, H/G, P, N)
        h_start = None if h0 is None else h0.to(x.dtype).reshape(b, G, H // G, P, N)  # (b, G, H/G, P, N)
        h = pscan.scan(chunk_decay, states, h_start, backend=scan_backend)  # (b, K, G, H/G, P, N)
        first = torch.zeros_like(h[:, :1]) if h_start is None else h_start.unsqueeze(1)
        h_in = torch.cat([first, h[:, :-1]], dim=1)  # (b, K, G, H/G, P, N)  the state entering each chunk

        # 4. what the carried-in state adds to each output, decayed to its position
        y = y + (Cc @ h_in.transpose(-1, -2)) * decay_from_start[..., None]  # (b, K, G, H/G, T, P)

    y = _time_major(y).reshape(b, n_chunks * T, H, P)[:, :L]  # (b, L, H, P)
    if D is not None:
        y = y + D.to(x.dtype)[:, None] * x[:, :L]
    y = y.to(out_dtype)
    if not return_last_state:
        return y
    # h[:, -1] is a view that would keep every chunk's state alive: copy the one we return
    return y, h[:, -1].reshape(b, H, P, N).clone(memory_format=torch.contiguous_format)  # (b, H, P, N)


# ------------------------------------------------------------------------------------------------
# 4. The model
# ------------------------------------------------------------------------------------------------
# The official MambaLMHeadModel is one class for both generations: ssm_cfg["layer"] picks the
# mixer, and everything around it (embedding, pre-norm residual blocks with an fp32 residual
# stream, norm_f, tied head, the init of mixer_seq_simple's `_init_weights`) is shared. So is it
# in this file: Mamba2LM is mamba_minimal.MambaLM with Mamba-2 mixers in its blocks.

@dataclass
class Mamba2Config:
    """Field names follow the official Mamba2 block and MambaConfig (config_mamba.py)."""
    d_model: int
    n_layer: int
    vocab_size: int
    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    headdim: int = 64
    d_ssm: Optional[int] = None  # channels that go through the SSM; None: all d_inner (the rest: a gated MLP)
    ngroups: int = 1
    A_init_range: tuple = (1, 16)
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: tuple = (0.0, float("inf"))
    bias: bool = False
    conv_bias: bool = True
    chunk_size: int = 256
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
    # how to run it (not part of a checkpoint's identity): pscan.scan's backend for the recurrence
    # across chunks, and whether the mixer's forward goes through torch.compile (see the mixer)
    scan_backend: str = "auto"
    compile_mixer: bool = False

    def __post_init__(self):
        for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand", "headdim",
                     "ngroups", "chunk_size", "pad_vocab_size_multiple"):
            value = getattr(self, name)
            if not mm._is_positive_int(value):
                raise ValueError(f"Mamba2Config.{name} must be a positive integer, got {value!r}")
        for name in ("bias", "conv_bias", "tie_embeddings", "residual_in_fp32", "compile_mixer"):
            if not isinstance(getattr(self, name), bool):  # a string such as "no" would count as true
                raise ValueError(f"Mamba2Config.{name} must be True or False, got {getattr(self, name)!r}")
        if self.d_ssm is None:
            self.d_ssm = self.d_inner
        if not mm._is_positive_int(self.d_ssm) or self.d_ssm > self.d_inner or self.d_ssm % self.headdim:
            raise ValueError(f"d_ssm = {self.d_ssm!r} must be a multiple of headdim = {self.headdim} (an int) "
                             f"and at most d_inner = expand * d_model = {self.d_inner}")
        if self.nheads % self.ngroups:
            raise ValueError(f"the number of heads d_ssm / headdim = {self.nheads} must be a multiple "
                             f"of ngroups = {self.ngroups}")
        for name in ("A_init_range", "dt_limit"):
            pair = getattr(self, name)
            if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair):
                raise ValueError(f"Mamba2Config.{name} must be a pair of numbers (low, high), got {pair!r}")
            setattr(self, name, tuple(pair))
        if not 0 < self.A_init_range[0] <= self.A_init_range[1] < math.inf:
            raise ValueError(f"A_init_range must be (low, high) with 0 < low <= high < inf, got {self.A_init_range}")
        if not 0 <= self.dt_limit[0] <= self.dt_limit[1]:  # low > high would clamp every Δ to high
            raise ValueError(f"dt_limit must be (low, high) with 0 <= low <= high, got {self.dt_limit}")
        if not mm._is_positive_number(self.norm_epsilon):  # not `> 0` alone: None or a string would raise a TypeError
            raise ValueError(f"Mamba2Config.norm_epsilon must be positive, got {self.norm_epsilon!r}")
        mm.check_dt_init(self)
        if self.scan_backend not in pscan.BACKENDS:
            raise ValueError(f"Mamba2Config.scan_backend must be one of {pscan.BACKENDS}, "
                             f"got {self.scan_backend!r}")
        hybrid._check_hybrid_fields(self)

    @property
    def d_inner(self):
        return self.expand * self.d_model

    @property
    def nheads(self):
        return self.d_ssm // self.headdim

    @property
    def conv_dim(self):  # the conv runs over x, B and C together
        return self.d_ssm + 2 * self.ngroups * self.d_state

    @property
    def padded_vocab_size(self):
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m


class RMSNormGated(RMSNorm):
    """The official RMSNormGated with norm_before_gate=False: y·SiLU(z) first, then an RMSNorm
    over each group of group_size channels (d_ssm / ngroups: one group per B/C group, so the
    norm does not mix what different groups computed), in fp32."""

    def __init__(self, d, group_size, eps=1e-5):
        super().__init__(d, eps)
        self.group_size = group_size

    def forward(self, y, z):
        gated = _at_least_fp32(y) * F.silu(_at_least_fp32(z))  # (..., d)
        groups = gated.unflatten(-1, (-1, self.group_size))  # (..., d / group_size, group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return groups.flatten(-2).to(self.weight.dtype) * self.weight  # (..., d)


class Mamba2Mixer(nn.Module):
    """The Mamba-2 block (the official `Mamba2` module, named `mixer` in the tree).

    u ─ in_proj ─┬─ z ───────────────────────────────────────────────────┐
                 ├─ x, B, C ─ causal conv1d ─ SiLU ─ x, B, C ─┐              │
                 └─ dt_raw ─ softplus(+ dt_bias) ─ dt ────────┴─ SSD (+D·x) ─ y·SiLU(z) ─ RMSNorm
                                                                  per group ─ out_proj

    Unlike Mamba-1, every SSM input (x, B, C and Δ) comes straight from in_proj, in parallel,
    instead of B, C, Δ being computed from x (paper section 7.1): one projection, and the
    norm before out_proj (absent in Mamba-1) keeps training stable at scale.
    """

    def __init__(self, cfg: Mamba2Config):
        super().__init__()
        self.cfg = cfg
        H, G, N = cfg.nheads, cfg.ngroups, cfg.d_state
        self.d_mlp = cfg.d_inner - cfg.d_ssm  # 0 unless d_ssm < d_inner
        # in_proj's output, in the official order: [z0, x0 (the gated MLP, d_mlp each), z (d_ssm),
        # xBC (d_ssm + 2·G·N), dt_raw (H)]
        self.split_sizes = [self.d_mlp, self.d_mlp, cfg.d_ssm, cfg.conv_dim, H]
        self.in_proj = nn.Linear(cfg.d_model, sum(self.split_sizes), bias=cfg.bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim,
                                padding=cfg.d_conv - 1, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))  # A = -exp(A_log), one scalar per head
        self.D = nn.Parameter(torch.empty(H))
        # eps: the official block fixes 1e-5, transformers takes layer_norm_epsilon; the same in
        # every released checkpoint
        self.norm = RMSNormGated(cfg.d_ssm, group_size=cfg.d_ssm // G, eps=cfg.norm_epsilon)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=cfg.bias)
        self.reset_ssm_parameters()

    # the depthwise causal conv and its one-token form on the rolling buffer: Mamba-1's methods
    # (they read self.cfg.d_conv and self.conv1d, which this block has too). The conv runs as
    # mamba_engine._CausalConv: mamba_minimal.shifted_sum with its backward written out
    # (mamba_engine.py section 1), the same numbers to rounding
    causal_conv = mm.MambaMixer.causal_conv
    conv_fn = staticmethod(eng._CausalConv.apply)
    conv_step = mm.MambaMixer.conv_step

    @torch.no_grad()
    def reset_ssm_parameters(self):
        """The official init: A uniform in A_init_range (A_log its log); Δ log-uniform in
        [dt_min, dt_max], floored, stored through the inverse softplus in dt_bias; D = 1."""
        cfg, H = self.cfg, self.cfg.nheads
        self.A_log.copy_(torch.empty(H).uniform_(*cfg.A_init_range).log())
        self.dt_bias.copy_(mm.dt_bias_init(H, cfg))  # Mamba-1's Δ init, one per head
        self.D.fill_(1.0)

    @property
    def A(self):
        """A = -exp(A_log) (H,), in fp32 even in a bf16 model: the decays exp(Δ·A) need it."""
        return -torch.exp(_at_least_fp32(self.A_log))

    def _delta(self, dt_raw):
        """dt_raw (..., H) from in_proj -> dt = Δ = softplus(dt_raw + dt_bias) (..., H) in fp32,
        within dt_limit."""
        dt = F.softplus(_at_least_fp32(dt_raw) + _at_least_fp32(self.dt_bias))
        low, high = self.cfg.dt_limit
        if (low, high) != (0.0, float("inf")):
            dt = dt.clamp(low, high)
        return dt

    def _split(self, zxbcdt):
        return zxbcdt.split(self.split_sizes, dim=-1)

    def _finish(self, y, z, z0, x0):
        """y (..., d_ssm) -> out (..., d_model): gated norm, the optional gated MLP, out_proj."""
        y = self.norm(y, z)  # (..., d_ssm)
        if self.d_mlp:
            y = torch.cat([F.silu(z0) * x0, y.to(x0.dtype)], dim=-1)  # (..., d_inner)
        return self.out_proj(y.to(self.out_proj.weight.dtype))  # (..., d_model)

    # Opt-in speed: cfg.compile_mixer runs this forward through torch.compile. Chunked SSD has
    # already turned the sequence work into matmuls; what is left to win on a CPU is the
    # elementwise work around them (conv, SiLU, decay mask, gate, norm), one pass over memory per
    # op in eager mode, which Inductor fuses into loops: about 1.3x per training step for the
    # trainer's default Mamba-2, a block of one chunk (`python -m bench mamba2_train`, 2-core
    # Intel Xeon with AVX-512). One graph serves every layer (the parameters are its inputs); a
    # new input shape compiles again. With several chunks the mixer is one graph on a GPU; on a
    # CPU ssd() breaks the graph at its step 2, which cuts each function on the way there too: six
    # graphs (`python -m bench graphs`). Only training runs compiled: a forward without autograd
    # (an evaluation, prefill, step()) runs eagerly; compiled, it would be one more graph, one more
    # compile for a small share of a run's time.

    def forward(self, u, want_cache=False, cache=None, seq_idx=None, attention_mask=None):
        """u: (b, L, d_model) -> (b, L, d_model); with want_cache also the layer's
        (conv_state, ssm_state). cache: start from this layer's (conv_state, ssm_state); seq_idx and
        attention_mask (b, L) as MambaLM.forward takes them, checked there."""
        if self.cfg.compile_mixer and not want_cache and cache is None and torch.is_grad_enabled() \
                and not torch.compiler.is_compiling():  # in a model compiled whole, that compile traces _forward
            return _compiled_forward(u.device.type)(self, u, False, None, seq_idx, attention_mask)
        return self._forward(u, want_cache, cache, seq_idx, attention_mask)

    def _forward(self, u, want_cache=False, cache=None, seq_idx=None, attention_mask=None):
        cfg = self.cfg
        H, P, G, N = cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state
        conv_state, h0 = (None, None) if cache is None else cache
        # z (b, L, d_ssm), xBC_in (b, L, conv_dim), dt_raw (b, L, H)
        z0, x0, z, xBC_in, dt_raw = self._split(self.in_proj(u))
        dt = self._delta(dt_raw)  # (b, L, H)
        if attention_mask is not None:  # padding: zeros into the conv, identity steps (Δ = 0) for the state
            xBC_in = xBC_in * attention_mask[..., None]
            dt = dt * attention_mask[..., None]
        xBC = F.silu(self.causal_conv(xBC_in, conv_state, seq_idx))  # (b, L, conv_dim)
        x, B, C = xBC.split([cfg.d_ssm, G * N, G * N], dim=-1)
        # packed sequences: a reset where seq_idx changes (passed only then, so ssd's plain signature still serves)
        packed = {} if seq_idx is None else {"reset": F.pad(seq_idx.diff(dim=1) != 0, (1, 0))}  # (b, L)
        y = ssd(x.unflatten(-1, (H, P)), dt, self.A, B.unflatten(-1, (G, N)),
                C.unflatten(-1, (G, N)), cfg.chunk_size, self.D, h0=h0, return_last_state=want_cache,
                scan_backend=cfg.scan_backend, **packed)  # (b, L, H, P); with want_cache also the state (b, H, P, N)
        y, h_last = y if want_cache else (y, None)
        out = self._finish(y.flatten(-2), z, z0, x0)  # (b, L, d_model)
        if not want_cache:
            return out
        conv_after = mm.conv_buffer_after(xBC_in, cfg.d_conv, self.conv1d.weight.dtype, conv_state, seq_idx)
        return out, (conv_after, h_last)  # (b, conv_dim, d_conv), (b, H, P, N)

    def cache_spec(self, batch):
        """What prefill's cache holds for this layer, as (name, shape, what the dims are, dtype):
        MambaLM.step checks a cache against it before writing into any layer."""
        cfg = self.cfg
        return (("conv_state", (batch, cfg.conv_dim, cfg.d_conv), "batch, conv_dim, d_conv",
                 self.conv1d.weight.dtype),
                ("ssm_state", (batch, cfg.nheads, cfg.headdim, cfg.d_state),
                 "batch, nheads, headdim, d_state", _at_least_fp32(self.A_log).dtype))

    def step(self, u, cache):
        """One token (the official Mamba2.step without its kernels). u: (b, d_model);
        cache = (conv_state, ssm_state), updated in place. -> (b, d_model)"""
        cfg = self.cfg
        H, P, G, N = cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state
        conv_state, ssm_state = cache  # (b, conv_dim, d_conv), (b, H, P, N)
        z0, x0, z, xBC, dt_raw = self._split(self.in_proj(u))  # (b, ...) each
        x, B, C = F.silu(self.conv_step(conv_state, xBC)).split([cfg.d_ssm, G * N, G * N], dim=-1)
        dt = self._delta(dt_raw).to(ssm_state.dtype)  # (b, H)
        x = x.unflatten(-1, (H, P)).to(ssm_state.dtype)  # (b, H, P)
        B, C = (t.unflatten(-1, (G, N)).repeat_interleave(H // G, dim=1).to(ssm_state.dtype)
                for t in (B, C))  # (b, H, N) each: head j reads group j // (H/G)
        h, y = ssd_step(ssm_state, x, dt, self.A.to(ssm_state.dtype), B, C)  # section 1's step
        ssm_state.copy_(h)
        y = y + self.D.to(x.dtype)[:, None] * x  # (b, H, P)
        return self._finish(y.flatten(-2), z, z0, x0)  # (b, d_model)


def _cpu_graph_break(x):
    """Under torch.compile on a CPU, start a new graph before ssd's step 2: for one graph holding
    steps 1 and 2 of several chunks, torch 2.13's C++ backend makes a backward that corrupts the
    heap (glibc aborts, "double free or corruption", at 4 heads of 16, N 8, two chunks of 8).
    CUDA's Triton backend is another code generator: there the graph stays one (test_model.py's
    compiled CUDA test runs two chunks)."""
    if torch.compiler.is_compiling() and x.device.type == "cpu":
        torch._dynamo.graph_break()


@functools.cache
def _compiled_forward(device_type):
    """Mamba2Mixer._forward through torch.compile (static shapes), made once per device type and
    shared by every mixer in the process: each new config or shape compiles again. Its backward
    is compiled with its forward, so that a compiler that fails, at either, fails inside the call
    and the call runs eagerly instead (mamba_engine.CompiledOrEager)."""
    return eng.CompiledOrEager(Mamba2Mixer._forward, f"Mamba-2's mixer on {device_type}", compile_backward_now=True,
                              dynamic=False)


class Mamba2LM(mm.MambaLM):
    """The language model, module tree as the official MambaLMHeadModel with Mamba2 mixers:
    backbone.embedding, backbone.layers.{i}.norm, backbone.layers.{i}.mixer.{in_proj, conv1d,
    dt_bias, A_log, D, norm, out_proj}, backbone.norm_f, lm_head.

    From MambaLM, unchanged: forward (logits (b, L, padded_vocab)), prefill, generate,
    generate_stream, optim_groups (no weight decay on A_log, D, dt_bias, norms, biases: every
    1-D parameter) and the official init (mixer_seq_simple's _init_weights, in the backbone and
    MambaLM: Linear biases zero, embedding N(0, 0.02), out_proj kaiming-uniform divided by
    sqrt(n_layer), then the SSM parameters).
    """
    backbone_cls = hybrid.HybridMamba  # the official configs' MLP and attention layers (mamba2attn)

    def __init__(self, cfg: Mamba2Config):
        super().__init__(cfg, mixer_cls=Mamba2Mixer)  # Block and the backbone as in Mamba-1

    # --------------------------------------------------------------------------------------------
    # 5. Recurrent inference
    # --------------------------------------------------------------------------------------------
    # A layer's memory of the past: the conv's last d_conv inputs of x, B, C (b, conv_dim, d_conv)
    # and the SSM state (b, H, P, N). MambaLM's prefill, step and generate run unchanged: prefill
    # is forward with want_cache (chunked SSD over the prompt), and each further token is one O(1)
    # Mamba2Mixer.step (section 1's ssd_step on the cache), after MambaLM.step has checked the
    # cache against every mixer's cache_spec. prefill(ids, cache=cache) continues a cache with many
    # tokens at once: ssd() starts from its state (h0) and the conv reads its buffer.


# ------------------------------------------------------------------------------------------------
# Appendix: input checks
# ------------------------------------------------------------------------------------------------

def _check_ssd_inputs(x, dt, A, B, C, D, h0, chunk_size=1):
    """Raise ValueError naming what was expected."""
    named = {"x": x, "dt": dt, "A": A, "B": B, "C": C}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must have shape (b, L, H, P), got {tuple(x.shape)}")
    b, L, H, P = x.shape
    if L == 0:
        raise ValueError(f"the sequence length must be at least 1, got x of shape {tuple(x.shape)}")
    if B.dim() != 4 or tuple(B.shape[:2]) != (b, L):
        raise ValueError(f"B must have shape (b, L, G, N) = ({b}, {L}, G, N), got {tuple(B.shape)}")
    G, N = B.shape[2:]
    if G == 0:
        raise ValueError(f"B and C must have at least one group G, got shape {tuple(B.shape)}")
    if H % G != 0:
        raise ValueError(f"the number of heads H = {H} must be a multiple of the number of groups G = {G}")
    if not mm._is_positive_int(chunk_size):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    expected = {"dt": (b, L, H), "A": (H,), "C": (b, L, G, N), "D": (H,), "h0": (b, H, P, N)}
    for name, t in (("dt", dt), ("A", A), ("C", C), ("D", D), ("h0", h0)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != expected[name]):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape {expected[name]}, got {got}")
    for name, t in list(named.items()) + [("D", D), ("h0", h0)]:
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on {x.device} like x, got {t.device}")
