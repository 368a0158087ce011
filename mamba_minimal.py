"""
mamba_minimal.py: Mamba (Gu & Dao 2023, arXiv 2312.00752) in plain PyTorch, compatible with the
official checkpoints.

Read it top to bottom: sections 1 to 5 are the whole model. By default their scan, and the conv's
backward, run through section 6's engine (the same numbers to rounding; a CPU training step 1.3-1.4
times as fast: RESULTS.md); MambaConfig(scan_backend="reference") runs sections 2 and 3's code
itself: the two paths sit side by side in MambaMixer. With that switch, sections 1 to 5 call later
code only for input checks and options.

    1. The SSM and its discretization   h' = A·h + B·x, sampled with a step Δ      (paper eqs. 1, 2, 4)
    2. The selective scan               discretize, scan, read out with C          (Algorithm 2; selective_scan_ref)
    3. The block                        MambaConfig, RMSNorm, the causal conv, the mixer (Mamba.forward, mamba_inner_ref)
    4. The language model               residual blocks, the LM, its init, weight decay (MambaLMHeadModel)
    5. Recurrent inference (in MambaLM) prefill, an O(1) step per token, sampling, generate (Mamba.step)
    6. Making it fast                   hand-written backwards, the fused path, torch.compile
    7. Loading checkpoints              official and transformers layouts, hub ids, shards
    8. Using a model for real           caches, packed sequences, padding
    9. Hybrid models                    attention layers and MLPs (MHA, GatedMLP)
   10. Selection switched off          the time-invariant ablation
   11. Appendix: input checks

Glossary. One name, one meaning; shape comments use these letters.

    b        batch size
    L        sequence length
    d_model  model width, the residual stream
    ED       d_inner = expand·d_model, the channels the SSM runs on (the paper's E·D; a lone D
             is always the skip below)
    N        d_state, the number of states per channel
    x        the scan's input: the causal conv's output after SiLU              (b, L, ED)
    delta    Δ > 0, the step size, one per token and channel (0: a padding step)   (b, L, ED)
    A        the continuous state matrix: diagonal, one negative entry per (channel, state)   (ED, N)
    B, C     the input and output matrices, one N-vector per token, shared by the channels   (b, L, N)
    D        the skip connection y += D·x, one per channel                      (ED,)
    z        the gate's input, y is multiplied by SiLU(z)                       (b, L, ED)
    h        the state             (b, L, ED, N), or (b, ED, N) for one step
    dA, dBx  the discretized step, exp(Δ·A) and Δ·B·x:  h_t = dA_t·h_{t-1} + dBx_t   (b, L, ED, N)
    V        padded_vocab_size, the vocabulary padded (65 -> 72)

The recurrence h_t = a_t·h_{t-1} + b_t itself, and every way to run it, lives in pscan.py: read
its sections 1 and 9 first, its parallel scan (sections 3-5, 8) after section 5 here.
"""

import contextlib
import functools
import importlib.util
import inspect
import json
import math
import os
import warnings
import weakref
from dataclasses import dataclass, field, fields
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

import pscan


def _at_least_fp32(t):
    """fp16/bf16 -> fp32; fp32 and fp64 stay as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


# ------------------------------------------------------------------------------------------------
# 1. The SSM and its discretization
# ------------------------------------------------------------------------------------------------
# A state space model maps an input x(t) to an output y(t) through a hidden state h(t) (paper eq. 1):
#
#     h'(t) = A·h(t) + B·x(t),        y(t) = C·h(t)
#
# Mamba runs ED of them, one per channel, each with N states; A is diagonal, stored as (ED, N).
# To run on tokens, each is sampled with a step Δ and the zero-order hold, x held constant over
# each step of length Δ (eqs. 2, 4):
#
#     h_t = Ā·h_{t-1} + B̄·x_t,      Ā = exp(Δ·A),      B̄ = (Δ·A)^-1 (exp(Δ·A) - 1)·Δ·B ≈ Δ·B
#
# Ā is exactly how the state decays over a step, whatever x does; B̄ is kept to first order,
# Euler's Δ·B, as in the official selective_scan_ref. Ā is not Euler's 1 + Δ·A, which could
# leave (0, 1).
#
# Why A_log: A = -exp(A_log) < 0 and Δ = softplus(·) > 0 put every decay exp(Δ·A) in (0, 1), and no
# optimizer step can make A positive. A large Δ forgets the past and takes the input in; a small
# Δ keeps the past.
#
# Selection (§3.2): Δ, B and C are computed per token from the conv's output. A stays a learned
# constant: a selective Δ already makes the decay exp(Δ·A) selective (§3.5.2).
#
# Seen from attention: y_t = Σ_{s≤t} C_t·(dA_{s+1}···dA_t)·Δ_s·B_s·x_s is causal linear attention
# with query C_t, key B_s, value Δ_s·x_s and, instead of a softmax, a decay the tokens choose.

def discretize(x, delta, A, B):
    """x, delta (b, L, ED), A (ED, N), B (b, L, N) -> dA = exp(Δ·A), dBx = Δ·B·x, (b, L, ED, N)
    each; for one token, drop the L."""
    dA = torch.exp(delta.unsqueeze(-1) * A)  # (b, L, ED, N)
    dBx = (delta * x).unsqueeze(-1) * B.unsqueeze(-2)  # (b, L, ED, N)
    return dA, dBx


# ------------------------------------------------------------------------------------------------
# 2. The selective scan
# ------------------------------------------------------------------------------------------------
# Algorithm 2 (the "S6" layer): discretize every token, run h_t = dA_t·h_{t-1} + dBx_t, read each
# state out with C_t, then add the skip D·x and gate with SiLU(z) (the block's, §3.4, applied
# inside the scan as the official kernel does). As dA_t, B_t and C_t change with the token, this
# is no fixed convolution as in S4 (eq. 3): it has to be scanned. selective_scan_reference mirrors
# the official selective_scan_ref (mamba_ssm/ops/selective_scan_interface.py), whose scan is a loop too.
#
# Why fp32 whatever the input dtype: bf16's values just below 1 are 2^-8 apart. A decay 0.999
# (Δ = 0.001, A = -1: the slowest state at init) rounds to 1.0, and Δ·B·x ≈ 0.001 added to a
# state near 1 rounds away; fp32's spacing there is 6e-8.

def skip_and_gate(y, x, D, z):
    """The last two steps of the selective scan: y + D·x, then the gate SiLU(z). (b, L, ED)."""
    if D is not None:
        y = y + D * x
    if z is not None:
        y = y * F.silu(z)
    return y


def selective_scan_reference(x, delta, A, B, C, D=None, z=None, h0=None, backend="sequential", reset=None):
    """y = SSM(Δ, A, B, C)(x) + D·x, gated by SiLU(z); section 6 is tested against it.
    x, delta, z: (b, L, ED); A: (ED, N); B, C: (b, L, N); D: (ED,); h0: (b, ED, N) or None;
    backend: the loop, or any of pscan.BACKENDS, the same h to rounding; reset: section 8.
    -> y (b, L, ED) and the final state (b, ED, N), in fp32 (fp64 for fp64 inputs)."""
    x, delta, A, B, C = (_at_least_fp32(t) for t in (x, delta, A, B, C))
    D, z = (None if t is None else t.to(x.dtype) for t in (D, z))
    dA, dBx = discretize(x, delta, A, B)  # (b, L, ED, N) each
    if reset is not None:  # §8
        dA = dA.masked_fill(reset[:, :, None, None], 0)
    h = pscan.scan(dA, dBx, None if h0 is None else h0.to(dA.dtype), backend)  # (b, L, ED, N)
    # C_t·h_t as a product and a sum: bf16 autocast would run a matmul in bf16
    y = (h * C.unsqueeze(-2)).sum(-1)  # (b, L, ED)
    y = skip_and_gate(y, x, D, z)  # (b, L, ED)
    # a copy: the view h[:, -1] would keep all of h alive in a cache
    return y, h[:, -1].clone()  # (b, L, ED), (b, ED, N)


# ------------------------------------------------------------------------------------------------
# 3. The block
# ------------------------------------------------------------------------------------------------
# The mixer around the selective scan (Figure 3, §3.4) and its parts; its cache and step belong
# to section 5.

@dataclass
class MambaConfig:
    """Names and block defaults as the official MambaConfig; the size of a small character model."""
    d_model: int = 128
    n_layer: int = 4
    vocab_size: int = 65
    d_state: int = 16
    expand: int = 2
    dt_rank: Union[int, str] = "auto"  # "auto": ceil(d_model / 16), the official default
    d_conv: int = 4
    conv_bias: bool = True
    bias: bool = False
    dt_min: float = 1e-3  # Δ at init: log-uniform in [dt_min, dt_max], at least dt_init_floor
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_scale: float = 1.0
    dt_init: str = "random"  # dt_proj.weight uniform in ±dt_rank^-0.5·dt_scale, or "constant" at +that
    norm_epsilon: float = 1e-5
    pad_vocab_size_multiple: int = 8  # the vocabulary is padded to a multiple of this (65 -> 72)
    tie_embeddings: bool = True
    residual_in_fp32: bool = True
    # the official MambaLMHeadModel's block fields (section 9): an MLP after each mixer, attention
    # layers in place of some mixers, LayerNorm instead of RMSNorm
    d_intermediate: int = 0
    attn_layer_idx: list = field(default_factory=list)
    attn_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True
    # How to run it, not part of a checkpoint. "reference": sections 2 and 3's code as written,
    # differentiated by autograd (the scan: pscan.py's loop); any other
    # value: section 6's engine, the same numbers, the value naming the scan it runs
    scan_backend: str = "auto"
    compile_scan: Union[bool, str] = False  # section 6: False, True or "loop"
    chunk_size: int = 16  # section 6: the fused path's chunk length T
    recompute: bool = True  # section 6: the fused path's hand-written backward (vs plain autograd)
    selection_off: bool = False  # an ablation, section 10: Δ, B and C constants, no selection

    def __post_init__(self):
        _check_config(self)  # the appendix
        if self.dt_rank == "auto":
            self.dt_rank = math.ceil(self.d_model / 16)

    @property
    def d_inner(self):
        return self.expand * self.d_model

    @property
    def padded_vocab_size(self):
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight: the normalisation in fp32, the product in the weight's dtype."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x32 = _at_least_fp32(x)
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(self.weight.dtype) * self.weight


def dt_bias_init(n, cfg):
    """n initial Δ, log-uniform in [dt_min, dt_max], at least dt_init_floor (the official init),
    as the bias whose softplus gives them."""
    u = torch.rand(n)
    dt = torch.exp(u * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min))
    dt = dt.clamp(min=cfg.dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)


def shifted_sum(x_pad, w, bias=None, keep=None):
    """The depthwise causal conv, out_t = Σ_k w_k·x_pad_{t+k} + bias: x_pad (b, d_conv-1+L, ED) is
    the d_conv-1 inputs before the first token, then the tokens; w (ED, d_conv); keep: conv_keep's
    (section 8). -> (b, L, ED): the conv as d_conv shifted multiply-adds (section 6 writes their
    backward out)."""
    width, L = w.shape[1], x_pad.shape[1] - w.shape[1] + 1

    def tap(k):  # the inputs d_conv-1-k tokens back, (b, L, ED)
        shifted = x_pad[:, k:k + L]
        return shifted if keep is None else shifted * keep[:, :, k, None]  # §8

    out = tap(0) * w[:, 0] if bias is None else torch.addcmul(bias, tap(0), w[:, 0])
    for k in range(1, width):
        out = torch.addcmul(out, tap(k), w[:, k])  # (b, L, ED)
    return out


def conv_buffer_after(x_in, d_conv, dtype, conv_state=None, seq_idx=None):
    """The conv's buffer after x_in (b, L, ED): its last d_conv inputs (zeros before the first
    token, or conv_state's, continuing a cache; with seq_idx, zeros for earlier sequences), a fresh
    (b, ED, d_conv) tensor of `dtype`: a cache must not keep the prompt's activations alive."""
    x_in = x_in.transpose(1, 2)  # (b, ED, L)
    if conv_state is None:
        state = F.pad(x_in, (max(d_conv - x_in.shape[-1], 0), 0))[..., -d_conv:]
    else:  # §8
        state = torch.cat([conv_state.to(x_in.dtype), x_in], dim=-1)[..., -d_conv:]
    if seq_idx is not None:  # §8
        seq_pad = torch.cat([seq_idx[:, :1].expand(-1, d_conv), seq_idx], dim=1)[:, -d_conv:]  # (b, d_conv)
        state = state * (seq_pad == seq_idx[:, -1:]).unsqueeze(1)
    return state.to(dtype).clone(memory_format=torch.contiguous_format)


class MambaMixer(nn.Module):
    """The Mamba block (the official `Mamba` module, `mixer` in the official tree; §3.4, Figure 3),
    its forward as the official Mamba.forward / mamba_inner_ref:

      hidden ─ in_proj ─┬─ x ─ causal conv1d ─ SiLU ─┬──────────────── x ─────────────┐
                        │                            └─ x_proj, dt_proj ─ Δ, B, C ────┤
                        │                                  selective scan: y = C·h + D·x
                        └─ z ─ SiLU ──────────────────────────────────────── × y ─ out_proj ─ out

    Why each piece:
      - the short causal conv (4 taps, kept from the H3 block, §3.4) mixes each channel with the
        last few tokens, so that Δ, B and C see a local context, not one token;
      - the gate SiLU(z) merges the H3 block and a gated MLP into one block (§3.4): one branch
        mixes along the sequence, the other decides per channel what passes;
      - Δ is low rank (§3.6): d_model/16 numbers per token, which dt_proj widens to ED channels,
        cheap next to the projections.
    """

    def __init__(self, cfg: MambaConfig):
        super().__init__()
        self.cfg = cfg
        ed, n, r = cfg.d_inner, cfg.d_state, cfg.dt_rank
        self.in_proj = nn.Linear(cfg.d_model, 2 * ed, bias=cfg.bias)
        # depthwise and causal (token t sees t-d_conv+1 .. t); an nn.Conv1d so that checkpoints load
        self.conv1d = nn.Conv1d(ed, ed, cfg.d_conv, groups=ed, padding=cfg.d_conv - 1, bias=cfg.conv_bias)
        self.x_proj = nn.Linear(ed, r + 2 * n, bias=False)  # -> Δ (low rank), B, C
        self.dt_proj = nn.Linear(r, ed, bias=True)  # Δ back to full width
        self.A_log = nn.Parameter(torch.empty(ed, n))  # A = -exp(A_log) < 0
        self.D = nn.Parameter(torch.empty(ed))
        self.out_proj = nn.Linear(ed, cfg.d_model, bias=cfg.bias)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self):
        """The official init of Δ, A and D; MambaLM calls it again after its generic init, which
        zeroes dt_proj's bias (every Δ would start at softplus(0) = 0.69)."""
        cfg = self.cfg
        std = cfg.dt_rank ** -0.5 * cfg.dt_scale  # keeps dt_proj's output O(1) for O(1) inputs
        if cfg.dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        else:
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        self.dt_proj.bias.copy_(dt_bias_init(cfg.d_inner, cfg))
        # A = -(1, 2, ..., N) in every channel: a spread of decay rates (the S4D-real init)
        self.A_log.copy_(torch.log(torch.arange(1, cfg.d_state + 1, dtype=torch.float32)).repeat(cfg.d_inner, 1))
        self.D.fill_(1.0)

    @property
    def A(self):
        """A = -exp(A_log) (ED, N), in fp32 even in a bf16 model: the decays exp(Δ·A) need it."""
        return -torch.exp(_at_least_fp32(self.A_log))

    def _ssm_inputs(self, x):
        """x (..., ED) after the conv -> delta (..., ED) in fp32 at least, B (..., N), C (..., N)."""
        cfg = self.cfg
        dt_low, B, C = self.x_proj(x).split([cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
        # The bias is added in fp32 (the official delta_bias): next to a bias of -2 to -7 bf16's
        # spacing is 1/64 to 1/32, a large share of the data-dependent part's spread at init.
        dt_raw = _at_least_fp32(F.linear(dt_low, self.dt_proj.weight))  # (..., ED) before softplus
        delta = F.softplus(dt_raw + _at_least_fp32(self.dt_proj.bias))  # (..., ED) Δ > 0
        return delta, B, C

    def causal_conv(self, x, conv_state=None, seq_idx=None):
        """The depthwise causal conv (shifted_sum), x: (b, L, ED) -> (b, L, ED). conv_state, seq_idx:
        continuing a cache, packed sequences (section 8)."""
        width = self.conv1d.kernel_size[0]  # d_conv (section 9's attention layers borrow this method)
        if conv_state is None:
            x_pad = F.pad(x, (0, 0, width - 1, 0))  # (b, d_conv-1+L, ED) zeros before the first token
        else:  # §8: the buffer's last d_conv-1 inputs: the conv needs no more before the first new token
            x_pad = torch.cat([conv_state[..., 1:].transpose(1, 2).to(x.dtype), x], dim=1)  # (b, d_conv-1+L, ED)
        keep = None if seq_idx is None else conv_keep(seq_idx, width, x.dtype)  # §8: (b, L, d_conv)
        w = self.conv1d.weight[:, 0, :]  # (ED, d_conv)
        if self.cfg.scan_backend == "reference":  # shifted_sum as written, differentiated by autograd
            return shifted_sum(x_pad, w, self.conv1d.bias, keep)
        return _CausalConv.apply(x_pad, w, self.conv1d.bias, keep)  # the same sum, its backward written out (section 6)

    def conv_step(self, conv_state, x):
        """causal_conv at one position: push x (b, ED) into the buffer of the last d_conv inputs,
        conv_state (b, ED, d_conv), in place. -> (b, ED)"""
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))  # drop the oldest input
        conv_state[:, :, -1] = x
        out = (conv_state * self.conv1d.weight[:, 0, :]).sum(-1)  # (b, ED)
        return out if self.conv1d.bias is None else out + self.conv1d.bias

    def forward(self, hidden, want_cache=False, cache=None, seq_idx=None, attention_mask=None):
        """hidden: (b, L, d_model) -> (b, L, d_model); with want_cache also the layer's cache
        (section 5). cache, seq_idx, attention_mask (b, L): section 8's options, None in training."""
        cfg = self.cfg
        conv_state, h0 = (None, None) if cache is None else cache  # §8
        x_in, z = self.in_proj(hidden).chunk(2, dim=-1)  # (b, L, ED) each
        if attention_mask is not None:  # §8, left padding: zeros into the conv ...
            x_in = x_in * attention_mask[..., None]
        x = F.silu(self.causal_conv(x_in, conv_state, seq_idx))  # (b, L, ED)
        delta, B, C = self._ssm_inputs(x)  # (b, L, ED), (b, L, N), (b, L, N)
        if attention_mask is not None:  # §8 ... and identity steps: Δ = 0 gives dA = 1, dBx = 0
            delta = delta * attention_mask[..., None]
        reset = None if seq_idx is None else F.pad(seq_idx.diff(dim=1) != 0, (1, 0))  # §8: (b, L) new documents
        if cfg.scan_backend == "reference":  # section 2 as written, autograd through pscan.py's loop
            y, h_last = selective_scan_reference(x, delta, self.A, B, C, self.D, z, h0, reset=reset)
            y = y.to(x.dtype)  # (b, L, ED)
        else:  # the same numbers by section 6's engine: a backward written by hand, or the fused path
            y, h_last = selective_scan(x, delta, self.A, B, C, self.D, z, h0, backend=cfg.scan_backend,
                                       compile=cfg.compile_scan, return_last_state=True,
                                       chunk_size=cfg.chunk_size, recompute=cfg.recompute, reset=reset)
        out = self.out_proj(y)  # (b, L, d_model)
        if not want_cache:
            return out
        conv_after = conv_buffer_after(x_in, cfg.d_conv, self.conv1d.weight.dtype, conv_state, seq_idx)
        return out, (conv_after, h_last)  # (b, ED, d_conv), (b, ED, N)

    def cache_spec(self, batch):
        """This layer's cache as (name, shape, its dims, dtype), which step's checks compare against;
        the SSM state is fp32 at least, like the scan."""
        cfg = self.cfg
        return (("conv_state", (batch, cfg.d_inner, cfg.d_conv), "batch, d_inner, d_conv", self.conv1d.weight.dtype),
                ("ssm_state", (batch, cfg.d_inner, cfg.d_state), "batch, d_inner, d_state",
                 _at_least_fp32(self.A_log).dtype))

    def step(self, hidden, cache):
        """One token, the recurrent form of forward (section 5; the official Mamba.step).
        hidden: (b, d_model); cache = (conv_state, ssm_state), updated in place. -> (b, d_model)"""
        conv_state, ssm_state = cache  # (b, ED, d_conv), (b, ED, N) fp32
        x, z = self.in_proj(hidden).chunk(2, dim=-1)  # (b, ED) each
        x = F.silu(self.conv_step(conv_state, x))  # (b, ED)
        delta, B, C = self._ssm_inputs(x)  # (b, ED), (b, N), (b, N)
        x32, B, C, z = (_at_least_fp32(t) for t in (x, B, C, z))
        dA, dBx = discretize(x32, delta, self.A, B)  # (b, ED, N) each: one token
        ssm_state.copy_(torch.addcmul(dBx, dA, ssm_state))  # h = dA·h + dBx
        y = (ssm_state * C.unsqueeze(1)).sum(-1)  # (b, ED)  C·h, in fp32 (a matmul would be bf16 under autocast)
        y = skip_and_gate(y, x32, self.D.to(x32.dtype), z)  # (b, ED)
        return self.out_proj(y.to(x.dtype))  # (b, d_model)


