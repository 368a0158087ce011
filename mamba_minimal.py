"""
mamba_minimal.py: Mamba (Gu & Dao 2023, arXiv 2312.00752) in plain PyTorch, compatible with the
official checkpoints.

Read it top to bottom: it is the whole model, and it is the code that runs. It imports torch and
pscan.py, which runs the recurrence h_t = a_t·h_{t-1} + b_t (read pscan.py's sections 1 and 9
first, its parallel scan, sections 3-5 and 8, after this file's section 5). Speed is one call
away and lives in a file of its own: mamba_engine.accelerate(model) runs the same numbers with
hand-written backwards, or with compile=True the fused path through torch.compile.

    1. The SSM and its discretization   h' = A·h + B·x, sampled with a step Δ      (paper eqs. 1, 2, 4)
    2. The selective scan               discretize, scan, read out with C          (Algorithm 2; selective_scan_ref)
    3. The mixer                        MambaConfig, RMSNorm, the causal conv, the paper's Mamba block
                                        (MambaMixer: the official Mamba module's forward)
    4. The backbone                     residual blocks: (b, L, d_model) -> (b, L, d_model), its init
    5. The language model               MambaLM, weight decay, recurrent inference: prefill, an O(1)
                                        step per token, sampling, generate (MambaLMHeadModel; the official
                                        Mamba.step is MambaMixer.step in this file)

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

Two names differ from the official code's: its `Mamba` module (the paper's block) is MambaMixer
in this file, and Mamba is the backbone, the official MixerModel without its embedding.

Other files build on this one and this one imports none of them: mamba_engine.py (speed),
pretrained.py (checkpoints), hybrid.py (attention and MLP layers), mamba2_minimal.py and
mamba3_minimal.py (the later generations).
"""

import math
from dataclasses import dataclass
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
    """y = SSM(Δ, A, B, C)(x) + D·x, gated by SiLU(z); mamba_engine.py is tested against it.
    x, delta, z: (b, L, ED); A: (ED, N); B, C: (b, L, N); D: (ED,); h0: (b, ED, N) or None;
    backend: the loop, or any of pscan.BACKENDS, the same h to rounding; reset: (b, L) bool or
    None, True where a packed sequence starts: the state restarts from zero there (dA = 0).
    -> y (b, L, ED) and the final state (b, ED, N), in fp32 (fp64 for fp64 inputs)."""
    x, delta, A, B, C = (_at_least_fp32(t) for t in (x, delta, A, B, C))
    D, z = (None if t is None else t.to(x.dtype) for t in (D, z))
    dA, dBx = discretize(x, delta, A, B)  # (b, L, ED, N) each
    if reset is not None:  # option: packed sequences
        dA = dA.masked_fill(reset[:, :, None, None], 0)
    h = pscan.scan(dA, dBx, None if h0 is None else h0.to(dA.dtype), backend)  # (b, L, ED, N)
    # C_t·h_t as a product and a sum: bf16 autocast would run a matmul in bf16
    y = (h * C.unsqueeze(-2)).sum(-1)  # (b, L, ED)
    y = skip_and_gate(y, x, D, z)  # (b, L, ED)
    # a copy: the view h[:, -1] would keep all of h alive in a cache
    return y, h[:, -1].clone()  # (b, L, ED), (b, ED, N)


# ------------------------------------------------------------------------------------------------
# 3. The mixer
# ------------------------------------------------------------------------------------------------
# The mixer around the selective scan (Figure 3, §3.4) and its parts: the config, the norm, the
# causal conv. Its one-token step, the recurrent form that section 5's generation runs, sits next
# to its forward.

