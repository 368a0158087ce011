"""
bench/train.py: one training step (forward, cross-entropy, backward, AdamW) of each model, timed
interleaved, and where its time goes.

    python -m bench train           # the default Mamba, its alternatives, Mamba-2, the same-size GPT
    python -m bench profile         # where the default Mamba's step goes, op by op (torch.profiler)
    python -m bench mamba2_train    # Mamba-2 candidates against Mamba-1 and the GPT
    python -m bench mamba2_profile  # where that step's time goes: matmuls against the rest
    python -m bench mamba3          # Mamba-3 candidates against Mamba-1, Mamba-2 and the GPT; generation

Every Mamba-1 row runs mamba_engine as the trainer does (accelerate: the hand-written backward),
unless its name says otherwise.
"""

import torch

import mamba_engine
import mamba_minimal as mm
from bench.common import interleaved, sync, table, trainer_default, trainer_gpt, trainer_mamba, training_step, \
    training_step_table
from gpt_minimal import GPTConfig, TinyGPT


def bench_train(args, device):
    """The trainer's default Mamba (d_state 2, mamba_engine's backend "auto") against the GPT
    yardstick and Mamba-2's default, with the alternatives beside it: the model as built (the lesson's
    code under autograd, not accelerated), d_state 4 and 16, each scan backend, the fused path
    eager and compiled."""
    import mamba2_minimal as m2
    gpu = dict(d_model=384, n_layer=7) if device.type == "cuda" else {}  # on a GPU: wider, as the GPU defaults
    batch, block, vocab = (2, 16, 65) if args.quick else (12, 64, 65)
    ids = torch.randint(0, vocab, (batch, block + 1), device=device)
    models = {}
    for name, kw, engine in [("mamba default (d_state 2, auto)", {}, {}),
                             ("mamba as built (the lesson, not accelerated)", {}, dict(backend="reference")),
                             ("mamba d_state 4", dict(d_state=4), {}),
                             ("mamba d_state 16", dict(d_state=16), {}),
                             ("mamba sequential", {}, dict(backend="sequential")),
                             ("mamba pscan", {}, dict(backend="pscan")),
                             ("mamba fused eager", {}, dict(backend="fused")),
                             ("mamba fused compiled", {}, dict(compile=True)),
                             ("mamba d_state 16, fused compiled", dict(d_state=16), dict(compile=True))]:
        if args.quick and engine.get("compile"):
            continue
        models[name] = trainer_mamba(vocab, engine, **dict(gpu, **kw))
    torch.manual_seed(0)
    models["mamba2 default"] = m2.Mamba2LM(m2.Mamba2Config(
        vocab_size=vocab, chunk_size=block, **MAMBA2_CPU_CANDIDATES["mamba2 128 x 7, headdim 64, d_state 64"]))
    models["GPT (yardstick)"] = trainer_gpt(vocab, block, **(dict(d_model=384, n_layer=4) if gpu else {}))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    shapes = {name: trainer_default(name, "d_model", "n_layer") for name in ("mamba", "gpt")}
    training_step_table(f"one training step (forward, backward, AdamW), batch {batch}, block {block}; "
                        + ("d_model 384" if gpu else "; ".join(f"{name} {s['n_layer']} x {s['d_model']}"
                                                               for name, s in shapes.items())),
                        models, ids, vocab, args, device, autocast)


PROFILE_GROUPS = {  # op name -> what it is doing, for the summary row of bench_profile
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "casts and copies": ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous"),
}


def bench_profile(args, device):
    """Where the default Mamba's training step goes, op by op, beside the GPT yardstick's: torch.profiler's
    CPU self time per step (forward, backward and AdamW together), the top ops and the matmul share."""
    from torch.profiler import ProfilerActivity, profile
    batch, block, vocab = (2, 16, 65) if args.quick else (12, 64, 65)
    ids = torch.randint(0, vocab, (batch, block + 1), device=device)
    torch.manual_seed(0)
    models = {"mamba (trainer's default)": trainer_mamba(vocab), "GPT (yardstick)": trainer_gpt(vocab, block)}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, model in models.items():
        step = training_step(model.to(device), ids, vocab)
        for _ in range(3):
            step()
        with profile(activities=activities) as prof:
            for _ in range(args.repeats):
                step()
            sync(device)
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events)
        per_step = lambda us: f"{us / args.repeats / 1e3:.2f}"
        rows = [[e.key, per_step(e.self_cpu_time_total), f"{e.self_cpu_time_total / total:.0%}",
                 f"{e.count / args.repeats:.0f}"] for e in events[:args.top]]
        for group, keys in PROFILE_GROUPS.items():
            us = sum(e.self_cpu_time_total for e in events if e.key in keys)
            calls = sum(e.count for e in events if e.key in keys)
            rows.append([f"({group})", per_step(us), f"{us / total:.0%}", f"{calls / args.repeats:.0f}"])
        rows.append(["(all ops)", per_step(total), "100%", f"{sum(e.count for e in events) / args.repeats:.0f}"])
        table(f"{name}: one training step under torch.profiler, batch {batch}, block {block}, CPU self time "
              f"per step over {args.repeats} steps, the top {args.top} ops", ["op", "ms/step", "share", "calls/step"],
              rows)