# ------------------------------------------------------------------------------------------------
# 4. The language model
# ------------------------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm residual block: hidden = hidden + mixer(norm(hidden)), the residual stream in fp32. The official
    Block runs Add -> Norm -> Mixer, to fuse the residual add with the norm in one kernel: the same
    sums, grouped differently. Section 9: attention instead of the mixer in cfg.attn_layer_idx's
    layers; with d_intermediate > 0, hidden = hidden + mlp(norm2(hidden)) after it."""

    def __init__(self, cfg: MambaConfig, mixer_cls=MambaMixer, layer_idx=0):
        super().__init__()
        norm_cls = RMSNorm if cfg.rms_norm else LayerNorm
        self.norm = norm_cls(cfg.d_model, cfg.norm_epsilon)
        # mamba2_minimal.py passes its Mamba2Mixer, as the official create_block does
        self.mixer = MHA(cfg) if layer_idx in cfg.attn_layer_idx else mixer_cls(cfg)  # §9: attention
        self.mlp = None
        if cfg.d_intermediate > 0:  # §9: an MLP
            self.norm2 = norm_cls(cfg.d_model, cfg.norm_epsilon)
            self.mlp = GatedMLP(cfg)
        self.residual_in_fp32 = cfg.residual_in_fp32

    def _residual(self, hidden):
        return _at_least_fp32(hidden) if self.residual_in_fp32 else hidden

    def _mlp(self, hidden):
        return hidden if self.mlp is None else hidden + self.mlp(self.norm2(hidden))

    def forward(self, hidden, want_cache=False, **use):  # use: the mixer's cache, seq_idx, attention_mask
        out = self.mixer(self.norm(hidden), want_cache, **use)
        if want_cache:
            out, cache = out
            return self._mlp(self._residual(hidden) + out), cache
        return self._mlp(self._residual(hidden) + out)

    def step(self, hidden, cache):
        return self._mlp(self._residual(hidden) + self.mixer.step(self.norm(hidden), cache))


class MixerModel(nn.Module):
    """The backbone: embedding, blocks, final norm (module names as in the official code)."""

    def __init__(self, cfg: MambaConfig, mixer_cls=MambaMixer):
        super().__init__()
        self.embedding = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)  # no padding_idx
        self.layers = nn.ModuleList(Block(cfg, mixer_cls, i) for i in range(cfg.n_layer))
        self.norm_f = (RMSNorm if cfg.rms_norm else LayerNorm)(cfg.d_model, cfg.norm_epsilon)


class MambaLM(nn.Module):
    """Language model with the official MambaLMHeadModel's module tree:
    backbone.embedding, backbone.layers.{i}.norm, backbone.layers.{i}.mixer.*, backbone.norm_f, lm_head
    (and section 9's backbone.layers.{i}.norm2, backbone.layers.{i}.mlp.{fc1, fc2})."""

    def __init__(self, cfg: MambaConfig, mixer_cls=MambaMixer):
        super().__init__()
        self.cfg = cfg
        if getattr(cfg, "selection_off", False):  # Mamba-1's ablation, section 10
            mixer_cls = SelectionOffMixer
        self.backbone = MixerModel(cfg, mixer_cls)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self):
        """The official _init_weights: Linear biases zero, embedding N(0, 0.02), each out_proj (and
        section 9's fc2) divided by sqrt(n_layer) so that the residual stream does not grow with
        depth; then the SSM parameters again."""
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        for layer in self.backbone.layers:
            for w in [layer.mixer.out_proj.weight] + ([] if layer.mlp is None else [layer.mlp.fc2.weight]):
                nn.init.kaiming_uniform_(w, a=math.sqrt(5))
                w /= math.sqrt(self.cfg.n_layer)
            if not isinstance(layer.mixer, MHA):
                layer.mixer.reset_ssm_parameters()

    def optim_groups(self, weight_decay):
        """AdamW parameter groups: matrices decay; A_log (decay would pull every A towards -1), D,
        norms and biases do not. Tied weights appear once."""
        params = [(name, p) for name, p in self.named_parameters() if p.requires_grad]
        exempt = [p.dim() < 2 or name.endswith("A_log") for name, p in params]
        return [{"params": [p for (_, p), e in zip(params, exempt) if not e], "weight_decay": weight_decay},
                {"params": [p for (_, p), e in zip(params, exempt) if e], "weight_decay": 0.0}]

    def forward(self, input_ids, want_cache=False, cache=None, seq_idx=None, attention_mask=None):
        """input_ids: (b, L) -> logits (b, L, padded_vocab); with want_cache also the inference cache.
        cache, seq_idx, attention_mask: continuing a cache, packed sequences, left padding (section 8;
        None in training: a first reading can skip the lines that use them)."""
        # the appendix: the inputs checked, and the keyword arguments every layer takes ({} in training)
        use = _check_forward(self, input_ids, want_cache, cache, seq_idx, attention_mask)
        if seq_idx is not None and seq_idx.shape[1] == input_ids.shape[1] + 1:  # §8: a piece of a packed row
            use["seq_idx"], cache = piece_of_packed_row(use["seq_idx"], cache)
        hidden = self.backbone.embedding(input_ids)  # (b, L, d_model)
        new_cache = []
        for i, layer in enumerate(self.backbone.layers):
            layer_use = dict(use, cache=cache[i]) if cache is not None else use  # §8
            if want_cache:
                hidden, layer_cache = layer(hidden, want_cache=True, **layer_use)
                new_cache.append(layer_cache)
            else:
                hidden = layer(hidden, **layer_use)  # (b, L, d_model)
        logits = self.lm_head(self.backbone.norm_f(hidden))  # (b, L, V)
        return (logits, new_cache) if want_cache else logits

    # --------------------------------------------------------------------------------------------
    # 5. Recurrent inference
    # --------------------------------------------------------------------------------------------
    # A Mamba layer's whole memory of the past is two small tensors: the conv's last d_conv inputs
    # (b, ED, d_conv) and the SSM state (b, ED, N). So a token costs the same at position 10 and
    # 10,000, unlike attention, whose KV cache grows. prefill reads the prompt in one pass, as training
    # does, and returns these states; then each token is one `step` of every layer.

    @torch.no_grad()
    def prefill(self, input_ids, cache=None, attention_mask=None):
        """input_ids (b, L) -> (logits (b, L, V), cache: per layer (conv_state, ssm_state)).
        cache, attention_mask: continuing a cache, left padding (section 8)."""
        return self.forward(input_ids, want_cache=True, cache=cache, attention_mask=attention_mask)

    @torch.no_grad()
    def step(self, token_ids, cache):
        """token_ids (b,) -> logits (b, V); advances the cache in place, O(1) in the position."""
        _check_step_inputs(self, token_ids, cache)
        return self._step(token_ids, cache)

    def _step(self, token_ids, cache):
        hidden = self.backbone.embedding(token_ids)  # (b, d_model)
        for layer, layer_cache in zip(self.backbone.layers, cache):
            hidden = layer.step(hidden, layer_cache)  # (b, d_model)
        return self.lm_head(self.backbone.norm_f(hidden))  # (b, V)

    @torch.no_grad()
    def generate_stream(self, input_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                        generator=None, attention_mask=None, compile=False):
        """Yield (b,) tensors of new token ids, one per step: prefill, then O(1) steps.
        attention_mask: prompts of different lengths, left-padded (section 8). compile: each step
        as one torch.compile graph (decode_step, section 6), for long generations."""
        _check_generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, attention_mask, compile)
        if max_new_tokens == 0:
            return
        logits, cache = self.prefill(input_ids, attention_mask=attention_mask)
        logits = logits[:, -1]  # (b, V)
        step = decode_step(self, compile) if compile else self._step  # compiled: section 6
        for i in range(max_new_tokens):
            token = _sample(logits[:, :self.cfg.vocab_size], temperature, top_k, top_p, generator)  # (b,)
            yield token
            if i + 1 < max_new_tokens:
                logits = step(token, cache)  # a sampled token, prefill's cache: nothing to check

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 generator=None, attention_mask=None, compile=False):
        """input_ids (b, L) -> (b, L + max_new_tokens); top_k=1 or temperature=0 is greedy."""
        new = list(self.generate_stream(input_ids, max_new_tokens, temperature, top_k, top_p, generator,
                                        attention_mask, compile))
        return torch.cat([input_ids] + [t.unsqueeze(1) for t in new], dim=1)

    @classmethod
    def from_pretrained(cls, path_or_id, device=None, dtype=None, **overrides):
        """Load a checkpoint folder (official or transformers layout) or a hub id: section 7."""
        return load_pretrained(cls, path_or_id, device, dtype, **overrides)

    def save_pretrained(self, folder, safe_serialization=None):
        """config.json and the weights, in the official layout: section 7."""
        return save_pretrained(self, folder, config_to_dict(self.cfg), safe_serialization)


# Sampling (section 5, continued)

def top_k_top_p(logits, top_k=None, top_p=None):
    """sample_next's filters: logits (b, V) -> (b, V) with -inf outside the top_k tokens and outside
    the smallest set whose probabilities sum to at least top_p."""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """logits (b, V) -> token ids (b,). Greedy for temperature 0 or top_k 1."""
    _check_sampling(temperature, top_k, top_p)
    return _sample(logits, temperature, top_k, top_p, generator)


def _sample(logits, temperature, top_k, top_p, generator):  # generate checked the arguments once
    if temperature == 0 or top_k == 1:
        return logits.argmax(-1)
    logits = top_k_top_p(logits.float() / temperature, top_k, top_p)  # (b, V)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ------------------------------------------------------------------------------------------------
# 6. Making it fast
# ------------------------------------------------------------------------------------------------
# Sections 1 to 5 are the whole model. This section changes how the selective scan is computed,
# not what: every path below is tested against selective_scan_reference and a float64 loop.
#
# One backward for the whole scan. Autograd through selective_scan_reference differentiates each
# broadcast on its own: exp(Δ·A), Δ·B·x and C·h each materialize and reduce (b, L, ED, N) tensors
# in the backward, about half of a CPU training step (`python bench.py profile`). The official
# selective_scan_fn has one backward for the whole operation, and so has _SelectiveScan below. Its
# formulas, shared with the fused path's chunk backward (_scan_chunk_backward), follow from
# h_t = dA_t·h_{t-1} + Δ_t·x_t·B_t with dA_t = exp(Δ_t·A), y_t = C_t·h_t, and
# out = (y + D·x)·SiLU(z); grad_X is dLoss/dX, and dA_t is the forward's decay, never a gradient.
#
#   The skip and the gate, with SiLU'(z) = σ(z)·(1 + z·(1 - σ(z))):
#       grad_y = grad_out·SiLU(z)        grad_z = grad_out·(y + D·x)·SiLU'(z)
#       grad_D = Σ_{b,t} grad_y·x        grad_x gets grad_y·D
#   The state. G_t = dLoss/dh_t in total, through y_t and through every later state, is pscan.py's
#   reverse recurrence (its section 8), driven by the read-out; grad_last is dLoss/d(final state):
#       G_t = grad_y_t·C_t + dA_{t+1}·G_{t+1},        G_{L-1} = grad_y_{L-1}·C_{L-1} + grad_last
#   Every input, summing over what it touches (G_t·B_t sums over the N states):
#       grad_C_t = Σ_ed grad_y_t·h_t      grad_B_t = Σ_ed G_t·Δ_t·x_t      grad_x_t = Δ_t·(G_t·B_t)
#       grad_Δ_t = x_t·(G_t·B_t) + Σ_n G_t·h_{t-1}·dA_t·A
#       grad_A = Σ_{b,t} G_t·h_{t-1}·dA_t·Δ_t                              grad_h0 = dA_0·G_0
#
# The eager forward has every state in memory anyway, so each Σ above is a pass over the whole
# sequence, and G is one reverse scan, run by the forward's own backend (in place for the
# "sequential" and "pscan" backends that "auto" picks). The forward keeps its inputs, the decays
# dA and the states h: recomputing dA would save memory, but exp is the dearest op of the forward
# (`python bench.py profile`).
#
# Two forms compute these formulas: one for a CPU and one for a GPU, since what a pass costs
# differs. The same numbers to rounding, tested against the same float64 loop; _SelectiveScan
# runs the CPU form on a CPU and the GPU form on any other device (_gpu_form).
#
# The CPU form. What the passes cost is memory traffic: G, dA and h, three (b, L, N, ED) tensors
# (2.0 MB each at the trainer's CPU shape), do not fit together in a core's L2 cache (1 MB on
# RESULTS.md's AMD VM, 2 MiB on its Intel one), so a pass over all of them goes out to the L3
# cache or to memory. The backward therefore works one state n at a time: several sums
# read each (b, L, ED) slice of G, dA and h (1.0 MB each) in turn while it is still in a cache,
# L2 or L3, instead of making a pass over each whole tensor.
#
# Layout: in the CPU form the states are (b, L, N, ED), ED last, not section 1's (b, L, ED, N).
# With N as small as 2 (the trainer's CPU default), a last dimension of N would make every
# broadcast and every sum over N run along 2 values, where one AVX-512 register holds 16 fp32
# values; with ED last they run along 320 contiguous values, and the read-out C·h is a batched
# (1, N) @ (N, ED) matmul.

def _scan_in_place(h, dA, backend, reverse=False):
    """The recurrence over dim 1, written over h: h_t += dA_t·h_{t-1} from the first step on, or
    with reverse=True, h_t += dA_{t+1}·h_{t+1} from the last step back (the backward's G). The
    caller has folded the start state into h's first step (the last one in reverse). dA, h:
    (b, L, *rest). Backends that cannot scan in place go through pscan.scan, which allocates."""
    if backend == "sequential":  # pscan.scan_sequential's loop, in place on views of each step
        h_steps, dA_steps = h.unbind(1), dA.unbind(1)  # (b, *rest) each
        if reverse:
            for t in range(h.shape[1] - 2, -1, -1):
                h_steps[t].addcmul_(dA_steps[t + 1], h_steps[t + 1])
        else:
            for t in range(1, h.shape[1]):
                h_steps[t].addcmul_(dA_steps[t], h_steps[t - 1])
        return h
    if backend == "pscan" or (backend == "associative" and reverse):  # the Brent-Kung tree in place:
        tree = pscan._brent_kung_reverse_ if reverse else pscan._brent_kung_  # pscan.py sections 5 and 8
        return tree(h, dA[:, 1:] if reverse else dA)
    if not reverse:
        return pscan.scan(dA, h, None, backend)
    # pscan.scan on the time-reversed sequence; the step after the last one is the identity
    dA_next = torch.cat([dA[:, 1:], torch.ones_like(dA[:, :1])], dim=1)  # (b, L, *rest)  dA_{t+1}
    return pscan.scan(dA_next.flip(1), h.flip(1), None, backend).flip(1)


def _autocast_off(device):
    """Autocast turned off on device; nothing to turn off where torch has no autocast (meta)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _in_compute_dtype(*tensors):
    """Cast to one dtype, at least fp32 (a state sums many small terms): fp64 if any is fp64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return [t.to(dtype) for t in tensors]