def _is_positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_positive_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def check_dt_init(cfg):
    """The numbers of the Δ init (dt_min, dt_max, dt_init_floor), in every generation's config: a
    string there would fail deep inside the init, a NaN floor would make every Δ NaN."""
    name = type(cfg).__name__
    for key in ("dt_min", "dt_max"):
        if not _is_positive_number(getattr(cfg, key)):
            raise ValueError(f"{name}.{key} must be a positive number, got {getattr(cfg, key)!r}")
    floor = cfg.dt_init_floor
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor < math.inf:
        raise ValueError(f"{name}.dt_init_floor must be a number >= 0, got {floor!r}")
    if not cfg.dt_min <= cfg.dt_max:
        raise ValueError(f"need 0 < dt_min <= dt_max, got {cfg.dt_min} and {cfg.dt_max}")


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

    def __post_init__(self):
        for name in ("d_model", "n_layer", "vocab_size", "d_state", "expand", "d_conv", "pad_vocab_size_multiple"):
            if not _is_positive_int(getattr(self, name)):
                raise ValueError(f"MambaConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("conv_bias", "bias", "tie_embeddings", "residual_in_fp32"):
            if not isinstance(getattr(self, name), bool):  # a string such as "no" would count as true
                raise ValueError(f"MambaConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.dt_rank != "auto" and not _is_positive_int(self.dt_rank):
            raise ValueError(f"MambaConfig.dt_rank must be 'auto' or a positive integer, got {self.dt_rank!r}")
        if self.dt_init not in ("random", "constant"):
            raise ValueError(f"MambaConfig.dt_init must be 'random' or 'constant', got {self.dt_init!r}")
        for name in ("norm_epsilon", "dt_scale"):
            if not _is_positive_number(getattr(self, name)):
                raise ValueError(f"MambaConfig.{name} must be a positive number, got {getattr(self, name)!r}")
        check_dt_init(self)
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


# Three options of real use run through the mixer; none changes what it computes for one whole
# sequence, and training uses none of them (a first reading can skip the lines marked "option"):
#
#   cache           (conv_state, ssm_state) from an earlier call: continue from there, so that any
#                   split of a sequence into pieces gives the outputs and final states of one pass
#   seq_idx         (b, L) integers, non-decreasing along a row: packed sequences, each starting
#                   from a zero state where the index changes. In the scan that is the step dA = 0
#                   (reset), in the conv a tap that reads another sequence's input is zeroed
#                   (conv_keep). MambaLM.forward takes it; seq_idx_from_cu_seqlens converts the
#                   official varlen boundaries.
#   attention_mask  (b, L) of 0/1, left padding: the 0s are identity steps for the state (Δ = 0,
#                   so dA = 1 and dBx = 0) and zero inputs for the conv, so each row computes what
#                   it computes alone (the outputs at padded positions mean nothing)

def shifted_sum(x_pad, w, bias=None, keep=None):
    """The depthwise causal conv, out_t = Σ_k w_k·x_pad_{t+k} + bias: x_pad (b, d_conv-1+L, ED) is
    the d_conv-1 inputs before the first token, then the tokens; w (ED, d_conv); keep: conv_keep's
    (option). -> (b, L, ED): the conv as d_conv shifted multiply-adds."""
    width, L = w.shape[1], x_pad.shape[1] - w.shape[1] + 1

    def tap(k):  # the inputs d_conv-1-k tokens back, (b, L, ED)
        shifted = x_pad[:, k:k + L]
        return shifted if keep is None else shifted * keep[:, :, k, None]  # option: packed sequences

    out = tap(0) * w[:, 0] if bias is None else torch.addcmul(bias, tap(0), w[:, 0])
    for k in range(1, width):
        out = torch.addcmul(out, tap(k), w[:, k])  # (b, L, ED)
    return out


def conv_keep(seq_idx, width, dtype):
    """Option, packed sequences: seq_idx (b, L) -> keep (b, L, width) of `dtype` for shifted_sum: 0
    where tap k would read an input of another sequence (the inputs before the first token count
    as the first sequence's)."""
    L = seq_idx.shape[1]
    seq_pad = torch.cat([seq_idx[:, :1].expand(-1, width - 1), seq_idx], dim=1)  # (b, width-1+L)
    return torch.stack([seq_pad[:, k:k + L] == seq_idx for k in range(width)], dim=-1).to(dtype)


def conv_buffer_after(x_in, d_conv, dtype, conv_state=None, seq_idx=None):
    """The conv's buffer after x_in (b, L, ED): its last d_conv inputs (zeros before the first
    token, or conv_state's, continuing a cache; with seq_idx, zeros for earlier sequences), a fresh
    (b, ED, d_conv) tensor of `dtype`: a cache must not keep the prompt's activations alive."""
    x_in = x_in.transpose(1, 2)  # (b, ED, L)
    if conv_state is None:
        state = F.pad(x_in, (max(d_conv - x_in.shape[-1], 0), 0))[..., -d_conv:]  # (b, ED, d_conv)
    else:  # option: continuing a cache
        state = torch.cat([conv_state.to(x_in.dtype), x_in], dim=-1)[..., -d_conv:]  # (b, ED, d_conv)
    if seq_idx is not None:  # option: packed sequences
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

    scan_fn and conv_fn are section 2's selective scan and the conv above; mamba_engine.accelerate
    sets faster ones with the same arguments and results on a built model.
    """
    scan_fn = staticmethod(selective_scan_reference)
    conv_fn = staticmethod(shifted_sum)

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
        """The official init of Δ, A and D; the backbone calls it again after its generic init, which
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
        dt_low, B, C = self.x_proj(x).split([cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)  # (..., dt_rank), (..., N) x2
        # The bias is added in fp32 (the official delta_bias): next to a bias of -2 to -7 bf16's
        # spacing is 1/64 to 1/32, a large share of the data-dependent part's spread at init.
        dt_raw = _at_least_fp32(F.linear(dt_low, self.dt_proj.weight))  # (..., ED) before softplus
        delta = F.softplus(dt_raw + _at_least_fp32(self.dt_proj.bias))  # (..., ED) Δ > 0
        return delta, B, C

    def causal_conv(self, x, conv_state=None, seq_idx=None):
        """The depthwise causal conv (shifted_sum), x: (b, L, ED) -> (b, L, ED). conv_state, seq_idx:
        options (continuing a cache, packed sequences)."""
        width = self.conv1d.kernel_size[0]  # d_conv (other layers with a conv1d borrow this method)
        if conv_state is None:
            x_pad = F.pad(x, (0, 0, width - 1, 0))  # (b, d_conv-1+L, ED) zeros before the first token
        else:  # option: the buffer's last d_conv-1 inputs, all the conv needs before the first new token
            x_pad = torch.cat([conv_state[..., 1:].transpose(1, 2).to(x.dtype), x], dim=1)  # (b, d_conv-1+L, ED)
        keep = None if seq_idx is None else conv_keep(seq_idx, width, x.dtype)  # option: (b, L, d_conv)
        return self.conv_fn(x_pad, self.conv1d.weight[:, 0, :], self.conv1d.bias, keep)  # (b, L, ED)

    def forward(self, hidden, want_cache=False, cache=None, seq_idx=None, attention_mask=None):
        """hidden: (b, L, d_model) -> (b, L, d_model); with want_cache also the layer's cache
        (conv_state, ssm_state) for section 5. cache, seq_idx, attention_mask: the options above."""
        cfg = self.cfg
        conv_state, h0 = (None, None) if cache is None else cache  # option
        x_in, z = self.in_proj(hidden).chunk(2, dim=-1)  # (b, L, ED) each
        if attention_mask is not None:  # option, left padding: zeros into the conv ...
            x_in = x_in * attention_mask[..., None]
        x = F.silu(self.causal_conv(x_in, conv_state, seq_idx))  # (b, L, ED)
        delta, B, C = self._ssm_inputs(x)  # (b, L, ED), (b, L, N), (b, L, N)
        if attention_mask is not None:  # option ... and identity steps: Δ = 0 gives dA = 1, dBx = 0
            delta = delta * attention_mask[..., None]
        reset = None if seq_idx is None else F.pad(seq_idx.diff(dim=1) != 0, (1, 0))  # option: (b, L)
        y, h_last = self.scan_fn(x, delta, self.A, B, C, self.D, z, h0, reset=reset)  # (b, L, ED), (b, ED, N)
        out = self.out_proj(y.to(x.dtype))  # (b, L, d_model)
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

    def conv_step(self, conv_state, x):
        """causal_conv at one position: push x (b, ED) into the buffer of the last d_conv inputs,
        conv_state (b, ED, d_conv), in place. -> (b, ED)"""
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))  # drop the oldest input
        conv_state[:, :, -1] = x
        out = (conv_state * self.conv1d.weight[:, 0, :]).sum(-1)  # (b, ED)
        return out if self.conv1d.bias is None else out + self.conv1d.bias

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
# 4. The backbone
# ------------------------------------------------------------------------------------------------
# Mixers stacked as pre-norm residual blocks, with a final norm: a model of any sequence of
# d_model-vectors, (b, L, d_model) -> (b, L, d_model), such as audio frames or sensor readings.
# The language model of section 5 puts an embedding before it and a head after it.

class Block(nn.Module):
    """Pre-norm residual block: hidden = hidden + mixer(norm(hidden)), the residual stream in fp32
    (the official Block runs Add -> Norm -> Mixer, to fuse the add with the norm in one kernel: the
    same sums, grouped differently). With an mlp (the official configs' d_intermediate > 0, built
    by hybrid.py) a second sub-block follows: hidden = hidden + mlp(norm2(hidden))."""

    def __init__(self, cfg, mixer, mlp=None, norm_cls=RMSNorm):
        super().__init__()
        self.norm = norm_cls(cfg.d_model, cfg.norm_epsilon)
        self.mixer = mixer
        if mlp is not None:
            self.norm2 = norm_cls(cfg.d_model, cfg.norm_epsilon)
        self.mlp = mlp
        self.residual_in_fp32 = cfg.residual_in_fp32

    def _add(self, hidden, out):
        hidden = (_at_least_fp32(hidden) if self.residual_in_fp32 else hidden) + out
        return hidden if self.mlp is None else hidden + self.mlp(self.norm2(hidden))

    def forward(self, hidden, want_cache=False, **options):  # options: the mixer's cache, seq_idx, attention_mask
        out = self.mixer(self.norm(hidden), want_cache, **options)
        if want_cache:
            out, cache = out
            return self._add(hidden, out), cache
        return self._add(hidden, out)

    def step(self, hidden, cache):
        return self._add(hidden, self.mixer.step(self.norm(hidden), cache))


def _check_hidden(hidden, d_model, rank, cache, n_layer):
    """The backbone's input (b, L, d_model), or (b, d_model) for step, and a cache of one entry a layer."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != rank or hidden.shape[-1] != d_model \
            or not hidden.is_floating_point():
        got = f"{hidden.dtype} {tuple(hidden.shape)}" if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        shape = "(b, L, d_model)" if rank == 3 else "(b, d_model)"
        raise ValueError(f"the input must be a floating-point tensor of shape {shape} with d_model = {d_model}, "
                         f"got {got}")
    if (cache is not None or rank == 2) and (not isinstance(cache, (list, tuple)) or len(cache) != n_layer):
        raise ValueError(f"cache must hold one entry per layer ({n_layer}), as forward(..., want_cache=True) "
                         f"returns it")


class Mamba(nn.Module):
    """The backbone (`backbone` in the official tree, the official MixerModel without its embedding):
    n_layer blocks, then norm_f. forward: (b, L, d_model) -> (b, L, d_model), with want_cache also
    each layer's cache; step: one position (b, d_model) -> (b, d_model), the cache advanced in place.
    mixer_cls: the layer's mixer, MambaMixer or a later generation's."""

    def __init__(self, cfg, mixer_cls=MambaMixer, init=True):
        super().__init__()
        self.layers = nn.ModuleList(self.make_block(cfg, mixer_cls, i) for i in range(cfg.n_layer))
        self.norm_f = self.make_norm(cfg)
        if init:  # MambaLM calls it itself, after its embedding's draw
            self._init_weights(cfg.n_layer)

    def make_block(self, cfg, mixer_cls, i):  # hybrid.py builds other layers here
        return Block(cfg, mixer_cls(cfg))

    def make_norm(self, cfg):
        return RMSNorm(cfg.d_model, cfg.norm_epsilon)

    @torch.no_grad()
    def _init_weights(self, n_layer):
        """The official _init_weights (mixer_seq_simple.py): Linear biases zero, each out_proj (and an
        MLP's fc2) kaiming-uniform divided by sqrt(n_layer), so that the residual stream does not grow
        with depth; then the SSM parameters again, as the bias pass zeroed dt_proj's."""
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for layer in self.layers:
            for name, w in layer.named_parameters():
                if name in ("mixer.out_proj.weight", "mlp.fc2.weight"):
                    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
                    w /= math.sqrt(n_layer)
            if hasattr(layer.mixer, "reset_ssm_parameters"):
                layer.mixer.reset_ssm_parameters()

    def forward(self, hidden, want_cache=False, cache=None, **options):
        """hidden (b, L, d_model) -> (b, L, d_model), and with want_cache the cache: per layer its
        mixer's (conv_state, ssm_state). cache, options: section 3's options."""
        _check_hidden(hidden, self.norm_f.weight.shape[0], 3, cache, len(self.layers))
        new_cache = []
        for i, layer in enumerate(self.layers):
            layer_options = options if cache is None else dict(options, cache=cache[i])  # option
            if want_cache:
                hidden, layer_cache = layer(hidden, want_cache=True, **layer_options)
                new_cache.append(layer_cache)
            else:
                hidden = layer(hidden, **layer_options)  # (b, L, d_model)
        hidden = self.norm_f(hidden)
        return (hidden, new_cache) if want_cache else hidden

    def step(self, hidden, cache):
        """One position: hidden (b, d_model) -> (b, d_model); the cache advances in place."""
        _check_hidden(hidden, self.norm_f.weight.shape[0], 2, cache, len(self.layers))
        for layer, layer_cache in zip(self.layers, cache):
            hidden = layer.step(hidden, layer_cache)  # (b, d_model)
        return self.norm_f(hidden)


# ------------------------------------------------------------------------------------------------
# 5. The language model and recurrent inference
# ------------------------------------------------------------------------------------------------
# A Mamba layer's whole memory of the past is two small tensors: the conv's last d_conv inputs
# (b, ED, d_conv) and the SSM state (b, ED, N). So a token costs the same at position 10 and
# 10,000, unlike attention, whose KV cache grows. prefill reads the prompt in one pass, as training
# does, and returns these states; then each token is one `step` of every layer.
#
# First, what the LM's public methods check: bad input gets an error naming what was expected,
# before any work is done (a first reading can skip to MambaLM). Token values are read only where
# that costs no device sync: ids on the CPU, or once per prompt.

def _check_ids(input_ids, rank, vocab_size, read_values):
    shape = "(b, L) (batch, length)" if rank == 2 else "(b,) (batch)"
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != rank:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a tensor of shape {shape}, got {got}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids must not be empty, got shape {tuple(input_ids.shape)}")
    if read_values:
        lo, hi = int(input_ids.min()), int(input_ids.max())  # reads values: a device sync on a GPU
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size}), got min {lo} and max {hi}")


