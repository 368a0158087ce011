"""
bench/decode.py: generation, token by token.

    python -m bench generate  # cost per generated token at position 16 vs 4096
    python -m bench decode    # prefill and decode tokens/s at the official checkpoints' shapes, beside transformers
"""

import copy
import statistics
import time

import torch

import mamba_engine
import mamba_minimal as mm
from bench.common import interleaved, sync, table


def bench_generate(args, device):
    """The cost of one more token: MambaLM.step at positions 16 and 4096 (O(1): the same), and
    greedy generate's tokens/s."""
    torch.manual_seed(0)
    vocab = 65
    model = mamba_engine.accelerate(mm.MambaLM(mm.MambaConfig(d_model=256, n_layer=4, vocab_size=vocab)))
    model = model.to(device).eval()
    n_steps = 20 if args.quick else 100
    caches, runs = {}, {}
    for pos in (16, 4096):  # both caches first, then the two positions timed interleaved
        prompt = torch.randint(0, vocab, (1, pos), device=device)
        _, caches[pos] = model.prefill(prompt)

        def steps(cache=caches[pos], token=prompt[:, -1]):
            for _ in range(n_steps):
                model.step(token, cache)

        runs[pos] = steps
    per_token = {pos: ms / n_steps for pos, ms in interleaved(runs, args.repeats, device).items()}
    prompt = torch.randint(0, vocab, (1, 16), device=device)
    model.generate(prompt, 8, top_k=1)
    sync(device)
    t0 = time.perf_counter()
    model.generate(prompt, 256, top_k=1)
    sync(device)
    tps = 256 / (time.perf_counter() - t0)
    rows = [[f"{per_token[16]:.2f}", f"{per_token[4096]:.2f}", f"{per_token[4096] / per_token[16]:.2f}", f"{tps:.0f}"]]
    table("recurrent generation, 4 layers, d_model 256: ms per token at two positions, and greedy tokens/s",
          ["ms/token at 16", "ms/token at 4096", "ratio", "greedy tokens/s"], rows)


# ------------------------------------------------------------------------------------------------
# Decoding at the official sizes: prefill and decode tokens/s beside transformers
# ------------------------------------------------------------------------------------------------
# The shapes of the official checkpoints, random weights in their layout. mamba3-siso-187m's is a
# choice, not its config.json: d_model 768, 12 layers, d_state 128, headdim 64 and a gated MLP of 1536
# after each mixer (d_intermediate), with the Llama 3 vocabulary of 128,256 tied, make 186,849,600
# parameters in 147 tensors, the size the checkpoint's name says.
DECODE_SHAPES = {
    "mamba-130m": (1, dict(d_model=768, n_layer=24, vocab_size=50277, d_state=16)),
    "mamba2-130m": (2, dict(d_model=768, n_layer=24, vocab_size=50277, d_state=128, headdim=64, ngroups=1,
                            pad_vocab_size_multiple=16)),
    "mamba3-siso-187m": (3, dict(d_model=768, n_layer=12, vocab_size=128256, d_state=128, headdim=64,
                                 d_intermediate=1536)),
    "mamba3 128 x 7, d_state 32": (3, dict(d_model=128, n_layer=7, vocab_size=65, d_state=32, headdim=64)),
}


def decode_model(generation, kw):
    """Our model of that generation and config (random weights), Mamba-1's run by mamba_engine as
    the trainer runs it."""
    import mamba2_minimal as m2
    import mamba3_minimal as m3
    if generation == 1:
        return mamba_engine.accelerate(mm.MambaLM(mm.MambaConfig(**kw))).eval()
    cls, cfg_cls = {2: (m2.Mamba2LM, m2.Mamba2Config), 3: (m3.Mamba3LM, m3.Mamba3Config)}[generation]
    return cls(cfg_cls(**kw)).eval()


def transformers_peer(model, generation):
    """transformers' MambaForCausalLM / Mamba2ForCausalLM with our model's config and weights, or None."""
    try:
        import transformers
    except ImportError:
        return None
    cfg = model.cfg
    tokens = dict(vocab_size=cfg.padded_vocab_size, tie_word_embeddings=cfg.tie_embeddings, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None, residual_in_fp32=cfg.residual_in_fp32,
                  layer_norm_epsilon=cfg.norm_epsilon)
    if generation == 1:
        hf = transformers.MambaForCausalLM(transformers.MambaConfig(
            hidden_size=cfg.d_model, state_size=cfg.d_state, num_hidden_layers=cfg.n_layer, expand=cfg.expand,
            conv_kernel=cfg.d_conv, time_step_rank=cfg.dt_rank, use_conv_bias=cfg.conv_bias, use_bias=cfg.bias,
            **tokens))
    elif generation == 2:
        hf = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
            num_heads=cfg.nheads, head_dim=cfg.headdim, hidden_size=cfg.d_model, state_size=cfg.d_state,
            num_hidden_layers=cfg.n_layer, n_groups=cfg.ngroups, chunk_size=cfg.chunk_size, expand=cfg.expand,
            conv_kernel=cfg.d_conv, use_bias=cfg.bias, use_conv_bias=cfg.conv_bias, **tokens))
    else:
        return None
    sd = {k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in model.state_dict().items()}
    hf.load_state_dict(sd, strict=True)
    return hf.float().eval()