def _without_autocast(fn):
    """fn run with autocast off on the device of its first tensor argument (positional or
    keyword), for the later generations' scans (mamba2_minimal.py, mamba3_minimal.py). They cast
    their inputs to fp32 at least (_in_compute_dtype), but autocast would run every matmul in bf16
    or fp16 again: the state would then sum its terms with an 8-bit mantissa."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if device is None or not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)
    return run


def _cpu_forward(x, delta, A, B, C, h0, backend, reset):
    """The CPU form's states and read-out: y = C·h (b, L, ED), dA and h (b, L, N, ED)."""
    A_transposed = A.t().contiguous()  # (N, ED), contiguous so that the broadcast reads it in order
    dA = torch.mul(delta.unsqueeze(-2), A_transposed).exp_()  # (b, L, N, ED)  exp(Δ·A)
    if reset is not None:  # saved with its zeros: the backward's G_t and dLoss/d(Δ·A) stop there
        dA.masked_fill_(reset[:, :, None, None], 0)
    h = (delta * x).unsqueeze(-2) * B.unsqueeze(-1)  # (b, L, N, ED)  Δ·B·x, scanned into h
    if h0 is not None:  # h_0 = dA_0·h0 + dBx_0
        h[:, 0].addcmul_(dA[:, 0], h0.transpose(1, 2))
    h = _scan_in_place(h, dA, backend)  # (b, L, N, ED)
    y = (C.unsqueeze(-2) @ h).squeeze(-2)  # (b, L, ED)  C_t·h_t
    return y, dA, h


def _cpu_backward(grad_y, grad_last, x, delta, A, B, C, h0, dA, h, backend):
    """The CPU form's gradients of x, Δ, A, B, C, h0 (the skip and the gate aside); test_selective_scan.py's
    test_forward_and_every_gradient_match_the_float64_loop checks each against a float64 loop."""
    G = grad_y.unsqueeze(-2) * C.unsqueeze(-1)  # (b, L, N, ED)  the read-out's share of G_t
    if grad_last is not None:
        G[:, -1] += grad_last.transpose(1, 2)
    G = _scan_in_place(G, dA, backend, reverse=True)  # (b, L, N, ED)  G_t in total
    # The rest, one state n at a time: each step reads the n-th (b, L, ED) slices of G, dA and h
    # once and works on them while they are in the CPU's cache, instead of making several passes
    # over the whole (b, L, N, ED) tensors, which do not fit in it.
    delta_x = delta * x  # (b, L, ED)
    GB = torch.zeros_like(G[:, :, 0])  # (b, L, ED)  Σ_n G_t·B_t
    through_A = torch.zeros_like(GB)  # (b, L, ED)  Σ_n dLoss/d(Δ_t·A)·A
    grad_A, grad_B, grad_C = [], [], []  # one entry per state, stacked at the end
    h_start = None if h0 is None else h0.transpose(1, 2)  # (b, N, ED)
    for n in range(A.shape[1]):
        G_n, dA_n, h_n = G[:, :, n], dA[:, :, n], h[:, :, n]  # (b, L, ED) each
        grad_B.append(torch.linalg.vecdot(G_n, delta_x))  # (b, L)  Σ_ed G·Δ·x
        grad_C.append(torch.linalg.vecdot(h_n, grad_y))  # (b, L)  Σ_ed grad_y·h
        GB.addcmul_(G_n, B[..., n, None])
        through_dA = G_n * dA_n  # dLoss/d(Δ_t·A) = G_t·dA_t·h_{t-1}
        through_dA[:, 1:].mul_(h_n[:, :-1])
        if h_start is None:
            through_dA[:, 0].zero_()
        else:
            through_dA[:, 0].mul_(h_start[:, n])
        through_A.addcmul_(through_dA, A[:, n])
        grad_A.append(through_dA.mul_(delta).sum((0, 1)))  # (ED,)
    grad_x = delta * GB  # (b, L, ED)
    grad_delta = through_A.addcmul_(x, GB)  # (b, L, ED)
    grad_h0 = None if h0 is None else (dA[:, 0] * G[:, 0]).transpose(1, 2)  # (b, ED, N)
    return grad_x, grad_delta, torch.stack(grad_A, -1), torch.stack(grad_B, -1), torch.stack(grad_C, -1), grad_h0


# On a GPU: where the bytes go. A GPU does these formulas' arithmetic far faster than it can
# fetch their operands, so what an eager step costs is nearly the bytes it moves between the
# GPU's memory (HBM) and its cores, plus a few microseconds for each kernel (every eager op is
# one). `python bench.py roofline` counts both, op by op and without a GPU, for one training
# step at the trainer's CUDA default: batch 64, block 256, 6 layers of width 384, N = 16, bf16
# autocast. There a (b, L, ED, N) fp32 tensor is U = 64·256·768·16·4 B = 805 MB, 16 times any
# (b, L, ED) one, and every op that reads or writes one moves U. The rest of a layer (the
# projections, the conv, the norms, the casts) moves about 5 GB; the scan, in the GPU form below:
#
#   forward    dA = exp(Δ·A), written once                                          1 U
#              Δ·B·x, written into h                                                1 U
#              the recurrence in place, the loop: reads dA_t, h_t, h_{t-1}, writes h_t   4 U
#              the read-out C·h, a batched matmul reading h                          1 U
#   backward   grad_y·C written into G, the reverse recurrence in place             5 U
#              grad_B, G·B and grad_C, batched matmuls reading G, G and h            3 U
#              dLoss/d(Δ·A) (two passes, see _gpu_backward) and its sums over N and
#              over (b, L), two batched matmuls                                      7 U
#
# 22 U, 17.7 GB a layer, 106 GB in six layers; with the scan's smaller (b, L, ED) tensors, 116 GB
# of the step's 155 GB, counted. The CPU form would move 294 GB (the same command's row for it,
# with pscan.py's tree): its per-state loop makes about eight passes over every (b, L, ED) slice,
# which a CPU's cache absorbs and a GPU pays in full, and the tree moves 11 U per scan against the
# loop's 4. 22 U is about the least that states in memory allow: the forward writes dA and h and
# reads them back, the backward writes G and reads it, h and dA back. At an H100's 3.35 TB/s, 155
# GB take 46 ms; the step's matmuls, 0.6 TFLOP, under 1 ms. The loop's price is kernels: 255 a
# scan, 3,897 in the step, which the CPU issues while the GPU works through the large ones
# (pscan.py, appendix C).
#
# The paper's answer (§3.3) is not to keep the states in memory at all: its kernel reads x, Δ, A,
# B, C, D and z once, holds each channel's N states in on-chip memory (SRAM) while it walks the
# sequence, writes y once, and recomputes the states in the backward. The same step would then
# move 33 GB, the scan's share 3 GB, in 591 kernels (the command's "ideal fused scan" row): 11.8
# ms on an H100, 4.6-5.0x faster than the GPU form, by the model. The fused path below is that
# idea in PyTorch: compiled, Inductor fuses a chunk of T steps into one kernel that keeps its
# states in registers and cache.
#
# The GPU form: the states in section 1's layout (b, L, ED, N), so that every contraction of the
# backward is a batched matmul (cuBLAS reads its operand once) instead of a product and a sum
# (which write the product and read it again); and the fewest passes over U, noted on each line.

def _gpu_forward(x, delta, A, B, C, h0, backend, reset):
    """The GPU form's states and read-out: y = C·h (b, L, ED), dA and h (b, L, ED, N)."""
    # exp(Δ·A) = (e^(A/s))^(Δ·s): one pass writing U from two small tensors, where exp of the
    # product would write U, then read and write it again. s per channel keeps e^(A/s) at least
    # e^-80, a normal fp32 number (e^A itself underflows below A = -104). The price is precision:
    # a relative error of about |Δ·A| + Δ·s ulps against exp's |Δ·A| + 1, the same where |A| < 80,
    # and 4e-6 on the outputs with rates down to A = -1000 and steps up to Δ = 20
    # (test_selective_scan.py); bf16 autocast rounds the projections around the scan at 4e-3
    s = (A.abs().amax(-1) / 80).clamp(min=torch.finfo(A.dtype).tiny)  # (ED,)
    dA = torch.pow(torch.exp(A / s[:, None]), (delta * s).unsqueeze(-1))  # (b, L, ED, N)  1 U
    if reset is not None:
        dA.masked_fill_(reset[:, :, None, None], 0)
    h = (delta * x).unsqueeze(-1) * B.unsqueeze(-2)  # (b, L, ED, N)  Δ·B·x  1 U
    if h0 is not None:
        h[:, 0].addcmul_(dA[:, 0], h0)
    h = _scan_in_place(h, dA, backend)  # (b, L, ED, N)  4 U with the loop
    y = (h @ C.unsqueeze(-1)).squeeze(-1)  # (b, L, ED)  C_t·h_t  1 U
    return y, dA, h


def _gpu_backward(grad_y, grad_last, x, delta, A, B, C, h0, dA, h, backend):
    """The GPU form's gradients of x, Δ, A, B, C, h0 (the skip and the gate aside)."""
    G = grad_y.unsqueeze(-1) * C.unsqueeze(-2)  # (b, L, ED, N)  the read-out's share of G_t  1 U
    if grad_last is not None:
        G[:, -1] += grad_last
    G = _scan_in_place(G, dA, backend, reverse=True)  # (b, L, ED, N)  G_t in total  4 U
    grad_h0 = None if h0 is None else dA[:, 0] * G[:, 0]  # (b, ED, N)
    delta_x = delta * x  # (b, L, ED)
    grad_B = (delta_x.unsqueeze(-2) @ G).squeeze(-2)  # (b, L, N)  Σ_ed G·Δ·x  1 U
    GB = (G @ B.unsqueeze(-1)).squeeze(-1)  # (b, L, ED)  Σ_n G·B  1 U
    grad_C = (grad_y.unsqueeze(-2) @ h).squeeze(-2)  # (b, L, N)  Σ_ed grad_y·h  1 U
    # dLoss/d(Δ_t·A) = G_t·dA_t·h_{t-1}, without reading dA: one step of G's recurrence says
    # dA_t·G_t = G_{t-1} - grad_y_{t-1}·C_{t-1}. So G becomes, in place, at each t < L-1 the
    # value for step t+1: (G_t - grad_y_t·C_t)·h_t. At L-1 it belongs to no step: Δ_{t+1} = 0
    # and the shift below leave it out
    through_dA = G.addcmul_(grad_y.unsqueeze(-1), C.unsqueeze(-2), value=-1).mul_(h)  # 2 U + 3 U
    b, L, ed, n = G.shape
    per_channel = through_dA.view(b * L, ed, n).transpose(0, 1)  # (ED, b·L, N), a view
    # Σ_n A·dLoss/d(Δ·A) per token and Σ_{b,t} Δ·dLoss/d(Δ·A) per (ed, n): batched over the channels
    through_A = torch.bmm(per_channel, A.unsqueeze(-1)).squeeze(-1).t().view(b, L, ed)  # 1 U
    delta_next = F.pad(delta[:, 1:], (0, 0, 0, 1))  # (b, L, ED)  Δ_{t+1}, and 0 for the last t
    grad_A = torch.bmm(delta_next.view(b * L, ed).t().unsqueeze(1), per_channel).squeeze(1)  # (ED, N)  1 U
    grad_x = delta * GB  # (b, L, ED)
    grad_delta = x * GB  # (b, L, ED)
    grad_delta[:, 1:] += through_A[:, :-1]
    if h0 is not None:  # step 0's dLoss/d(Δ_0·A) = G_0·dA_0·h0
        first = grad_h0 * h0  # (b, ED, N)
        grad_delta[:, 0] += (first * A).sum(-1)
        grad_A += (first * delta[:, 0, :, None]).sum(0)
    return grad_x, grad_delta, grad_A, grad_B, grad_C, grad_h0


class _SelectiveScan(torch.autograd.Function):
    """selective_scan_reference's forward; the backward above, in the CPU or the GPU form. Takes
    fp32 or fp64 tensors, and computes in their dtype whatever autocast says: under bf16 autocast
    the read-out C·h, a matmul, would be rounded to bf16.

    Forward-mode AD (torch.func.jvp) has no rule here: eager_selective_scan runs the reference
    instead (_forward_mode). torch.func.grad and vmap work through it. The forward's intermediate
    tensors go to the backward as extra outputs, which the setup_context form asks for."""

    generate_vmap_rule = True  # torch.func.vmap runs forward and backward on batched tensors

    @staticmethod
    def forward(x, delta, A, B, C, D, z, h0, backend, reset, gpu_form):
        with _autocast_off(x.device):
            if gpu_form:
                y, dA, h = _gpu_forward(x, delta, A, B, C, h0, backend, reset)  # (b, L, ED), states (b, L, ED, N)
                h_last = h[:, -1].clone()  # (b, ED, N)
            else:
                y, dA, h = _cpu_forward(x, delta, A, B, C, h0, backend, reset)  # (b, L, ED), states (b, L, N, ED)
                h_last = h[:, -1].transpose(1, 2).contiguous()  # (b, ED, N)
            if D is not None:
                y.addcmul_(x, D)  # y + D·x, kept so that the backward need not add it again
            if z is None:
                return y, h_last, dA, h, None, None
            silu_z = F.silu(z)
            return y * silu_z, h_last, dA, h, y, silu_z  # (b, L, ED), (b, ED, N), then what the backward needs

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, delta, A, B, C, D, z, h0, backend, reset, gpu_form = inputs
        _, _, dA, h, y_skip, silu_z = output
        ctx.mark_non_differentiable(*(t for t in output[2:] if t is not None))
        ctx.set_materialize_grads(False)  # else autograd hands the backward a zero tensor per extra output
        ctx.save_for_backward(x, delta, A, B, C, D, z, h0, dA, h, y_skip, silu_z)
        ctx.backend, ctx.reset, ctx.gpu_form = backend, reset, gpu_form

    @staticmethod
    def backward(ctx, grad_out, grad_last, *_):
        x, delta, A, B, C, D, z, h0, dA, h, y_skip, silu_z = ctx.saved_tensors
        if grad_out is None:  # an output that reached no loss has no gradient (the final state, in training)
            grad_out = torch.zeros_like(x)  # (b, L, ED)
        if torch.is_grad_enabled():  # create_graph=True: a second derivative will follow
            if grad_last is None:
                grad_last = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])  # (b, ED, N)
            return (*_recorded_gradients(ctx, (x, delta, A, B, C, D, z, h0), grad_out, grad_last), None, None, None)
        with _autocast_off(x.device):
            grad_y, grad_z = grad_out, None  # (b, L, ED)
            if z is not None:
                grad_z = torch.ops.aten.silu_backward(grad_out * y_skip, z)  # grad_out·(y + D·x)·SiLU'(z)
                grad_y = grad_out * silu_z
            backward = _gpu_backward if ctx.gpu_form else _cpu_backward
            grad_x, grad_delta, grad_A, grad_B, grad_C, grad_h0 = backward(
                grad_y, grad_last, x, delta, A, B, C, h0, dA, h, ctx.backend)
            grad_D = None
            if D is not None:
                grad_D = (grad_y * x).sum((0, 1))  # (ED,)
                grad_x.addcmul_(grad_y, D)
        return grad_x, grad_delta, grad_A, grad_B, grad_C, grad_D, grad_z, grad_h0, None, None, None


def _recorded_gradients(ctx, inputs, grad_out, grad_last):
    """The gradients as a graph that can be differentiated again (a Hessian, a gradient penalty):
    the vector-Jacobian product of selective_scan_reference, recomputed under autograd. Only
    then; a plain backward takes the lean path above. torch.func.vjp rather than
    torch.autograd.grad: it records at whatever level of torch.func's transforms (grad, vmap)
    the backward runs, as well as under plain autograd."""
    wanted = [i for i, t in enumerate(inputs) if t is not None and ctx.needs_input_grad[i]]

    def reference(*live):  # the wanted inputs as arguments, the others fixed
        full = list(inputs)
        for i, t in zip(wanted, live):
            full[i] = t
        return selective_scan_reference(*full, backend=ctx.backend, reset=ctx.reset)

    with torch.enable_grad():
        _, vjp = torch.func.vjp(reference, *(inputs[i] for i in wanted))
        found = vjp((grad_out, grad_last))
    grads = [None] * len(inputs)
    for i, g in zip(wanted, found):
        grads[i] = g
    return grads


def _forward_mode():
    """Whether forward-mode AD (torch.func.jvp, jacfwd, or torch.autograd.forward_ad) is differentiating
    this call. The Functions of this section have no forward-mode rule (torch.compile refuses a
    Function that has one), so under it each runs the code it replaces, which forward mode
    differentiates op by op: the same numbers. (torch.func.jvp opens a dual level too.)"""
    return torch.autograd.forward_ad._current_level >= 0


def _partly_mapped(per_token, others):
    """Whether torch.func.vmap maps some of these tensors but not every per-token one."""
    tokens = [_batched_by_vmap(t) for t in per_token if t is not None]
    return not all(tokens) and (any(tokens) or any(_batched_by_vmap(t) for t in others if t is not None))


def _gpu_form(device):
    """Whether _SelectiveScan runs its GPU form: on any device but a CPU. (The tests, and the
    model of `python bench.py roofline`, run it on a CPU by replacing this function.)"""
    return device.type != "cpu"


def eager_selective_scan(x, delta, A, B, C, D=None, z=None, h0=None, backend="auto", reset=None):
    """selective_scan_reference (same arguments, same numbers to rounding) through _SelectiveScan:
    the backward written above instead of autograd's. Returns y and the final state, in fp32 (fp64
    for fp64 inputs)."""
    x, delta, A, B, C = (_at_least_fp32(t) for t in (x, delta, A, B, C))
    D, z, h0 = (None if t is None else t.to(x.dtype) for t in (D, z, h0))
    # torch.func.vmap that leaves a per-token input unmapped (a model vmapped over A_log, say): the
    # in-place scans would write mapped tensors into unmapped ones, which vmap refuses (per-sample
    # gradients map them all); forward mode: no rule (_forward_mode). The reference serves both
    if not torch.compiler.is_compiling() and (_forward_mode() or _partly_mapped((x, delta, B, C, z),
                                                                                (A, D, h0, reset))):
        return selective_scan_reference(x, delta, A, B, C, D, z, h0, backend, reset)
    if backend == "auto":  # chosen for a scan without autograd, which is what both scans are
        backend = pscan.backend_for(x.device, x.shape[0] * x.shape[2] * A.shape[1], needs_grad=False)
    y, h_last, *_ = _SelectiveScan.apply(x, delta, A, B, C, D, z, h0, backend, reset, _gpu_form(x.device))
    return y, h_last


