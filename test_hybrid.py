"""Specification of the hybrid models of the official MambaLMHeadModel config, for every generation:
a GatedMLP sub-block after each mixer (d_intermediate > 0), attention layers in place of the mixer
(attn_layer_idx, attn_cfg) and LayerNorm blocks (rms_norm false).

The oracle is a float64 model written here from the official equations (state-spaces/mamba at
e9594ce: mamba_ssm/models/mixer_seq_simple.py, modules/block.py, modules/mlp.py, modules/mha.py;
flash_attn's RotaryEmbedding, flash_attn/layers/rotary.py): its own norms, MLP, rotary embedding and
attention with an explicit causal mask, one sequence at a time. Its SSM layers run the library's
mixers on their own, which test_model.py, test_mamba2.py and test_mamba3.py check against float64
loops of their own. The checkpoints are folders in the official layout that the tests write key by
key from those files. Packed documents, left-padded rows and caches are checked as test_use.py checks
them: against each document, each row and the whole sequence run alone."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import hybrid
import mamba2_minimal as m2
import mamba3_minimal as m3
import mamba_engine
import mamba_minimal as mm
import pretrained
from test_use import (CHUNK, DOC_LENGTHS, PROMPT_LENGTHS, VOCAB, assert_jvp_equals_central_differences,
                      embedding_gradients, left_padded, packed_row, random_split)

def difference(got, expected):
    """The largest absolute difference between two tensors or two (nested) caches, as test_use.py's
    max_difference; bool tensors (a KV cache's valid) are equal (0) or not (inf)."""
    if isinstance(got, torch.Tensor):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        if got.dtype == torch.bool:
            return 0.0 if torch.equal(got, expected) else math.inf
        return (got - expected).abs().max().item() if got.numel() else 0.0
    assert len(got) == len(expected)
    return max((difference(g, e) for g, e in zip(got, expected)), default=0.0)


# ------------------------------------------------------------------------------------------------
# The configs: each generation's mixer, with two hybrid layouts
# ------------------------------------------------------------------------------------------------

def mamba1_lm(cfg):
    """Mamba-1's LM for a config from pretrained.config_from_dict: HybridMambaLM where the config has
    the hybrid fields (a HybridMambaConfig), MambaLM where it has none, as pretrained.load builds them."""
    return (hybrid.HybridMambaLM if isinstance(cfg, hybrid.HybridMambaConfig) else mm.MambaLM)(cfg)


GENERATIONS = {  # LM class (or builder), config_from_dict, d_model, ssm_cfg
    "mamba1": (mamba1_lm, pretrained.config_from_dict, 16, {"d_state": 4}),
    "mamba2": (m2.Mamba2LM, pretrained.mamba2_config_from_dict, 32,
               {"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": 2, "chunk_size": CHUNK}),
    "mamba3": (m3.Mamba3LM, pretrained.mamba3_config_from_dict, 16,
               {"layer": "Mamba3", "d_state": 8, "headdim": 8, "ngroups": 2, "chunk_size": CHUNK}),
}
LM_CLASS = {"mamba1": mm.MambaLM, "mamba2": m2.Mamba2LM, "mamba3": m3.Mamba3LM}  # pretrained.load's cls


def layout(name, d_model):
    """The hybrid fields of a config.json. "gqa_conv": one attention layer in the middle, GQA (2 query
    heads per key), an explicit head_dim, partial rotary (4 of 6 dims, halves paired), the conv over
    qkv, mlp_dim (rounded up to 256), biases, RMSNorm blocks. "mqa_layernorm": attention first and
    last, one key head for all (MQA), head_dim from d_model, full interleaved rotary, softmax_scale,
    no conv, no mlp_dim, no biases, an MLP whose width is rounded up from 130 to 256, LayerNorm."""
    if name == "gqa_conv":
        return dict(d_intermediate=24, attn_layer_idx=[1], rms_norm=True,
                    attn_cfg=dict(num_heads=4, num_heads_kv=2, head_dim=6, rotary_emb_dim=4, rotary_emb_base=100.0,
                                  d_conv=3, mlp_dim=40, qkv_proj_bias=True, out_proj_bias=True, causal=True))
    return dict(d_intermediate=130, attn_layer_idx=[0, 2], rms_norm=False,
                attn_cfg=dict(num_heads=4, num_heads_kv=1, rotary_emb_dim=d_model // 4, rotary_emb_interleaved=True,
                              softmax_scale=0.3, qkv_proj_bias=False, out_proj_bias=False, causal=True))


LAYOUTS = ("gqa_conv", "mqa_layernorm")
CASES = [(g, name) for g in GENERATIONS for name in LAYOUTS]


def official_config(generation, layout_name):
    _, _, d_model, ssm_cfg = GENERATIONS[generation]
    return dict(d_model=d_model, n_layer=3, vocab_size=VOCAB, ssm_cfg=dict(ssm_cfg), residual_in_fp32=True,
                fused_add_norm=True, pad_vocab_size_multiple=8, tie_embeddings=True, **layout(layout_name, d_model))


# ------------------------------------------------------------------------------------------------
# The official layout, written key by key
# ------------------------------------------------------------------------------------------------

def attention_sizes(config):
    """The official MHA's sizes (mha.py): heads, key heads, head_dim, the qkv width, mlp_dim rounded up."""
    a, d_model = config["attn_cfg"], config["d_model"]
    H = a["num_heads"]
    Hkv = a.get("num_heads_kv") or H
    d = a.get("head_dim") or d_model // H
    return H, Hkv, d, d * (H + 2 * Hkv), math.ceil(a.get("mlp_dim", 0) / 256) * 256


def mlp_hidden(config):
    """GatedMLP's hidden width (mlp.py): d_intermediate rounded up to a multiple of 128."""
    return (config["d_intermediate"] + 127) // 128 * 128


def pure_mixers(generation, config):
    """The library's model of this generation without attention or MLP, off its init values: the
    oracle runs its mixers, and the checkpoint holds their tensors. Every value is a float32 number
    (a model is built in float32 and loads the checkpoint before it is cast to float64)."""
    cls, from_dict, _, _ = GENERATIONS[generation]
    pure = dict(config, d_intermediate=0, attn_layer_idx=[], attn_cfg={}, rms_norm=True)
    model = cls(from_dict(pure)).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.double()


def official_state_dict(generation, config, seed=0):
    """Every tensor of the official MambaLMHeadModel for config, under the names and shapes that
    mixer_seq_simple.py, block.py, mlp.py and mha.py give them, with random float32 values in float64; the
    mixers' tensors come from pure_mixers. Returns the state dict and the pure model."""
    g = torch.Generator().manual_seed(seed)
    D = config["d_model"]
    V = (config["vocab_size"] + 7) // 8 * 8

    def rand(*shape, scale=1.0, mean=0.0):  # float32 numbers, as float64 tensors
        return (mean + scale * torch.randn(*shape, generator=g)).double()

    pure = pure_mixers(generation, config)
    sd = {"backbone.embedding.weight": rand(V, D)}

    def norm(prefix):
        sd[prefix + ".weight"] = rand(D, scale=0.2, mean=1.0)
        if not config["rms_norm"]:  # nn.LayerNorm has a bias
            sd[prefix + ".bias"] = rand(D, scale=0.2)

    a = config["attn_cfg"]
    for i in range(config["n_layer"]):
        p = f"backbone.layers.{i}."
        norm(p + "norm")
        if i in config["attn_layer_idx"]:
            H, Hkv, d, qkv, mlp = attention_sizes(config)
            sd[p + "mixer.in_proj.weight"] = rand(qkv + mlp, D, scale=D ** -0.5)
            if a.get("qkv_proj_bias", True):
                sd[p + "mixer.in_proj.bias"] = rand(qkv + mlp, scale=0.2)
            if a.get("d_conv", 0):
                sd[p + "mixer.conv1d.weight"] = rand(qkv, 1, a["d_conv"], scale=0.6)
                sd[p + "mixer.conv1d.bias"] = rand(qkv, scale=0.2)
            sd[p + "mixer.out_proj.weight"] = rand(D, H * d + mlp // 2, scale=(H * d + mlp // 2) ** -0.5)
            if a.get("out_proj_bias", True):
                sd[p + "mixer.out_proj.bias"] = rand(D, scale=0.2)
        else:
            for k, v in pure.backbone.layers[i].mixer.state_dict().items():
                sd[p + "mixer." + k] = v.clone()
        if config["d_intermediate"]:
            norm(p + "norm2")
            hidden = mlp_hidden(config)
            sd[p + "mlp.fc1.weight"] = rand(2 * hidden, D, scale=D ** -0.5)
            sd[p + "mlp.fc2.weight"] = rand(D, hidden, scale=hidden ** -0.5)
    norm("backbone.norm_f")
    sd["lm_head.weight"] = sd["backbone.embedding.weight"]  # tied, as the official state_dict holds it
    return sd, pure


def write_official_folder(folder, config, sd):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(sd, folder / "pytorch_model.bin")
    return str(folder)


def hybrid_model(tmp_path, generation, layout_name, accelerated=True):
    """The library's model loaded from an official-layout folder, the state dict written there, the
    config and the pure model whose mixers the oracle runs. A Mamba-1 model runs mamba_engine.py's
    scan and conv (accelerate, as the trainer runs it), or with accelerated=False the lesson's code
    as mamba_minimal.py writes it."""
    config = official_config(generation, layout_name)
    sd, pure = official_state_dict(generation, config)
    folder = write_official_folder(tmp_path / f"{generation}_{layout_name}", config, sd)
    model = pretrained.load(folder, dtype=torch.float64, cls=LM_CLASS[generation])
    if generation == "mamba1" and accelerated:
        mamba_engine.accelerate(model)
    return model, sd, config, pure


# ------------------------------------------------------------------------------------------------
# The oracle: the official equations, one sequence at a time, in float64
# ------------------------------------------------------------------------------------------------

def rms_norm(x, w, eps=1e-5):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layer_norm(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)  # biased, as nn.LayerNorm
    return (x - mean) / torch.sqrt(var + eps) * w + b


def rotary(x, positions, dim, base, interleaved):
    """RoFormer's rotation as flash_attn's RotaryEmbedding applies it: pair j < dim/2 of every head
    turns by positions·base^(-2j/dim); the pairs are entries (j, j + dim/2), or (2j, 2j + 1) when
    interleaved; entries from dim on stay. x (L, heads, head_dim), positions (L,)."""
    out = x.clone()
    for j in range(dim // 2):
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + dim // 2)
        angle = positions.double() * base ** (-2 * j / dim)  # (L,)
        cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        out[:, :, a] = x[:, :, a] * cos - x[:, :, b] * sin
        out[:, :, b] = x[:, :, b] * cos + x[:, :, a] * sin
    return out


def attention(u, sd, p, config):
    """The official MHA (mha.py) on one sequence u (L, d_model), causal, at positions 0..L-1."""
    a = config["attn_cfg"]
    H, Hkv, d, qkv_dim, mlp = attention_sizes(config)
    L = u.shape[0]
    zx = u @ sd[p + "in_proj.weight"].T
    if p + "in_proj.bias" in sd:
        zx = zx + sd[p + "in_proj.bias"]
    qkv, m = zx[:, :qkv_dim], zx[:, qkv_dim:]
    if a.get("d_conv", 0):  # depthwise and causal over qkv, with a bias, no activation
        w, width = sd[p + "conv1d.weight"][:, 0], a["d_conv"]
        conv = sd[p + "conv1d.bias"].expand(L, -1).clone()
        for t in range(L):
            for k in range(width):
                s = t - width + 1 + k
                if s >= 0:
                    conv[t] += w[:, k] * qkv[s]
        qkv = conv
    q = qkv[:, :H * d].reshape(L, H, d)
    k = qkv[:, H * d:(H + Hkv) * d].reshape(L, Hkv, d)
    v = qkv[:, (H + Hkv) * d:].reshape(L, Hkv, d)
    dim = a.get("rotary_emb_dim", 0)
    if dim:
        base, interleaved = a.get("rotary_emb_base", 10000.0), a.get("rotary_emb_interleaved", False)
        positions = torch.arange(L)
        q, k = rotary(q, positions, dim, base, interleaved), rotary(k, positions, dim, base, interleaved)
    scale = a.get("softmax_scale") or d ** -0.5
    future = torch.ones(L, L, dtype=torch.bool).triu(1)  # key j > query i
    out = torch.zeros(L, H, d, dtype=u.dtype)
    for h in range(H):
        kv_head = h // (H // Hkv)  # GQA: consecutive query heads share a key head
        scores = (q[:, h] @ k[:, kv_head].T * scale).masked_fill(future, -math.inf)  # (L, L)
        out[:, h] = scores.softmax(-1) @ v[:, kv_head]
    context = out.reshape(L, H * d)
    if mlp:
        up, gate = m.chunk(2, dim=-1)
        context = torch.cat([context, up * F.silu(gate)], dim=-1)
    y = context @ sd[p + "out_proj.weight"].T
    return y + sd[p + "out_proj.bias"] if p + "out_proj.bias" in sd else y


def gated_mlp(x, sd, p):
    """The official GatedMLP (mlp.py): fc1, split into y and gate, y·SiLU(gate), fc2."""
    y, gate = (x @ sd[p + "fc1.weight"].T).chunk(2, dim=-1)
    return (y * F.silu(gate)) @ sd[p + "fc2.weight"].T


def oracle_logits(ids, sd, config, pure):
    """ids (L,) -> logits (L, padded vocab): the official Block (block.py) without its fused kernel,
    h = h + mixer(norm(h)), then h = h + mlp(norm2(h)) when d_intermediate > 0."""
    def norm(x, prefix):
        if config["rms_norm"]:
            return rms_norm(x, sd[prefix + ".weight"])
        return layer_norm(x, sd[prefix + ".weight"], sd[prefix + ".bias"])

    h = sd["backbone.embedding.weight"][ids]  # (L, d_model)
    for i in range(config["n_layer"]):
        p = f"backbone.layers.{i}."
        if i in config["attn_layer_idx"]:
            h = h + attention(norm(h, p + "norm"), sd, p + "mixer.", config)
        else:
            with torch.no_grad():
                h = h + pure.backbone.layers[i].mixer(norm(h, p + "norm")[None])[0]
        if config["d_intermediate"]:
            h = h + gated_mlp(norm(h, p + "norm2"), sd, p + "mlp.")
    return norm(h, "backbone.norm_f") @ sd["lm_head.weight"].T


# ------------------------------------------------------------------------------------------------
# 1. An official hybrid checkpoint loads strictly and computes the official equations
# ------------------------------------------------------------------------------------------------

AS_BUILT = [("mamba1", name, False) for name in LAYOUTS]  # not accelerated: mamba_minimal.py's sections 2 and 3


@pytest.mark.parametrize("generation,layout_name,accelerated", [(*case, True) for case in CASES] + AS_BUILT)
def test_a_hybrid_checkpoint_loads_strictly_and_equals_the_float64_oracle(tmp_path, generation, layout_name,
                                                                          accelerated):
    model, sd, config, pure = hybrid_model(tmp_path, generation, layout_name, accelerated)
    assert set(model.state_dict()) == set(sd)
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        logits = model(ids)
    for row in range(2):
        assert difference(logits[row], oracle_logits(ids[row], sd, config, pure)) < 1e-10


def test_rotary_turns_the_pairs_of_the_official_convention():
    """The library's rotary against the loop above, for both pairings, a partial and a full dim,
    one position per row."""
    x = torch.randn(2, 7, 3, 10, dtype=torch.float64)
    positions = torch.randint(0, 50, (2, 7))
    for dim, interleaved in ((10, False), (10, True), (6, False), (4, True)):
        got = hybrid.apply_rotary(x, positions, dim, 500.0, interleaved)
        for row in range(2):
            assert difference(got[row], rotary(x[row], positions[row], dim, 500.0, interleaved)) < 1e-12


def test_rotary_turns_a_bf16_input_by_fp32_angles():
    """bf16 keeps 8 significant bits: a position of 1001 would round to 1000 and its angle be off
    by a radian. The angles and the turn are computed in fp32, only the result is rounded to bf16."""
    x = torch.randn(2, 4, 3, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64).bfloat16()
    positions = torch.tensor([[1001, 2003, 4097, 30001], [3, 517, 1023, 8191]])
    got = hybrid.apply_rotary(x, positions, 8, 10000.0, False)
    assert got.dtype == torch.bfloat16
    for row in range(2):  # the oracle turns the same bf16 numbers in float64
        expected = rotary(x[row].double(), positions[row], 8, 10000.0, False)
        assert difference(got[row].double(), expected) < 2 ** -6 * expected.abs().max().item()


def test_the_mlp_width_is_d_intermediate_rounded_up_to_a_multiple_of_128():
    # the official GatedMLP: (hidden + multiple_of - 1) // multiple_of * multiple_of, multiple_of 128;
    # a width that already is a multiple stays as it is
    for d_intermediate, hidden in ((1, 128), (127, 128), (128, 128), (129, 256), (256, 256), (300, 384)):
        assert hybrid.gated_mlp_hidden(d_intermediate) == hidden, d_intermediate
    model = hybrid.HybridMambaLM(hybrid.HybridMambaConfig(d_model=16, n_layer=1, vocab_size=VOCAB, d_state=4,
                                                          d_intermediate=256))
    mlp = model.backbone.layers[0].mlp
    assert mlp.fc1.weight.shape == (512, 16) and mlp.fc2.weight.shape == (16, 256)


def test_layernorm_blocks_use_the_configs_epsilon():
    # norm_epsilon reaches every LayerNorm, as it reaches RMSNorm: at 0.5 the two differ visibly
    # from the default 1e-5 on inputs of variance about 0.1
    model = hybrid.HybridMambaLM(hybrid.HybridMambaConfig(d_model=16, n_layer=1, vocab_size=VOCAB, d_state=4,
                                                          rms_norm=False, d_intermediate=8, norm_epsilon=0.5)).double()
    g = torch.Generator().manual_seed(0)
    x = 0.3 * torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    w, b = torch.randn(16, generator=g, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64)
    for norm in (model.backbone.layers[0].norm, model.backbone.layers[0].norm2, model.backbone.norm_f):
        with torch.no_grad():
            norm.weight.copy_(w)
            norm.bias.copy_(b)
            assert difference(norm(x), layer_norm(x, w, b, eps=0.5)) < 1e-12


def test_a_checkpoint_missing_the_mlp_or_the_attention_bias_is_refused(tmp_path):
    config = official_config("mamba2", "gqa_conv")
    sd, _ = official_state_dict("mamba2", config)
    for key in ("backbone.layers.1.mixer.in_proj.bias", "backbone.layers.2.mlp.fc2.weight",
                "backbone.layers.0.norm2.weight"):
        partial = {k: v for k, v in sd.items() if k != key}
        with pytest.raises(ValueError, match=rf"missing \['{key}'\]"):
            pretrained.load(write_official_folder(tmp_path / key, config, partial), cls=m2.Mamba2LM)


# ------------------------------------------------------------------------------------------------
# 2. Recurrent inference: the KV cache of the attention layers
# ------------------------------------------------------------------------------------------------

def attention_entries(model, cache):
    return [cache[i] for i in model.cfg.attn_layer_idx]


@pytest.mark.parametrize("generation,layout_name", CASES)
def test_prefill_and_steps_follow_the_forward_and_the_kv_cache_grows_by_one_per_token(tmp_path, generation,
                                                                                     layout_name):
    model, *_ = hybrid_model(tmp_path, generation, layout_name)
    ids = torch.randint(0, VOCAB, (2, 25))
    with torch.no_grad():
        expected = model(ids)
    _, cache = model.prefill(ids[:, :11])
    for k, v, *_ in attention_entries(model, cache):  # copies: views of qkv would keep all of it alive
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in (k, v))
    for t in range(11, 25):
        assert difference(model.step(ids[:, t], cache), expected[:, t]) < 1e-10
        for k, v, valid, *_ in attention_entries(model, cache):
            assert k.shape[1] == v.shape[1] == valid.shape[1] == t + 1


def split_difference(model):
    """test_use.py's split_difference: the logits and final cache of pieces against one pass, the
    cache given never written; every cache here covers the same tokens, so the shapes agree."""
    worst = 0.0
    ids = torch.randint(0, VOCAB, (2, 41))
    with torch.no_grad():
        expected, expected_cache = model(ids, want_cache=True)
    rng = torch.Generator().manual_seed(1)
    for split in ([1] * 5 + [36], [CHUNK, CHUNK, 25], *(random_split(41, rng) for _ in range(2))):
        logits, cache, start = [], None, 0
        for length in split:
            frozen = None if cache is None else [[t.clone() for t in c] for c in cache]
            out, new_cache = model.prefill(ids[:, start:start + length], cache=cache)
            if frozen is not None:
                assert difference(cache, frozen) == 0
            logits.append(out)
            cache, start = new_cache, start + length
        worst = max(worst, difference(torch.cat(logits, dim=1), expected), difference(cache, expected_cache))
    return worst


@pytest.mark.parametrize("generation,layout_name", CASES)
def test_pieces_with_a_cache_give_the_one_pass_logits_and_cache(tmp_path, generation, layout_name):
    model, *_ = hybrid_model(tmp_path, generation, layout_name)
    assert split_difference(model) < 1e-10


@pytest.mark.parametrize("generation,layout_name", CASES)
def test_forward_with_a_cache_carries_gradients_like_the_one_pass(tmp_path, generation, layout_name):
    model, *_ = hybrid_model(tmp_path, generation, layout_name)
    ids = torch.randint(0, VOCAB, (2, 17))
    weights = torch.randn(2, 17, model.cfg.padded_vocab_size, dtype=torch.float64)
    (model(ids) * weights).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    first, cache = model(ids[:, :9], want_cache=True)
    second = model(ids[:, 9:], cache=cache)
    (torch.cat([first, second], dim=1) * weights).sum().backward()
    for n, p in model.named_parameters():
        assert difference(p.grad, expected[n]) < 1e-10, n


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_under_bf16_autocast_the_kv_cache_keeps_the_model_dtype_and_step_follows_the_forward(tmp_path,
                                                                                              layout_name):
    model, *_ = hybrid_model(tmp_path, "mamba2", layout_name)
    model = model.float()
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        expected = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, cache = model.prefill(ids[:, :8])
        steps = torch.stack([model.step(ids[:, t], cache) for t in range(8, 12)], dim=1)
    for k, v, valid, *conv_state in attention_entries(model, cache):
        assert k.dtype == v.dtype == torch.float32 and k.shape[1] == 12
        assert all(c.dtype == torch.float32 for c in conv_state)
    # bf16 keeps 8 significant bits: a few hundredths of the logits' spread
    assert difference(steps.float(), expected[:, 8:]) < 0.1 * expected.std().item()


@pytest.mark.parametrize("generation,layout_name", CASES)
def test_greedy_generate_equals_a_float64_greedy_loop_over_the_oracle(tmp_path, generation, layout_name):
    model, sd, config, pure = hybrid_model(tmp_path, generation, layout_name)
    prompts = torch.randint(0, VOCAB, (2, 6))
    generated = model.generate(prompts, 8, top_k=1)
    streamed = torch.stack(list(model.generate_stream(prompts, 8, temperature=0)), dim=1)
    assert torch.equal(streamed, generated[:, 6:])
    for row in range(2):
        ids = prompts[row].tolist()
        for _ in range(8):
            ids.append(int(oracle_logits(torch.tensor(ids), sd, config, pure)[-1, :VOCAB].argmax()))
        assert generated[row].tolist() == ids


# ------------------------------------------------------------------------------------------------
# 3. Packed documents and left padding: each as if it ran alone
# ------------------------------------------------------------------------------------------------

def cache_meaning(model, cache, row):
    """What row `row` of a cache holds: the SSM layers' states as they are; an attention layer's keys
    and values at its valid slots (the tokens the next one may see), and its conv buffer."""
    meaning = []
    for i, entry in enumerate(cache):
        if i in model.cfg.attn_layer_idx:
            k, v, valid, *conv = entry
            meaning.append((k[row][valid[row]], v[row][valid[row]], *(c[row] for c in conv)))
        else:
            meaning.append(tuple(t[row] for t in entry))
    return meaning


@pytest.mark.parametrize("generation,layout_name", CASES)
def test_a_packed_row_equals_each_document_alone_outputs_and_gradients(tmp_path, generation, layout_name):
    """test_use.py's packing check: attention stays inside its document, whose rotary positions start
    at 0, and no gradient crosses a boundary."""
    model, *_ = hybrid_model(tmp_path, generation, layout_name)
    ids, seq_idx = packed_row(DOC_LENGTHS)
    weights = torch.randn(*ids.shape, model.cfg.padded_vocab_size, dtype=torch.float64)
    logits, grads, grad_embedded = embedding_gradients(model, ids, weights, seq_idx)
    expected_grads = {n: torch.zeros_like(g) for n, g in grads.items()}
    start = 0
    for length in DOC_LENGTHS:
        doc = slice(start, start + length)
        alone, alone_grads, alone_embedded = embedding_gradients(model, ids[:, doc], weights[:, doc])
        assert difference(logits[:, doc], alone) < 1e-10
        assert difference(grad_embedded[:, doc], alone_embedded) < 1e-10
        for n, g in alone_grads.items():
            expected_grads[n] += g
        start += length
    assert difference(list(grads.values()), list(expected_grads.values())) < 1e-10


@pytest.mark.parametrize("generation,layout_name", CASES)
def test_a_packed_row_continues_from_a_cache_in_pieces_and_ends_with_the_last_document_alone(
        tmp_path, generation, layout_name):
    model, *_ = hybrid_model(tmp_path, generation, layout_name)
    ids, seq_idx = packed_row(DOC_LENGTHS)
    with torch.no_grad():
        expected = model(ids, seq_idx=seq_idx)
        _, last_alone = model.prefill(ids[:, -DOC_LENGTHS[-1]:])
        logits, cache, start = [], None, 0
        for length in (3, 6, 14, 12):
            out, cache = model(ids[:, start:start + length], want_cache=True, cache=cache,
                               seq_idx=seq_idx[:, start:start + length])
            logits.append(out)
            start += length
    assert difference(torch.cat(logits, dim=1), expected) < 1e-10
    for row in range(2):
        assert difference(cache_meaning(model, cache, row), cache_meaning(model, last_alone, row)) < 1e-10
    # and the next token continues the last document, at its position
    token = torch.randint(0, VOCAB, (2,))
    alone_next = model.step(token, last_alone)
    assert difference(model.step(token, cache), alone_next) < 1e-10


@pytest.mark.parametrize("generation,layout_name", CASES)
def test_a_split_at_any_position_continues_or_restarts_as_the_documents_say(tmp_path, generation, layout_name):
    """fuzz N2 for the attention layers too: with seq_idx[:, k - 1:] a document that starts at the
    split sees none of the cached keys, and its positions start at 0."""
    from test_use import split_at_every_position_difference
    model, *_ = hybrid_model(tmp_path, generation, layout_name)
    ids, seq_idx = packed_row([3, 1, 4, 2])
    assert split_at_every_position_difference(model, ids, seq_idx) < 1e-10


@pytest.mark.parametrize("generation,layout_name", CASES)
def test_each_row_of_a_left_padded_batch_equals_the_row_alone(tmp_path, generation, layout_name):
    """Padded keys are never seen, and a row's positions count from its first real token: logits,
    cache, the steps after it and greedy generation equal the row run alone."""
    model, *_ = hybrid_model(tmp_path, generation, layout_name)
    prompts = [torch.randint(0, VOCAB, (n,)) for n in PROMPT_LENGTHS]
    for pad_id in (0, 17):
        ids, mask = left_padded(prompts, pad_id)
        L = ids.shape[1]
        logits, cache = model.prefill(ids, attention_mask=mask)
        generated = model.generate(ids, 6, top_k=1, attention_mask=mask)
        streamed = torch.stack(list(model.generate_stream(ids, 6, top_k=1, attention_mask=mask)), dim=1)
        assert torch.equal(streamed, generated[:, L:])
        token = torch.randint(0, VOCAB, (len(prompts),))
        stepped = model.step(token, [type(c)(t.clone() for t in c) for c in cache])
        for i, p in enumerate(prompts):
            n = len(p)
            alone, alone_cache = model.prefill(p[None])
            assert difference(logits[i, L - n:], alone[0]) < 1e-10
            assert difference(cache_meaning(model, cache, i), cache_meaning(model, alone_cache, 0)) < 1e-10
            assert difference(stepped[i], model.step(token[i:i + 1], alone_cache)[0]) < 1e-10
            assert torch.equal(generated[i, L:], model.generate(p[None], 6, top_k=1)[0, n:])


def test_left_padding_holds_with_a_kernel_whose_softmax_over_no_key_is_nan(tmp_path, monkeypatch):
    """A padded query sees no real key. PyTorch's CPU kernels return zeros for a query that sees no
    key; the textbook softmax returns NaN, which would reach the real tokens through the next layers
    (0·NaN is NaN): so each padded query attends to itself."""
    def textbook(q, k, v, attn_mask, scale):
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~attn_mask, -math.inf)
        return scores.softmax(-1) @ v

    monkeypatch.setattr(F, "scaled_dot_product_attention", textbook)
    model, *_ = hybrid_model(tmp_path, "mamba2", "mqa_layernorm")  # attention in the first and the last layer
    prompts = [torch.randint(0, VOCAB, (n,)) for n in PROMPT_LENGTHS]
    ids, mask = left_padded(prompts, 0)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)
        for i, p in enumerate(prompts):
            assert difference(logits[i, ids.shape[1] - len(p):], model(p[None])[0]) < 1e-10