def bench_decode(args, device):
    """Prefill tokens/s (a prompt of P tokens, one pass that also returns the cache) and decode
    tokens/s (greedy generation through each one's generate, batch 1: the time from the first new
    token to the (n+1)-th, over n) of each implementation at each shape, interleaved round by round,
    at 1 and 2 threads."""
    prompt_len, n_new = (16, 8) if args.quick else (128, 32)
    threads = [1] if args.quick else [1, 2]
    shapes = {k: v for k, v in DECODE_SHAPES.items() if (not args.quick or "x 7" in k)
              and (not args.shapes or any(name in k for name in args.shapes.split(",")))}
    if not shapes:
        offered = [k for k in DECODE_SHAPES if not args.quick or "x 7" in k]
        raise SystemExit(f"error: no shape{' of --quick' if args.quick else ''} matches --shapes {args.shapes!r}; "
                         f"the shapes are: {'; '.join(offered)}")
    rows = []
    for shape, (generation, kw) in shapes.items():
        torch.manual_seed(0)
        ours = decode_model(generation, dict(kw, vocab_size=65) if args.quick else kw).to(device)
        prompt = torch.randint(0, ours.cfg.vocab_size, (1, prompt_len), device=device)

        def decode(model, n):  # from the first new token to the (n+1)-th
            times = [time.perf_counter() for _ in model.generate_stream(prompt, n + 1, top_k=1)]
            return times[-1] - times[0]

        cands = {"ours": dict(prefill=lambda: ours.prefill(prompt), decode=lambda n: decode(ours, n),
                              tokens=lambda n: ours.generate(prompt, n, top_k=1))}
        if not args.no_compile:  # the same weights, its step compiled: the first call compiles, timed apart
            compiled = mamba_engine.compile_decode(copy.deepcopy(ours))
            t0 = time.perf_counter()
            first = compiled.generate(prompt, 2, top_k=1)
            compile_note = f"compiling took {time.perf_counter() - t0:.0f} s"
            assert torch.equal(first, ours.generate(prompt, 2, top_k=1))
            cands["ours, compiled step"] = dict(prefill=lambda: compiled.prefill(prompt),
                                                decode=lambda n: decode(compiled, n))
        hf = transformers_peer(ours, generation)
        if hf is not None:
            hf = hf.to(device)
            ones = torch.ones_like(prompt)

            class Clock:  # transformers' streamer interface: put() gets the prompt, then each new token
                def __init__(self):
                    self.times = []

                def put(self, value):
                    self.times.append(time.perf_counter())

                def end(self):
                    pass

            def hf_tokens(n, streamer=None):
                with torch.no_grad():
                    return hf.generate(prompt, attention_mask=ones, max_new_tokens=n, min_new_tokens=n,
                                       do_sample=False, streamer=streamer)

            def hf_prefill():
                with torch.no_grad():
                    return hf(prompt, attention_mask=ones, use_cache=True)

            def hf_decode(n):
                clock = Clock()
                hf_tokens(n + 1, clock)
                return clock.times[-1] - clock.times[1]  # from the first new token to the last

            cands["transformers"] = dict(prefill=hf_prefill, decode=hf_decode, tokens=hf_tokens)
        if "transformers" in cands:  # the same weights: the same greedy tokens
            assert torch.equal(cands["ours"]["tokens"](4), cands["transformers"]["tokens"](4))
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            rates = {name: {"prefill": [], "decode": []} for name in cands}
            for c in cands.values():  # warm-up
                c["prefill"](), c["decode"](2)
            for _ in range(args.repeats):
                for name, c in cands.items():
                    t0 = time.perf_counter()
                    c["prefill"]()
                    rates[name]["prefill"].append(prompt_len / (time.perf_counter() - t0))
                    rates[name]["decode"].append(n_new / c["decode"](n_new))
            for name in cands:
                p, d = rates[name]["prefill"], rates[name]["decode"]
                rows.append([shape, n_threads, name, f"{statistics.median(p):.0f} ({min(p):.0f}-{max(p):.0f})",
                             f"{statistics.median(d):.0f} ({min(d):.0f}-{max(d):.0f})",
                             compile_note if name == "ours, compiled step" and n_threads == threads[0] else ""])
            print(rows[-len(cands):], flush=True)
    torch.set_num_threads(args.threads or 1)
    table(f"batch 1, fp32, random weights: prefill of {prompt_len} tokens, then {n_new} greedy tokens; "
          f"tokens/s, median (min-max) of {args.repeats} interleaved rounds; the compiled step: "
          f"mamba_engine.compile_decode(model), its compile time apart",
          ["shape", "threads", "implementation", "prefill tokens/s", "decode tokens/s", "note"], rows)
