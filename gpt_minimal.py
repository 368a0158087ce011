"""
gpt_minimal.py: the GPT yardstick, a plain GPT of the same size as the Mamba models it is compared with.

The model follows nanoGPT's model.py (github.com/karpathy/nanoGPT, model.py: GPT, Block,
CausalSelfAttention, MLP): token and learned position embeddings, pre-norm blocks of causal
self-attention and a 4x GELU MLP, no biases in LayerNorm and the linear layers (nanoGPT train.py's
bias = False), the head tied to the token embedding, and nanoGPT's init (normal(0, 0.02), the residual projections
scaled by 1/sqrt(2 * n_layer)). Dropout is left out: the Shakespeare runs it serves train with 0.

It is used by `train_shakespeare.py --arch gpt` (the same data, windows and log as Mamba) and by
bench.py's training tables (the "GPT (yardstick)" rows). At GPTConfig's defaults, nanoGPT's README
CPU model (4 layers, width 128, 4 heads, context 64), it has 0.80M parameters with a 65-character
vocabulary, not counting the position embedding, as nanoGPT reports it.
"""

import math
from dataclasses import dataclass

import torch

import mamba_minimal as mm


@dataclass
class GPTConfig:
    vocab_size: int = 65
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    block_size: int = 64  # the longest context: the position embedding has this many rows


class TinyGPT(torch.nn.Module):
    """A plain pre-norm GPT as nanoGPT's model.py builds it (no biases, tied head, its init), only as
    a yardstick for Mamba: bench.py's training step, and `train_shakespeare.py --arch gpt` (on a CPU
    2 layers of width 192 with 6 heads, 0.91M parameters, the shape its 300 s sweep chose; GPTConfig's
    defaults are nanoGPT's README CPU model, 4 layers of width 128 with 4 heads, 0.80M)."""

    def __init__(self, cfg=None):
        super().__init__()
        nn = torch.nn
        self.cfg = cfg = cfg or GPTConfig()
        d = cfg.d_model
        if d % cfg.n_head:
            raise ValueError(f"d_model ({d}) must be a multiple of n_head ({cfg.n_head})")
        self.tok, self.pos = nn.Embedding(cfg.vocab_size, d), nn.Embedding(cfg.block_size, d)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(d, bias=False), qkv=nn.Linear(d, 3 * d, bias=False), proj=nn.Linear(d, d, bias=False),
            ln2=nn.LayerNorm(d, bias=False), fc=nn.Linear(d, 4 * d, bias=False), out=nn.Linear(4 * d, d, bias=False),
        )) for _ in range(cfg.n_layer))
        self.ln_f, self.head = nn.LayerNorm(d, bias=False), nn.Linear(d, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as in nanoGPT
        for name, p in self.named_parameters():  # nanoGPT's init; residual projections scaled by depth
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"the GPT reads at most {self.cfg.block_size} tokens, got {t}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))  # (B, T, d)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).split(x.shape[-1], dim=-1)
            q, k, v = (u.view(b, t, self.cfg.n_head, -1).transpose(1, 2) for u in (q, k, v))  # (B, H, T, d/H)
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](att.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["out"](torch.nn.functional.gelu(blk["fc"](blk["ln2"](x))))
        return self.head(self.ln_f(x))  # (B, T, vocab)

    def optim_groups(self, weight_decay):
        """As nanoGPT: matrices (and embeddings) decay, norms do not."""
        params = list(self.parameters())  # tied weights appear once
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    @torch.no_grad()
    def generate_stream(self, input_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None):
        """Yield (B,) new token ids. No KV cache: every token re-reads the last block_size tokens,
        which is what attention costs without one (Mamba's step is O(1) instead)."""
        ids = input_ids
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.cfg.block_size:])[:, -1]  # (B, vocab)
            token = mm.sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
            yield token
            ids = torch.cat([ids, token[:, None]], dim=1)
