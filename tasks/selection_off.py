"""
tasks/selection_off.py: Mamba-1 with selection switched off, the time-invariant layer that selection
replaced (an ablation; no official model uses it).

SelectionOffMixer is mamba_minimal.MambaMixer with Δ, B and C learned constants instead of functions
of the token: the decay exp(Δ·A) is the same at every step, the S4D-style layer of pscan.py section
2, whose SSM is one fixed convolution. tasks/selective_copying.py and tasks/induction_heads.py
train both on the Mamba paper's tasks (§4.1.1, §4.1.2): MambaLM(cfg, mixer_cls=SelectionOffMixer).
Its checkpoints hold dt_bias, B and C where a selective model's hold x_proj and dt_proj.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from mamba_minimal import MambaConfig, MambaMixer, _at_least_fp32, dt_bias_init


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

