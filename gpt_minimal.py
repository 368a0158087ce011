"""
gpt_minimal.py: the GPT yardstick, a plain GPT of the same size as the Mamba models it is compared with.

The model follows nanoGPT's model.py (github.com/karpathy/nanoGPT, model.py: GPT, Block,
CausalSelfAttention, MLP): token and learned position embeddings, pre-norm blocks of causal
self-attention and a 4x GELU MLP, no biases in LayerNorm and the linear layers (nanoGPT train.py's
bias = False), the head tied to the token embedding, and nanoGPT's init (normal(0, 0.02), the residual projections
scaled by 1/sqrt(2 * n_layer)). Dropout is left out: the Shakespeare runs it serves train with 0.

It is used by `train_shakespeare.py --arch gpt` (the same data, windows and log as Mamba) and by
the benchmarks' training tables (`python -m bench train`, the "GPT (yardstick)" rows); it imports
torch only. At GPTConfig's defaults, nanoGPT's README CPU model (4 layers, width 128, 4 heads,
context 64), it has 0.80M parameters with a 65-character vocabulary, not counting the position
embedding, as nanoGPT reports it.
"""

import math
from dataclasses import dataclass

import torch


@dataclass
class GPTConfig:
    vocab_size: int = 65
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    block_size: int = 64  # the longest context: the position embedding has this many rows


class TinyGPT(torch.nn.Module):
    """A plain pre-norm GPT as nanoGPT's model.py builds it (no biases, tied head, its init), only as
    a yardstick for Mamba: the benchmarks' training step, and `train_shakespeare.py --arch gpt` (on a CPU
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
        if not (0 <= temperature < math.inf and (top_k is None or top_k >= 1) and (top_p is None or 0 < top_p <= 1)):
            raise ValueError(f"expected temperature >= 0 (finite), top_k >= 1 or None and top_p in (0, 1] or None, "
                             f"got {temperature!r}, {top_k!r}, {top_p!r}")
        ids = input_ids
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.cfg.block_size:])[:, -1]  # (B, vocab)
            token = sample(logits, temperature, top_k, top_p, generator)  # (B,)
            yield token
            ids = torch.cat([ids, token[:, None]], dim=1)


def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """logits (B, vocab) -> token ids (B,): greedy for temperature 0 or top_k 1, else drawn from the
    softmax of logits / temperature, kept to the top_k tokens and to the smallest set whose
    probabilities reach top_p (as mamba_minimal.sample_next, so that both models sample alike)."""
    if temperature < torch.finfo(torch.float32).tiny or top_k == 1:  # 0, or 0 once in fp32: greedy
        return logits.argmax(-1)
    logits = (logits.float() - logits.float().max(-1, keepdim=True).values) / temperature  # the largest at 0
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches top_p
        drop[:, 0] = False  # the likeliest token stays, however small top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