def _batched_by_vmap(t):
    """Whether torch.func.vmap batches t (a batched tensor has no single value to read)."""
    functorch = torch._C._functorch
    while isinstance(t, torch.Tensor) and functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def _cache_entry_name(spec):
    """How _check_cache names a layer's cache: "(conv_state, ssm_state) pair", or for an attention
    layer, whose step replaces tensors in it, "list [k, v, valid, conv_state]"."""
    names = ", ".join(name for name, *_ in spec)
    if any(None in shape for _, shape, *_ in spec):
        return f"list [{names}]"
    return f"({names}) {'pair' if len(spec) == 2 else 'tuple'}"


def _check_cache(model, cache, batch, written_in_place=False):
    """A cache must be prefill's for this model and batch: one entry per layer, each tensor of its
    layer's cache_spec (a None in a shape: an attention layer's tokens, any number). step writes
    into the fixed-size states, so there no two may share memory, and a growing entry is a list."""
    specs = [layer.mixer.cache_spec(batch) for layer in model.backbone.layers]
    entries = [_cache_entry_name(spec) for spec in specs]
    if not isinstance(cache, (list, tuple)) or len(cache) != len(specs):
        got = len(cache) if isinstance(cache, (list, tuple)) else type(cache).__name__
        what = f"{entries[0]}s" if len(set(entries)) == 1 else "entries (" + "; ".join(dict.fromkeys(entries)) + ")"
        raise ValueError(f"cache must be a list of {len(specs)} {what}, one per layer, as prefill returns it for "
                         f"this model; got {got}")
    owners, lists = [], {}  # (storage, first byte, end byte, whose); id of a growing entry -> its layer
    for i, (layer, entry, spec) in enumerate(zip(model.backbone.layers, cache, specs)):
        grows = [name for name, shape, *_ in spec if None in shape]
        if not isinstance(entry, (list, tuple)) or len(entry) != len(spec) or (
                written_in_place and grows and not isinstance(entry, list)):
            raise ValueError(f"cache[{i}] must be a {entries[i]}, as prefill returns it for this model"
                             + (f" (step replaces its {', '.join(grows)})" if grows else ""))
        if written_in_place and grows:
            if id(entry) in lists:  # [entry] * n_layer: step would append every layer's token to one list
                raise ValueError(f"cache[{i}] is the same list as cache[{lists[id(entry)]}]; each layer needs a "
                                 f"list of its own, as prefill returns them")
            lists[id(entry)] = i
        device, tokens = next(layer.mixer.parameters()).device, set()
        for t, (name, shape, dims, dtype) in zip(entry, spec):
            if not isinstance(t, torch.Tensor) or t.dim() != len(shape) or any(
                    s is not None and s != size for s, size in zip(shape, t.shape)):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                wanted = "(" + ", ".join("T" if s is None else str(s) for s in shape) + ")"
                raise ValueError(f"cache[{i}] {name} must have shape {wanted} ({dims}) for a batch of "
                                 f"{batch}, got {got}")
            if t.dtype != dtype or t.device != device:
                raise ValueError(f"cache[{i}] {name} must be {dtype} on {device} (as prefill makes it for "
                                 f"this model), got {t.dtype} on {t.device}")
            if None in shape:
                tokens.add(t.shape[shape.index(None)])
            elif written_in_place:
                if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
                    raise ValueError(f"cache[{i}] {name} repeats one row in memory (an expand()ed tensor); "
                                     f"give it memory of its own, e.g. with .clone()")
                extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0) + 1
                first = t.storage_offset() * t.element_size()
                span = (t.untyped_storage().data_ptr(), first, first + extent * t.element_size())
                for storage, start, end, owner in owners:
                    if span[0] == storage and span[1] < end and start < span[2]:
                        raise ValueError(f"cache[{i}] {name} shares its memory with {owner}; each state needs "
                                         f"memory of its own ([pair] * n_layer repeats one pair; views of one "
                                         f"buffer overlap): give it its own, e.g. with .clone()")
                owners.append((*span, f"cache[{i}] {name}"))
        if len(tokens) > 1 or 0 in tokens:
            raise ValueError(f"cache[{i}] {', '.join(grows)} must hold the same number of tokens, at least one")