class _CausalConv(torch.autograd.Function):
    """shifted_sum (section 3) with its backward written out. Autograd's would, for every tap, zero
    a tensor the size of x_pad, copy the tap's gradient into it (the backward of a slice) and add
    them up; this backward writes the taps' gradients into one buffer, and each weight's gradient is one dot
    product over the batch and the sequence. The backward is made of differentiable ops, so a
    second derivative (create_graph=True) and torch.func.grad work through it, and torch.func.vmap
    runs both passes on batched tensors (generate_vmap_rule). Under forward mode, shifted_sum itself
    (_forward_mode)."""
    generate_vmap_rule = True

    @classmethod
    def apply(cls, x_pad, w, bias, keep):
        if not torch.compiler.is_compiling() and _forward_mode():
            return shifted_sum(x_pad, w, bias, keep)
        return super().apply(x_pad, w, bias, keep)

    @staticmethod
    def forward(x_pad, w, bias, keep):
        return shifted_sum(x_pad, w, bias, keep)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_pad, w, bias, keep = inputs
        ctx.save_for_backward(x_pad, w, keep)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad_out):
        x_pad, w, keep = ctx.saved_tensors
        width, L = w.shape[1], grad_out.shape[1]
        grad_w = []
        for k in range(width):  # out_t = Σ_k w_k·x_pad_{t+k}: tap k read x_pad[:, k:k+L]
            grad_k = grad_out if keep is None else grad_out * keep[:, :, k, None]  # (b, L, ED)
            if k == 0:  # the buffer starts as tap 0's share, padded: batched under vmap wherever grad_out or w is
                grad_x_pad = F.pad(grad_k * w[:, 0], (0, 0, 0, width - 1))  # (b, d_conv-1+L, ED)
            else:
                grad_x_pad[:, k:k + L].addcmul_(grad_k, w[:, k])
            grad_w.append((grad_k * x_pad[:, k:k + L]).sum((0, 1)))  # (ED,)
        grad_bias = grad_out.sum((0, 1)) if ctx.has_bias else None
        return grad_x_pad.to(x_pad.dtype), torch.stack(grad_w, dim=1).to(w.dtype), grad_bias, None


# The fused path. Where the time goes: the reference writes dA, dBx and h to memory as
# (b, L, ED, N) tensors and reads them back several times: at the trainer's CPU shape
# (12, 64, 320, 2) that is 2.0 MB each (15.7 MB at the official N = 16), for a long sequence
# gigabytes, while the inputs x, Δ, B, C are N times smaller. The arithmetic is trivial; the cost
# is memory traffic.
#
# The paper's answer (§3.3, the hardware-aware algorithm) is kernel fusion plus recomputation:
# load x, Δ, A, B, C into fast memory, discretize and scan there, write only y, and recompute
# the states in the backward instead of storing them. The official CUDA kernel walks the
# sequence in chunks: inside a chunk its threads run a parallel scan over the steps (cub's
# BlockScan), and the running state is carried from one chunk to the next.
#
# Here, in PyTorch: for a chunk of T steps, discretize, run the recurrence from the carried
# state, contract with C, add D·x, gate with SiLU(z), and pass the last state on. In a forward
# pass, and in training with recompute (below), only (b, T, ED, N) is ever alive. Eagerly this
# is still several passes over a small block; under torch.compile, Inductor fuses the chunk into
# one kernel (generated C++ on a CPU, Triton on a GPU, where this path has not been timed) that
# reads x, Δ, B, C, z once and writes y once, the states staying in registers and cache.
#
# Sequential in time, parallel across channels: this is what makes the fused path fast on a CPU.
# Each chunk runs its T steps one after another from the carried state, and every step is one
# vector operation over the b·ED·N independent recurrences, which fill the CPU's vector lanes, as
# each thread of the official kernel walks its few consecutive steps in order. The parallel scans
# of pscan.py are a lesson about depth (how few dependent steps the recurrence needs given enough
# processors), not what makes a CPU fast: a few cores cannot repay their extra work (where pscan
# beats the loop in training, it is by needing fewer autograd nodes than the loop's L steps, as
# pscan.py's appendix C says). Nor is this pscan.py's two-level scan (its section 7), which scans
# every chunk from a zero state and corrects each by its carried-in state: the fused path has no correction pass.
#
# The chunk length T (MambaConfig.chunk_size, 16 by default) trades the number of calls against
# the size of the compiled kernels: a longer chunk halves the calls but unrolls a longer loop, in
# the backward above all, which compiles for longer. 16 was measured on a CPU, where 32 trained
# slower. On a GPU each call costs more Python per kernel (launches, guards, wrappers), so a
# longer chunk may pay there; no figure for it yet.
#
# The loop over chunks. Each call of a compiled function has a fixed cost, paid in Python
# (guards, wrappers): tens of microseconds on a CPU, as much as the kernel of a small chunk.
# With compile="loop" a forward-only pass compiles the loop too (_chunk_loop, with torch's scan
# operator), so a whole sequence is one call. It is opt-in because torch cannot cache a graph
# that holds this operator: every new process compiles it again. Training calls the compiled
# chunk, and its backward, once per chunk.
#
# Static shapes: every chunk has length T. The last one is padded with identity steps, Δ = 0,
# which give dA = exp(0) = 1 and dBx = 0, so the state passes through unchanged and the padded
# outputs are dropped. A new sequence length therefore never triggers a recompile (the compiled
# loop of a forward pass takes the number of chunks as a dynamic size). Nor does a new batch
# size (an evaluation's smaller last batch): the batch is compiled as a dynamic size too, except
# a batch of 1, which torch always specializes. An evaluation runs the graph that training
# compiled: the chunk's forward runs without autograd in both, on detached inputs.
#
# A compiler that fails (none installed, an Inductor or Triton error, a shape it cannot handle,
# its recompile limit) fails at a call: the first training step, the first evaluation, a new
# shape. CompiledOrEager runs that call again eagerly and, if the eager call works, warns once
# and keeps the function eager from then on, so that a long run goes on, slower, never dies.
#
# Recompute (training, the paper's §3.3.2): plain autograd through a chunk keeps every step's
# (b, ED, N) tensors for the backward, so O(b·L·ED·N) is back, and the backward graph it records
# is a long chain of small ops that Inductor fuses poorly. With recompute=True each chunk is a
# custom autograd Function instead: the forward keeps only the chunk's inputs and its start
# state, and the backward (written out below, fused by torch.compile like the forward)
# recomputes the states from the start state and runs the reverse recurrence. Memory:
# O(b·L·ED) for the inputs plus one (b, ED, N) start state per chunk, plus O(b·T·ED·N) inside
# the chunk being worked on.

def _scan_chunk(x, delta, A, B, C, D, z, h, keep=None):
    """One chunk: selective_scan_reference on T steps, with the loop written out so that the
    compiler fuses it. x, delta, z: (b, T, ED); A: (ED, N); B, C: (b, T, N); D: (ED,);
    h: (b, ED, N) start state; D and z may be None; keep (b, T) or None: 0 where a packed
    sequence starts (dA = 0), 1 elsewhere. Returns y (b, T, ED) and the end state
    (b, ED, N). The skip D·x and the gate SiLU(z) are applied here, as the official kernel does:
    inside the fused chunk they ride in the same pass, outside they are three more passes over
    (b, L, ED)."""
    dA, dBx = discretize(x, delta, A, B)  # (b, T, ED, N), one chunk only
    if keep is not None:
        dA = dA * keep[:, :, None, None]
    ys = []
    for dA_t, dBx_t, C_t in zip(dA.unbind(1), dBx.unbind(1), C.unbind(1)):
        h = torch.addcmul(dBx_t, dA_t, h)  # (b, ED, N)
        ys.append((h * C_t.unsqueeze(1)).sum(-1))  # (b, ED)
    return skip_and_gate(torch.stack(ys, dim=1), x, D, z), h  # (b, T, ED), (b, ED, N)


def _scan_chunk_backward(x, delta, A, B, C, D, z, h0, keep, grad_out, grad_h):
    """Gradients of _scan_chunk from its inputs and the output gradients, recomputing the states:
    the formulas of "One backward for the whole scan" at the top of this section, on a chunk of T
    steps (grad_h is the gradient of the chunk's end state). Every reduction is taken inside the
    reverse loop, step by step. Batching them after the loop
    looks more vectorized but needs G and h as (b, T, ED, N) tensors. In Inductor's generated C++
    the per-step reductions over N fuse into the reverse pass and those over ED and the batch
    become small loops per step; the batched form was 1.8x slower.
    """
    dA, dBx = discretize(x, delta, A, B)  # (b, T, ED, N)
    if keep is not None:  # as the forward: G_t and dLoss/d(Δ·A) stop where a sequence starts
        dA = dA * keep[:, :, None, None]
    hs = [h0]
    for dA_t, dBx_t in zip(dA.unbind(1), dBx.unbind(1)):
        hs.append(torch.addcmul(dBx_t, dA_t, hs[-1]))  # h_t (b, ED, N)
    grad_y, grad_z = grad_out, None  # (b, T, ED)
    if z is not None:
        y = torch.stack([(h_t * C_t.unsqueeze(1)).sum(-1) for h_t, C_t in zip(hs[1:], C.unbind(1))], dim=1)
        sig = torch.sigmoid(z)
        grad_z = grad_out * skip_and_gate(y, x, D, None) * sig * (1 + z * (1 - sig))
        grad_y = grad_out * z * sig  # grad_out·SiLU(z)
    g, grad_A = grad_h, torch.zeros_like(A)  # g: G_t as the loop walks back
    grads = []  # (grad_x_t, grad_Δ_t, grad_B_t, grad_C_t), last step first
    steps = zip(x.unbind(1), delta.unbind(1), B.unbind(1), C.unbind(1), grad_y.unbind(1),
                dA.unbind(1), hs[:-1], hs[1:])
    for x_t, delta_t, B_t, C_t, grad_y_t, dA_t, h_prev, h_t in reversed(list(steps)):
        g = torch.addcmul(g, grad_y_t.unsqueeze(-1), C_t.unsqueeze(1))  # G_t (b, ED, N)
        GB = (g * B_t.unsqueeze(1)).sum(-1)  # (b, ED)  G_t·B_t
        through_dA = g * h_prev * dA_t  # (b, ED, N)  dLoss/d(Δ_t·A)
        grad_A = grad_A + (through_dA * delta_t.unsqueeze(-1)).sum(0)  # (ED, N)
        grads.append((delta_t * GB,  # grad_x_t (b, ED)
                      x_t * GB + (through_dA * A).sum(-1),  # grad_Δ_t (b, ED)
                      (g * (delta_t * x_t).unsqueeze(-1)).sum(1),  # grad_B_t (b, N)
                      (grad_y_t.unsqueeze(-1) * h_t).sum(1)))  # grad_C_t (b, N)
        g = g * dA_t  # G_t's share for h_{t-1}
    grad_x, grad_delta, grad_B, grad_C = (torch.stack(per_step[::-1], dim=1) for per_step in zip(*grads))
    grad_D = None
    if D is not None:
        grad_D = (grad_y * x).sum((0, 1))  # (ED,)
        grad_x = grad_x + grad_y * D
    return grad_x, grad_delta, grad_A, grad_B, grad_C, grad_D, grad_z, g  # the last g is grad_h0


class CompileFallbackWarning(UserWarning):
    """torch.compile failed for a function that then ran eagerly, as it will from then on."""


class CompiledOrEager:
    """torch.compile(fn, **options) that falls back to fn. A call that raises is made again
    eagerly: if that works too, the compiler was what failed, so warn once (CompileFallbackWarning)
    and call fn from then on; an error that fn raises as well is the caller's, and is raised.

    compile_backward_now: compile a training graph's backward when its forward compiles (torch
    defers it to the first backward, outside this call and its fallback; torch before 2.10 has no
    switch for it and keeps that order). batch_args: the names of
    fn's arguments whose dim 0 is the batch, compiled as a dynamic size. fallback=False: raise
    instead, for a caller with a better plan."""

    def __init__(self, fn, what, compile_backward_now=False, batch_args=(), fallback=True, **options):
        self.fn, self.what, self.batch_args, self.fallback = fn, what, batch_args, fallback
        self.compiled = torch.compile(fn, **options)
        self.compile_backward_now = compile_backward_now and hasattr(torch._functorch.config,
                                                                      "force_non_lazy_backward_lowering")
        self.failed = False
        self.arg_names = list(inspect.signature(fn).parameters)

    def compiled_call(self, *args):
        for name, t in zip(self.arg_names, args):
            if name in self.batch_args and t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        if self.compile_backward_now:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                return self.compiled(*args)
        return self.compiled(*args)

    def __call__(self, *args):
        # fn itself inside a model being compiled (that compile traces fn) and under torch.func's
        # grad or vmap (whose wrapped tensors a compiled graph does not take: not a failure)
        if self.failed or torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None:
            return self.fn(*args)
        try:
            return self.compiled_call(*args)
        except Exception as err:
            if not self.fallback:
                raise
            out = self.fn(*args)
            self.failed = True
            while getattr(err, "inner_exception", None) or err.__cause__:  # the compiler's own error,
                err = getattr(err, "inner_exception", None) or err.__cause__  # under torch's wrappers
            message = (str(err).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"torch.compile failed for {self.what} ({type(err).__name__}: {message}); it runs "
                          f"eagerly from now on", CompileFallbackWarning, stacklevel=2)
            return out


_compiled = {}  # (fn, device type) -> CompiledOrEager


def _compile_options(device):
    # On a CPU, Inductor's C++ wrapper instead of its Python one: the code around the kernels
    # (output allocation, views, the compiled loop of _chunk_loop) then runs in C++, which trims
    # the fixed cost of every call.
    return {"cpp_wrapper": True} if device.type == "cpu" else None


def _maybe_compiled(fn, compile, device):
    """fn itself, or its torch.compile'd version (made once per device type; static shapes but the
    batch). After a compiler failure on a device the fused path runs eagerly there, the chunk's
    backward too: one warning, and no time spent on compiles that would fail alike. Inside a
    model that torch.compile compiles whole, fn itself: that compile traces it."""
    if not compile or torch.compiler.is_compiling() or any(c.failed for (_, on), c in _compiled.items()
                                                           if on == device.type):
        return fn
    key = (fn, device.type)
    if key not in _compiled:
        _compiled[key] = CompiledOrEager(fn, f"the fused selective scan ({fn.__name__} on {device.type})",
                                         batch_args=("x", "delta", "B", "C", "z", "h", "h0", "keep", "grad_out",
                                                     "grad_h"),
                                         fallback=fn is not _chunk_loop,  # _forward_in_one_call has its own
                                         dynamic=False, fullgraph=True, options=_compile_options(device))
    return _compiled[key]