# ------------------------------------------------------------------------------------------------
# Mamba-2's training step
# ------------------------------------------------------------------------------------------------

MAMBA2_CPU_CANDIDATES = {  # 0.78M-0.87M parameters, like Mamba-1's 0.83M (d_model 128, 7 layers)
    "mamba2 128 x 7, headdim 32, d_state 64": dict(d_model=128, n_layer=7, headdim=32, d_state=64),
    "mamba2 128 x 7, headdim 64, d_state 64": dict(d_model=128, n_layer=7, headdim=64, d_state=64),
    "mamba2 128 x 7, headdim 32, d_state 32": dict(d_model=128, n_layer=7, headdim=32, d_state=32),
    "mamba2 176 x 4, headdim 32, d_state 64": dict(d_model=176, n_layer=4, headdim=32, d_state=64),
}


def bench_mamba2_train(args, device):
    """One training step of Mamba-2 LMs of Mamba-1's default size, eager and compiled, against
    Mamba-1 and the GPT yardstick (eager, as nanoGPT runs it on a CPU, and compiled)."""
    import mamba2_minimal as m2
    d_model = 384 if device.type == "cuda" else 128
    batch, block, vocab = (2, 16, 65) if args.quick else (12, 64, 65)
    ids = torch.randint(0, vocab, (batch, block + 1), device=device)
    models = {}
    torch.manual_seed(0)
    models["mamba 128 x 7, d_state 4"] = mamba_engine.accelerate(mm.MambaLM(
        mm.MambaConfig(d_model=d_model, n_layer=7, vocab_size=vocab, d_state=4)))
    for name, kw in MAMBA2_CPU_CANDIDATES.items():
        if device.type == "cuda":  # the CUDA default's width, 6 layers
            kw = dict(kw, d_model=d_model, n_layer=6, headdim=64)
        torch.manual_seed(0)
        models[name] = m2.Mamba2LM(m2.Mamba2Config(vocab_size=vocab, chunk_size=block, **kw))
    default = "mamba2 128 x 7, headdim 64, d_state 64"
    kw = MAMBA2_CPU_CANDIDATES[default]
    if device.type == "cuda":  # the same size as the eager rows above
        default, kw = f"mamba2 {d_model} x 6, headdim 64, d_state 64", dict(kw, d_model=d_model, n_layer=6)
    torch.manual_seed(0)
    models[default + ", compile_mixer (--compile)"] = m2.Mamba2LM(m2.Mamba2Config(
        vocab_size=vocab, chunk_size=block, compile_mixer=True, **kw))
    for compiled in (False, True):
        torch.manual_seed(0)
        gpt = TinyGPT(GPTConfig(vocab_size=vocab, d_model=d_model, block_size=block))
        models["GPT (yardstick)" + (", torch.compile" if compiled else "")] = torch.compile(gpt) if compiled else gpt
    training_step_table(f"one training step (forward, backward, AdamW), batch {batch}, block {block}; Mamba-1 "
                        f"d_model {d_model}, 7 layers; GPT d_model {d_model}, 4 layers; Mamba-2 chunk_size = block; "
                        "/GPT: over the eager GPT", models, ids, vocab, args, device)


def bench_mamba2_profile(args, device):
    """Where one training step's time goes: matmuls against everything else, for the default
    Mamba-2 (eager and compile_mixer) and the GPT yardstick, from torch.profiler's self times."""
    import mamba2_minimal as m2
    from torch.profiler import ProfilerActivity, profile
    batch, block, vocab = (2, 16, 65) if args.quick else (12, 64, 65)
    ids = torch.randint(0, vocab, (batch, block + 1), device=device)
    models = {}
    for name, compiled in (("mamba2 default, eager", False), ("mamba2 default, compile_mixer", True)):
        torch.manual_seed(0)
        models[name] = m2.Mamba2LM(m2.Mamba2Config(vocab_size=vocab, chunk_size=block, compile_mixer=compiled,
                                                   **MAMBA2_CPU_CANDIDATES["mamba2 128 x 7, headdim 64, d_state 64"]))
    torch.manual_seed(0)
    models["GPT (yardstick)"] = TinyGPT(GPTConfig(vocab_size=vocab, d_model=128, block_size=block))
    matmuls = ("aten::mm", "aten::addmm", "aten::bmm")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    rows = []
    for name, model in models.items():
        step = training_step(model.to(device), ids, vocab)
        for _ in range(3):  # compiles, where there is a compile, and warms up
            step()
        with profile(activities=activities) as prof:
            for _ in range(args.repeats):
                step()
            sync(device)
        events = prof.key_averages()
        # on a GPU an op's CPU self time is its launch: what the GPU spends is its device time
        self_time = (lambda e: e.self_device_time_total) if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
        total = sum(self_time(e) for e in events) / args.repeats / 1e3
        mm_ms = sum(self_time(e) for e in events if e.key in matmuls) / args.repeats / 1e3
        rows.append([name, f"{total:.1f}", f"{mm_ms:.1f}", f"{total - mm_ms:.1f}", f"{mm_ms / total:.0%}"])
    table(f"one training step under torch.profiler ({'CUDA' if device.type == 'cuda' else 'CPU'} self time, ms per "
          f"step, {args.repeats} steps), batch {batch}, "
          f"block {block}: matmuls (mm, addmm, bmm) against everything else",
          ["model", "step ms", "matmul ms", "rest ms", "matmul share"], rows)