# ------------------------------------------------------------------------------------------------
# 4. The official init
# ------------------------------------------------------------------------------------------------

def assert_std(w, expected, what):
    """The sample standard deviation of w within 4 of its standard errors of expected (at most
    sqrt(0.5/n) relative, for normal and uniform samples alike)."""
    assert abs(w.std().item() / expected - 1) < 4 * math.sqrt(0.5 / w.numel()), what


def with_headdim(generation, headdim):
    """The generation's ssm_cfg with another headdim (Mamba-1 has none)."""
    ssm_cfg = dict(GENERATIONS[generation][3])
    if generation != "mamba1":
        ssm_cfg["headdim"] = headdim
    return ssm_cfg


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_the_official_init_of_the_mlp_and_attention_layers(generation):
    """mixer_seq_simple._init_weights as MambaLMHeadModel leaves it: every Linear bias 0, the
    embedding N(0, 0.02); each module's out_proj.weight and fc2.weight (the mixers' and MHA's
    out_proj, the MLP's fc2) redrawn from nn.Linear's kaiming-uniform init and divided by
    sqrt(n_layer). (MixerModel divides by sqrt(2·n_layer) when there is an MLP, but the LM then
    applies _init_weights again with its default n_residuals_per_layer = 1, which redraws them.)
    The rest keeps PyTorch's own init: fc1 and MHA's in_proj U(±1/sqrt(fan_in)), the conv over qkv
    U(±1/sqrt(d_conv)). Bounds exactly, standard deviations to sampling error."""
    cls, from_dict, _, _ = GENERATIONS[generation]
    n_layer, D = 6, 64
    config = dict(d_model=D, n_layer=n_layer, vocab_size=VOCAB, ssm_cfg=with_headdim(generation, 16),
                  d_intermediate=200, attn_layer_idx=[1, 4],
                  attn_cfg=dict(num_heads=8, num_heads_kv=2, d_conv=4, mlp_dim=100, rotary_emb_dim=8, causal=True))
    model = cls(from_dict(config))
    H, Hkv, d, qkv, mlp = attention_sizes(config)
    hidden, rescaled = mlp_hidden(config), 1 / math.sqrt(n_layer)
    mixer_out = model.backbone.layers[0].mixer.out_proj.in_features
    bounds = {  # nn.Linear's and nn.Conv1d's kaiming-uniform bound is 1/sqrt(fan_in)
        "mixer.out_proj.weight": (rescaled / math.sqrt(H * d + mlp // 2), rescaled / math.sqrt(mixer_out)),
        "mlp.fc2.weight": (rescaled / math.sqrt(hidden),) * 2,
        "mlp.fc1.weight": (1 / math.sqrt(D),) * 2,
        "mixer.in_proj.weight": (1 / math.sqrt(D), None),  # the SSM mixers' in_proj: their own tests
        "mixer.conv1d.weight": (1 / math.sqrt(4), None),
        "mixer.conv1d.bias": (1 / math.sqrt(4), None),
    }
    for name, per_kind in bounds.items():
        for is_attention, bound in zip((True, False), per_kind):
            if bound is None:
                continue
            w = torch.cat([dict(layer.named_parameters())[name].detach().flatten()
                           for i, layer in enumerate(model.backbone.layers)
                           if (i in config["attn_layer_idx"]) == is_attention])
            assert w.abs().max() <= bound, (name, is_attention)
            assert_std(w, bound / math.sqrt(3), (name, is_attention))  # U(±bound)
    for i in config["attn_layer_idx"]:
        mixer = model.backbone.layers[i].mixer
        assert torch.equal(mixer.in_proj.bias, torch.zeros(qkv + mlp))
        assert torch.equal(mixer.out_proj.bias, torch.zeros(D))
    assert_std(model.backbone.embedding.weight.detach(), 0.02, "embedding")
    # the SSM layers still get their own init after the generic pass
    mixer = model.backbone.layers[0].mixer
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))
    dt = F.softplus(mixer.dt_proj.bias if generation == "mamba1" else mixer.dt_bias)
    assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6