def _check_options(model, input_ids, cache, seq_idx, attention_mask, read_values):
    """forward's options, checked against input_ids (b, L); returns the mixers' keyword arguments:
    seq_idx as int64, the mask as bool (b, L), None left out."""
    b, L = input_ids.shape
    options = {}
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
            raise ValueError("seq_idx must be non-decreasing along each row (packed sequences, one after another)")
        options["seq_idx"] = seq_idx.long()
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, L) \
                or attention_mask.is_floating_point() or attention_mask.device != input_ids.device:
            got = (f"{tuple(attention_mask.shape)} {attention_mask.dtype} on {attention_mask.device}"
                   if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__)
            raise ValueError(f"attention_mask must be a bool or integer tensor of shape ({b}, {L}) like input_ids, "
                             f"on {input_ids.device}, got {got}")
        mask = attention_mask.long()
        if read_values and (((mask != 0) & (mask != 1)).any() or (mask.diff(dim=1) < 0).any()
                            or (mask[:, -1] != 1).any()):
            raise ValueError("attention_mask must be left padding: each row 0s (padding) then 1s (tokens), "
                             "ending with a token")
        if read_values and cache is not None and (mask == 0).any():
            raise ValueError("attention_mask with a cache must be all ones: padding would sit between the "
                             "cache and the new tokens")
        options["attention_mask"] = mask.bool()
    return options