class _RecomputedChunk(torch.autograd.Function):
    """One chunk with the recomputing backward: saves the inputs only. Its forward runs the
    compiled _scan_chunk without autograd, on detached inputs, as an evaluation does (one graph
    for both); torch.func.vmap runs both passes on batched tensors (generate_vmap_rule)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, delta, A, B, C, D, z, h, compile, keep):
        return _maybe_compiled(_scan_chunk, compile, x.device)(*_detached(x, delta, A, B, C, D, z, h, keep))

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, ctx.compile, keep = inputs
        ctx.save_for_backward(*tensors, keep)  # the inputs only, no states

    @staticmethod
    def backward(ctx, grad_y, grad_h):
        if torch.is_grad_enabled():  # create_graph=True or torch.func.grad: a graph to differentiate again
            return (*_chunk_gradients_recorded(ctx, grad_y, grad_h), None, None)
        # contiguous, as in the forward: grad_y arrives as a slice of the whole sequence's gradient
        backward = _maybe_compiled(_scan_chunk_backward, ctx.compile, grad_y.device)
        grads = backward(*_detached(*ctx.saved_tensors), grad_y.contiguous(), grad_h.contiguous())
        return (*grads, None, None)


def _chunk_gradients_recorded(ctx, grad_y, grad_h):
    """The chunk's gradients as a graph that can be differentiated again (a Hessian, torch.func.grad):
    _scan_chunk recomputed eagerly under autograd and differentiated with create_graph. Only then;
    a plain backward takes the recomputing backward."""
    *inputs, keep = ctx.saved_tensors
    wanted = [i for i, t in enumerate(inputs) if t is not None and ctx.needs_input_grad[i]]
    with torch.enable_grad():
        # through aliases: autograd.grad with respect to A itself would also follow A's path
        # through h into the chunks before, which their own backward counts
        inputs = [None if t is None else t.view_as(t) for t in inputs]
        y, h = _scan_chunk(*inputs, keep)
        # with respect to D (or z) alone the state h needs no gradient and has none
        outputs = [(out, grad) for out, grad in ((y, grad_y), (h, grad_h)) if out.requires_grad]
        found = torch.autograd.grad([out for out, _ in outputs], [inputs[i] for i in wanted],
                                    [grad for _, grad in outputs], create_graph=True)
    grads = [None] * len(inputs)
    for i, g in zip(wanted, found):
        grads[i] = g
    return grads


def _detached(*tensors):
    # The first chunk's start state is a plain zero tensor, the later ones come out of autograd
    # and require grad; D is a Parameter. The compiled code guards on requires_grad and on the
    # type, so without this the first chunk, the others and a no-grad pass would each compile
    # their own copy of the same graph.
    return [None if t is None else t.detach() for t in tensors]


try:  # torch's scan operator, a prototype in torch; only compile="loop" uses it
    from torch._higher_order_ops.scan import scan as _scan_op
except ImportError:
    _scan_op = None


def _chunk_loop(x, delta, A, B, C, D, z, h):
    """Every chunk of a forward-only pass in one call: x, delta, z (b, K, T, ED), B, C (b, K, T, N),
    K chunks of T steps; h: the start state (b, ED, N). Returns y (b, K, T, ED) and the end state.
    torch's scan operator, carry, ys = scan(f, init, xs), calls f(carry, chunk k) for k = 0..K-1
    and stacks the ys; compiled, Inductor turns it into a loop around the fused chunk kernel, so
    the per-call cost of "The loop over chunks" above is paid once per sequence instead of per chunk."""
    def one_chunk(h, chunk):
        x_c, delta_c, B_c, C_c, *z_c = chunk  # (b, T, ·); z_c: [] when there is no gate
        y, h = _scan_chunk(x_c, delta_c, A, B_c, C_c, D, z_c[0] if z_c else None, h)
        return h, y

    # chunks first, scanned over dim 0: torch 2.6, 2.8 and 2.12 stack the ys along dim 0 whatever dim is
    chunks = [t.movedim(1, 0) for t in (x, delta, B, C, z) if t is not None]  # (K, b, T, ·)
    h, ys = _scan_op(one_chunk, h, chunks)
    return ys.movedim(0, 1), h


_compiled_loop_works = _scan_op is not None  # until a compile of it fails


def _forward_in_one_call(x, delta, A, B, C, D, z, h, T):
    """Forward only, compiled: every chunk in one call of the compiled _chunk_loop. The inputs
    are padded to K·T steps. Returns y (b, K·T, ED) and the end state, or None (with a warning,
    once) where this torch cannot compile the scan operator."""
    global _compiled_loop_works
    k = x.shape[1] // T
    # contiguous: a padded input is, an unpadded slice (B, C and z in the model) is not, and a
    # change of layout would be a recompile
    parts = [None if t is None else t.contiguous().unflatten(1, (k, T)) for t in (x, delta, B, C, z)]
    for t in parts:
        if t is not None:  # K changes with the length: a dynamic size, so no recompile
            torch._dynamo.maybe_mark_dynamic(t, 1)
    x_k, delta_k, B_k, C_k, z_k = parts  # (b, K, T, ED|N)
    try:  # where it fails, one compiled call per chunk beats the scan operator run eagerly
        y, h = _maybe_compiled(_chunk_loop, True, x.device)(x_k, delta_k, A, B_k, C_k, D, z_k, h)
    except Exception as e:
        _compiled_loop_works = False
        warnings.warn(f"compiling the loop over chunks failed ({type(e).__name__}: {e}); compiled "
                      f"forward passes now call the compiled chunk once per chunk instead", CompileFallbackWarning)
        return None
    return y.flatten(1, 2), h  # (b, K·T, ED), (b, ED, N)


def fused_selective_scan(x, delta, A, B, C, D=None, z=None, h0=None, chunk_size=MambaConfig.chunk_size,
                         recompute=True, compile=False, reset=None):
    """The scan chunk by chunk, computed in fp32 at least (as section 2). Returns y (b, L, ED) and
    the final state (b, ED, N)."""
    x, delta, A, B, C = (_at_least_fp32(t) for t in (x, delta, A, B, C))
    D, z = (None if t is None else t.to(x.dtype) for t in (D, z))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, delta, A, B, C, D, z, h0))
    # forward mode, or torch.func's grad of a grad (jacrev of jacrev): plain, eager ops, which every
    # level differentiates (the recomputing backward would lose a level)
    if not torch.compiler.is_compiling() and (_forward_mode() or pscan._transform_levels("Grad") > 1):
        needs_grad, recompute, compile = True, False, False
    if not _is_positive_int(chunk_size):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    b, l, ed = x.shape
    T = chunk_size
    pad = (-l) % T
    if pad:  # identity steps: Δ = 0 gives dA = 1, dBx = 0 (their outputs are dropped)
        x, delta, B, C, z = (None if t is None else F.pad(t, (0, 0, 0, pad)) for t in (x, delta, B, C, z))
    keep = None if reset is None else (~F.pad(reset, (0, pad))).to(x.dtype)  # (b, L + pad)
    h = x.new_zeros(b, ed, A.shape[1]) if h0 is None else h0.to(x.dtype)  # (b, ED, N)
    recompute = recompute and needs_grad
    if compile == "loop" and not needs_grad and _compiled_loop_works and keep is None:
        out = _forward_in_one_call(*_detached(x, delta, A, B, C, D, z, h), T)
        if out is not None:
            return out[0][:, :l], out[1]  # (b, L, ED), (b, ED, N)
    step = _maybe_compiled(_scan_chunk, compile, x.device)

    def chunks(t):
        # split, not t[:, s:s+T]: autograd's backward of a slice writes a zero tensor of the whole
        # sequence per chunk (quadratic in L), a split's backward is one cat. Contiguous chunks:
        # their strides then do not depend on L, so neither does the compile.
        if t is None:
            return [None] * ((l + pad) // T)
        return [c.contiguous() for c in t.split(T, dim=1)]  # (b, T, ED|N) each

    ys = []
    for x_c, delta_c, B_c, C_c, z_c, keep_c in zip(*map(chunks, (x, delta, B, C, z, keep))):
        if recompute:
            y, h = _RecomputedChunk.apply(x_c, delta_c, A, B_c, C_c, D, z_c, h, compile, keep_c)
        elif needs_grad:  # plain autograd through each chunk
            y, h = step(x_c, delta_c, A, B_c, C_c, D, z_c, h, keep_c)
        else:  # forward only: the graph that training's _RecomputedChunk compiled
            y, h = step(*_detached(x_c, delta_c, A, B_c, C_c, D, z_c, h, keep_c))
        ys.append(y)
    return torch.cat(ys, dim=1)[:, :l], h  # (b, L, ED), (b, ED, N)


chunked_selective_scan = fused_selective_scan  # deprecated alias: "chunked" names Mamba-2's SSD form


# The public entry point. It takes the arguments of the official selective_scan_fn, except that Δ
# arrives already through softplus (no delta_bias, delta_softplus) and the layout is (b, L, ED),
# not (b, ED, L). It sends each call to eager_selective_scan (section 2's reference with the
# backward above), to the fused path, or with "reference" to section 2's code itself.
#
# The eager backends name the pscan.py scan that runs the recurrence; "fused" is this section's
# chunk-by-chunk path, which runs its own loop. "chunked" is accepted for "fused" with a
# DeprecationWarning: the word belongs to Mamba-2's chunked SSD (mamba2_minimal.py).
SCAN_BACKENDS = ("auto", "reference", "sequential", "pscan", "hillis_steele", "two_level", "associative", "fused",
                 "chunked")
FUSED_BACKENDS = ("fused", "chunked")
COMPILE_MODES = (False, True, "loop")


def selective_scan(x, delta, A, B, C, D=None, z=None, h0=None, backend="auto", compile=False,
                   return_last_state=False, chunk_size=MambaConfig.chunk_size, recompute=True, reset=None):
    """The selective scan y = SSM(Δ, A, B, C)(x) + D·x, gated by SiLU(z): selective_scan_reference
    or this section's fused path, with the same numbers to rounding.

    Args:
        x, delta, A, B, C, D, z, h0: as in selective_scan_reference (section 2)
        backend: "sequential", "pscan", "hillis_steele", "two_level", "associative" (the pscan.py
                 scan that eager_selective_scan runs over materialized tensors), "auto" (pscan.scan's
                 choice), "fused" (the fused path of this section; "chunked": deprecated, "fused"),
                 or "reference" (selective_scan_reference itself, plain autograd)
        compile: False; True to run the fused path through torch.compile (implies
                 backend="fused"), chunk by chunk; "loop" to compile, for forward-only passes,
                 the loop over chunks as well (faster on long sequences, but every new process
                 compiles it again)
        chunk_size, recompute: the fused path's T and its recomputing backward (see above)
        reset: (b, L) bool or None, True where a packed sequence starts (dA = 0 there)
    Returns:
        y: (b, L, ED) in x's dtype, and with return_last_state the final state (b, ED, N) in fp32
        (fp64 for fp64 inputs)
    """
    _check_selective_scan_inputs(x, delta, A, B, C, D, z, h0, backend, compile, reset)
    if backend == "chunked":
        warnings.warn('selective_scan: backend="chunked" is deprecated, it is the fused path: use "fused"',
                      DeprecationWarning, stacklevel=2)
    out_dtype = x.dtype
    if backend == "reference":
        y, h_last = selective_scan_reference(x, delta, A, B, C, D, z, h0, reset=reset)
    elif compile or backend in FUSED_BACKENDS:
        y, h_last = fused_selective_scan(x, delta, A, B, C, D, z, h0, chunk_size, recompute, compile, reset)
    else:
        y, h_last = eager_selective_scan(x, delta, A, B, C, D, z, h0, backend, reset)
    y = y.to(out_dtype)
    return (y, h_last) if return_last_state else y


# The decode step, captured. A token of a small model is little arithmetic and many small ops:
# each layer's step is some 30 to 140 of them (projections, conv buffer, discretization, gate,
# norm), each paying the framework's dispatch, so that at d_model 128 the step costs far more
# than its maths. The official generate captures the whole step in a CUDA graph (cg=True) and
# replays it; decode_step(model, compile=True) does the same with torch.compile: one graph of
# every layer's step (fullgraph, so either all of it compiles or nothing runs), the cache tensors
# its inputs, written in place as the eager step writes them. Each new batch size or dtype
# compiles again (tens of seconds on a CPU), so it pays off over long generations; it is opt-in
# (generate(..., compile=True)). `python bench.py decode` measures both.

_compiled_steps = weakref.WeakKeyDictionary()  # model -> its compiled step, or its eager one after a failure


def decode_step(model, compile=False):
    """The function generate calls once per token, (token_ids (b,), cache) -> logits (b, V):
    model._step, or with compile the same step compiled (made once per model). If compiling
    fails (no C++ compiler, an op the compiler lacks), one warning, then the eager step."""
    if not compile:
        return model._step
    if model.cfg.attn_layer_idx and model not in _compiled_steps:
        # an attention layer's KV cache grows by a token per step: a new shape, a new graph, each token
        warnings.warn("compile=True covers models without attention layers; decoding eagerly", stacklevel=3)
        _compiled_steps[model] = model._step
    if model not in _compiled_steps:
        compiled = torch.compile(model._step, fullgraph=True, dynamic=False)

        def step(token_ids, cache):
            if _compiled_steps[model] is not step:  # compiling failed before
                return model._step(token_ids, cache)
            try:
                return compiled(token_ids, cache)
            except Exception as err:  # fullgraph: nothing ran, the cache is untouched
                warnings.warn(f"compiling the decode step failed, decoding eagerly instead "
                              f"({type(err).__name__}: {str(err)[:500]})", stacklevel=2)
                _compiled_steps[model] = model._step
                return model._step(token_ids, cache)

        _compiled_steps[model] = step
    return _compiled_steps[model]


# ------------------------------------------------------------------------------------------------
# 7. Loading checkpoints
# ------------------------------------------------------------------------------------------------
# Official (state-spaces/mamba-130m ...): config.json with d_model, n_layer, vocab_size, ssm_cfg,
# pad_vocab_size_multiple, ...; weights in pytorch_model.bin under our key names.
# transformers (state-spaces/mamba-130m-hf ...): config.json with hidden_size, num_hidden_layers,
# state_size, ...; weights under the same names except backbone.embeddings.*, often as
# model.safetensors, which may leave out the tied lm_head.weight. Larger checkpoints come in shards
# that an index.json lists. In order: config.json -> a config; the folder (or hub repository) ->
# one dict of tensors; a model built without memory for its parameters -> those tensors assigned
# to it; and save_pretrained, which writes the official layout back.

_HF_FIELDS = {  # transformers name -> MambaConfig name
    "hidden_size": "d_model", "num_hidden_layers": "n_layer", "vocab_size": "vocab_size",
    "state_size": "d_state", "expand": "expand", "conv_kernel": "d_conv", "time_step_rank": "dt_rank",
    "use_conv_bias": "conv_bias", "use_bias": "bias", "time_step_min": "dt_min", "time_step_max": "dt_max",
    "time_step_floor": "dt_init_floor", "time_step_scale": "dt_scale", "layer_norm_epsilon": "norm_epsilon",
    "tie_word_embeddings": "tie_embeddings",
    "residual_in_fp32": "residual_in_fp32", "time_step_init_scheme": "dt_init",
}
_OFFICIAL_SSM_FIELDS = {"d_state", "d_conv", "expand", "dt_rank", "dt_min", "dt_max", "dt_init_floor",
                        "dt_scale", "conv_bias", "bias", "dt_init"}


def config_from_dict(d, **overrides):
    """A MambaConfig from an official or a transformers config.json dict."""
    ours = {f.name for f in fields(MambaConfig)}
    to_mamba2 = "; load it with mamba2_minimal.Mamba2LM.from_pretrained"
    if "hidden_size" in d or "num_hidden_layers" in d:
        if d.get("model_type") == "mamba2" or "head_dim" in d or "num_heads" in d:
            raise ValueError("config.json describes a Mamba-2 model (transformers' Mamba2ForCausalLM)" + to_mamba2)
        required = ["hidden_size", "num_hidden_layers", "vocab_size"]
        kwargs = {_HF_FIELDS[k]: v for k, v in d.items() if k in _HF_FIELDS}
        # transformers never pads the vocabulary (a config.json converted from the official one may
        # still carry pad_vocab_size_multiple): its embedding has exactly vocab_size rows
        kwargs["pad_vocab_size_multiple"] = 1
    else:
        required = ["d_model", "n_layer", "vocab_size"]
        ssm_cfg = dict(_ssm_cfg(d))
        layer = ssm_cfg.pop("layer", "Mamba1")
        if layer != "Mamba1":
            raise ValueError(f"MambaLM covers Mamba-1 only; config.json asks for {layer}"
                             + (to_mamba2 if layer == "Mamba2" else ""))
        ssm_cfg.pop("use_fast_path", None)  # the choice of the official CUDA path: nothing to do here
        unknown = set(ssm_cfg) - _OFFICIAL_SSM_FIELDS
        if unknown:
            raise ValueError(f"unsupported ssm_cfg fields in config.json: {sorted(unknown)}")
        kwargs = official_lm_fields(d, ours)  # with section 9's d_intermediate, attn_layer_idx, attn_cfg, rms_norm
        kwargs.update(ssm_cfg)
        if "tie_embeddings" not in d and "tie_word_embeddings" in d:
            kwargs["tie_embeddings"] = d["tie_word_embeddings"]
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(f"config.json is missing the fields {missing} (found {sorted(d)})")
    if kwargs.get("dt_rank") is None:
        kwargs["dt_rank"] = "auto"
    kwargs.update(overrides)
    return MambaConfig(**kwargs)


def official_lm_fields(d, ours):
    """The fields of an official config.json that a config class has (ours: its field names), with
    null attn_layer_idx and attn_cfg read as the official defaults (create_block does); fused_add_norm
    and initializer_cfg, which choose kernels and an init, are left out."""
    kwargs = {k: v for k, v in d.items() if k in ours}
    for name in ("attn_layer_idx", "attn_cfg"):
        if name in kwargs and kwargs[name] is None:
            del kwargs[name]
    return kwargs


def _ssm_cfg(d):
    ssm_cfg = {} if d.get("ssm_cfg") is None else d["ssm_cfg"]  # null: the official default
    if not isinstance(ssm_cfg, dict):
        raise ValueError(f"config.json's ssm_cfg must be an object of fields, got a {type(ssm_cfg).__name__}")
    return ssm_cfg


def _safetensors_installed():
    return importlib.util.find_spec("safetensors") is not None


def _weights_files(folder):
    """The folder's weights files, in the order they are tried: safetensors first, whole or sharded
    (as transformers does), unless the safetensors package is missing: then the .bin, whole or
    sharded, is read where the folder has one."""
    safetensors = ["model.safetensors", "model.safetensors.index.json"]
    pickles = ["pytorch_model.bin", "pytorch_model.bin.index.json"]
    order = safetensors + pickles if _safetensors_installed() else pickles + safetensors
    return [os.path.join(folder, name) for name in order]


def _load_state_dict_file(folder):
    """The folder's weights as one dict: model.safetensors, pytorch_model.bin, or the shards that a
    model.safetensors.index.json or pytorch_model.bin.index.json lists (transformers'
    save_pretrained splits models above its max_shard_size)."""
    for path in _weights_files(folder):
        if os.path.islink(path) and not os.path.exists(path):
            raise FileNotFoundError(f"{path} is a symbolic link to {os.readlink(path)}, which does not exist "
                                    f"(an interrupted download? download it again)")
        if not os.path.exists(path):
            continue
        if not path.endswith(".index.json"):
            return _read_weights(path)
        with open(path) as f:
            try:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{path} must be JSON with a weight_map of tensor names to shard "
                                 f"files ({type(err).__name__}: {err})") from None
        state_dict = {}
        for shard in shards:
            # a name such as ../../x would open a file outside the checkpoint
            if not isinstance(shard, str) or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
                raise ValueError(f"{path} lists the shard {shard!r}: shards must be file names inside {folder}")
            state_dict.update(_read_weights(os.path.join(folder, shard)))
        return state_dict
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (nor a sharded index.json) in {folder}")


def _read_weights(path):
    """One weights file (.bin or .safetensors) as a dict of tensor name -> tensor. A .bin is
    memory-mapped: its tensors are the file's pages, read from disk as they are used, so that
    loading holds no second copy of the weights. safetensors 0.8 maps its files so too; their
    tensors start where the file puts them, aligned to their element size, not to torch's 64, and CPU
    kernels may round a last bit otherwise over such memory (the same values; a matmul in fp64
    differed by 1e-16). A copy to aligned memory would hold the weights twice while loading."""
    safetensors = path.endswith(".safetensors")
    if safetensors:
        try:
            from safetensors.torch import load_file
        except ImportError as err:
            raise ImportError(f"{path} needs the safetensors package: pip install safetensors") from err
    try:
        if safetensors:
            state_dict = load_file(path)
        else:
            try:
                state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:  # the legacy (not zip) format cannot be memory-mapped
                if "mmap" not in str(err):
                    raise
                state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated download, or not a plain tensor checkpoint
        raise ValueError(f"{path} could not be read as a PyTorch state dict (truncated or not a "
                         f"checkpoint?): {type(err).__name__}: {err}") from err
    if not isinstance(state_dict, dict):
        raise ValueError(f"{path} must hold a dict of tensor name -> tensor (a state dict), got a "
                         f"{type(state_dict).__name__}")
    wrong = sorted(k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    if wrong:
        raise ValueError(f"{path} must hold only tensors; not tensors: {wrong[:4]}{' ...' if len(wrong) > 4 else ''}")
    return state_dict


def _looks_like_a_path(s):
    # a hub id is "owner/name": one slash, no leading "/", ".", or "~"
    return (os.path.isabs(s) or s.startswith(("./", "../", "~", ".\\", "..\\"))
            or s.count("/") > 1 or (os.sep != "/" and os.sep in s))


def _resolve_folder(path_or_id):
    if not isinstance(path_or_id, (str, os.PathLike)):
        raise ValueError(f"from_pretrained needs a folder or a hub id such as state-spaces/mamba-130m, "
                         f"got {type(path_or_id).__name__}")
    path_or_id = os.fspath(path_or_id)
    if os.path.isdir(path_or_id):
        return path_or_id
    if os.path.exists(path_or_id):
        raise ValueError(f"{path_or_id} is a file; pass the folder holding config.json and the weights")
    if _looks_like_a_path(path_or_id):
        raise FileNotFoundError(f"the folder {path_or_id} does not exist (pass a folder holding config.json "
                                f"and the weights, or a hub id such as state-spaces/mamba-130m)")
    try:
        from huggingface_hub import list_repo_files, snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{path_or_id!r} is not a folder, and huggingface_hub is not installed to download it. "
            f"Either `pip install huggingface_hub`, or download config.json and model.safetensors "
            f"(or pytorch_model.bin) from https://huggingface.co/{path_or_id} into a folder and pass "
            f"that folder.") from None
    try:
        files = list_repo_files(path_or_id)
    except Exception:  # offline or unreachable: snapshot_download answers from the cache, or says why not
        files = None
    return snapshot_download(path_or_id, allow_patterns=_download_patterns(files))


def _download_patterns(files):
    """What to download of a repository with these files: config.json and one format of weights
    with its index (sharded repositories list their shards in model.safetensors.index.json or
    pytorch_model.bin.index.json), .safetensors where the repository has it and the package is
    installed. files None (the list is unknown, offline): both formats, as the cache holds them."""
    safetensors = ["*.safetensors", "model.safetensors.index.json"]
    pickles = ["*.bin", "pytorch_model.bin.index.json"]
    if files is None:
        return ["config.json"] + safetensors + pickles
    has_safetensors = any(f.endswith(".safetensors") for f in files)
    has_bin = any(f.endswith(".bin") for f in files)
    use_safetensors = has_safetensors and (_safetensors_installed() or not has_bin)
    return ["config.json"] + (safetensors if use_safetensors else pickles)


def convert_state_dict(state_dict, model):
    """Map either layout onto our key names, re-tie the head, and check the keys strictly."""
    sd = {}
    for k, v in state_dict.items():
        if k.startswith("backbone.embeddings."):
            k = "backbone.embedding." + k[len("backbone.embeddings."):]
        sd[k] = v
    if model.cfg.tie_embeddings and "backbone.embedding.weight" in sd:
        head = sd.setdefault("lm_head.weight", sd["backbone.embedding.weight"])
        if head is not sd["backbone.embedding.weight"] and not torch.equal(head, sd["backbone.embedding.weight"]):
            raise ValueError("the config ties the embeddings, but the checkpoint's lm_head.weight differs "
                             "from backbone.embedding.weight; set tie_embeddings (tie_word_embeddings) to "
                             "false to load an untied head")
        sd["lm_head.weight"] = sd["backbone.embedding.weight"]  # one tensor, as in the model
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint keys do not match the model: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    for k, v in model.state_dict().items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ValueError(f"checkpoint tensor {k} has shape {tuple(sd[k].shape)}, the config "
                             f"expects {tuple(v.shape)} (vocab padded to {model.cfg.padded_vocab_size})")
    return sd


def load_pretrained(cls, path_or_id, device=None, dtype=None, **overrides):
    _check_load_arguments(MambaConfig, dtype, overrides)
    folder = _resolve_folder(path_or_id)
    return load_weights(cls, config_from_dict(read_config_json(folder), **overrides), folder, device, dtype)


def read_config_json(folder):
    """The folder's config.json as a dict (mamba2_minimal.py's loader reads it here too)."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {folder}")
    with open(cfg_path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{cfg_path} is not valid JSON: {err}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object of config fields, got a {type(d).__name__}")
    return d


# The model is built with its parameters on the meta device (shapes, no memory, inits that do
# nothing) and then handed the checkpoint's tensors themselves (load_state_dict with assign=True),
# each converted to its final dtype and device on the way. So loading a bf16 checkpoint in bf16
# holds one copy of the weights, never an fp32 model beside it; nothing is initialized only to be
# overwritten. Buffers (values computed at construction that no checkpoint holds) are built as usual.

@contextlib.contextmanager
def _parameters_on_meta():
    """Inside, every parameter a module registers is moved to the meta device, and buffers stay
    real (accelerate's init_empty_weights(include_buffers=False) does the same)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def load_weights(cls, cfg, folder, device=None, dtype=None, keep_fp32=("mixer.A_log", "mixer.D")):
    """cls(cfg) with the folder's weights (strict keys, either layout), in `dtype` on `device`.
    dtype None: the dtypes the model is built with (fp32). Under fp16/bf16 the parameters named
    in keep_fp32 stay fp32, as the official modules create them whatever the dtype: rounding
    A_log to bf16 would move every decay rate. Shared with mamba2_minimal.py and mamba3_minimal.py."""
    with _parameters_on_meta():
        model = cls(cfg)
    state_dict = convert_state_dict(_load_state_dict_file(folder), model)
    built = model.state_dict()
    converted = {}  # id -> tensor: the tied head and embedding stay one tensor
    for name, t in state_dict.items():
        want = built[name].dtype if dtype is None else dtype
        if name.endswith(keep_fp32) and dtype in (torch.float16, torch.bfloat16):
            want = torch.float32
        if id(t) not in converted:
            converted[id(t)] = t.to(device=device, dtype=want)  # no copy when nothing changes
        state_dict[name] = converted[id(t)]
    model.load_state_dict(state_dict, strict=True, assign=True)
    if cfg.tie_embeddings:  # assign gave the head a Parameter of its own, over the same tensor
        model.lm_head.weight = model.backbone.embedding.weight
    return model.to(device=device).eval()  # the buffers


# Saving: config.json in the official layout (MambaLMHeadModel's config: the model's fields at the
# top, the mixer's in ssm_cfg with its "layer"), and the weights under the official names, as
# model.safetensors (the tied head stored once, as transformers does) or, without the safetensors
# package, pytorch_model.bin (both keys, one storage, as the official save_pretrained writes).
# Each file is written beside its final name and then renamed over it, so that an interrupted save
# leaves the old file or the new one, never half of one; config.json is written first and takes its
# name last, and weights in the other format are set aside (renamed) once the new ones are whole, put
# back if the new file cannot take its name, and removed at the end.

# fields of the official MambaConfig (config_mamba.py); the rest of ours are the mixer's or runtime options
_OFFICIAL_TOP_FIELDS = ("d_model", "d_intermediate", "n_layer", "vocab_size", "attn_layer_idx", "attn_cfg",
                        "rms_norm", "residual_in_fp32", "pad_vocab_size_multiple", "tie_embeddings")
# how to run, not what the model is (Mamba-2's and Mamba-3's chunk_size are mixer fields: saved)
_RUNTIME_FIELDS = {"scan_backend", "compile_scan", "chunk_size", "recompute", "compile_mixer"}


def config_to_dict(cfg, layer="Mamba1", ssm_fields=_OFFICIAL_SSM_FIELDS, own_ssm_fields=()):
    """A config as the official config.json writes it: the official top-level fields, the mixer's
    fields (ssm_fields) in ssm_cfg with `layer`, and, only where they differ from their defaults
    (the official code would refuse them), our own mixer fields (own_ssm_fields) in ssm_cfg and any
    other field of ours at the top, where config_from_dict reads them back. Runtime options are
    not saved."""
    d = {"d_model": cfg.d_model, "d_intermediate": 0, "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size,
         "ssm_cfg": {"layer": layer}, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
         "residual_in_fp32": cfg.residual_in_fp32, "fused_add_norm": True,
         "pad_vocab_size_multiple": cfg.pad_vocab_size_multiple, "tie_embeddings": cfg.tie_embeddings}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        value = _as_json(value)
        if f.name in _OFFICIAL_TOP_FIELDS:
            d[f.name] = value
        elif f.name in ssm_fields:
            if value == _as_json(f.default) and not math.isfinite(sum(value) if isinstance(value, list) else 0):
                continue  # JSON has no inf (Mamba-2's dt_limit): the default, left out, loads as itself
            d["ssm_cfg"][f.name] = value
        elif f.name not in _RUNTIME_FIELDS and value != f.default:
            (d["ssm_cfg"] if f.name in own_ssm_fields else d)[f.name] = value
    return d


def _as_json(value):
    return list(value) if isinstance(value, tuple) else value  # JSON has lists


def save_pretrained(model, folder, config_dict, safe_serialization=None):
    """Write config_dict as config.json and the model's weights into folder (created if needed);
    safe_serialization: model.safetensors (True), pytorch_model.bin (False), or None: safetensors
    where the package is installed. Each file is written beside its name first, config.json before
    the weights, so that a save that fails while writing (a full disk, an interrupt) or at the
    weights' rename (refused on Windows while a scanner holds the file) leaves the checkpoint that
    was there. Weights in the other format are set aside once the new file is whole, put back if it
    cannot take its name, and removed at the end (the loader would otherwise find a stale
    model.safetensors before a new pytorch_model.bin); one that will not go stays, with a warning."""
    if safe_serialization is None:
        safe_serialization = _safetensors_installed()
    if safe_serialization:  # before anything in the folder changes
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise ImportError("safe_serialization=True needs the safetensors package: pip install safetensors "
                              "(or save_pretrained(folder, safe_serialization=False) for pytorch_model.bin)") from err
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, "model.safetensors" if safe_serialization else "pytorch_model.bin")
    stale = [path for path in _weights_files(folder) if path != target and os.path.lexists(path)]
    aside = f".old{os.getpid()}"

    def set_stale_aside():  # renamed, not removed: if the new file cannot take its name, they go back
        for path in stale:
            os.replace(path, path + aside)

    def put_stale_back():
        for path in stale:
            if os.path.lexists(path + aside):
                try:
                    os.replace(path + aside, path)
                except OSError as err:
                    warnings.warn(f"save_pretrained could not put {path} back ({err}): the old weights are in "
                                  f"{path + aside}")

    state_dict = model.state_dict()
    if safe_serialization and model.cfg.tie_embeddings:
        del state_dict["lm_head.weight"]  # one storage under two names: safetensors stores it once

    def write(tmp):
        if safe_serialization:
            save_file({k: v.contiguous() for k, v in state_dict.items()}, tmp, metadata={"format": "pt"})
        else:
            torch.save(state_dict, tmp)

    config_tmp = os.path.join(folder, f"config.json.tmp{os.getpid()}")
    try:
        _write_json(config_tmp, config_dict)  # first: a full disk stops the save before anything changes
        try:
            _write_atomically(target, write, set_stale_aside)
        except BaseException:  # a full disk, a refused rename, an interrupt: the folder as it was
            put_stale_back()
            raise
        os.replace(config_tmp, os.path.join(folder, "config.json"))
    finally:
        if os.path.exists(config_tmp):
            os.remove(config_tmp)
    for path in stale:  # the new checkpoint is whole: a file that will not go is harmless, and said
        try:
            os.remove(path + aside)
        except OSError as err:
            warnings.warn(f"save_pretrained could not remove {path + aside} ({err}); the new checkpoint is "
                          f"complete and the loader never reads that file: delete it by hand")
    return folder


def _write_json(path, d):
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")


def _write_atomically(path, write, before_rename=None):
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ------------------------------------------------------------------------------------------------
# 8. Using a model for real: caches, packed sequences, padding
# ------------------------------------------------------------------------------------------------
# Options of MambaLM.forward (and prefill) that serving and training on real data need; none of
# them changes what the model computes for one whole sequence. The mixer applies them (section 3);
# each is checked in the appendix.
#
#   cache           a cache as prefill returns it: continue from its states (it is not modified),
#                   so any split of a sequence into pieces gives the logits and final cache of one pass
#   seq_idx         (b, L) integers, non-decreasing along a row: packed sequences, each starting from
#                   a zero state where the index changes (reset: dA = 0 at its first token); the
#                   official varlen boundaries convert with seq_idx_from_cu_seqlens. With a cache,
#                   the first document of the call continues it; or seq_idx is one column longer,
#                   (b, L + 1), its first column the document of the cache's last token, so that a
#                   boundary right at the split is seen: a row whose first token starts a new
#                   document then starts from an empty cache. A packed row s cut at k continues with
#                   model(ids[:, k:], cache=c, seq_idx=s[:, k - 1:]).
#   attention_mask  (b, L) of 0/1, left padding: the 0s are identity steps for the state (Δ = 0,
#                   so dA = 1 and dBx = 0) and zeros for the conv, so each row computes what it
#                   computes alone (the logits at padded positions mean nothing)
#
# The conv needs the most care: its taps look d_conv-1 tokens back, into the cache's buffer
# (conv_buffer_after, section 3) or into the previous packed sequence (conv_keep below).

def conv_keep(seq_idx, width, dtype):
    """seq_idx (b, L) -> keep (b, L, width) of `dtype` for shifted_sum: 0 where tap k would read an
    input of another sequence (the inputs before the first token count as the first sequence's)."""
    L = seq_idx.shape[1]
    seq_pad = torch.cat([seq_idx[:, :1].expand(-1, width - 1), seq_idx], dim=1)  # (b, width-1+L)
    return torch.stack([seq_pad[:, k:k + L] == seq_idx for k in range(width)], dim=-1).to(dtype)


def piece_of_packed_row(seq_idx, cache):
    """A piece of a packed row: seq_idx (b, L + 1), whose column 0 is the document of the cache's
    last token -> the piece's seq_idx (b, L) and the cache to continue, emptied (zeros) in the rows
    whose first token starts another document."""
    new_document = seq_idx[:, 1] != seq_idx[:, 0]  # (b,)
    cache = [type(c)(t.masked_fill(new_document.view(-1, *(1,) * (t.dim() - 1)), 0) for t in c) for c in cache]
    return seq_idx[:, 1:], cache


def seq_idx_from_cu_seqlens(cu_seqlens):
    """The official varlen boundaries -> seq_idx: cu_seqlens (n+1,) = (0, end of sequence 0, ...,
    total length), increasing -> (1, total) int64, sequence i's tokens marked i."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool \
            or cu_seqlens[0] != 0 or (cu_seqlens.diff() <= 0).any():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor (0, end of sequence 0, ..., total), "
                         f"increasing, got {cu_seqlens!r}")
    lengths = cu_seqlens.diff()  # (n,)
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths).unsqueeze(0)


# ------------------------------------------------------------------------------------------------
# 9. Hybrid models: attention layers and MLPs
# ------------------------------------------------------------------------------------------------
# The official MambaLMHeadModel builds more than a stack of mixers. Four fields of its config
# (mamba_ssm/models/config_mamba.py; create_block in models/mixer_seq_simple.py) change the blocks,
# in every generation:
#
#   d_intermediate > 0   a gated MLP (modules/mlp.py, GatedMLP) after each mixer, as a second
#                        pre-norm residual sub-block with a norm of its own (norm2, modules/block.py):
#                            h = h + mixer(norm(h)),     h = h + fc2(y·SiLU(g)),  [y, g] = fc1(norm2(h))
#                        fc1 widens to twice the hidden width, d_intermediate rounded up to a multiple of 128;
#                        fc2 starts like out_proj, divided by sqrt(n_layer) (the official MixerModel divides
#                        by sqrt(2·n_layer), but MambaLMHeadModel then draws both again with 1/sqrt(n_layer):
#                        mixer_seq_simple.py, _init_weights, at e9594ce)
#   attn_layer_idx       the layers that run multi-head attention (modules/mha.py, MHA) instead of
#   attn_cfg             the mixer, with the settings of attn_cfg
#   rms_norm = false     LayerNorm (with a bias) instead of RMSNorm in every norm, norm_f included
#
# The official hybrid checkpoints are built this way: mamba2attn-2.7b has Mamba-2 mixers and attention
# in 6 of its 64 layers; transformerpp-2.7b is the Mamba paper's Transformer++ baseline (arXiv
# 2312.00752, section 4.2: rotary attention and gated MLPs, RMSNorm, no biases), attention in every layer.
#
# One attention layer (MHA.forward), for the token at position t and query head j:
#
#     [qkv_t, m_t] = in_proj(u_t)                    q_t: H heads, k_t, v_t: H_kv heads, each head_dim wide
#     qkv_t = Σ_k w_k·qkv_{t-d_conv+1+k} + bias      only with d_conv > 0: a depthwise causal conv, no activation
#     q_t, k_t = R(t)·q_t, R(t)·k_t                  the rotary position embedding
#     o_t = Σ_{s ≤ t} softmax_s(scale·q_t·k_s)·v_s   with the key head j // (H / H_kv); scale = head_dim^-1/2
#     out_t = out_proj([o_t, m_up·SiLU(m_gate)])     the second half only with mlp_dim > 0: a gated MLP
#                                                    beside the attention, mlp_dim rounded up to 256
#
# H_kv < H is grouped-query attention (GQA, arXiv 2305.13245): H / H_kv consecutive query heads read one
# key and value head, so the cache below is H / H_kv times smaller; H_kv = 1 is multi-query attention.
# R(t) is the rotary embedding (RoFormer, arXiv 2104.09864, as flash_attn's RotaryEmbedding applies
# it): the first rotary_emb_dim entries of a head turn pair by pair, pair i by the angle
# t·base^(-2i/rotary_emb_dim), the pairs being entries (i, i + rotary_emb_dim/2), or (2i, 2i + 1)
# when interleaved. As rotations compose, R(t)ᵀR(s) = R(s - t): q_t·k_s depends on the positions
# only through their distance. Mamba-3 turns its B and C the same way, with angles its data choose
# (mamba3_minimal.py, section 2).
#
# Attention's memory of the past is every key and value it has seen. The layer's cache holds them
# and grows by one key and one value per token: a step costs O(context) time, and the cache
# O(context) memory, where a mixer's state has a fixed size (section 5). The cache is a list
# [k, v, valid] (+ conv_state with d_conv): the keys, already rotated, and the values of every token
# read, (b, T, H_kv, head_dim), and valid (b, T), the slots that the next token may see. A tensor
# cannot grow in place, so step replaces k, v and valid in the list with tensors one slot longer;
# that is why the entry is a list where the mixers' are tuples. The copy moves about as many bytes
# as the attention reads from the cache anyway (the official code preallocates max_seqlen slots).
#
# Section 8's options, in attention's terms. Which keys a token sees is one boolean mask: key s is
# seen by the token in slot t when s ≤ t, s is no padding, and s lies in the token's own document
# (seq_idx). A token's position is the number of keys it sees, minus one (itself), so positions
# restart at every document's first token and start at each row's first real token. Under left
# padding a padded query sees no real key: it attends to itself alone (a softmax over no key is not a
# number in some kernels, and 0·NaN would reach the real tokens) and its output means nothing, as
# section 8 says. Continuing a cache, its valid slots belong to the first document of the new tokens;
# after a forward over packed documents, valid marks the last document's tokens only, so that the
# next token continues that document alone.
#
# The official decode step (MHA.forward with inference_params) is no reference for step: without
# flash_attn it calls PyTorch's scaled_dot_product_attention with is_causal=True on a one-token
# query, a mask PyTorch aligns top-left, so the new token sees only the first key; and with d_conv > 0
# its prefill stores the conv's outputs, not its inputs, as the conv's state. The tests check step
# against the forward.


def gated_mlp_hidden(d_intermediate):
    return (d_intermediate + 127) // 128 * 128  # GatedMLP's multiple_of = 128


class GatedMLP(nn.Module):
    """The official GatedMLP (modules/mlp.py): fc1 to twice the hidden width, y·SiLU(gate), fc2."""

    def __init__(self, cfg):
        super().__init__()
        hidden = gated_mlp_hidden(cfg.d_intermediate)
        self.fc1 = nn.Linear(cfg.d_model, 2 * hidden, bias=False)
        self.fc2 = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x):
        y, gate = self.fc1(x).chunk(2, dim=-1)  # (..., hidden) each
        return self.fc2(y * F.silu(gate))  # (..., d_model)


class LayerNorm(nn.Module):
    """nn.LayerNorm's (x - mean)/sqrt(var + eps)·weight + bias, normalised in fp32 like RMSNorm: the
    norms of rms_norm = false."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        out = F.layer_norm(_at_least_fp32(x), x.shape[-1:], eps=self.eps)
        return out.to(self.weight.dtype) * self.weight + self.bias


def apply_rotary(x, positions, dim, base=10000.0, interleaved=False):
    """The rotary embedding R(position) on x (b, L, heads, head_dim), positions (b, L) integers: the
    first dim entries of each head turned pair by pair, the rest as they are. The angles and the
    turn in fp32 at least (bf16 rounds an angle of 1000 rad to a multiple of 4), then x's dtype."""
    if dim == 0:
        return x
    dtype = _at_least_fp32(x).dtype
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=dtype, device=x.device) / dim)  # (dim/2,)
    angle = positions.to(dtype)[..., None, None] * inv_freq  # (b, L, 1, dim/2), one per pair, all heads
    cos, sin = torch.cos(angle), torch.sin(angle)
    turned = x[..., :dim].to(dtype)
    if interleaved:  # pairs (2i, 2i+1)
        x0, x1 = turned[..., 0::2], turned[..., 1::2]
    else:  # pairs (i, i + dim/2)
        x0, x1 = turned.chunk(2, dim=-1)
    y0, y1 = x0 * cos - x1 * sin, x1 * cos + x0 * sin  # (b, L, heads, dim/2) each
    turned = torch.stack([y0, y1], dim=-1).flatten(-2) if interleaved else torch.cat([y0, y1], dim=-1)
    return torch.cat([turned.to(x.dtype), x[..., dim:]], dim=-1)  # (b, L, heads, head_dim)