# ------------------------------------------------------------------------------------------------
# 5. Bad configs and caches get errors that name the problem
# ------------------------------------------------------------------------------------------------

GOOD_ATTN = dict(num_heads=4, causal=True)


@pytest.mark.parametrize("change,message", [
    (dict(attn_cfg=dict(num_heads=4)), "causal"),  # the official MHA's default is causal = False
    (dict(attn_cfg=dict(GOOD_ATTN, causal=False)), "causal"),
    (dict(attn_cfg=dict(causal=True)), "num_heads"),
    (dict(attn_cfg=dict(GOOD_ATTN, num_heads_kv=3)), "num_heads_kv"),
    (dict(attn_cfg=dict(GOOD_ATTN, num_heads=3)), "head_dim"),  # d_model 16 is no multiple of 3 heads
    (dict(attn_cfg=dict(GOOD_ATTN, rotary_emb_dim=3)), "rotary_emb_dim"),
    (dict(attn_cfg=dict(GOOD_ATTN, rotary_emb_dim=6)), "rotary_emb_dim"),  # head_dim 4
    (dict(attn_cfg=dict(GOOD_ATTN, softmax_scale=0)), "softmax_scale"),
    (dict(attn_cfg=dict(GOOD_ATTN, d_conv=-1)), "d_conv"),
    (dict(attn_cfg=dict(GOOD_ATTN, mlp_dim=1.5)), "mlp_dim"),
    (dict(attn_cfg=dict(GOOD_ATTN, rotary_emb_base=-1.0)), "rotary_emb_base"),
    (dict(attn_cfg=dict(GOOD_ATTN, rotary_emb_interleaved="yes")), "rotary_emb_interleaved"),
    (dict(attn_cfg=dict(GOOD_ATTN, rotary_scale_base=512)), r"unknown attn_cfg fields.*rotary_scale_base"),
    (dict(attn_layer_idx=[2]), r"attn_layer_idx"),  # n_layer 2
    (dict(attn_layer_idx=[1, 1]), r"attn_layer_idx"),
    (dict(attn_layer_idx="0"), r"attn_layer_idx"),
    (dict(d_intermediate=-1), "d_intermediate"),
    (dict(rms_norm="yes"), "rms_norm"),
])
@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_bad_hybrid_configs_raise_errors_that_name_the_field(generation, change, message):
    from_dict = GENERATIONS[generation][1]
    config = dict(d_model=16, n_layer=2, vocab_size=VOCAB, ssm_cfg=with_headdim(generation, 8), attn_layer_idx=[0],
                  attn_cfg=GOOD_ATTN)
    config.update(change)
    with pytest.raises(ValueError, match=message):
        from_dict(config)


