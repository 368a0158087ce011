"""
test_tasks.py: the two ablation switches of the papers' synthetic tasks, MambaConfig.selection_off
and Mamba3Config.rotations_off, against what they claim: an LTI layer that is one fixed convolution
(pscan.scan_time_invariant), and a Mamba-3 whose angles are zero.
"""

import pytest
import torch
import torch.nn.functional as F

import pscan
from mamba3_minimal import Mamba3Config, Mamba3LM
from mamba_minimal import MambaConfig, MambaLM


# ------------------------------------------------------------------------------------------------
# MambaConfig.selection_off: Δ, B and C learned constants, the layer one fixed convolution
# ------------------------------------------------------------------------------------------------

def lti_mixer_by_convolution(mixer, hidden):
    """The oracle, in float64 from the mixer's parameters: in_proj, the causal conv (F.conv1d),
    SiLU, then the SSM as a convolution with the fixed kernel exp(Δ·A)^k (pscan.scan_time_invariant,
    an FFT), read out with C, plus D·x, gated by SiLU(z), out_proj."""
    b, L, _ = hidden.shape
    x, z = (hidden @ mixer.in_proj.weight.t()).chunk(2, dim=-1)  # (b, L, ED)
    w = mixer.conv1d.weight  # (ED, 1, d_conv)
    x = F.conv1d(x.transpose(1, 2), w, mixer.conv1d.bias, padding=w.shape[-1] - 1, groups=w.shape[0])
    x = F.silu(x[..., :L].transpose(1, 2))  # (b, L, ED)
    delta = F.softplus(mixer.dt_bias)  # (ED,) the same at every step
    A = -torch.exp(mixer.A_log)  # (ED, N)
    a = torch.exp(delta[:, None] * A).expand(b, *A.shape)  # (b, ED, N) constant in time
    u = (delta * x)[..., None] * mixer.B  # (b, L, ED, N)  Δ·B·x
    h = pscan.scan_time_invariant(a, u)  # (b, L, ED, N)
    y = (h * mixer.C).sum(-1) + mixer.D * x  # (b, L, ED)
    return (y * F.silu(z)) @ mixer.out_proj.weight.t()


@pytest.mark.parametrize("backend", ["reference", "auto", "sequential", "pscan", "fused"])
def test_selection_off_makes_the_ssm_one_fixed_convolution(backend):
    torch.manual_seed(1)
    cfg = MambaConfig(d_model=8, n_layer=1, vocab_size=5, d_state=4, selection_off=True, scan_backend=backend)
    mixer = MambaLM(cfg).double().backbone.layers[0].mixer
    with torch.no_grad():  # away from the init (B = 1, D = 1) so that each parameter shows
        for p in (mixer.B, mixer.C, mixer.D, mixer.dt_bias):
            p.add_(0.3 * torch.randn_like(p))
    hidden = torch.randn(2, 37, 8, dtype=torch.float64)
    torch.testing.assert_close(mixer(hidden), lti_mixer_by_convolution(mixer, hidden), rtol=1e-9, atol=1e-10)


def test_selection_off_parameters_are_constants_and_the_selective_ones_are_gone():
    model = MambaLM(MambaConfig(d_model=8, n_layer=2, vocab_size=5, d_state=4, selection_off=True))
    mixer = model.backbone.layers[0].mixer
    names = {n for n, _ in mixer.named_parameters()}
    assert names == {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "B", "C", "A_log", "D",
                     "out_proj.weight"}
    assert mixer.B.shape == mixer.C.shape == (4,) and mixer.dt_bias.shape == (16,)
    dt = F.softplus(mixer.dt_bias)  # the official Δ init: in [dt_min, dt_max]
    assert ((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all()
    # A_log, D, dt_bias, B and C take no weight decay, as per-channel constants
    decayed = {id(p) for g in model.optim_groups(0.1) if g["weight_decay"] > 0 for p in g["params"]}
    assert not any(id(p) in decayed for p in (mixer.B, mixer.C, mixer.dt_bias, mixer.A_log, mixer.D))


def test_a_checkpoint_without_selection_off_loads_strictly_and_the_two_do_not_mix(tmp_path):
    # the official parameter names, written out: the option adds nothing to a default model
    official = {"in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                "dt_proj.bias", "A_log", "D", "out_proj.weight"}
    cfg = dict(d_model=8, n_layer=1, vocab_size=5, d_state=4)
    selective = MambaLM(MambaConfig(**cfg))
    assert {n for n, _ in selective.backbone.layers[0].mixer.named_parameters()} == official
    torch.save(selective.state_dict(), tmp_path / "selective.pt")
    MambaLM(MambaConfig(**cfg)).load_state_dict(torch.load(tmp_path / "selective.pt", weights_only=True))
    # an LTI model saves and loads itself; a checkpoint of the one kind is refused by the other
    lti = MambaLM(MambaConfig(**cfg, selection_off=True))
    torch.save(lti.state_dict(), tmp_path / "lti.pt")
    again = MambaLM(MambaConfig(**cfg, selection_off=True))
    again.load_state_dict(torch.load(tmp_path / "lti.pt", weights_only=True))
    ids = torch.randint(0, 5, (2, 9))
    torch.testing.assert_close(again(ids), lti(ids), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="x_proj"):
        lti.load_state_dict(selective.state_dict())
    with pytest.raises(RuntimeError, match="dt_bias"):
        selective.load_state_dict(lti.state_dict())


def test_selection_off_must_be_a_bool():
    with pytest.raises(ValueError, match="selection_off"):
        MambaConfig(selection_off="yes")


# ------------------------------------------------------------------------------------------------
# Mamba3Config.rotations_off: the angles are zero
# ------------------------------------------------------------------------------------------------

def test_rotations_off_equals_the_model_with_zero_angles_and_rotations_on_differ():
    torch.manual_seed(2)
    cfg = dict(d_model=16, n_layer=2, vocab_size=7, d_state=8, headdim=8, chunk_size=4)
    off = Mamba3LM(Mamba3Config(**cfg, rotations_off=True)).double()
    on = Mamba3LM(Mamba3Config(**cfg)).double()
    on.load_state_dict(off.state_dict())  # the same parameters: the option adds and removes none
    ids = torch.randint(0, 7, (2, 13))
    with torch.no_grad():
        with_rotations = on(ids)
        zeroed = Mamba3LM(Mamba3Config(**cfg)).double()
        zeroed.load_state_dict(off.state_dict())
        for layer in zeroed.backbone.layers:  # in_proj's last num_rope_angles rows give θ = π·tanh(·)
            layer.mixer.in_proj.weight[-zeroed.cfg.num_rope_angles:] = 0
        torch.testing.assert_close(off(ids), zeroed(ids), rtol=0, atol=1e-12)
        assert (off(ids) - with_rotations).abs().max() > 1e-3
        # and the recurrent step, which reads the same angles
        _, cache_off = off.prefill(ids[:, :5])
        _, cache_zeroed = zeroed.prefill(ids[:, :5])
        torch.testing.assert_close(off.step(ids[:, 5], cache_off), zeroed.step(ids[:, 5], cache_zeroed))
        assert all((c[0] == 0).all() for c in cache_off)  # the accumulated angles stay 0


def test_rotations_off_must_be_a_bool():
    with pytest.raises(ValueError, match="rotations_off"):
        Mamba3Config(d_model=16, n_layer=1, vocab_size=5, rotations_off=1)