def visible_keys(valid_new, seq_idx=None, valid_cached=None):
    """Which keys each new token sees: key s by the token in slot t when s ≤ t, s is valid and in the
    token's document. valid_new (b, L) bool: no padding; seq_idx (b, L) or None; valid_cached (b, T0) or
    None: the cache's slots, first, in the document of the first new token. Returns the mask
    (b, L, T0 + L) and the valid slots after these tokens, (b, T0 + L): the last document's only."""
    b, L = valid_new.shape
    T0 = 0 if valid_cached is None else valid_cached.shape[1]
    valid = valid_new if valid_cached is None else torch.cat([valid_cached, valid_new], dim=1)  # (b, T)
    slots = torch.arange(T0 + L, device=valid_new.device)
    see = (slots <= T0 + torch.arange(L, device=valid_new.device)[:, None]) & valid[:, None, :]  # (b, L, T)
    if seq_idx is not None:
        doc = torch.cat([seq_idx[:, :1].expand(-1, T0), seq_idx], dim=1)  # (b, T)
        see = see & (doc[:, None, :] == seq_idx[:, :, None])
        valid = valid & (doc == seq_idx[:, -1:])
    return see, valid


class MHA(nn.Module):
    """Causal multi-head attention (the official MHA, modules/mha.py) in the layers of
    cfg.attn_layer_idx, with the settings of cfg.attn_cfg (official names and defaults: attn_settings
    in the appendix). It takes and returns what a mixer does; its cache is the KV cache above."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        a = attn_settings(cfg)
        self.num_heads, self.num_heads_kv, self.head_dim = a["num_heads"], a["num_heads_kv"], a["head_dim"]
        self.qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        self.mlp_dim = math.ceil(a["mlp_dim"] / 256) * 256
        self.d_conv = a["d_conv"]
        self.rotary = dict(dim=a["rotary_emb_dim"], base=a["rotary_emb_base"], interleaved=a["rotary_emb_interleaved"])
        self.scale = a["softmax_scale"] or self.head_dim ** -0.5
        self.in_proj = nn.Linear(cfg.d_model, self.qkv_dim + self.mlp_dim, bias=a["qkv_proj_bias"])
        if self.d_conv:
            self.conv1d = nn.Conv1d(self.qkv_dim, self.qkv_dim, self.d_conv, groups=self.qkv_dim,
                                    padding=self.d_conv - 1)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim + self.mlp_dim // 2, cfg.d_model,
                                  bias=a["out_proj_bias"])

    def _heads(self, qkv):
        """qkv (b, L, qkv_dim) -> q (b, L, H, head_dim), k, v (b, L, H_kv, head_dim)."""
        H, Hkv, d = self.num_heads, self.num_heads_kv, self.head_dim
        q, k, v = qkv.split([H * d, Hkv * d, Hkv * d], dim=-1)
        return q.unflatten(-1, (H, d)), k.unflatten(-1, (Hkv, d)), v.unflatten(-1, (Hkv, d))

    def _attend(self, q, k, v, see):
        """q (b, L, H, d), k, v (b, T, H_kv, d), see (b, L, T) -> (b, L, H·d): softmax(scale·q·kᵀ) over
        the keys seen, times v, by PyTorch's fused scaled_dot_product_attention. A NaN or inf in a
        key or value reaches every query of its row, earlier ones too: a masked weight is a zero,
        and zero times NaN is NaN (the chunked scans do the same within a chunk)."""
        repeat = self.num_heads // self.num_heads_kv  # query head j reads key head j // repeat
        k, v = (t.repeat_interleave(repeat, dim=2).transpose(1, 2) for t in (k, v))  # (b, H, T, d)
        # forward-mode AD (section 6's _forward_mode): only the plain-ops kernel has a rule for it
        attention = torch.nn.attention
        math_only = not torch.compiler.is_compiling() and _forward_mode()
        with attention.sdpa_kernel(attention.SDPBackend.MATH) if math_only else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=see[:, None], scale=self.scale)
        return o.transpose(1, 2).flatten(-2)  # (b, L, H·d)

    def _finish(self, o, m):
        """The attention's output o (..., H·d) and in_proj's MLP part m (..., mlp_dim) -> out_proj."""
        if self.mlp_dim:
            up, gate = m.chunk(2, dim=-1)
            o = torch.cat([o, up * F.silu(gate)], dim=-1)  # (..., H·d + mlp_dim/2)
        return self.out_proj(o)  # (..., d_model)

    def forward(self, u, want_cache=False, cache=None, seq_idx=None, attention_mask=None):
        """u: (b, L, d_model) -> (b, L, d_model); with want_cache also the layer's cache [k, v, valid
        (, conv_state)]. cache, seq_idx, attention_mask: as the mixers take them (section 8)."""
        b, L, _ = u.shape
        qkv, m = self.in_proj(u).split([self.qkv_dim, self.mlp_dim], dim=-1)  # (b, L, qkv_dim), (b, L, mlp_dim)
        # left padding: zeros into the conv, as in the mixers
        qkv_in = qkv if attention_mask is None else qkv * attention_mask[..., None]
        conv_state = cache[3] if cache is not None and self.d_conv else None
        qkv = self.causal_conv(qkv_in, conv_state, seq_idx) if self.d_conv else qkv_in
        q, k, v = self._heads(qkv)
        valid_new = torch.ones(b, L, dtype=torch.bool, device=u.device) if attention_mask is None else attention_mask
        see, valid = visible_keys(valid_new, seq_idx, None if cache is None else cache[2])  # (b, L, T), (b, T)
        positions = see.sum(-1) - 1  # (b, L): the keys a token sees, but itself (-1 for padding)
        q, k = apply_rotary(q, positions, **self.rotary), apply_rotary(k, positions, **self.rotary)
        if cache is not None:  # (b, T, H_kv, d) each
            k, v = (torch.cat([old, new.to(old.dtype)], dim=1) for old, new in ((cache[0], k), (cache[1], v)))
        T = see.shape[2]
        itself = torch.arange(T, device=u.device) == torch.arange(T - L, T, device=u.device)[:, None]  # (L, T)
        see = see | itself  # every token sees itself: a padded one has no other key
        out = self._finish(self._attend(q, k, v, see), m)  # (b, L, d_model)
        if not want_cache:
            return out
        dtype = self.in_proj.weight.dtype  # the cache's, also under autocast
        # copies: a slice of qkv would keep all of it alive in the cache
        new_cache = [k.to(dtype).clone(memory_format=torch.contiguous_format),
                     v.to(dtype).clone(memory_format=torch.contiguous_format), valid]
        if self.d_conv:
            new_cache.append(conv_buffer_after(qkv_in, self.d_conv, self.conv1d.weight.dtype, conv_state, seq_idx))
        return out, new_cache

    # the depthwise causal conv and its one-token form on the rolling buffer, as in the mixers
    causal_conv = MambaMixer.causal_conv
    conv_step = MambaMixer.conv_step

    def cache_spec(self, batch):
        """The layer's cache, as (name, shape, what the dims are, dtype); None: the number of tokens
        read, which grows by one per step."""
        kv_shape, dims = (batch, None, self.num_heads_kv, self.head_dim), "batch, tokens, num_heads_kv, head_dim"
        dtype = self.in_proj.weight.dtype
        spec = (("k", kv_shape, dims, dtype), ("v", kv_shape, dims, dtype),
                ("valid", (batch, None), "batch, tokens", torch.bool))
        if self.d_conv:
            spec += (("conv_state", (batch, self.qkv_dim, self.d_conv), "batch, qkv width, d_conv",
                      self.conv1d.weight.dtype),)
        return spec

    def step(self, u, cache):
        """One token: u (b, d_model); cache = [k, v, valid (, conv_state)], whose k, v and valid step
        replaces with tensors one slot longer (and writes conv_state in place). -> (b, d_model)"""
        qkv, m = self.in_proj(u).split([self.qkv_dim, self.mlp_dim], dim=-1)  # (b, qkv_dim), (b, mlp_dim)
        if self.d_conv:
            qkv = self.conv_step(cache[3], qkv)
        q, k, v = self._heads(qkv[:, None])  # (b, 1, H, d), (b, 1, H_kv, d) x 2
        position = cache[2].sum(-1, keepdim=True)  # (b, 1): the document's tokens before this one
        q, k = apply_rotary(q, position, **self.rotary), apply_rotary(k, position, **self.rotary)
        cache[0] = torch.cat([cache[0], k.to(cache[0].dtype)], dim=1)  # (b, T+1, H_kv, d)
        cache[1] = torch.cat([cache[1], v.to(cache[1].dtype)], dim=1)
        cache[2] = F.pad(cache[2], (0, 1), value=True)  # (b, T+1)
        return self._finish(self._attend(q, cache[0], cache[1], cache[2][:, None])[:, 0], m)  # (b, d_model)


# ------------------------------------------------------------------------------------------------
# 10. Selection switched off: the time-invariant layer that selection replaced
# ------------------------------------------------------------------------------------------------
# An ablation, off in every official model. With MambaConfig(selection_off=True) Δ, B and C are
# learned constants instead of functions of the token: the decay exp(Δ·A) is the same at every
# step, the S4D-style layer of pscan.py section 2, whose SSM is one fixed convolution.
# tasks/selective_copying.py trains both on the Mamba paper's selective copying task (§4.1.1).
# Its checkpoints hold dt_bias, B and C where a selective model's hold x_proj and dt_proj.

class SelectionOffMixer(MambaMixer):
    """MambaMixer with Δ = softplus(dt_bias) per channel, and B and C one learned N-vector each."""

    def __init__(self, cfg: MambaConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        ed, n = cfg.d_inner, cfg.d_state
        self.in_proj = nn.Linear(cfg.d_model, 2 * ed, bias=cfg.bias)
        self.conv1d = nn.Conv1d(ed, ed, cfg.d_conv, groups=ed, padding=cfg.d_conv - 1, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(ed))  # Δ = softplus(dt_bias), one per channel
        self.B = nn.Parameter(torch.empty(n))
        self.C = nn.Parameter(torch.empty(n))
        self.A_log = nn.Parameter(torch.empty(ed, n))
        self.D = nn.Parameter(torch.empty(ed))
        self.out_proj = nn.Linear(ed, cfg.d_model, bias=cfg.bias)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self):
        """MambaMixer's Δ, A and D init; B = 1 and a random C, as S4D initialises them."""
        cfg = self.cfg
        self.dt_bias.copy_(dt_bias_init(cfg.d_inner, cfg))
        self.B.fill_(1.0)
        self.C.normal_()
        self.A_log.copy_(torch.log(torch.arange(1, cfg.d_state + 1, dtype=torch.float32)).repeat(cfg.d_inner, 1))
        self.D.fill_(1.0)

    def _ssm_inputs(self, x):
        """The same Δ, B and C at every token: x alone varies. x (..., ED) -> (..., ED), (..., N), (..., N)."""
        shape = x.shape[:-1]
        delta = F.softplus(_at_least_fp32(self.dt_bias)).expand(*shape, self.cfg.d_inner)  # (..., ED)
        B, C = (t.to(x.dtype).expand(*shape, self.cfg.d_state) for t in (self.B, self.C))  # (..., N) each
        return delta, B, C


