"""
hybrid.py: the official MambaLMHeadModel's other layers, for every generation: a gated MLP after
each mixer, multi-head attention in place of some mixers, LayerNorm instead of RMSNorm. Built on
mamba_minimal.py's Block and backbone, which import nothing of this file: HybridMamba is the backbone
whose make_block and make_norm read four config fields, d_intermediate, attn_layer_idx, attn_cfg
and rms_norm. It imports torch and mamba_minimal.py (with pscan.py under it) only.

    1. The layers                 the four fields; GatedMLP, LayerNorm, the rotary embedding, MHA
                                  and its KV cache, as the official modules compute them
    2. The settings and checks    attn_cfg over the official MHA's defaults, the four fields checked
    3. The hybrid backbone and LM HybridMambaConfig (MambaConfig plus the four fields), HybridMamba
                                  (the backbone that builds those layers), HybridMambaLM

    model = HybridMambaLM(HybridMambaConfig(d_model=256, n_layer=4, vocab_size=65, d_intermediate=512,
                                            attn_layer_idx=[2], attn_cfg=dict(num_heads=4, causal=True)))

Mamba2Config and Mamba3Config carry the four fields too, and Mamba2LM and Mamba3LM run on
HybridMamba. pretrained.py loads the official hybrid checkpoints (mamba2attn-2.7b,
transformerpp-2.7b, the Mamba-3 checkpoints with their MLPs) into these classes.
"""

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from mamba_minimal import (Block, Mamba, MambaConfig, MambaLM, MambaMixer, RMSNorm, _at_least_fp32,
                           _is_positive_int, _is_positive_number, conv_buffer_after, shifted_sum)

# ------------------------------------------------------------------------------------------------
# 1. The layers
# ------------------------------------------------------------------------------------------------
# Four fields of the official MambaLMHeadModel's config (mamba_ssm/models/config_mamba.py; create_block
# in models/mixer_seq_simple.py) change the blocks, in every generation:
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
# O(context) memory, where a mixer's state has a fixed size (mamba_minimal.py section 5). The cache is a list
# [k, v, valid] (+ conv_state with d_conv): the keys, already rotated, and the values of every token
# read, (b, T, H_kv, head_dim), and valid (b, T), the slots that the next token may see. A tensor
# cannot grow in place, so step replaces k, v and valid in the list with tensors one slot longer;
# that is why the entry is a list where the mixers' are tuples. The copy moves about as many bytes
# as the attention reads from the cache anyway (the official code preallocates max_seqlen slots).
#
# The mixers' options (mamba_minimal.py section 3: a cache, seq_idx, attention_mask), in attention's
# terms. Which keys a token sees is one boolean mask: key s is seen by the token in slot t when s ≤ t,
# s is no padding, and s lies in the token's own document (seq_idx). A token's position is the number
# of keys it sees, minus one (itself), so positions restart at every document's first token and start
# at each row's first real token. Under left padding a padded query sees no real key: it attends to
# itself alone (a softmax over no key is not a number in some kernels, and 0·NaN would reach the real
# tokens) and its output means nothing, as a mixer's output at a padded position does. Continuing a
# cache, its valid slots belong to the first document of the new tokens; after a forward over packed
# documents, valid marks the last document's tokens only, so that the next token continues that
# document alone.
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
    cfg.attn_layer_idx, with the settings of cfg.attn_cfg (official names and defaults: attn_settings,
    section 2). It takes and returns what a mixer does; its cache is the KV cache above."""

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
        # forward-mode AD (torch.func.jvp): only the plain-ops kernel has a rule for it
        attention = torch.nn.attention
        math_only = not torch.compiler.is_compiling() and torch.autograd.forward_ad._current_level >= 0
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
        (, conv_state)]. cache, seq_idx, attention_mask: as the mixers take them (mamba_minimal.py
        section 3)."""
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

    # the depthwise causal conv and its one-token form on the rolling buffer, as in the mixers, over
    # shifted_sum always (mamba_engine.accelerate swaps the conv of MambaMixers only)
    causal_conv = MambaMixer.causal_conv
    conv_fn = staticmethod(shifted_sum)
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
# 2. The settings and checks
# ------------------------------------------------------------------------------------------------
# attn_cfg holds the official MHA's arguments; those it leaves out take the official defaults.
# Every field is checked when a config is made, and attn_cfg only where an attention layer reads it.

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


def _check_hybrid_fields(cfg):
    """The four fields of section 1, in every generation's config; attn_cfg's settings only where an
    attention layer reads them (_check_attn_cfg)."""
    name = type(cfg).__name__
    if not _is_count(cfg.d_intermediate):
        raise ValueError(f"{name}.d_intermediate must be an integer >= 0 (0: no MLP), got {cfg.d_intermediate!r}")
    if not isinstance(cfg.rms_norm, bool):
        raise ValueError(f"{name}.rms_norm must be True (RMSNorm) or False (LayerNorm), got {cfg.rms_norm!r}")
    idx = cfg.attn_layer_idx
    if not isinstance(idx, (list, tuple)) or not all(_is_count(i) and i < cfg.n_layer for i in idx) \
            or len(set(idx)) != len(idx):
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


# ------------------------------------------------------------------------------------------------
# 3. The hybrid backbone and LM
# ------------------------------------------------------------------------------------------------

@dataclass
class HybridMambaConfig(MambaConfig):
    """MambaConfig and the official MambaLMHeadModel's four block fields (section 1)."""
    d_intermediate: int = 0
    attn_layer_idx: list = field(default_factory=list)
    attn_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True

    def __post_init__(self):
        super().__post_init__()
        _check_hybrid_fields(self)


class HybridMamba(Mamba):
    """The backbone with attention in cfg.attn_layer_idx's layers, a GatedMLP after each layer when
    cfg.d_intermediate > 0, LayerNorm when not cfg.rms_norm; the official create_block."""

    def make_norm(self, cfg):
        return (RMSNorm if cfg.rms_norm else LayerNorm)(cfg.d_model, cfg.norm_epsilon)

    def make_block(self, cfg, mixer_cls, i):
        mixer = MHA(cfg) if i in cfg.attn_layer_idx else mixer_cls(cfg)
        mlp = GatedMLP(cfg) if cfg.d_intermediate > 0 else None
        return Block(cfg, mixer, mlp, RMSNorm if cfg.rms_norm else LayerNorm)


class HybridMambaLM(MambaLM):
    """MambaLM over HybridMamba: a HybridMambaConfig's model."""
    backbone_cls = HybridMamba