# ------------------------------------------------------------------------------------------------
# Mamba-3: the training step at the trainer's shape, and generation
# ------------------------------------------------------------------------------------------------


MAMBA3_CPU_CANDIDATES = {  # d_model 128, 7 layers: 0.8M-0.9M parameters, like Mamba-1's and Mamba-2's defaults
    "mamba3 SISO, d_state 64, headdim 64, chunk 64": dict(d_state=64, headdim=64, chunk_size=64),
    "mamba3 SISO, d_state 32, headdim 64, chunk 64 (trainer's CPU default)":
        dict(d_state=32, headdim=64, chunk_size=64),
    "mamba3 SISO, d_state 64, headdim 32, chunk 64": dict(d_state=64, headdim=32, chunk_size=64),
    "mamba3 SISO, d_state 64, headdim 64, chunk 16": dict(d_state=64, headdim=64, chunk_size=16),
    "mamba3 MIMO rank 2, d_state 32, chunk 32 (--mimo-rank 2)": dict(d_state=32, headdim=64, chunk_size=32,
                                                                       is_mimo=True, mimo_rank=2),
    "mamba3 MIMO rank 4, d_state 32, chunk 16 (--mimo-rank 4)": dict(d_state=32, headdim=64, chunk_size=16,
                                                                       is_mimo=True, mimo_rank=4),
}


def bench_mamba3(args, device):
    """One training step of Mamba-3 candidates at the trainer's CPU shape against the Mamba-1 and
    Mamba-2 trainer defaults and the GPT yardstick (interleaved), then greedy generation tokens/s
    of the three generations at their defaults (prefill of 16 tokens, then 256 steps)."""
    import mamba2_minimal as m2
    import mamba3_minimal as m3
    batch, block, vocab = (2, 16, 65) if args.quick else (12, 64, 65)
    ids = torch.randint(0, vocab, (batch, block + 1), device=device)
    models = {}
    torch.manual_seed(0)
    models["mamba 128 x 7, d_state 4"] = mamba_engine.accelerate(mm.MambaLM(
        mm.MambaConfig(d_model=128, n_layer=7, vocab_size=vocab, d_state=4)))
    torch.manual_seed(0)
    models["mamba2 d_state 64, headdim 64 (trainer's CPU default)"] = m2.Mamba2LM(m2.Mamba2Config(
        d_model=128, n_layer=7, vocab_size=vocab, d_state=64, headdim=64, chunk_size=block))
    for name, kw in MAMBA3_CPU_CANDIDATES.items():
        torch.manual_seed(0)
        models[name] = m3.Mamba3LM(m3.Mamba3Config(d_model=128, n_layer=7, vocab_size=vocab, **kw))
    torch.manual_seed(0)
    models["GPT (yardstick)"] = TinyGPT(GPTConfig(vocab_size=vocab, d_model=128, block_size=block))
    training_step_table(f"one training step (forward, backward, AdamW), batch {batch}, block {block}, d_model 128; "
                        "Mamba 7 layers, GPT 4 layers; /GPT: over the GPT", models, ids, vocab, args, device)

    n_new = 32 if args.quick else 256
    prompt = torch.randint(0, vocab, (1, 16), device=device)
    runs = {}
    for name in ("mamba 128 x 7, d_state 4", "mamba2 d_state 64, headdim 64 (trainer's CPU default)",
                 "mamba3 SISO, d_state 32, headdim 64, chunk 64 (trainer's CPU default)",
                 "mamba3 MIMO rank 2, d_state 32, chunk 32 (--mimo-rank 2)"):
        model = models[name].eval()
        runs[name] = lambda model=model: model.generate(prompt, n_new, top_k=1)
    ms = interleaved(runs, max(1, args.repeats // 2), device)
    table(f"greedy generation, batch 1: prompt of 16, then {n_new} tokens, one O(1) step each",
          ["model", "ms", "tokens/s"], [[name, f"{t:.0f}", f"{n_new / t * 1e3:,.0f}"] for name, t in ms.items()])