@pytest.mark.parametrize("empty", [[], None])
@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_kernel_only_fields_are_accepted_and_ignored_and_null_means_no_attention(generation, empty):
    from_dict = GENERATIONS[generation][1]
    config = dict(d_model=16, n_layer=2, vocab_size=VOCAB, ssm_cfg=with_headdim(generation, 8), fused_add_norm=True,
                  initializer_cfg={"initializer_range": 0.02}, d_intermediate=0, attn_layer_idx=empty,
                  attn_cfg=None if empty is None else {})
    cfg = from_dict(config)
    if generation == "mamba1":  # no hybrid field set: a plain MambaConfig, which has none of them
        assert type(cfg) is mm.MambaConfig
    else:
        assert cfg.d_intermediate == 0 and cfg.attn_layer_idx == [] and cfg.attn_cfg == {} and cfg.rms_norm


def test_one_kv_list_shared_by_two_layers_is_refused():
    # [entry] * n_layer: step would append both layers' keys to one list, and layer 1 would read layer 0's
    model = hybrid.HybridMambaLM(hybrid.HybridMambaConfig(d_model=16, n_layer=2, vocab_size=11, attn_layer_idx=[0, 1],
                                                          attn_cfg=dict(num_heads=2, causal=True)))
    _, cache = model.prefill(torch.randint(0, 11, (1, 6)))
    tokens = cache[0][0].shape[1]
    with pytest.raises(ValueError, match=r"cache\[1\] is the same list as cache\[0\]"):
        model.step(torch.tensor([3]), [cache[0], cache[0]])
    assert cache[0][0].shape[1] == tokens  # nothing appended
    model.step(torch.tensor([3]), cache)  # each layer's own list: one token more in each
    assert [c[0].shape[1] for c in cache] == [tokens + 1] * 2