def _check_sampling(temperature, top_k, top_p):
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 <= temperature < math.inf:  # also refuses NaN
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and not _is_positive_int(top_k):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")


# Sampling: a distribution over the next token from the last logits.

def top_k_top_p(logits, top_k=None, top_p=None):
    """logits (b, V) -> (b, V) with -inf outside the top_k tokens and outside the smallest set whose
    probabilities sum to at least top_p."""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        drop[:, 0] = False  # the likeliest token stays, however small top_p (0 in fp32: all would go)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def _sample(logits, temperature, top_k, top_p, generator):
    """logits (b, V) -> token ids (b,), the arguments checked already (by sample_next below, or by
    generate once for all its tokens)."""
    if temperature < torch.finfo(torch.float32).tiny or top_k == 1:  # 0, or 0 once in fp32: greedy
        return logits.argmax(-1)
    # the largest logit moved to 0 first: a tiny temperature then sends the others to -inf, never
    # the largest to inf (inf - inf would be NaN)
    logits = logits.float()
    logits = top_k_top_p((logits - logits.max(-1, keepdim=True).values) / temperature, top_k, top_p)  # (b, V)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """logits (b, V) -> token ids (b,). Greedy for temperature 0 or top_k 1."""
    _check_sampling(temperature, top_k, top_p)
    return _sample(logits, temperature, top_k, top_p, generator)