# ------------------------------------------------------------------------------------------------
# 11. Appendix: input checks
# ------------------------------------------------------------------------------------------------
# Bad input gets an error that names what was expected, before any work is done. None of these
# checks reads a tensor's values except _check_token_range and _check_use's checks of seq_idx and
# attention_mask: on a GPU, reading a value waits for the device, so a training step would wait
# once per forward. They run on CPU ids in forward and step, and once per prompt (prefill, and so
# generate) on any device; off the CPU, an id out of range in a plain forward stops the embedding
# with the device's own index error instead, and a plain forward trusts seq_idx and the mask.

def _is_positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_config(cfg):
    for name in ("d_model", "n_layer", "vocab_size", "d_state", "expand", "d_conv",
                 "pad_vocab_size_multiple", "chunk_size"):
        value = getattr(cfg, name)
        if not _is_positive_int(value):
            raise ValueError(f"MambaConfig.{name} must be a positive integer, got {value!r}")
    for name in ("conv_bias", "bias", "tie_embeddings", "residual_in_fp32", "recompute"):
        if not isinstance(getattr(cfg, name), bool):  # a string such as "no" would count as true
            raise ValueError(f"MambaConfig.{name} must be True or False, got {getattr(cfg, name)!r}")
    if cfg.dt_rank != "auto" and not _is_positive_int(cfg.dt_rank):
        raise ValueError(f"MambaConfig.dt_rank must be 'auto' or a positive integer, got {cfg.dt_rank!r}")
    _check_backend(cfg.scan_backend, "MambaConfig.scan_backend")
    if cfg.compile_scan not in COMPILE_MODES:
        raise ValueError(f"MambaConfig.compile_scan must be one of {COMPILE_MODES}, got {cfg.compile_scan!r}")
    if cfg.scan_backend == "reference" and cfg.compile_scan:
        raise ValueError("MambaConfig.scan_backend='reference' runs sections 2 and 3 as written, compile_scan "
                         "runs section 6's fused path: choose one")
    if isinstance(cfg.norm_epsilon, bool) or not isinstance(cfg.norm_epsilon, (int, float)) \
            or not 0 < cfg.norm_epsilon < math.inf:
        raise ValueError(f"MambaConfig.norm_epsilon must be a positive number, got {cfg.norm_epsilon!r}")
    if cfg.dt_init not in ("random", "constant"):
        raise ValueError(f"MambaConfig.dt_init must be 'random' or 'constant', got {cfg.dt_init!r}")
    _check_dt_init(cfg)
    _check_hybrid_fields(cfg)
    if not isinstance(cfg.selection_off, bool):
        raise ValueError(f"MambaConfig.selection_off must be True or False, got {cfg.selection_off!r}")


# the official MHA's arguments and defaults (modules/mha.py); num_heads has none
ATTN_DEFAULTS = dict(num_heads=None, num_heads_kv=None, head_dim=None, mlp_dim=0, qkv_proj_bias=True,
                     out_proj_bias=True, softmax_scale=None, causal=False, d_conv=0, rotary_emb_dim=0,
                     rotary_emb_base=10000.0, rotary_emb_interleaved=False)


