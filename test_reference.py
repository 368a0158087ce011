"""The model against an independent reference: Mamba written out plainly from the paper.

test_model.py checks the model's parts against each other (a backend against the loop, a step against
the forward, a save against a load); a mistake that both sides share passes there. Here the oracle is
a second, deliberately naive float64 Mamba (Gu & Dao 2023, arXiv 2312.00752: the selective SSM of
Algorithm 2 in section 3.2, the block of Figure 3 in section 3.4), written in this file from the
equations. It reads only the tensors of a MambaLM's state_dict and calls none of mamba_minimal's
modules or functions:

    x, z   = in_proj(u)                                  the two branches of the block
    x      = SiLU(conv(x))                               causal depthwise conv, d_conv taps, + bias
    dt,B,C = x_proj(x)                                   dt of rank r; B, C of size N
    Δ      = softplus(dt_proj(dt))                       one step size per token and channel
    A      = -exp(A_log)
    h_t    = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t x_t          ZOH for A (eq. 4), Δ·B for B (selective_scan_ref)
    y_t    = C_t · h_t + D x_t
    out    = out_proj(y ⊙ SiLU(z))
    block: h = h + mixer(RMSNorm(h));  LM: embedding, blocks, RMSNorm (norm_f), lm_head

and, where transformers is installed, transformers' MambaForCausalLM on the same weights. The last
section checks the initialization and the transformers config names against the official recipe
(mamba_ssm's Mamba.__init__ and MambaLMHeadModel._init_weights), written out as numbers here.
"""

import math

import pytest
import torch

import mamba_engine as me
import mamba_minimal as mm
import pretrained
from mamba_minimal import MambaConfig, MambaLM

# "reference": the model as built, the lesson's code; the others accelerated by mamba_engine
BACKENDS = ["reference", "sequential", "pscan", "associative", "fused"]
TOL = 1e-10  # float64 throughout: anything above rounding is a real difference


# ------------------------------------------------------------------------------------------------
# the reference, in float64, from the equations
# ------------------------------------------------------------------------------------------------

def silu(v):
    return v / (1 + torch.exp(-v))


def softplus(v):
    return torch.log1p(torch.exp(v))


def linear(v, weight, bias=None):
    out = v @ weight.T
    return out if bias is None else out + bias


def rms_norm(v, weight, eps):
    """v / sqrt(mean(v²) + eps) · weight: eps inside the root (Zhang & Sennrich 2019)."""
    return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * weight


def reference_mixer(u, W, prefix, cfg, state=None):
    """One Mamba block (the mixer), one token at a time.

    u: (b, l, d_model). W: the state_dict in float64. state: None (start of the text) or what a
    previous call returned. Returns (b, l, d_model) and the state after the last token: the conv's
    last d_conv - 1 inputs (b, d_conv - 1, ED) and the SSM state h (b, ED, N).
    """
    b, l, _ = u.shape
    ed, n, r, K = cfg.d_inner, cfg.d_state, cfg.dt_rank, cfg.d_conv
    xz = linear(u, W[prefix + "in_proj.weight"], W.get(prefix + "in_proj.bias"))  # (b, l, 2·ED)
    x, z = xz[..., :ed], xz[..., ed:]  # (b, l, ED) each

    # Causal depthwise conv, as nn.Conv1d computes it (a cross-correlation): tap k of channel c
    # multiplies that channel's input K-1-k tokens back, so the last tap meets the current token.
    # Before the first token the inputs are zeros (or the previous call's last inputs).
    past = torch.zeros(b, K - 1, ed, dtype=u.dtype) if state is None else state[0]
    xs = torch.cat([past, x], dim=1)  # (b, K-1+l, ED): xs[:, K-1+t] is x_t
    w = W[prefix + "conv1d.weight"][:, 0, :]  # (ED, K)
    conv_bias = W.get(prefix + "conv1d.bias")
    conv = []
    for t in range(l):
        acc = torch.zeros(b, ed, dtype=u.dtype) if conv_bias is None else conv_bias.expand(b, ed)
        for k in range(K):
            acc = acc + w[:, k] * xs[:, t + k]  # x_{t-(K-1)+k}
        conv.append(acc)
    x = silu(torch.stack(conv, dim=1))  # (b, l, ED)

    x_dbl = linear(x, W[prefix + "x_proj.weight"])  # (b, l, r + 2N)
    dt, B, C = x_dbl[..., :r], x_dbl[..., r:r + n], x_dbl[..., r + n:]
    delta = softplus(linear(dt, W[prefix + "dt_proj.weight"], W[prefix + "dt_proj.bias"]))  # (b, l, ED)
    A = -torch.exp(W[prefix + "A_log"])  # (ED, N)
    D = W[prefix + "D"]  # (ED,)

    h = torch.zeros(b, ed, n, dtype=u.dtype) if state is None else state[1]
    ys = []
    for t in range(l):
        d_t = delta[:, t, :, None]  # (b, ED, 1)
        h = torch.exp(d_t * A) * h + d_t * B[:, t, None, :] * x[:, t, :, None]  # (b, ED, N)
        ys.append((h * C[:, t, None, :]).sum(-1) + D * x[:, t])  # (b, ED)
    y = torch.stack(ys, dim=1) * silu(z)  # (b, l, ED)
    out = linear(y, W[prefix + "out_proj.weight"], W.get(prefix + "out_proj.bias"))
    return out, (xs[:, l:], h)