def piece_of_packed_row(seq_idx, cache):
    """Option: a piece of a packed row. seq_idx (b, L + 1), whose column 0 is the document of the
    cache's last token -> the piece's seq_idx (b, L) and the cache to continue, emptied (zeros) in
    the rows whose first token starts another document. A packed row s cut at k continues with
    model(ids[:, k:], cache=c, seq_idx=s[:, k - 1:])."""
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


class MambaLM(nn.Module):
    """Language model with the official MambaLMHeadModel's module tree: backbone.embedding,
    backbone.layers.{i}.norm, backbone.layers.{i}.mixer.*, backbone.norm_f, lm_head."""
    backbone_cls = Mamba  # hybrid.py's HybridMamba builds attention and MLP layers too

    def __init__(self, cfg, mixer_cls=MambaMixer):
        super().__init__()
        self.cfg = cfg
        embedding = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)  # no padding_idx
        self.backbone = self.backbone_cls(cfg, mixer_cls, init=False)
        self.backbone.embedding = embedding
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = embedding.weight
        # the official init, the embedding N(0, 0.02) first: a seed gives the same weights whatever the
        # backbone's class
        with torch.no_grad():
            nn.init.normal_(embedding.weight, std=0.02)
        self.backbone._init_weights(cfg.n_layer)

    def optim_groups(self, weight_decay):
        """AdamW parameter groups: matrices decay; A_log (decay would pull every A towards -1), D,
        norms and biases do not. Tied weights appear once."""
        params = [(name, p) for name, p in self.named_parameters() if p.requires_grad]
        exempt = [p.dim() < 2 or name.endswith("A_log") for name, p in params]
        return [{"params": [p for (_, p), e in zip(params, exempt) if not e], "weight_decay": weight_decay},
                {"params": [p for (_, p), e in zip(params, exempt) if e], "weight_decay": 0.0}]

    def forward(self, input_ids, want_cache=False, cache=None, seq_idx=None, attention_mask=None):
        """input_ids: (b, L) -> logits (b, L, V); with want_cache also the inference cache.
        cache, seq_idx, attention_mask: section 3's options, None in training."""
        # values are read on CPU ids or once per prompt; not while torch.compile traces (a read would
        # cut the graph in two), nor under torch.func.vmap
        read_values = isinstance(input_ids, torch.Tensor) and (want_cache or input_ids.device.type == "cpu") \
            and not torch.compiler.is_compiling() \
            and not any(_batched_by_vmap(t) for t in (input_ids, seq_idx, attention_mask))
        _check_ids(input_ids, 2, self.cfg.vocab_size, read_values)
        options = {}
        if cache is not None or seq_idx is not None or attention_mask is not None:  # options
            options = _check_options(self, input_ids, cache, seq_idx, attention_mask, read_values)
            if seq_idx is not None and seq_idx.shape[1] == input_ids.shape[1] + 1:
                options["seq_idx"], cache = piece_of_packed_row(options["seq_idx"], cache)
        hidden = self.backbone.embedding(input_ids)  # (b, L, d_model)
        out = self.backbone(hidden, want_cache, cache, **options)
        hidden, new_cache = out if want_cache else (out, None)  # (b, L, d_model)
        logits = self.lm_head(hidden)  # (b, L, V)
        return (logits, new_cache) if want_cache else logits

    @torch.no_grad()
    def prefill(self, input_ids, cache=None, attention_mask=None):
        """input_ids (b, L) -> (logits (b, L, V), cache: per layer (conv_state, ssm_state)).
        cache, attention_mask: section 3's options."""
        return self.forward(input_ids, want_cache=True, cache=cache, attention_mask=attention_mask)

    @torch.no_grad()
    def step(self, token_ids, cache):
        """token_ids (b,) -> logits (b, V); advances the cache in place, O(1) in the position."""
        _check_ids(token_ids, 1, self.cfg.vocab_size, token_ids.device.type == "cpu")
        _check_cache(self, cache, token_ids.shape[0], written_in_place=True)
        return self._step(token_ids, cache)

    def _step(self, token_ids, cache):  # mamba_engine.compile_decode compiles this one
        hidden = self.backbone.embedding(token_ids)  # (b, d_model)
        return self.lm_head(self.backbone.step(hidden, cache))  # (b, V)

    @torch.no_grad()
    def generate_stream(self, input_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                        generator=None, attention_mask=None):
        """Yield (b,) tensors of new token ids, one per step: prefill, then O(1) steps.
        attention_mask: prompts of different lengths, left-padded (section 3's option)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        _check_sampling(temperature, top_k, top_p)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if max_new_tokens == 0:
            if attention_mask is not None:  # no prefill checks the prompt and its mask
                _check_ids(input_ids, 2, self.cfg.vocab_size, False)
                _check_options(self, input_ids, None, None, attention_mask, True)
            return
        logits, cache = self.prefill(input_ids, attention_mask=attention_mask)
        logits = logits[:, -1]  # (b, V)
        for i in range(max_new_tokens):
            token = _sample(logits[:, :self.cfg.vocab_size], temperature, top_k, top_p, generator)  # (b,)
            yield token
            if i + 1 < max_new_tokens:
                logits = self._step(token, cache)  # a sampled token, prefill's cache: nothing to check

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 generator=None, attention_mask=None):
        """input_ids (b, L) -> (b, L + max_new_tokens); top_k=1 or temperature=0 is greedy."""
        new = list(self.generate_stream(input_ids, max_new_tokens, temperature, top_k, top_p, generator,
                                        attention_mask))
        return torch.cat([input_ids] + [t.unsqueeze(1) for t in new], dim=1)