def test_the_shared_kv_list_error_names_the_layer_that_holds_it_first():
    # attention at layers 0 and 2, a Mamba layer between: the list layer 2 repeats is layer 0's,
    # not the layer just before it
    model = hybrid.HybridMambaLM(hybrid.HybridMambaConfig(d_model=16, n_layer=3, vocab_size=11, attn_layer_idx=[0, 2],
                                                          attn_cfg=dict(num_heads=2, causal=True)))
    _, cache = model.prefill(torch.randint(0, 11, (1, 6)))
    with pytest.raises(ValueError, match=r"cache\[2\] is the same list as cache\[0\]; each layer needs a list"):
        model.step(torch.tensor([3]), [cache[0], cache[1], cache[0]])


def test_bad_kv_caches_are_refused_before_anything_is_written(tmp_path):
    model, *_ = hybrid_model(tmp_path, "mamba1", "gqa_conv")
    ids = torch.randint(0, VOCAB, (2, 5))
    token = ids[:, 0]
    _, cache = model.prefill(ids)
    k, v, valid, conv_state = cache[1]
    bad = {
        "a tuple": (tuple(cache[1]), r"cache\[1\] must be a list"),
        "k and v of different lengths": ([k, v[:, :4], valid, conv_state], r"same number of tokens"),
        "valid not bool": ([k, v, valid.long(), conv_state], r"cache\[1\] valid must be torch.bool"),
        "no tokens": ([k[:, :0], v[:, :0], valid[:, :0], conv_state], "at least one"),
    }
    for what, (entry, message) in bad.items():
        broken = list(cache)
        broken[1] = entry
        before = [[t.clone() for t in c] for c in cache]
        with pytest.raises(ValueError, match=message):
            model.step(token, broken)
        assert difference(cache, before) == 0, what
    with pytest.raises(ValueError, match="cache"):  # a pure model's cache: the attention layer's entry is missing
        model.prefill(ids, cache=pure_mixers("mamba1", official_config("mamba1", "gqa_conv")).prefill(ids)[1])


@pytest.mark.parametrize("generation, layout_name", CASES)
def test_forward_mode_ad_through_a_hybrid_equals_central_differences(tmp_path, generation, layout_name):
    # attention layers too: under forward mode the attention runs PyTorch's math kernel, the only one
    # with a forward-mode rule on a CPU
    model, _, _, _ = hybrid_model(tmp_path, generation, layout_name)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    assert_jvp_equals_central_differences(model, ids, seed=5)