def reference_lm(W, cfg, ids, state=None):
    """ids (b, l) -> logits (b, l, padded vocab), and the state after the last token per layer."""
    h = W["backbone.embedding.weight"][ids]  # (b, l, d_model)
    new_state = []
    for i in range(cfg.n_layer):
        p = f"backbone.layers.{i}."
        out, s = reference_mixer(rms_norm(h, W[p + "norm.weight"], cfg.norm_epsilon), W, p + "mixer.", cfg,
                                 None if state is None else state[i])
        h = h + out
        new_state.append(s)
    head = W["backbone.embedding.weight"] if cfg.tie_embeddings else W["lm_head.weight"]
    return rms_norm(h, W["backbone.norm_f.weight"], cfg.norm_epsilon) @ head.T, new_state


def reference_greedy(W, cfg, prompt, n_new):
    """Greedy decoding with the reference: one reference step per new token from its own state."""
    logits, state = reference_lm(W, cfg, prompt)
    tokens = []
    for _ in range(n_new):
        token = logits[:, -1, :cfg.vocab_size].argmax(-1)  # (b,) padded rows are no tokens
        tokens.append(token)
        logits, state = reference_lm(W, cfg, token[:, None], state)
    return torch.stack(tokens, dim=1)


def weights(model, requires_grad=False):
    """The model's state_dict as fresh float64 leaves: the reference's only input from the model."""
    return {k: v.detach().to(torch.float64).clone().requires_grad_(requires_grad and v.is_floating_point())
            for k, v in model.state_dict().items()}


def random_model(seed=0, dtype=torch.float64, backend="reference", recompute=True, **kw):
    """A small model whose every parameter is moved off its init: the init has zero biases, unit
    norms and D = 1, under which a forgotten bias, norm weight or skip would not show. backend:
    "reference" leaves it as built; any other accelerates it (the fused path in chunks of 4)."""
    torch.manual_seed(seed)
    cfg = dict(d_model=24, n_layer=2, vocab_size=21, d_state=5)  # dt_rank auto: 2
    cfg.update(kw)
    model = MambaLM(MambaConfig(**cfg)).to(dtype)
    if backend != "reference":
        me.accelerate(model, backend=backend, chunk_size=4, recompute=recompute)
    with torch.no_grad():
        for p in model.parameters():  # a tied head is one parameter, moved once
            p.add_(0.1 * torch.randn_like(p))
    return model


def token_ids(b, l, vocab, seed):
    return torch.randint(0, vocab, (b, l), generator=torch.Generator().manual_seed(seed))


VARIANTS = {
    "tied": dict(),
    "untied": dict(tie_embeddings=False),
    "no-conv-bias": dict(conv_bias=False),
    "bias": dict(bias=True),
    "untied,bias,no-conv-bias": dict(tie_embeddings=False, bias=True, conv_bias=False),
    "d_conv=2,dt_rank=3,expand=3,eps=1e-2": dict(d_conv=2, dt_rank=3, expand=3, d_state=3, norm_epsilon=1e-2),
    "d_conv=6,no-fp32-residual": dict(d_conv=6, residual_in_fp32=False),
}


def test_reference_carries_its_state_across_calls():
    """The reference itself: a text read in two calls, the state carried, equals one call."""
    model = random_model(d_conv=4)
    W, cfg = weights(model), model.cfg
    ids = token_ids(2, 9, 21, seed=1)
    whole, _ = reference_lm(W, cfg, ids)
    for cut in (1, 2, 5):
        first, state = reference_lm(W, cfg, ids[:, :cut])
        second, _ = reference_lm(W, cfg, ids[:, cut:], state)
        torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-13, atol=1e-13)