def attn_settings(cfg):
    """cfg.attn_cfg over the official MHA's defaults, with num_heads_kv (num_heads) and head_dim
    (d_model / num_heads) filled in; checked by _check_attn_cfg."""
    a = {**ATTN_DEFAULTS, **cfg.attn_cfg}
    if a["num_heads_kv"] is None:
        a["num_heads_kv"] = a["num_heads"]
    if a["head_dim"] is None:
        a["head_dim"] = cfg.d_model // a["num_heads"]
    return a


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_positive_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _check_dt_init(cfg):
    """The numbers of the Δ init (dt_bias_init, and Mamba-1's dt_scale), in every generation's config:
    a string or null there would fail deep inside the init, a NaN floor would make every Δ NaN."""
    name = type(cfg).__name__
    for key in ("dt_min", "dt_max") + (("dt_scale",) if hasattr(cfg, "dt_scale") else ()):
        if not _is_positive_number(getattr(cfg, key)):
            raise ValueError(f"{name}.{key} must be a positive number, got {getattr(cfg, key)!r}")
    floor = cfg.dt_init_floor
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor < math.inf:
        raise ValueError(f"{name}.dt_init_floor must be a number >= 0, got {floor!r}")
    if not cfg.dt_min <= cfg.dt_max:
        raise ValueError(f"need 0 < dt_min <= dt_max, got {cfg.dt_min} and {cfg.dt_max}")


def _check_hybrid_fields(cfg):
    """Section 9's fields, in every generation's config; attn_cfg's settings only where an attention
    layer reads them (_check_attn_cfg)."""
    name = type(cfg).__name__
    if not _is_count(cfg.d_intermediate):
        raise ValueError(f"{name}.d_intermediate must be an integer >= 0 (0: no MLP), got {cfg.d_intermediate!r}")
    if not isinstance(cfg.rms_norm, bool):
        raise ValueError(f"{name}.rms_norm must be True (RMSNorm) or False (LayerNorm), got {cfg.rms_norm!r}")
    idx = cfg.attn_layer_idx
    if not isinstance(idx, (list, tuple)) or len(set(idx)) != len(idx) or not all(
            _is_count(i) and i < cfg.n_layer for i in idx):
        raise ValueError(f"{name}.attn_layer_idx must be a list of distinct layer indices in [0, n_layer = "
                         f"{cfg.n_layer}), got {idx!r}")
    if not isinstance(cfg.attn_cfg, dict):
        raise ValueError(f"{name}.attn_cfg must be a dict of the official MHA's arguments, got {cfg.attn_cfg!r}")
    if idx:
        _check_attn_cfg(cfg)


def _check_attn_cfg(cfg):
    """attn_cfg over the official MHA's defaults (attn_settings), for a model with attention layers."""
    unknown = set(cfg.attn_cfg) - set(ATTN_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown attn_cfg fields {sorted(unknown)}; the official MHA takes {sorted(ATTN_DEFAULTS)}")
    a = {**ATTN_DEFAULTS, **cfg.attn_cfg}
    if not _is_positive_int(a["num_heads"]):
        raise ValueError(f"attn_cfg.num_heads must be a positive integer (the official MHA has no default), "
                         f"got {a['num_heads']!r}")
    if a["causal"] is not True:
        raise ValueError(f"attn_cfg.causal must be true: a language model's attention must not see later tokens "
                         f"(false is the official MHA's default, for other uses), got {a['causal']!r}")
    heads, kv = a["num_heads"], a["num_heads_kv"]
    if kv is not None and (not _is_positive_int(kv) or heads % kv):
        raise ValueError(f"attn_cfg.num_heads_kv must divide num_heads = {heads} (GQA: query heads per key head), "
                         f"got {kv!r}")
    if a["head_dim"] is None and cfg.d_model % heads:
        raise ValueError(f"attn_cfg.head_dim is not given, so d_model = {cfg.d_model} must be a multiple of "
                         f"num_heads = {heads}")
    if a["head_dim"] is not None and not _is_positive_int(a["head_dim"]):
        raise ValueError(f"attn_cfg.head_dim must be a positive integer or null, got {a['head_dim']!r}")
    head_dim = a["head_dim"] or cfg.d_model // heads
    for key in ("d_conv", "mlp_dim"):
        if not _is_count(a[key]):
            raise ValueError(f"attn_cfg.{key} must be an integer >= 0 (0: none), got {a[key]!r}")
    rotary = a["rotary_emb_dim"]
    if not _is_count(rotary) or rotary % 2 or rotary > head_dim:
        raise ValueError(f"attn_cfg.rotary_emb_dim must be an even integer from 0 to head_dim = {head_dim} (it "
                         f"turns pairs of entries), got {rotary!r}")
    if a["softmax_scale"] is not None and not _is_positive_number(a["softmax_scale"]):
        raise ValueError(f"attn_cfg.softmax_scale must be a positive number or null (head_dim^-1/2), got "
                         f"{a['softmax_scale']!r}")
    if not _is_positive_number(a["rotary_emb_base"]):
        raise ValueError(f"attn_cfg.rotary_emb_base must be a positive number, got {a['rotary_emb_base']!r}")
    for key in ("qkv_proj_bias", "out_proj_bias", "rotary_emb_interleaved"):
        if not isinstance(a[key], bool):
            raise ValueError(f"attn_cfg.{key} must be true or false, got {a[key]!r}")


def _check_backend(backend, what):
    # an eager backend is a pscan.py scan: pscan.BACKENDS decides which names it knows
    known = tuple(b for b in SCAN_BACKENDS if b in FUSED_BACKENDS or b in pscan.BACKENDS or b == "reference")
    if backend not in known:
        raise ValueError(f"{what} must be one of {known}, got {backend!r}")


def _check_selective_scan_inputs(x, delta, A, B, C, D, z, h0, backend, compile, reset=None):
    _check_backend(backend, "backend")
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    if backend == "reference" and compile:
        raise ValueError("backend='reference' runs section 2's code, compile runs the fused path: choose one")
    for name, t in (("x", x), ("delta", delta), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("h0", h0)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got a {type(t).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape (b, L, ED) (batch, length, channels), got {tuple(x.shape)}")
    b, l, ed = x.shape
    if l == 0:
        raise ValueError("the sequence length must be at least 1, got x of shape (batch, 0, ED)")
    if A.dim() != 2 or A.shape[0] != ed:
        raise ValueError(f"A must have shape (ED, N) = ({ed}, N), got {tuple(A.shape)}")
    given = {name: t for name, t in (("x", x), ("delta", delta), ("A", A), ("B", B), ("C", C), ("D", D),
                                     ("z", z), ("h0", h0)) if t is not None}
    for name, t in given.items():
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    computed_in = {name: _at_least_fp32(t).dtype for name, t in given.items()}
    if len(set(computed_in.values())) > 1:  # fp16/bf16 count as fp32: they are computed in fp32
        raise ValueError(f"selective_scan's inputs must be all float64 or all at most float32 (fp16/bf16 "
                         f"are computed in fp32), got {', '.join(f'{k} {t.dtype}' for k, t in given.items())}")
    n = A.shape[1]
    expected = {"delta": (b, l, ed), "B": (b, l, n), "C": (b, l, n), "D": (ed,), "z": (b, l, ed),
                "h0": (b, ed, n)}
    for name, shape in expected.items():
        if name in given and tuple(given[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(given[name].shape)}")
    if reset is not None and (not isinstance(reset, torch.Tensor) or reset.dtype != torch.bool
                              or tuple(reset.shape) != (b, l)):
        raise ValueError(f"reset must be a bool tensor of shape (b, L) = ({b}, {l}), got "
                         f"{reset.dtype if isinstance(reset, torch.Tensor) else type(reset).__name__}")


def _check_token_ids(input_ids, rank=2):
    shape = "(b, L)" if rank == 2 else "(b,)"
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != rank:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a tensor of shape {shape} (batch{', length' if rank == 2 else ''}), "
                         f"got {got}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids must not be empty, got shape {tuple(input_ids.shape)}")


def _check_token_range(input_ids, vocab_size):
    lo, hi = int(input_ids.min()), int(input_ids.max())  # reads values: a device sync on a GPU
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got min {lo} and max {hi}")


def _check_step_inputs(model, token_ids, cache):
    """Everything `step` will write into, checked before it writes anything: a bad cache must
    neither broadcast silently nor fail after some layers were already advanced. The ids' range
    is checked only where they live on the CPU (no device sync); generate skips it all. Every
    generation's mixer describes its cache with cache_spec, so this one check serves them all."""
    _check_token_ids(token_ids, rank=1)
    if token_ids.device.type == "cpu":
        _check_token_range(token_ids, model.cfg.vocab_size)
    _check_cache(model, cache, token_ids.shape[0], written_in_place=True)


def _check_forward(model, input_ids, want_cache, cache, seq_idx, attention_mask):
    """forward's arguments; returns the mixers' keyword arguments, {} in training (_check_use).
    Values are read where that costs no device sync: CPU ids, or a prefill (want_cache), once per
    prompt; batched by torch.func.vmap, only their shapes are checked."""
    _check_token_ids(input_ids)
    # not while torch.compile traces the model: a value read there would cut the graph in two; nor
    # where torch.func.vmap batches an argument: a batched tensor has no single value to read
    read_values = (want_cache or input_ids.device.type == "cpu") and not torch.compiler.is_compiling() \
        and not any(_batched_by_vmap(t) for t in (input_ids, seq_idx, attention_mask))  # False but under vmap
    if read_values:
        _check_token_range(input_ids, model.cfg.vocab_size)
    if cache is None and seq_idx is None and attention_mask is None:
        return {}  # training, or a first prefill: no options
    return _check_use(model, input_ids, cache, seq_idx, attention_mask, read_values)


def _batched_by_vmap(t):
    """Whether t is batched by torch.func.vmap, at any level of torch.func's wrappers (inside
    vmap(grad(f)), grad wraps vmap's batched tensors)."""
    functorch = torch._C._functorch
    while isinstance(t, torch.Tensor) and functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def _check_use(model, input_ids, cache, seq_idx, attention_mask, read_values=True):
    """forward's cache, seq_idx and attention_mask, checked against input_ids (b, L) and the model,
    their values only with read_values. Returns the mixers' keyword arguments: seq_idx as int64,
    the mask as bool (b, L); None left out."""
    b, L = input_ids.shape
    use = {}
    if cache is not None:
        _check_cache(model, cache, b)
    if seq_idx is not None:
        shapes = [(b, L)] + ([(b, L + 1)] if cache is not None else [])  # with a cache: the cache's document first
        if not isinstance(seq_idx, torch.Tensor) or tuple(seq_idx.shape) not in shapes \
                or seq_idx.dtype not in (torch.int64, torch.int32) or seq_idx.device != input_ids.device:
            got = (f"{tuple(seq_idx.shape)} {seq_idx.dtype} on {seq_idx.device}" if isinstance(seq_idx, torch.Tensor)
                   else type(seq_idx).__name__)
            with_cache = (f", or ({b}, {L + 1}) with the document of the cache's last token first"
                          if cache is not None else "")
            raise ValueError(f"seq_idx must be an integer tensor of shape ({b}, {L}) like input_ids{with_cache}, "
                             f"on {input_ids.device}, got {got}")
        if read_values and (seq_idx.diff(dim=1) < 0).any():
            raise ValueError("seq_idx must be non-decreasing along each row (packed sequences, one after "
                             "another)")
        use["seq_idx"] = seq_idx.long()
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, L) \
                or attention_mask.is_floating_point() or attention_mask.device != input_ids.device:
            got = (f"{tuple(attention_mask.shape)} {attention_mask.dtype} on {attention_mask.device}"
                   if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__)
            raise ValueError(f"attention_mask must be a bool or integer tensor of shape ({b}, {L}) like "
                             f"input_ids, on {input_ids.device}, got {got}")
        mask = attention_mask.long()
        if read_values and (((mask != 0) & (mask != 1)).any() or (mask.diff(dim=1) < 0).any()
                            or (mask[:, -1] != 1).any()):
            raise ValueError("attention_mask must be left padding: each row 0s (padding) then 1s (tokens), "
                             "ending with a token")
        if read_values and cache is not None and (mask == 0).any():
            raise ValueError("attention_mask with a cache must be all ones: padding would sit between the "
                             "cache and the new tokens")
        use["attention_mask"] = mask.bool()
    return use


def _check_cache(model, cache, batch, written_in_place=False):
    """A cache must be prefill's for this model and batch: one entry per layer, each tensor of the
    shape, dtype and device of its layer's cache_spec (a None in a shape: the tokens of an attention
    layer's KV cache, any number, the same for the layer's k, v and valid). written_in_place (step):
    step writes into every fixed-size state, so no such state may repeat a row in memory or share its
    memory with another; and it replaces a KV cache's tensors, so that entry must be a list."""
    n_layer = len(model.backbone.layers)
    specs = [layer.mixer.cache_spec(batch) for layer in model.backbone.layers]
    entries = [_cache_entry_name(spec) for spec in specs]
    if not isinstance(cache, (list, tuple)) or len(cache) != n_layer:
        got = len(cache) if isinstance(cache, (list, tuple)) else type(cache).__name__
        what = f"{entries[0]}s" if len(set(entries)) == 1 else "entries (" + "; ".join(dict.fromkeys(entries)) + ")"
        raise ValueError(f"cache must be a list of {n_layer} {what}, one per layer, as prefill returns it for "
                         f"this model; got {got}")
    owners = []  # (storage, first byte, end byte, the state that holds them)
    kv_lists = {}  # id of a KV cache's list -> its layer: step replaces the list's tensors
    for i, (layer, layer_cache, spec) in enumerate(zip(model.backbone.layers, cache, specs)):
        grows = [name for name, shape, *_ in spec if None in shape]
        if not isinstance(layer_cache, (list, tuple)) or len(layer_cache) != len(spec):
            raise ValueError(f"cache[{i}] must be a {entries[i]}, as prefill returns it for this model")
        if written_in_place and grows and not isinstance(layer_cache, list):
            raise ValueError(f"cache[{i}] must be a {entries[i]}, as prefill returns it: step replaces its "
                             f"{', '.join(grows)} with tensors one token longer")
        if written_in_place and grows:
            if id(layer_cache) in kv_lists:  # [entry] * n_layer: step would append every layer's token to it
                raise ValueError(f"cache[{i}] is the same list as cache[{kv_lists[id(layer_cache)]}]; each layer "
                                 f"needs a list of its own, as prefill returns them")
            kv_lists[id(layer_cache)] = i
        device = next(layer.mixer.parameters()).device
        tokens = {}  # name -> the number of tokens of a KV cache tensor
        for t, (name, shape, dims, dtype) in zip(layer_cache, spec):
            if not isinstance(t, torch.Tensor) or t.dim() != len(shape) or any(
                    s is not None and s != size for s, size in zip(shape, t.shape)):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                wanted = "(" + ", ".join("T" if s is None else str(s) for s in shape) + ")"
                raise ValueError(f"cache[{i}] {name} must have shape {wanted} ({dims}) for a batch of "
                                 f"{batch}, got {got}")
            if t.dtype != dtype or t.device != device:
                raise ValueError(f"cache[{i}] {name} must be {dtype} on {device} (as prefill makes "
                                 f"it for this model), got {t.dtype} on {t.device}")
            if None in shape:
                tokens[name] = t.shape[shape.index(None)]
                continue  # a KV cache's tensors are replaced, never written
            if not written_in_place:
                continue
            if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
                raise ValueError(f"cache[{i}] {name} repeats one row in memory (an expand()ed tensor); "
                                 f"give it memory of its own, e.g. with .clone()")
            storage, first, end = _memory_span(t)
            for other_storage, other_first, other_end, owner in owners:
                if storage == other_storage and first < other_end and other_first < end:
                    raise ValueError(f"cache[{i}] {name} shares its memory with {owner}; each state needs "
                                     f"memory of its own ([pair] * n_layer repeats one pair; views of one "
                                     f"buffer overlap): give it its own, e.g. with .clone()")
            owners.append((storage, first, end, f"cache[{i}] {name}"))
        if len(set(tokens.values())) > 1:
            raise ValueError(f"cache[{i}] {', '.join(tokens)} must hold the same number of tokens, got "
                             f"{', '.join(str(n) for n in tokens.values())}")
        if 0 in tokens.values():
            raise ValueError(f"cache[{i}] {', '.join(tokens)} must hold at least one token")


def _memory_span(t):
    """(storage address, first byte, end byte) of the memory a tensor's elements can reach."""
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0) + 1
    first = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), first, first + extent * t.element_size()


def _cache_entry_name(spec):
    """How _check_cache's errors name a layer's cache: "(conv_state, ssm_state) pair", or for an
    attention layer, whose step replaces tensors in it, "list [k, v, valid, conv_state]"."""
    names = ", ".join(name for name, *_ in spec)
    if any(None in shape for _, shape, *_ in spec):
        return f"list [{names}]"
    return f"({names}) {'pair' if len(spec) == 2 else 'tuple'}"


def _check_sampling(temperature, top_k, top_p):
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 <= temperature < math.inf:  # also refuses NaN
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and not _is_positive_int(top_k):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")


def _check_generate_arguments(max_new_tokens, temperature, top_k, top_p):
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    _check_sampling(temperature, top_k, top_p)


def _check_generate(model, input_ids, max_new_tokens, temperature, top_k, top_p, attention_mask, compile=False):
    """generate's arguments, before the prefill; with no new tokens there is no prefill to check
    the prompt and its mask, so they are checked here."""
    _check_generate_arguments(max_new_tokens, temperature, top_k, top_p)
    if not isinstance(compile, bool):  # a string such as "no" would count as true
        raise ValueError(f"compile must be True or False, got {compile!r}")
    if max_new_tokens == 0 and attention_mask is not None:
        _check_token_ids(input_ids)
        _check_use(model, input_ids, None, None, attention_mask)


def _check_load_arguments(cfg_cls, dtype, overrides):
    """from_pretrained's dtype and config overrides, before any file is read."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype such as torch.float32 or torch.bfloat16, "
                         f"got {dtype!r}")
    unknown = sorted(set(overrides) - {f.name for f in fields(cfg_cls)})
    if unknown:
        raise ValueError(f"unknown {cfg_cls.__name__} fields {unknown}; the fields are "
                         f"{[f.name for f in fields(cfg_cls)]}")