# ------------------------------------------------------------------------------------------------
# the model against the reference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_logits_match_the_reference(backend, variant):
    model = random_model(backend=backend, **VARIANTS[variant])
    ids = token_ids(2, 11, 21, seed=2)  # 11 tokens: chunks of 4, the last one padded
    with torch.no_grad():
        logits = model(ids)
    expected, _ = reference_lm(weights(model), model.cfg, ids)
    assert logits.shape == (2, 11, 24)  # vocab 21 padded to 24
    torch.testing.assert_close(logits, expected, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("variant", ["tied", "untied,bias,no-conv-bias"])
@pytest.mark.parametrize("backend, recompute", [(b, True) for b in BACKENDS] + [("fused", False)])
def test_gradients_match_the_reference(backend, recompute, variant):
    """Every parameter's gradient, the reference's through plain autograd. A tied head's gradient
    is the sum of its two uses, as the reference's single leaf used twice gives."""
    model = random_model(backend=backend, recompute=recompute, **VARIANTS[variant])
    ids = token_ids(2, 11, 21, seed=3)
    probe = torch.randn(2, 11, 24, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (model(ids) * probe).sum().backward()
    W = weights(model, requires_grad=True)
    logits, _ = reference_lm(W, model.cfg, ids)
    (logits * probe).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, W[name].grad, rtol=1e-9, atol=TOL, msg=f"gradient wrt {name}")


@pytest.mark.parametrize("variant", ["tied", "untied,bias,no-conv-bias", "d_conv=6,no-fp32-residual"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_and_steps_match_the_reference(backend, variant):
    """The recurrent path: prefill's logits and cache, then each step's logits, against the
    reference read over the whole text. Prompts shorter and longer than the conv."""
    model = random_model(backend=backend, **VARIANTS[variant]).eval()
    W, cfg = weights(model), model.cfg
    ids = token_ids(2, 10, 21, seed=5)
    expected, _ = reference_lm(W, cfg, ids)
    for prompt_len in (1, 3, 7):
        logits, cache = model.prefill(ids[:, :prompt_len])
        torch.testing.assert_close(logits, expected[:, :prompt_len], rtol=TOL, atol=TOL)
        _, state = reference_lm(W, cfg, ids[:, :prompt_len])
        for (conv_state, ssm_state), (past, h) in zip(cache, state):
            torch.testing.assert_close(ssm_state, h, rtol=TOL, atol=TOL)  # (b, ED, N)
            keep = cfg.d_conv - 1  # the conv's last inputs; the model may keep one more slot
            torch.testing.assert_close(conv_state[..., conv_state.shape[-1] - keep:], past.transpose(1, 2),
                                       rtol=TOL, atol=TOL)
        for t in range(prompt_len, ids.shape[1]):
            torch.testing.assert_close(model.step(ids[:, t], cache), expected[:, t], rtol=TOL, atol=TOL,
                                       msg=f"prompt {prompt_len}, step at position {t}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_generation_step_matches_the_reference_step(backend):
    """A single step from the prompt's state: the model's step against the reference run on the
    one new token from the reference's own state (not against the model's cache)."""
    model = random_model(backend=backend, tie_embeddings=False).eval()
    W, cfg = weights(model), model.cfg
    prompt = token_ids(3, 6, 21, seed=6)
    _, cache = model.prefill(prompt)
    _, state = reference_lm(W, cfg, prompt)
    token = torch.tensor([0, 7, 20])
    expected, _ = reference_lm(W, cfg, token[:, None], state)
    torch.testing.assert_close(model.step(token, cache), expected[:, 0], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_follows_the_reference(backend):
    model = random_model(backend=backend, vocab_size=19).eval()  # 19 padded to 24: 5 padded rows
    W, cfg = weights(model), model.cfg
    prompt = token_ids(2, 4, 19, seed=7)
    out = model.generate(prompt, max_new_tokens=10, top_k=1)
    assert torch.equal(out[:, :4], prompt)
    assert torch.equal(out[:, 4:], reference_greedy(W, cfg, prompt, 10))


# ------------------------------------------------------------------------------------------------
# transformers' MambaForCausalLM on the same weights (skipped where transformers is not installed)
# ------------------------------------------------------------------------------------------------

def transformers_twin(model):
    """transformers' MambaForCausalLM with the config and weights of our model (float32)."""
    transformers = pytest.importorskip("transformers")
    cfg = model.cfg
    hf_cfg = transformers.MambaConfig(
        vocab_size=cfg.padded_vocab_size,  # transformers stores the vocab as the weights have it
        hidden_size=cfg.d_model, state_size=cfg.d_state, num_hidden_layers=cfg.n_layer,
        expand=cfg.expand, conv_kernel=cfg.d_conv, time_step_rank=cfg.dt_rank,
        use_conv_bias=cfg.conv_bias, use_bias=cfg.bias, tie_word_embeddings=cfg.tie_embeddings,
        residual_in_fp32=cfg.residual_in_fp32, layer_norm_epsilon=cfg.norm_epsilon,
        time_step_min=cfg.dt_min, time_step_max=cfg.dt_max, time_step_floor=cfg.dt_init_floor,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)  # no token ends generation early
    hf = transformers.MambaForCausalLM(hf_cfg)
    sd = {k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in model.state_dict().items()}
    hf.load_state_dict(sd, strict=True)
    return hf.float().eval(), hf_cfg


@pytest.mark.parametrize("variant", ["tied", "untied,bias,no-conv-bias", "d_conv=2,dt_rank=3,expand=3,eps=1e-2"])
def test_transformers_mamba_gives_the_same_logits_and_greedy_tokens(variant):
    model = random_model(dtype=torch.float32, vocab_size=24, **VARIANTS[variant]).eval()  # unpadded vocab
    hf, _ = transformers_twin(model)
    ids = token_ids(2, 13, 24, seed=8)
    with torch.no_grad():
        hf_logits = hf(ids, use_cache=False).logits
        ours = model(ids)
    expected, _ = reference_lm(weights(model), model.cfg, ids)
    torch.testing.assert_close(hf_logits.double(), expected, rtol=1e-5, atol=1e-5)  # checks the reference too
    torch.testing.assert_close(ours, hf_logits, rtol=1e-5, atol=1e-5)
    prompt = ids[:, :5]
    with torch.no_grad():
        hf_out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert hf_out.shape == (2, 13)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, top_k=1), hf_out)


def test_transformers_config_and_saved_folder_load_into_the_same_model(tmp_path):
    """What transformers itself writes (config.json with its names, weights without the tied head)
    loads through pretrained.config_from_dict and pretrained.load into a model with the same logits."""
    model = random_model(dtype=torch.float32, vocab_size=32, d_model=40, d_conv=3, dt_min=2e-3, dt_max=0.05,
                         dt_init_floor=3e-4, norm_epsilon=1e-4).eval()
    hf, hf_cfg = transformers_twin(model)
    cfg = pretrained.config_from_dict(hf_cfg.to_dict())
    for name in ["d_model", "n_layer", "vocab_size", "d_state", "expand", "d_conv", "dt_rank", "conv_bias",
                 "bias", "dt_min", "dt_max", "dt_init_floor", "norm_epsilon", "tie_embeddings", "residual_in_fp32"]:
        assert getattr(cfg, name) == getattr(model.cfg, name), name
    hf.save_pretrained(tmp_path)
    loaded = pretrained.load(str(tmp_path), cls=MambaLM)
    ids = token_ids(2, 9, 32, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), hf(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# initialization and config names, against the official recipe written out here
# ------------------------------------------------------------------------------------------------

def test_rms_norm_puts_eps_inside_the_square_root():
    """With inputs as small as eps, eps inside or outside the root differ by tens of percent."""
    norm = mm.RMSNorm(8, eps=0.05).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8, dtype=torch.float64))
    v = 0.2 * torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    torch.testing.assert_close(norm(v), rms_norm(v, norm.weight.detach(), 0.05), rtol=1e-14, atol=1e-14)


def ks_distance_from_uniform(u):
    """Kolmogorov-Smirnov distance between the sample u (values in [0, 1]) and Uniform(0, 1)."""
    u, _ = torch.sort(u.double())
    n = u.numel()
    above = torch.arange(1, n + 1, dtype=torch.float64) / n - u  # the empirical CDF just after each value
    below = u - torch.arange(0, n, dtype=torch.float64) / n  # ... and just before it
    return max(above.max().item(), below.max().item())


def test_dt_starts_log_uniform_between_dt_min_and_dt_max():
    """softplus(dt_proj.bias) is the initial Δ: log-uniform in [dt_min, dt_max] (mamba_ssm's
    Mamba.__init__), i.e. log Δ uniform. The KS distance of 4096 draws from the right law stays
    below 0.042 with probability 1 - 1e-6; drawn uniformly in [1e-3, 0.1] it is about 0.46."""
    dt_min, dt_max = 1e-3, 0.1
    torch.manual_seed(11)
    model = MambaLM(MambaConfig(d_model=256, expand=8, n_layer=2, vocab_size=8, dt_min=dt_min, dt_max=dt_max,
                                dt_init_floor=1e-4))
    dt = torch.cat([softplus(layer.mixer.dt_proj.bias.detach().double()) for layer in model.backbone.layers])
    assert dt.numel() == 4096
    assert dt.min() >= dt_min * (1 - 1e-5) and dt.max() <= dt_max * (1 + 1e-5)
    u = (dt.log() - math.log(dt_min)) / (math.log(dt_max) - math.log(dt_min))  # Uniform(0, 1) if right
    assert ks_distance_from_uniform(u.clamp(0, 1)) < 0.042
    # the floor: with dt_min below it, the draws under the floor are lifted onto it
    torch.manual_seed(12)
    model = MambaLM(MambaConfig(d_model=256, expand=8, n_layer=1, vocab_size=8, dt_min=1e-5, dt_max=0.1,
                                dt_init_floor=1e-3))
    dt = softplus(model.backbone.layers[0].mixer.dt_proj.bias.detach().double())
    on_floor = ((dt - 1e-3).abs() < 1e-8).double().mean().item()
    assert dt.min() >= 1e-3 * (1 - 1e-5)
    assert abs(on_floor - 0.5) < 0.05  # log(1e-3/1e-5) / log(0.1/1e-5) = 2/4 of the draws


@pytest.mark.parametrize("n_layer", [1, 4, 9])
def test_out_proj_is_scaled_down_by_the_square_root_of_the_depth(n_layer):
    """mamba_ssm's _init_weights: out_proj starts as kaiming_uniform(a=√5), i.e. Uniform(±1/√fan_in),
    then is divided by √n_layer, so the residual stream's variance does not grow with depth.
    Uniform(±bound) has std bound/√3; 64·128 draws per layer pin it within about 1%."""
    torch.manual_seed(13)
    model = MambaLM(MambaConfig(d_model=64, n_layer=n_layer, vocab_size=8))
    bound = 1 / math.sqrt(128) / math.sqrt(n_layer)  # fan_in = d_inner = 128
    for layer in model.backbone.layers:
        w = layer.mixer.out_proj.weight.detach().double()
        assert w.abs().max() <= bound * (1 + 1e-6)
        assert w.abs().max() > 0.99 * bound
        assert abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.05
    # the other matrices keep their own scale: in_proj is not rescaled with depth
    w = model.backbone.layers[0].mixer.in_proj.weight.detach()
    assert abs(w.std().item() / (1 / math.sqrt(64) / math.sqrt(3)) - 1) < 0.05


def test_transformers_config_names_map_to_their_fields():
    """A transformers config.json (MambaConfig's names) with every value distinct, so a name mapped
    to the wrong field shows. Written out by hand: the oracle is the transformers documentation."""
    d = {"model_type": "mamba", "hidden_size": 48, "num_hidden_layers": 3, "vocab_size": 40, "state_size": 6,
         "expand": 3, "conv_kernel": 5, "time_step_rank": 7, "use_conv_bias": False, "use_bias": True,
         "time_step_min": 0.002, "time_step_max": 0.05, "time_step_floor": 0.0003, "time_step_scale": 0.5,
         "layer_norm_epsilon": 1e-4, "tie_word_embeddings": False, "residual_in_fp32": False,
         "intermediate_size": 144, "time_step_init_scheme": "constant", "hidden_act": "silu"}
    cfg = pretrained.config_from_dict(d)
    expected = dict(d_model=48, n_layer=3, vocab_size=40, d_state=6, expand=3, d_conv=5, dt_rank=7,
                    conv_bias=False, bias=True, dt_min=0.002, dt_max=0.05, dt_init_floor=0.0003, dt_scale=0.5,
                    norm_epsilon=1e-4, tie_embeddings=False, residual_in_fp32=False, dt_init="constant")
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.padded_vocab_size == 40  # transformers never pads the vocabulary
