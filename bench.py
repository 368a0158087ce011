"""
bench.py: side-by-side timings and memory of the scan backends.

    python bench.py scan          # h = scan(a, b): every backend vs the loop and a memory floor
    python bench.py depth         # work and depth of each scan, counted, beside its CPU time
    python bench.py crossover     # forward only: from which width the loop beats pscan on a CPU
    python bench.py selective     # selective_scan: eager backends vs the fused chunked path
    python bench.py train         # one training step: the default Mamba, its alternatives, Mamba-2, the same-size GPT
    python bench.py profile       # where the default Mamba's training step goes, op by op (torch.profiler)
    python bench.py race --max-time 300 --runs 2  # GPT vs default Mamba, whole trainings at equal time
    python bench.py sweep --max-time 300 [--round 2|3|4]  # the grid that chose both models' CPU defaults
    python bench.py generate      # cost per generated token at position 16 vs 4096
    python bench.py decode        # prefill and decode tokens/s at the official checkpoints' shapes, beside transformers
    python bench.py mamba2_ssd    # Mamba-2's SSD and block vs Mamba-1's scan and block, eager and compiled
    python bench.py mamba2_train  # one training step of Mamba-2 candidates, Mamba-1 and the GPT
    python bench.py mamba2_profile  # where that step's time goes: matmuls vs the rest (torch.profiler)
    python bench.py mamba3        # one training step of Mamba-3 candidates vs Mamba-1, Mamba-2 and the GPT; generation
    python bench.py roofline      # a MODEL of one training step on four GPUs (no GPU needed): kernels, bytes, FLOPs, memory
    python bench.py graphs        # what torch.compile makes of each model: graphs, graph breaks, recompiles
    python bench.py reading       # the reading path's minutes by the README's method, part by part
    python bench.py all           # everything above
    python bench.py gpu --data data/tinyshakespeare.txt  # a CUDA machine, offline, within --budget s
    python bench.py gpu --tiny    # the same parts in the same order, at a toy size on the CPU

`gpu` trains, times the L = 8192 selective scan and runs the CUDA tests, most valuable first
(its section says what and why); it needs the Tiny Shakespeare text on the machine (--data, or
data/tinyshakespeare.txt, which the trainer otherwise downloads).

Every table is measured in one process with the candidates interleaved (round-robin, median of
the repeats), so a noisy machine slows them all alike and the ratios stay meaningful. One thread
by default (--threads).
Peak memory is read from /proc/self/status (VmHWM after resetting it with /proc/self/clear_refs),
one subprocess per case, so it is Linux only.
"""

import argparse
import ast
import contextlib
import functools
import io
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tokenize
import weakref
from dataclasses import fields as dataclass_fields

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import mamba_minimal as mm
import pscan as ps
from gpt_minimal import GPTConfig, TinyGPT


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(cases, repeats, device, warmup=1):
    """cases: {name: fn}. Returns {name: median ms}, running the cases round-robin."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def table(title, header, rows):
    print(f"\n{title}")
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).rjust(w) for c, w in zip(r, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


# ------------------------------------------------------------------------------------------------
# Peak memory, one subprocess per case
# ------------------------------------------------------------------------------------------------

def _proc_status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_bytes(run):
    """Peak resident memory above the current level while `run()` executes (Linux, CPU)."""
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap memory back, so RSS = live memory
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    base = _proc_status_kb("VmRSS")
    run()
    return (_proc_status_kb("VmHWM") - base) * 1024


def memory_in_subprocess(spec):
    """Run `python bench.py --memory-case SPEC` and return the JSON it prints."""
    # every allocation of 64 KiB or more gets its own mapping, returned to the OS when freed, so
    # the resident set follows the live tensors instead of glibc's heap
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--memory-case", json.dumps(spec)],
        capture_output=True, text=True, check=True, env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_case(spec):
    """One forward+backward (or one load) in this (sub)process; prints its peak memory as JSON."""
    torch.set_num_threads(1)
    if spec["kind"] == "load":
        return load_case(spec)
    B, L, D, N = spec["shape"]
    if spec["kind"] == "scan":
        inputs = [torch.rand(B, L, D, N, requires_grad=True), torch.randn(B, L, D, N, requires_grad=True)]
        grad = torch.randn(B, L, D, N)  # the incoming gradient counts as an input
        fn = SCAN_BACKENDS[spec["backend"]]

        def run():
            fn(*inputs).backward(grad)
    elif spec["kind"] == "selective":
        inputs = selective_inputs(B, L, D, N, requires_grad=True)

        def run():
            mm.selective_scan(*inputs, **spec["kwargs"]).sum().backward()
    else:
        raise ValueError(f"unknown memory case {spec}")
    run()  # warm-up: the allocator's first touches, and the compile when asked for
    for t in inputs:
        t.grad = None
    extra = peak_extra_bytes(run)
    print(json.dumps({"tensors": extra / (B * L * D * N * 4), "mb": extra / 2**20}))


# ------------------------------------------------------------------------------------------------
# h = scan(a, b)
# ------------------------------------------------------------------------------------------------

SCAN_BACKENDS = {
    "loop": ps.scan_sequential,
    "pscan": ps.pscan,
    "hillis_steele": ps.scan_hillis_steele,
    "two_level": ps.scan_two_level,
    "associative": ps.scan_associative,
}


def per_step_table(args, device):
    """Does an awkward length cost more per step than a power of two? pscan only, all lengths
    interleaved in one loop (separate tables drift with the machine's load)."""
    inputs = {}
    for L in (4096, 3000, 2049, 2048):
        a = torch.rand(1, L, 256, 16, device=device, requires_grad=True)
        b = torch.randn(1, L, 256, 16, device=device, requires_grad=True)
        inputs[L] = (a, b, torch.randn_like(b))

    def fwd(L):
        with torch.no_grad():
            ps.pscan(*inputs[L][:2])

    def fb(L):
        a, b, g = inputs[L]
        a.grad = b.grad = None
        ps.pscan(a, b).backward(g)

    t_f = interleaved({L: (lambda L=L: fwd(L)) for L in inputs}, args.repeats, device)
    t_b = interleaved({L: (lambda L=L: fb(L)) for L in inputs}, args.repeats, device)
    rows = [[f"(1, {L}, 256, 16)", f"{t_f[L] / L * 1e3:.2f}", f"{t_f[L] / L / (t_f[4096] / 4096):.2f}",
             f"{t_b[L] / L * 1e3:.2f}", f"{t_b[L] / L / (t_b[4096] / 4096):.2f}"] for L in inputs]
    table("pscan cost per step (µs), and its ratio to L = 4096", ["(B, L, D, N)", "fwd µs/step", "ratio",
                                                                   "fwd+bwd µs/step", "ratio"], rows)


def bench_scan(args, device):
    shapes = [(1, L, 256, 16) for L in (256, 1024, 4096, 3000)]
    shapes += [(1, 4096, 16, 16), (1, 4096, 1536, 16)]  # widths 256 and 24576 per step
    if args.quick:
        shapes = [(1, 256, 256, 16), (1, 1024, 256, 16)]
    rows, mem_rows = [], []
    for B, L, D, N in shapes:
        a = torch.rand(B, L, D, N, device=device)  # in [0, 1): a decaying state, as exp(Δ·A)
        b = torch.randn(B, L, D, N, device=device)
        backends = dict(SCAN_BACKENDS)
        if L * B * D * N > 4096 * 256 * 16 or (args.quick and L > 256):
            backends.pop("associative")  # generic associative_scan is slow and memory-hungry
            backends.pop("hillis_steele")  # a new (B, L, D, N) tensor per level
        fwd = {"floor": lambda: torch.addcmul(b, a, b)}
        fwd.update({k: (lambda f=f: f(a, b)) for k, f in backends.items()})
        ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()
        grad = torch.randn_like(a)

        def fb(f):
            ag.grad = bg.grad = None
            f(ag, bg).backward(grad)

        both = {k: (lambda f=f: fb(f)) for k, f in backends.items()}
        reps = args.repeats if L * D * N * B <= 1024 * 256 * 16 else max(3, args.repeats // 2)
        t_f = interleaved(fwd, reps, device)
        t_b = interleaved(both, max(3, reps // 2), device)
        floor = t_f["floor"]
        for k in backends:
            rows.append([f"({B}, {L}, {D}, {N})", B * D * N, k,
                         f"{t_f[k]:.2f}", f"{t_f[k] / t_f['loop']:.2f}", f"{t_f[k] / floor:.1f}",
                         f"{t_b[k]:.1f}", f"{t_b[k] / t_b['loop']:.2f}", f"{t_b[k] / floor:.1f}"])
        rows.append([f"({B}, {L}, {D}, {N})", B * D * N, "floor (1 addcmul)", f"{floor:.2f}",
                     "", "1.0", "", "", ""])
        if device.type == "cpu" and sys.platform == "linux" and not args.no_memory and L == 4096 and D == 256:
            for k in backends:
                m = memory_in_subprocess({"kind": "scan", "shape": [B, L, D, N], "backend": k})
                mem_rows.append([f"({B}, {L}, {D}, {N})", k, f"{m['tensors']:.2f}"])
    table("h = scan(a, b): median ms; ratios to the loop and to the memory floor",
          ["(B, L, D, N)", "width", "backend", "fwd ms", "/loop", "/floor",
           "fwd+bwd ms", "/loop", "/floor"], rows)
    if not args.quick:
        per_step_table(args, device)
    if mem_rows:
        table("peak memory of forward+backward, in (B, L, D, N) tensors beyond the inputs a, b and "
              "the incoming gradient", ["(B, L, D, N)", "backend", "tensors"], mem_rows)


def bench_depth(args, device):
    """Work and depth of each scan as pscan.count_combines counts them, beside their CPU times."""
    launch_us = LAUNCH_US  # a dependent level is at least one op the CPU issues: the roofline's assumption
    lengths = (256,) if args.quick else (1024, 4096)
    rows = []
    for L in lengths:
        one = (torch.rand(1, L), torch.randn(1, L))  # one recurrence: counts are combines
        shape = (1, L, 64, 16)  # width 1024: Hillis-Steele's L·log2(L) work stays affordable
        a, b = torch.rand(*shape, device=device), torch.randn(*shape, device=device)
        ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()
        grad = torch.randn_like(a)
        names = ["loop", "pscan", "hillis_steele", "two_level"]
        counts = {}
        for name in names:
            with ps.count_combines() as levels:
                SCAN_BACKENDS[name](*one)
            counts[name] = (sum(levels), len(levels))

        def fb(f):
            ag.grad = bg.grad = None
            f(ag, bg).backward(grad)

        reps = max(3, args.repeats // (2 if L > 1024 else 1))
        t_f = interleaved({k: (lambda f=SCAN_BACKENDS[k]: f(a, b)) for k in names}, reps, device)
        t_b = interleaved({k: (lambda f=SCAN_BACKENDS[k]: fb(f)) for k in names}, max(3, reps // 2), device)
        for k in names:
            work, depth = counts[k]
            rows.append([L, k, f"{work:,}", f"{work / L:.2f}", depth, f"{t_f[k]:.1f}", f"{t_b[k]:.1f}",
                         f"{depth * launch_us / 1e3:.2f}"])
    table(f"work (combines) and depth (dependent levels) of one recurrence of length L, counted by "
          f"pscan.count_combines;\nCPU times at (1, L, 64, 16); GPU ms = depth x {launch_us:.0f} µs, "
          f"a prediction for a launch-bound GPU, not a measurement",
          ["L", "scan", "work", "work / L", "depth", "fwd ms", "fwd+bwd ms", "GPU fwd ms (predicted)"], rows)


def bench_crossover(args, device):
    """Forward only, no autograd: pscan's time over the loop's as a step gets wider. This sets
    pscan.CPU_LOOP_MIN_WIDTH (run with --threads 1 and 2)."""
    L = 256 if args.quick else 1024
    rows = []
    for D in (64, 128, 256, 512, 1024, 1536):
        a, b = torch.rand(1, L, D, 16, device=device), torch.randn(1, L, D, 16, device=device)
        t = interleaved({"loop": lambda: ps.scan_sequential(a, b), "pscan": lambda: ps.pscan(a, b)},
                        args.repeats, device)
        rows.append([f"(1, {L}, {D}, 16)", D * 16, f"{t['loop']:.1f}", f"{t['pscan']:.1f}",
                     f"{t['pscan'] / t['loop']:.2f}"])
    table("forward only: median ms, and pscan / loop (above 1: the loop is faster)",
          ["(B, L, D, N)", "width", "loop ms", "pscan ms", "pscan / loop"], rows)


# ------------------------------------------------------------------------------------------------
# y = selective_scan(x, Δ, A, B, C, D, z)
# ------------------------------------------------------------------------------------------------

def selective_inputs(B, L, D, N, device="cpu", requires_grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, L, D, generator=g)
    delta = torch.nn.functional.softplus(torch.randn(B, L, D, generator=g) - 2)
    A = -torch.arange(1, N + 1.0).repeat(D, 1)
    Bm, Cm = torch.randn(B, L, N, generator=g), torch.randn(B, L, N, generator=g)
    Dv, z = torch.ones(D), torch.randn(B, L, D, generator=g)
    return [t.to(device).requires_grad_(requires_grad) for t in (x, delta, A, Bm, Cm, Dv, z)]


SELECTIVE_VARIANTS = {
    "sequential": dict(backend="sequential"),
    "pscan": dict(backend="pscan"),
    "fused eager": dict(backend="fused", recompute=False),
    "fused eager + recompute": dict(backend="fused", recompute=True),
    "compiled": dict(compile=True, recompute=False),
    "compiled + recompute": dict(compile=True, recompute=True),
    "compiled, loop too": dict(compile="loop", recompute=False),  # forward only, long shape only
}


def loop_label(name, kw):
    """A row's name, saying so where compile="loop" fell back to one compiled call per chunk
    (mamba_minimal warns once and then runs the per-chunk path, whose figures the row shows)."""
    if kw.get("compile") == "loop" and not mm._compiled_loop_works:
        return f"{name} [fell back: one compiled call per chunk]"
    return name


def bench_selective(args, device, shapes=None):
    if shapes is None:
        shapes = [(12, 64, 256, 16), (1, 4096, 256, 16)]
        if device.type == "cuda":
            shapes.append((8, 2048, 1536, 16))
        if args.quick:
            shapes = [(2, 64, 64, 16)]
    rows, compile_rows = [], []
    for shape in shapes:
        # The compiled chunk is compiled with static shapes and fullgraph=True: each shape and
        # each kind of call (no grad, autograd, the recomputing backward's forward) is a graph of
        # its own, about four per shape, and past torch's recompile limit (8 per function) a
        # fullgraph compile fails instead of running eagerly. A fresh start per shape keeps
        # every shape's graphs within the limit.
        torch._dynamo.reset()
        inputs = selective_inputs(*shape, device=device, requires_grad=True)
        variants = dict(SELECTIVE_VARIANTS)
        long = shape[1] >= 2048
        if not long:  # with a backward it runs as "compiled"
            variants.pop("compiled, loop too")
        if long and device.type == "cpu":  # forward only on the CPU: recompute changes nothing
            variants.pop("compiled + recompute")
            variants.pop("fused eager + recompute")

        def fwd(kw):
            with torch.no_grad():
                mm.selective_scan(*inputs, **kw)

        def fb(kw):
            for t in inputs:
                t.grad = None
            mm.selective_scan(*inputs, **kw).sum().backward()

        for name, kw in variants.items():  # first calls: compile time where there is one
            if kw.get("compile"):
                sync(device)
                t0 = time.perf_counter()
                fwd(kw)
                sync(device)
                t1 = time.perf_counter()
                if not (long and device.type == "cpu"):
                    fb(kw)
                sync(device)
                compile_rows.append([str(shape), loop_label(name, kw), f"{t1 - t0:.1f}",
                                     f"{time.perf_counter() - t1:.1f}"])
        reps = max(3, args.repeats // (2 if long else 1))
        t_f = interleaved({k: (lambda kw=kw: fwd(kw)) for k, kw in variants.items()}, reps, device)
        t_b = {}
        if not (long and device.type == "cpu"):
            t_b = interleaved({k: (lambda kw=kw: fb(kw)) for k, kw in variants.items()}, reps, device)
        for k in variants:
            rows.append([str(shape), loop_label(k, variants[k]), f"{t_f[k]:.1f}", f"{t_f['sequential'] / t_f[k]:.2f}",
                         f"{t_b[k]:.1f}" if t_b else "", f"{t_b['sequential'] / t_b[k]:.2f}" if t_b else ""])
    table("y = selective_scan(...): median ms, and speed-up over the eager sequential backend",
          ["(B, L, ED, N)", "path", "fwd ms", "speed-up", "fwd+bwd ms", "speed-up"], rows)
    table("first call (compile) in seconds, forward then forward+backward",
          ["(B, L, ED, N)", "path", "fwd s", "fwd+bwd s"], compile_rows)
    if device.type == "cpu" and sys.platform == "linux" and not args.no_memory and not args.quick:
        shape = [1, 4096, 1536, 16]
        mem_rows = []
        for name in ("pscan", "compiled", "compiled + recompute"):
            m = memory_in_subprocess({"kind": "selective", "shape": shape, "kwargs": SELECTIVE_VARIANTS[name]})
            mem_rows.append([str(tuple(shape)), name, f"{m['mb']:.0f}", f"{m['tensors']:.2f}"])
        base = float(mem_rows[0][2])
        for r in mem_rows:
            r.append(f"{float(r[2]) / base:.3f}")
        table("peak memory of selective_scan forward+backward beyond its inputs",
              ["(B, L, ED, N)", "path", "MiB", "(B, L, ED, N) tensors", "/ pscan"], mem_rows)


# ------------------------------------------------------------------------------------------------
# One training step of a small language model
# ------------------------------------------------------------------------------------------------

def training_step(model, ids, vocab, autocast=None):
    """A function that runs one training step of model on the batch ids (B, L + 1): forward,
    cross-entropy on the next character, backward, AdamW. Every training table times this."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # as the trainer's
    autocast = autocast or contextlib.nullcontext()

    def step():
        with autocast:
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits[..., :vocab].float().flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def training_step_table(title, models, ids, vocab, args, device, autocast=None):
    """Time one training step of each model (the first, which may compile, apart), interleaved,
    and print ms, the ratio to the eager "GPT (yardstick)" and tokens/s."""
    steps, first = {}, {}
    for name, model in models.items():
        steps[name] = training_step(model.to(device), ids, vocab, autocast)
        t0 = time.perf_counter()
        steps[name]()
        sync(device)
        first[name] = time.perf_counter() - t0
    t = interleaved(steps, args.repeats, device)
    gpt = t["GPT (yardstick)"]
    tokens = ids.shape[0] * (ids.shape[1] - 1)
    rows = [[name, f"{sum(p.numel() for p in models[name].parameters()) / 1e6:.2f}M", f"{t[name]:.1f}",
             f"{t[name] / gpt:.2f}", f"{tokens / t[name] * 1e3:,.0f}", f"{first[name]:.1f}"] for name in models]
    table(title, ["model", "params", "ms/iter", "/GPT", "tokens/s", "first step s"], rows)


def bench_train(args, device):
    """The trainer's default Mamba (d_state 2, eager, backend "auto") against the GPT yardstick and
    Mamba-2's default, with the alternatives beside it: the read path (sections 2 and 3 under
    autograd), d_state 4 and 16, each scan backend, the fused path eager and compiled."""
    import mamba2_minimal as m2
    gpu = dict(d_model=384, n_layer=7) if device.type == "cuda" else {}  # on a GPU: wider, as the GPU defaults
    batch, block, vocab = (2, 16, 65) if args.quick else (12, 64, 65)
    ids = torch.randint(0, vocab, (batch, block + 1), device=device)
    models = {}
    for name, kw in [("mamba default (d_state 2, auto)", {}),
                     ("mamba read path (reference)", dict(scan_backend="reference")),
                     ("mamba d_state 4", dict(d_state=4)),
                     ("mamba d_state 16", dict(d_state=16)),
                     ("mamba sequential", dict(scan_backend="sequential")),
                     ("mamba pscan", dict(scan_backend="pscan")),
                     ("mamba fused eager", dict(scan_backend="fused")),
                     ("mamba fused compiled", dict(compile_scan=True)),
                     ("mamba d_state 16, fused compiled", dict(d_state=16, compile_scan=True))]:
        if args.quick and kw.get("compile_scan"):
            continue
        models[name] = trainer_mamba(vocab, **dict(gpu, **kw))
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


def trainer_default(arch, *keys):
    """The values of keys in train_shakespeare.py's CPU defaults for arch ("mamba" or "gpt")."""
    from train_shakespeare import ARCH_DEFAULTS, DEFAULTS
    settings = dict(DEFAULTS["cpu"], **ARCH_DEFAULTS[arch].get("cpu", {}))
    return {key: settings[key] for key in keys}


def trainer_mamba(vocab, **kw):
    """The trainer's default CPU Mamba (its d_model, n_layer and d_state), kw overriding them."""
    torch.manual_seed(0)
    shape = trainer_default("mamba", "d_model", "n_layer", "d_state")
    return mm.MambaLM(mm.MambaConfig(**dict(shape, vocab_size=vocab, **kw)))


def trainer_gpt(vocab, block, **kw):
    """The trainer's default CPU GPT yardstick (its d_model, n_layer and n_head), kw overriding them."""
    torch.manual_seed(0)
    shape = trainer_default("gpt", "d_model", "n_layer", "n_head")
    return TinyGPT(GPTConfig(**dict(shape, vocab_size=vocab, block_size=block, **kw)))


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
# The race: equal wall-clock budgets, whole training runs
# ------------------------------------------------------------------------------------------------
# A step's cost is half of the story: Mamba learns more per step than the GPT. The fair comparison
# trains both for the same time, each with its learning-rate schedule fitted to that time (the
# trainer's --max-time), on the same data and the same evaluation windows, one run after the
# other so that they share the machine's state, and repeats to show the spread.

RACERS = {  # --racers names: (row label, the trainer's flags); each runs with its own defaults
    "gpt": ("GPT (yardstick)", ["--arch", "gpt"]),
    "mamba": ("mamba (default)", []),
    "mamba2": ("mamba2 (default)", ["--arch", "mamba2"]),
    "mamba3": ("mamba3 (default)", ["--arch", "mamba3"]),
    # the default Mamba under each precision, named so that the race means the same whatever the
    # device's default --dtype is
    "mamba_fp32": ("mamba, --dtype fp32", ["--dtype", "fp32"]),
    "mamba_bf16": ("mamba, --dtype bf16", ["--dtype", "bf16"]),
}


def race_curve(log_path):
    """[(elapsed s, val loss)] from a train_shakespeare.py log.jsonl, in order."""
    with open(log_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(row["elapsed"], row["val_loss"]) for row in rows if "val_loss" in row]


def race_summary(curves, budget):
    """curves: {racer: [curve per run]} -> (rows of val loss at common times, rows of best val per
    racer with its spread over the runs, the margin: the GPT's mean best val minus Mamba's, and the
    largest spread). The trainer evaluates when its clock passes k/n of the budget (k = 1..n), a
    little later for a slower step, so each curve is read at those n times: the latest evaluation
    made before the next one was due."""
    names = list(curves)
    n = max(len(c) for runs in curves.values() for c in runs)

    def val_at(curve, k):  # the last evaluation of slot k or earlier, None before the first
        due = [v for t, v in curve if min(int(t * n / budget), n) <= k]
        return due[-1] if due else None

    curve_rows = []
    for k in range(1, n + 1):
        vals = [[v for v in (val_at(c, k) for c in curves[name]) if v is not None] for name in names]
        means = [statistics.mean(v) if v else None for v in vals]
        margin = f"{means[0] - means[1]:+.4f}" if None not in means else ""
        curve_rows.append([f"{budget * k / n:.0f}"] + [f"{m:.4f}" if m is not None else "" for m in means] + [margin])
    best = {name: [min(v for _, v in c) for c in runs] for name, runs in curves.items()}
    best_rows = [[name, f"{statistics.mean(b):.4f}", f"{min(b):.4f}", f"{max(b):.4f}", f"{max(b) - min(b):.4f}",
                  " ".join(f"{v:.4f}" for v in b)] for name, b in best.items()]
    margin = statistics.mean(best[names[0]]) - statistics.mean(best[names[1]])
    return curve_rows, best_rows, margin, max(max(b) - min(b) for b in best.values())


def train_runs(group, args, device, env):
    """Train each (label, trainer flags, out_dir) of group with train_shakespeare.py for
    --max-time seconds: one after the other, or all at once with --together. Yields (label, its
    val curve, (steps, ms per step)) per run, in order."""
    trainer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_shakespeare.py")
    started = []
    for label, flags, out_dir in group:
        if os.path.exists(os.path.join(out_dir, "log.jsonl")):
            os.remove(os.path.join(out_dir, "log.jsonl"))  # a fresh run, not an appended one
        cmd = [sys.executable, trainer, "--max-time", str(args.max_time), "--out-dir", out_dir,
               "--device", str(device), "--no-sample"] + flags + (["--data", args.data] if args.data else [])
        print(f"  {label}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
        started.append((label, out_dir, proc))
        if not args.together:
            proc.wait()
    for label, out_dir, proc in started:
        if proc.wait() != 0:
            raise SystemExit(f"{label}'s run failed (exit {proc.returncode}); see {out_dir}")
        log_path = os.path.join(out_dir, "log.jsonl")
        with open(log_path) as f:
            last = [json.loads(line) for line in f if line.strip() and '"step"' in line][-1]
        yield label, race_curve(log_path), (last["step"], last["elapsed"] / last["step"] * 1e3)


def bench_race(args, device):
    """The GPT yardstick and the default Mamba (or the models --racers names), each trained by
    train_shakespeare.py for --max-time seconds, --runs times; their val curves at equal times, each
    one's best val with its spread over the runs, and the margin between the first two. One after
    the other by default; with --together the models of a run train at the same time, one thread
    each unless --threads says otherwise, so that a busy machine slows them alike."""
    names = args.racers.split(",")  # checked by check_args
    out_root = args.out_dir or os.path.join("out", "race")
    threads = args.threads or (1 if args.together else None)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    curves = {RACERS[n][0]: [] for n in names}
    speed = {RACERS[n][0]: [] for n in names}
    for run in range(args.runs):
        group = [(RACERS[name][0], RACERS[name][1], os.path.join(out_root, f"{name}-{run}")) for name in names]
        print(f"run {run + 1}/{args.runs}", flush=True)
        for label, curve, steps_ms in train_runs(group, args, device, env):
            curves[label].append(curve)
            speed[label].append(steps_ms)
    curve_rows, best_rows, margin, spread = race_summary(curves, args.max_time)
    labels = list(curves)
    how = "at the same time" if args.together else "one after the other"
    table(f"val loss at equal times, mean of {args.runs} run(s) of {args.max_time:g} s each, {how}"
          f"{f', {threads} thread(s) each' if threads else ''}",
          ["seconds"] + labels + [f"{labels[0]} - {labels[1]}"], curve_rows)
    table("best val loss over each run", ["model", "mean", "min", "max", "spread", "runs"], best_rows)
    table("steps in the budget, and ms per step (evaluations included)", ["model", "steps", "ms/step"],
          [[label, " ".join(str(n) for n, _ in runs), " ".join(f"{ms:.0f}" for _, ms in runs)]
           for label, runs in speed.items()])
    print(f"\nmargin at equal time ({labels[0]}'s mean best val - {labels[1]}'s): {margin:+.4f}; "
          + race_verdict(margin, spread, args.runs, labels))


def race_verdict(margin, spread, runs, labels):
    """What the margin (first racer's mean best val - second's) says, against the largest spread
    over the runs: a margin inside the spread is a tie, and one run has no spread to judge by."""
    if runs < 2:
        return "no verdict: one run per model has no spread to judge the margin by (--runs 2 or more)"
    verdict = "a tie: the margin is inside the spread" if abs(margin) <= spread else \
        (f"{labels[1]} ahead" if margin > 0 else f"{labels[0]} ahead")
    return f"largest spread over runs {spread:.4f}: {verdict}"


# The CPU defaults of both models, checked at the 300 s budget by the same small grid around each
# one's defaults: the learning rate halved and doubled, two other shapes of about the same size
# (for Mamba, one is a larger state), and twice the batch. Point i of each model trains at the same
# time as point i of the other, one thread each, so that the machine's load falls on both alike.
# One run per point: a point replaces a default only if it beats it by more than 0.01 (Mamba's
# run-to-run spread in `bench.py race` on a quiet machine is 0.001-0.003, the GPT's 0.001-0.011).
# The trainer evaluates eval_iters batches of the run's batch size, drawn from one fixed stream of
# windows: batch 24 with --eval-iters 10 scores the same 240 windows as the others' 20 batches of 12.
SWEEP_GRID = {
    "mamba": [[], ["--lr", "3e-3"], ["--lr", "1.2e-2"], ["--d-state", "8"],
              ["--n-layer", "5", "--d-model", "160"], ["--batch-size", "24", "--eval-iters", "10"]],
    "gpt": [[], ["--lr", "5e-4"], ["--lr", "2e-3"], ["--n-layer", "6", "--d-model", "112"],
            ["--n-layer", "2", "--d-model", "192", "--n-head", "6"], ["--batch-size", "24", "--eval-iters", "10"]],
}
# Round 2 (--round 2), two points each around round 1's winners (Mamba: 5 layers of width 160; the
# GPT: 2 layers of width 192, and lr 2e-3): shallower and wider again, and the GPT's two combined.
SWEEP_ROUND_2 = {
    "mamba": [["--n-layer", "4", "--d-model", "176"], ["--n-layer", "3", "--d-model", "208"]],
    "gpt": [["--n-layer", "2", "--d-model", "192", "--n-head", "6", "--lr", "2e-3"],
            ["--n-layer", "3", "--d-model", "160", "--n-head", "5", "--lr", "2e-3"]],
}
# Round 3 (--round 3), two points each around the defaults that rounds 1 and 2 chose, each a
# cheaper step: Mamba with fewer states per channel, the GPT with one wider layer or fewer heads.
SWEEP_ROUND_3 = {
    "mamba": [["--d-state", "2"], ["--d-state", "1"]],
    "gpt": [["--n-layer", "1", "--d-model", "256", "--n-head", "8"], ["--n-head", "3"]],
}
# Round 4 (--round 4), two points each around round 3's defaults (Mamba at d_state 2): one layer
# fewer and wider, one more and narrower, at about the same size; the GPT narrower and wider.
SWEEP_ROUND_4 = {
    "mamba": [["--n-layer", "4", "--d-model", "176"], ["--n-layer", "6", "--d-model", "144"]],
    "gpt": [["--d-model", "176", "--n-head", "4"], ["--d-model", "208", "--n-head", "8"]],
}
# Each round's points are changes to the defaults of its time, spelled out so that a round
# measures the same runs whatever the trainer's defaults are.
_GPT_2_X_192 = ["--n-layer", "2", "--d-model", "192", "--n-head", "6"]
SWEEP_ROUNDS = {
    1: ({"mamba": ["--n-layer", "7", "--d-model", "128", "--d-state", "4"],
         "gpt": ["--n-layer", "4", "--d-model", "128", "--n-head", "4"]}, SWEEP_GRID),
    2: ({"mamba": ["--n-layer", "5", "--d-model", "160", "--d-state", "4"], "gpt": _GPT_2_X_192}, SWEEP_ROUND_2),
    3: ({"mamba": ["--n-layer", "5", "--d-model", "160", "--d-state", "4"], "gpt": _GPT_2_X_192}, SWEEP_ROUND_3),
    4: ({"mamba": ["--n-layer", "5", "--d-model", "160", "--d-state", "2"], "gpt": _GPT_2_X_192}, SWEEP_ROUND_4),
}


def with_flags(base, point):
    """The trainer's flags base (pairs "--name", "value") with point's on top: a flag point sets
    replaces base's, so that the command names it once."""
    merged = dict(zip(base[::2], base[1::2]))
    merged.update(zip(point[::2], point[1::2]))
    return [token for pair in merged.items() for token in pair]


def bench_sweep(args, device):
    """The points of round --round (SWEEP_ROUNDS), each trained by train_shakespeare.py for
    --max-time seconds, paired as above; per model, each point's steps, ms per step and best val
    (round 1: also against its first point, the defaults of that time)."""
    out_root = os.path.join(args.out_dir or os.path.join("out", "sweep"), f"round-{args.round}")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads or 1))
    base, grid = SWEEP_ROUNDS[args.round]
    pairs = list(zip(grid["mamba"], grid["gpt"]))
    results = {"mamba": [], "gpt": []}
    for i, (mamba_flags, gpt_flags) in enumerate(pairs):
        print(f"point {i + 1}/{len(pairs)}", flush=True)
        group = [("mamba", with_flags(base["mamba"], mamba_flags), os.path.join(out_root, f"mamba-{i}")),
                 ("gpt", ["--arch", "gpt"] + with_flags(base["gpt"], gpt_flags), os.path.join(out_root, f"gpt-{i}"))]
        runs = train_runs(group, argparse.Namespace(**dict(vars(args), together=True)), device, env)
        for (name, flags), (_, curve, (steps, ms)) in zip((("mamba", mamba_flags), ("gpt", gpt_flags)), runs):
            results[name].append((" ".join(flags) or "(defaults)", steps, ms, min(v for _, v in curve)))
    for name, rows in results.items():
        default = rows[0][3] if args.round == 1 else None  # later rounds have no defaults' row
        table(f"{name}: round {args.round} (from {' '.join(base[name])}), {args.max_time:g} s each, one "
              f"thread, best val", ["flags", "steps", "ms/step", "best val"] + (["- defaults'"] if default else []),
              [[f, str(n), f"{ms:.0f}", f"{v:.4f}"] + ([f"{v - default:+.4f}"] if default else [])
               for f, n, ms, v in rows])


# ------------------------------------------------------------------------------------------------
# Generation: the cost of one more token
# ------------------------------------------------------------------------------------------------

def bench_generate(args, device):
    torch.manual_seed(0)
    vocab = 65
    model = mm.MambaLM(mm.MambaConfig(d_model=256, n_layer=4, vocab_size=vocab)).to(device).eval()
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
# Loading a large checkpoint in bf16: python bench.py load
# ------------------------------------------------------------------------------------------------
# from_pretrained(dtype=torch.bfloat16) builds the model on the meta device (shapes, no storage)
# and assigns the checkpoint's tensors to it, so memory holds the weights once, in bf16. The plain
# way, an fp32 model built and initialized, then the weights loaded and cast, peaks at the fp32
# model plus the file's tensors. Both at mamba-1.4b's shape (48 layers of width 2048, vocabulary
# 50,277) with random weights saved in bf16, each load in a subprocess of its own (peak RSS, with
# every weight read once: safetensors maps the file, and a mapped page is resident once read).

LOAD_SHAPE = dict(d_model=2048, n_layer=48, vocab_size=50277)  # state-spaces/mamba-1.4b's config.json


def load_case(spec):
    folder, shape = spec["folder"], spec["shape"]

    def run():
        if spec["how"] == "from_pretrained":
            model = mm.MambaLM.from_pretrained(folder, dtype=torch.bfloat16)
        else:  # the plain way
            model = mm.MambaLM(mm.MambaConfig(**shape))
            model.load_state_dict(mm._load_state_dict_file(folder), strict=False)  # tied head: one key
            model.to(torch.bfloat16)
        for p in model.parameters():  # read every page: a memory-mapped file counts once it is read
            p.detach().view(-1)[::1024].sum()
    print(json.dumps({"gib": peak_extra_bytes(run) / 2**30}))


def bench_load(args, device):
    """Peak memory of loading a 1.4B-parameter Mamba in bf16, the meta-device way and the plain way."""
    import tempfile
    shape = dict(d_model=128, n_layer=2, vocab_size=1000) if args.quick else LOAD_SHAPE
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)  # the checkpoint in bf16, as the hub's are stored
        try:
            model = mm.MambaLM(mm.MambaConfig(**shape))
        finally:
            torch.set_default_dtype(torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        weights = n_params * 2 / 2**30
        rows = []
        for how in ("from_pretrained", "fp32 model, load, cast"):
            gib = memory_in_subprocess({"kind": "load", "folder": folder, "how": how, "shape": shape})["gib"]
            rows.append([how, f"{gib:.2f}", f"{gib / weights:.2f}"])
    table(f"peak memory of a bf16 load, GiB above the process's start: {n_params / 1e9:.2f}B parameters "
          f"({'a toy' if args.quick else 'mamba-1.4b'}'s shape), {weights:.2f} GiB of bf16 weights", ["load", "peak GiB", "/ the bf16 weights"], rows)


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
    """Our model of that generation and config (random weights), or None with the reason."""
    import mamba2_minimal as m2
    import mamba3_minimal as m3
    cls, cfg_cls = {1: (mm.MambaLM, mm.MambaConfig), 2: (m2.Mamba2LM, m2.Mamba2Config),
                    3: (m3.Mamba3LM, m3.Mamba3Config)}[generation]
    known = {f.name for f in dataclass_fields(cfg_cls)}
    missing = sorted(set(kw) - known)
    if missing:
        return None, f"{cfg_cls.__name__} has no {missing}"
    return cls(cfg_cls(**kw)).eval(), None


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
        ours, why = decode_model(generation, dict(kw, vocab_size=65) if args.quick else kw)
        if ours is None and "d_intermediate" in kw:  # a model without hybrid layers: its mixers alone
            shape = f"{shape} without its MLPs ({why})"
            ours, why = decode_model(generation, {k: v for k, v in kw.items() if k != "d_intermediate"})
        if ours is None:
            rows.append([shape, "", "ours", "", "", f"not run: {why}"])
            continue
        ours = ours.to(device)
        prompt = torch.randint(0, ours.cfg.vocab_size, (1, prompt_len), device=device)
        def ours_decode(n):
            times = [time.perf_counter() for _ in ours.generate_stream(prompt, n + 1, top_k=1)]
            return times[-1] - times[0]

        def ours_compiled_decode(n):
            times = [time.perf_counter() for _ in ours.generate_stream(prompt, n + 1, top_k=1, compile=True)]
            return times[-1] - times[0]

        cands = {"ours": dict(prefill=lambda: ours.prefill(prompt), decode=ours_decode,
                              tokens=lambda n: ours.generate(prompt, n, top_k=1))}
        if not args.no_compile:
            t0 = time.perf_counter()
            assert torch.equal(ours.generate(prompt, 4, top_k=1, compile=True), ours.generate(prompt, 4, top_k=1))
            compile_note = f"compiling took {time.perf_counter() - t0:.0f} s"
            cands["ours, compiled step"] = dict(prefill=lambda: ours.prefill(prompt), decode=ours_compiled_decode)
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
          f"generate(..., compile=True), its compile time apart",
          ["shape", "threads", "implementation", "prefill tokens/s", "decode tokens/s", "note"], rows)


# ------------------------------------------------------------------------------------------------
# Mamba-2: SSD against Mamba-1's selective scan, and the training step
# ------------------------------------------------------------------------------------------------

def ssd_inputs(b, L, H, P, G, N, device="cpu", requires_grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, L, H, P, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, L, H, generator=g) - 2)
    A = -torch.arange(1, H + 1.0)
    Bm, Cm = torch.randn(b, L, G, N, generator=g), torch.randn(b, L, G, N, generator=g)
    return [t.to(device).requires_grad_(requires_grad) for t in (x, dt, A, Bm, Cm, torch.ones(H))]


def bench_mamba2_ssd(args, device):
    """Mamba-1's selective scan and block against Mamba-2's SSD and block at equal width:
    d_model 128, so ED = 256 channels, as 8 heads of 32 for Mamba-2 (N = 16 vs 64), each eager
    and compiled."""
    import mamba2_minimal as m2
    shapes = [(2, 64)] if args.quick else [(12, 64), (1, 4096)]
    d_model = 128
    ssd_compiled = torch.compile(m2.ssd, dynamic=False)
    rows = []
    for b, L in shapes:
        sel = selective_inputs(b, L, 2 * d_model, 16, device=device, requires_grad=True)
        ssd_in = ssd_inputs(b, L, 8, 32, 1, 64, device=device, requires_grad=True)
        torch.manual_seed(0)
        u = torch.randn(b, L, d_model, device=device, requires_grad=True)
        mixer1 = {c: mm.MambaMixer(mm.MambaConfig(d_model=d_model, n_layer=1, vocab_size=65, compile_scan=c)).to(device)
                  for c in (False, True)}
        mixer2 = {(T, c): m2.Mamba2Mixer(m2.Mamba2Config(d_model=d_model, n_layer=1, vocab_size=65, headdim=32,
                                                         d_state=64, chunk_size=T, compile_mixer=c)).to(device)
                  for T in (64, 256) for c in (False, True)}
        cases = {  # path: (eager, compiled)
            "Mamba-1 scan (N 16), pscan | compiled chunked":
                (lambda: mm.selective_scan(*sel, backend="pscan"), lambda: mm.selective_scan(*sel, compile=True)),
            "Mamba-2 SSD (N 64), chunk 64":
                (lambda: m2.ssd(*ssd_in[:5], 64, ssd_in[5]), lambda: ssd_compiled(*ssd_in[:5], 64, ssd_in[5])),
            "Mamba-2 SSD, chunk 256":
                (lambda: m2.ssd(*ssd_in[:5], 256, ssd_in[5]), lambda: ssd_compiled(*ssd_in[:5], 256, ssd_in[5])),
            "Mamba-1 block (default) | compile_scan": (lambda: mixer1[False](u), lambda: mixer1[True](u)),
            "Mamba-2 block, chunk 64 | compile_mixer": (lambda: mixer2[64, False](u), lambda: mixer2[64, True](u)),
            "Mamba-2 block, chunk 256 | compile_mixer": (lambda: mixer2[256, False](u), lambda: mixer2[256, True](u)),
        }
        if L <= 64:  # at L = 64 a chunk of 256 is the chunk of 64
            cases = {k: v for k, v in cases.items() if "256" not in k}
        params = sel + ssd_in + [u] + [p for m in list(mixer1.values()) + list(mixer2.values()) for p in m.parameters()]

        def fwd(fn):
            with torch.no_grad():
                fn()

        def fb(fn):
            for p in params:
                p.grad = None
            fn().sum().backward()

        runs = {(k, kind): fn for k, pair in cases.items() for kind, fn in zip(("eager", "compiled"), pair)}
        reps = max(3, args.repeats // (2 if L >= 2048 else 1))
        t_f = interleaved({key: (lambda fn=fn: fwd(fn)) for key, fn in runs.items()}, reps, device)
        t_b = interleaved({key: (lambda fn=fn: fb(fn)) for key, fn in runs.items()}, reps, device)
        for k in cases:
            ref = "Mamba-1 block (default) | compile_scan" if "block" in k else "Mamba-1 scan (N 16), pscan | compiled chunked"
            cells = []
            for t in (t_f, t_b):
                for kind in ("eager", "compiled"):
                    cells.append(f"{t[(k, kind)]:.1f} ({t[(ref, 'eager')] / t[(k, kind)]:.2f}x)")
            rows.append([f"({b}, {L})", k] + cells)
    table(f"Mamba-2 SSD vs Mamba-1's selective scan, d_model {d_model} (ED 256: Mamba-2 as 8 heads of 32): median "
          "ms (speed-up over the eager Mamba-1 scan, or the eager Mamba-1 block for block rows); a path 'a | b' runs "
          "a eagerly and b compiled",
          ["(B, L)", "path", "fwd eager", "fwd compiled", "fwd+bwd eager", "fwd+bwd compiled"], rows)


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
    models["mamba 128 x 7, d_state 4"] = mm.MambaLM(
        mm.MambaConfig(d_model=d_model, n_layer=7, vocab_size=vocab, d_state=4))
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
    "mamba3 SISO, d_state 32, headdim 64, chunk 64 (trainer's CPU default)": dict(d_state=32, headdim=64, chunk_size=64),
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
    models["mamba 128 x 7, d_state 4"] = mm.MambaLM(
        mm.MambaConfig(d_model=128, n_layer=7, vocab_size=vocab, d_state=4))
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


# ------------------------------------------------------------------------------------------------
# A training step on a GPU, modelled without one: python bench.py roofline
# ------------------------------------------------------------------------------------------------
# An eager training step on a GPU is a sequence of kernels, one per PyTorch op, and each takes at
# least the time to move its bytes through the GPU's memory (HBM) and to do its FLOPs: the
# roofline model (Williams, Waterman & Patterson 2009), with each GPU's datasheet peaks,
#
#     a kernel's time = max(bytes / bandwidth, FLOPs / FLOP rate) + KERNEL_US,
#
# a lower bound for the first term: real kernels reach less than the datasheet's peaks. The CPU
# issues the kernels one after another, LAUNCH_US each (Python, dispatch, autograd), and the GPU
# runs each once it is issued and the one before has finished; the step's modelled time is when
# the last one ends. So a step of many small kernels is bound by the CPU, one of few large ones
# by the GPU. The count runs the trainer's real step (forward under bf16 autocast,
# the loss, backward, gradient clipping, fused AdamW) on fake tensors (torch's FakeTensorMode:
# shapes and dtypes, no data, no arithmetic), on the CPU, with the choices the code makes on
# CUDA: the GPU form of the selective scan, no token-range read, foreach gradient clipping. CPU
# autocast's bf16 ops stand for CUDA's (both run matmuls in bf16). A kernel's bytes are the
# distinct elements it reads and writes: a broadcast input once, a view nothing, an in-place op
# its tensor twice. FLOPs are torch's FLOP counter's (torch.utils.flop_counter: matmuls and
# attention; elementwise ops are free against the bandwidth). Peak memory is the most live
# tensor storage at any point of the step, parameters and optimizer state included.
#
# Mamba-1 has a row per eager scan backend of the selective scan's GPU form, one for its CPU
# form (with pscan), to show what the GPU form saves, and the "ideal fused scan": the same step
# with the selective scan replaced by a stand-in that costs exactly one kernel reading its
# inputs and writing its output once in the forward, and one reading the inputs and the
# output's gradient and writing the inputs' gradients once in the backward: what a kernel that
# keeps the states on chip (the paper's §3.3, the official selective_scan_cuda) moves at best.

KERNEL_US = 3.0  # an eager kernel's fixed cost on the GPU (launch latency, ramp-up and tail): an assumption
LAUNCH_US = 8.0  # what issuing one eager op costs the CPU (Python, dispatch, autograd): an assumption
ROOFLINE_GPUS = {  # datasheet peaks: HBM bytes/s; dense FLOP/s of bf16 (fp16 on the T4) and fp32
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 3.35 TB/s, BF16 989 TFLOPS (1,979 with
    # sparsity), FP32 67 TFLOPS, 80 GB
    "H100 SXM": dict(bandwidth=3.35e12, half=989e12, fp32=67e12),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 4.8 TB/s, the H100's compute, 141 GB
    "H200": dict(bandwidth=4.8e12, half=989e12, fp32=67e12),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: 2,039 GB/s, BF16 312 TFLOPS, FP32 19.5
    "A100 80GB": dict(bandwidth=2.039e12, half=312e12, fp32=19.5e12),
    # NVIDIA T4 Tensor Core GPU datasheet: 320 GB/s, mixed-precision FP16 65 TFLOPS, FP32 8.1 TFLOPS,
    # 16 GB; no bf16 (the trainer takes --dtype fp16 there: the same bytes)
    "T4": dict(bandwidth=320e9, half=65e12, fp32=8.1e12),
}
# the eager scans; "associative" asks torch for a compiled scan on CUDA, which no count of eager ops sees
ROOFLINE_BACKENDS = ("sequential", "pscan", "hillis_steele", "two_level")
ROOFLINE_ARCHS = ("mamba", "mamba2", "mamba3", "gpt")


def _unique_bytes(t):
    """The bytes of the distinct elements of t: a broadcast (stride-0) dimension counts once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


class StepCounter(TorchDispatchMode):
    """Counts every kernel that runs under it: (op, phase, bytes, FLOPs, half precision or not,
    shape of the first tensor argument) in self.kernels, and the live tensor bytes (self.live,
    with its highest value in self.peak)."""

    NO_KERNEL = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
                 "lift_fresh", "_local_scalar_dense", "set_", "resize_", "_to_copy_noop")
    WRITE_ONLY = ("zero_", "fill_", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
                  "new_zeros", "new_ones", "new_full", "scalar_tensor", "arange")

    def __init__(self):
        super().__init__()
        self.kernels, self.phase = [], "setup"
        self.live, self.peak, self._storages = 0, 0, {}

    def record(self, op, nbytes, flops=0, half=False, shape=()):
        self.kernels.append(dict(op=op, phase=self.phase, bytes=nbytes, flops=flops, half=half, shape=shape))

    def _track(self, t):
        storage = t.untyped_storage()
        if id(storage) in self._storages:
            return
        self._storages[id(storage)] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)

        def free(key=id(storage), nbytes=storage.nbytes()):
            self.live -= nbytes
            self._storages.pop(key, None)
        weakref.finalize(storage, free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outputs:
            self._track(t)
        name = func._schema.name.split("::")[-1]
        written = [a for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        views = not written and all(t.untyped_storage()._cdata in inputs for t in outputs)  # _unsafe_view too
        if name in self.NO_KERNEL or (outputs and views) or not (outputs or written):
            return out
        by_name = dict(zip([a.name for a in func._schema.arguments], args), **kwargs)
        out_args = {a.name for a in written if a.kwarg_only}  # out=: written, never read
        reads = [t for key, value in by_name.items() if key not in out_args and name not in self.WRITE_ONLY
                 and not (name == "copy_" and key == "self") for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        fresh = [t for t, r in zip(outputs, func._schema.returns) if r.alias_info is None]
        writes = fresh + [t for a in written for t in tree_flatten(by_name.get(a.name))[0] if isinstance(t, torch.Tensor)]
        flops, packet = 0, func._overloadpacket
        if packet in flop_counter.flop_registry:
            flops = flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
        elif "scaled_dot_product" in name:  # the CPU's attention kernels: the registry's formulas
            q, k, v = args[:3] if "backward" not in name else args[1:4]
            flops = (flop_counter.sdpa_backward_flop_count(args[0].shape, q.shape, k.shape, v.shape)
                     if "backward" in name else flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape))
        half = bool(flops) and reads[0].dtype in (torch.bfloat16, torch.float16)
        first = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
        self.record(name, sum(map(_unique_bytes, reads + writes)), flops, half,
                    tuple(first.shape) if first is not None else ())
        return out


class _IdealScan(torch.autograd.Function):
    """The selective scan as one ideal kernel each way: reads its inputs once and writes y once;
    the backward reads the inputs and grad_y once and writes each gradient once. No arithmetic:
    it stands in for the scan inside StepCounter."""
    counter = None

    @staticmethod
    def forward(ctx, *inputs):
        x, B = inputs[0], inputs[3]
        ctx.save_for_backward(*inputs)
        _IdealScan.counter.record("ideal selective scan", sum(_unique_bytes(t) for t in inputs if t is not None)
                                  + _unique_bytes(x))
        h_last = x.new_empty(x.shape[0], x.shape[2], B.shape[2], dtype=torch.float32)
        return torch.empty_like(x), h_last  # (b, L, ED), (b, ED, N)

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        inputs = ctx.saved_tensors
        live = [t for t in inputs if t is not None]
        _IdealScan.counter.record("ideal selective scan, backward",
                                  2 * sum(map(_unique_bytes, live)) + _unique_bytes(grad_y))
        return tuple(None if t is None else torch.empty_like(t) for t in inputs)


def _ideal_selective_scan(x, delta, A, B, C, D=None, z=None, h0=None, return_last_state=False, **_):
    y, h_last = _IdealScan.apply(x, delta, A, B, C, D, z, h0)
    return (y, h_last) if return_last_state else y


def roofline_step(arch, flags=(), scan=None, gpu_form=True):
    """One training step of the trainer's model for arch at its CUDA defaults (flags override
    them, as on the trainer's command line), counted by a StepCounter. scan: a backend for
    Mamba-1, or "ideal" for the ideal fused scan; gpu_form=False runs the selective scan's CPU
    form instead. Returns (counter, the filled-in arguments, parameter count)."""
    from unittest import mock
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    import train_shakespeare as ts
    vocab = 65  # Tiny Shakespeare's characters
    args = ts.parse_args(["--arch", arch, "--dtype", "bf16", *flags]
                         + (["--scan-backend", scan] if scan not in (None, "ideal") else []))
    ts.fill_defaults(args, torch.device("cuda"))
    counter = StepCounter()
    _IdealScan.counter = counter
    as_on_cuda = [mock.patch.object(mm, "_gpu_form", lambda device: gpu_form),  # the scan's GPU form
                  mock.patch.object(mm, "_check_token_range", lambda *a, **k: None)]  # skipped off the CPU
    if scan == "ideal":
        as_on_cuda.append(mock.patch.object(mm, "selective_scan", _ideal_selective_scan))
    with contextlib.ExitStack() as stack:
        for patch in as_on_cuda:
            stack.enter_context(patch)
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(counter)  # from the start: the parameters count as live memory
        model = ts.build_model(arch, ts.model_kwargs(args, vocab))
        optimizer = torch.optim.AdamW(model.optim_groups(args.weight_decay), lr=args.lr, fused=True)
        ids = torch.randint(0, vocab, (args.batch_size, args.block_size + 1))
        x, y = ids[:, :-1], ids[:, 1:]
        for _ in range(2):  # the second step is counted: AdamW's state exists by then
            counter.kernels.clear()
            counter.peak = counter.live
            counter.phase = "forward"
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits[..., :vocab].float().flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            counter.phase = "backward"
            loss.backward()
            counter.phase = "optimizer"
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip, foreach=True)  # as on CUDA
            optimizer.step()
            del logits, loss
    return counter, args, sum(p.numel() for p in model.parameters())


def roofline_ms(kernels, gpu):
    """The step's modelled time on gpu (a ROOFLINE_GPUS entry), in ms: the CPU issues a kernel
    every LAUNCH_US, the GPU runs each once issued and once the previous one is done."""
    spec = ROOFLINE_GPUS[gpu]
    issued = done = 0.0
    for k in kernels:
        issued += LAUNCH_US * 1e-6
        work = max(k["bytes"] / spec["bandwidth"], k["flops"] / spec["half" if k["half"] else "fp32"])
        done = max(done, issued) + work + KERNEL_US * 1e-6
    return done * 1e3


def bench_roofline(args, device):
    """The modelled step per architecture (and per scan backend for Mamba-1) at the trainer's
    CUDA defaults, or at the shape --flags gives."""
    flags = shlex.split(args.flags or "")
    cases = []
    for arch in (args.archs.split(",") if args.archs else ROOFLINE_ARCHS):
        if arch != "mamba":
            cases.append((arch, None, True))
            continue
        # the CPU form beside the GPU form, and the ideal fused scan
        cases += [(arch, backend, True) for backend in ROOFLINE_BACKENDS] + [(arch, "pscan", False), (arch, "ideal", True)]
    rows, described = [], None
    for arch, scan, gpu_form in cases:
        counter, filled, n_params = roofline_step(arch, flags, scan, gpu_form)
        kernels = counter.kernels
        if described is None:
            described = (f"batch {filled.batch_size}, block {filled.block_size}, {filled.n_layer} layers of "
                         f"width {filled.d_model}, bf16 autocast")
        label = arch
        if arch == "mamba":
            state = filled.d_state
            width = filled.batch_size * filled.d_model * 2 * state  # one step of the scan: b·ED·N
            chosen = ps.backend_for(torch.device("cuda"), width, needs_grad=False)
            label = (f"mamba (N {state}), ideal fused scan" if scan == "ideal"
                     else f"mamba (N {state}), {scan}, the scan's CPU form" if not gpu_form
                     else f"mamba (N {state}), {scan}{' = auto' if scan == chosen else ''}")
        elif arch in ("mamba2", "mamba3"):
            mimo = f", MIMO rank {filled.mimo_rank}" if getattr(filled, "mimo_rank", None) else ""
            label = f"{arch} (N {filled.d_state}{mimo})"
        gb = sum(k["bytes"] for k in kernels) / 1e9
        tflop = sum(k["flops"] for k in kernels) / 1e12
        rows.append([label, f"{n_params / 1e6:.2f}M", f"{len(kernels):,}", f"{gb:.1f}", f"{tflop:.2f}",
                     f"{counter.peak / 1e9:.1f}"]
                    + [f"{roofline_ms(kernels, gpu):.1f}" for gpu in ROOFLINE_GPUS])
        print(f"  {label}: done", file=sys.stderr, flush=True)
    table(f"MODELLED, not measured: one training step ({described}), forward + backward + clip + "
          f"fused AdamW.\nms: each kernel max(bytes / bandwidth, FLOPs / rate) at the datasheet peaks + "
          f"{KERNEL_US:.0f} µs, issued by the CPU every {LAUNCH_US:.0f} µs; peak: live tensors, GB",
          ["model", "params", "kernels", "GB moved", "matmul TFLOP", "peak GB"]
          + [f"{gpu} ms" for gpu in ROOFLINE_GPUS], rows)


# ------------------------------------------------------------------------------------------------
# What torch.compile makes of each model: python bench.py graphs
# ------------------------------------------------------------------------------------------------
# torch.compile's front end, Dynamo, turns Python into graphs and hands each to a compiler
# (Inductor by default). Where it cannot follow the code it breaks the graph: the piece between
# two graphs runs eagerly, and each graph is a separate compile and a separate call. A compiled
# graph is guarded (input shapes, dtypes, grad mode, ...); a call that fails its guards compiles
# again (a recompile). This table counts both, per phase of a training run: the first and the
# second training step (the second must compile nothing), an evaluation under no_grad, and an
# evaluation of a smaller last batch. Dynamo decides the graphs and the breaks before any
# compiler sees them, so by default every graph goes to Dynamo's "eager" backend, which runs it
# as it is (seconds, where Inductor takes minutes on a CPU); --backend inductor compiles for real.
# The models are small (d_model 32, 2 layers, block 128, batch 4 then 3) and run under bf16
# autocast, as the trainer runs them on a GPU.

GRAPH_CASES = ("mamba --compile", "mamba2 --compile", "mamba --compile-model", "mamba --compile --compile-model",
               "mamba2 --compile-model", "mamba3 --compile-model", "gpt --compile-model")


@contextlib.contextmanager
def compiled_with(backend):
    """torch.compile with `backend` for every function compiled inside (the models' own compiles
    included), from empty caches and counters."""
    import logging
    import mamba2_minimal as m2
    real_compile = torch.compile

    def compile_with(fn=None, **kw):
        if backend != "inductor":
            kw = {k: v for k, v in kw.items() if k not in ("options", "mode")}  # Inductor's settings
        return real_compile(fn, **dict(kw, backend=backend))

    def reset():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch._dynamo.utils.clear_compilation_metrics()
        mm._compiled.clear()
        m2._compiled_forward.cache_clear()

    torch.compile = compile_with
    torch._logging.set_logs(dynamo=logging.ERROR)  # the table says what the graph-break warnings would
    reset()
    try:
        yield
    finally:
        torch.compile = real_compile
        torch._logging.set_logs()
        reset()


def compiles_so_far():
    """(graphs, graph breaks, recompile reasons) that Dynamo has counted since compiled_with began."""
    counters = torch._dynamo.utils.counters
    reasons = [m.recompile_reason for m in torch._dynamo.utils.get_compilation_metrics() if m.recompile_reason]
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), reasons


def short(reason):
    """A Dynamo message on one line, without its explanation and the frame numbers of guards."""
    import re
    reason = " ".join(str(reason).split()).split(" Explanation:")[0]
    return re.sub(r"(^|- )\d+/\d+: ", r"\1", reason)[:150]


def graph_model(case, vocab, block):
    """The model of a GRAPH_CASES row, small, and the function the run calls."""
    import mamba2_minimal as m2
    import mamba3_minimal as m3
    arch, *flags = case.split()
    torch.manual_seed(0)
    small = dict(d_model=32, n_layer=2, vocab_size=vocab)
    if arch == "mamba":  # d_state 16 and chunks of 16, the CUDA default's
        model = mm.MambaLM(mm.MambaConfig(**small, d_state=16, compile_scan="--compile" in flags))
    elif arch == "mamba2":  # chunks of 64 as the trainer's: two per block
        model = m2.Mamba2LM(m2.Mamba2Config(**small, d_state=16, headdim=16, chunk_size=64,
                                            compile_mixer="--compile" in flags))
    elif arch == "mamba3":
        model = m3.Mamba3LM(m3.Mamba3Config(**small, d_state=16, headdim=16, chunk_size=64))
    else:
        model = TinyGPT(GPTConfig(d_model=32, n_layer=2, n_head=4, vocab_size=vocab, block_size=block))
    return model, torch.compile(model) if "--compile-model" in flags else model


def bench_graphs(args, device):
    """Dynamo's graphs, graph breaks and recompiles for each of GRAPH_CASES, phase by phase."""
    from collections import Counter
    vocab, block, batch = 65, 128, 4
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, block + 1), device=device)
    phases = ("train step 1", "train step 2", "eval (no_grad)", "eval, last batch of 3")
    rows, notes = [], {}
    for case in GRAPH_CASES:
        with compiled_with(args.backend):
            model, run = graph_model(case, vocab, block)
            model.to(device)
            per_phase, t0 = [], time.perf_counter()
            for phase in phases:
                before = compiles_so_far()
                x = ids[:3] if phase.endswith("of 3") else ids
                with torch.set_grad_enabled(phase.startswith("train")), autocast:
                    logits = run(x[:, :-1])
                if phase.startswith("train"):
                    loss = torch.nn.functional.cross_entropy(logits[..., :vocab].float().flatten(0, 1),
                                                             x[:, 1:].flatten())
                    loss.backward()
                after = compiles_so_far()
                per_phase.append([after[i] - before[i] for i in range(2)] + [len(after[2]) - len(before[2])])
            graphs, breaks, recompiles = compiles_so_far()
            rows.append([case, str(graphs), str(breaks), str(len(recompiles))]
                        + [" / ".join(str(p[i]) for p in per_phase) for i in range(3)]
                        + [f"{time.perf_counter() - t0:.0f}"])
            broke = Counter()
            for reason, n in torch._dynamo.utils.counters["graph_break"].items():
                broke[short(reason)] += n
            notes[case] = [f"break x{n}: {r}" for r, n in broke.items()]
            notes[case] += [f"recompile x{n}: {r}" for r, n in Counter(map(short, recompiles)).items()]
    table(f"torch.compile (backend {args.backend!r}) of small models (d_model 32, 2 layers, block {block}) "
          f"under bf16 autocast; phases: {'; '.join(phases)}",
          ["case", "graphs", "breaks", "recompiles", "graphs by phase", "breaks by phase", "recompiles by phase",
           "s"], rows)
    for case, lines in notes.items():
        if lines:
            print(f"\n{case}:\n  " + "\n  ".join(lines))


# ------------------------------------------------------------------------------------------------
# On a GPU, in one go: python bench.py gpu
# ------------------------------------------------------------------------------------------------
# A run on a CUDA machine that may have no network and a quarter of an hour, which answers what a
# GPU user of the trainer asks first: how fast each model trains at the CUDA defaults, with and
# without torch.compile, how much memory it needs, and which model is ahead after the same time.
# The most valuable figures come first, so a run cut short still has them:
#   1. step times: train_shakespeare.py --max-iters 40 with the CUDA defaults, the median ms/step
#      of the steps after the 10th, the first step's seconds (start-up and any compiling) and the
#      peak memory: Mamba eager, the GPT eager, then Mamba --compile (the fused scan, compiled)
#      and the GPT --compile-model (nanoGPT's setting), then Mamba-2 and Mamba-3
#   2. the race: the default Mamba and the GPT, each trained for the same 120 s (schedules fitted
#      to it, 4 evaluations): the val loss each reaches
#   3. the CUDA tests that compile nothing: pytest -k cuda -m "not compile"
#   4. the selective scan of one Mamba layer at d_model 1024 (ED = 2048), N = 16, L = 8192,
#      batch 1, forward and forward+backward, the eager paths: the Python loop (8192 steps of a
#      few kernel launches each), torch's associative_scan and pscan (a tree of log2(L) levels)
#   5. what compiles (tens of seconds to minutes per graph on a cold machine): the compiled
#      rows of 4., then the compiled CUDA tests
# Each part runs in a process group of its own, killed at the deadline with every process it
# started (Inductor's compile workers too), so --budget bounds the whole command, compiling
# included. A compiled run whose compiler fails trains on eagerly, with a warning the table
# reports ("compile failed, ran eagerly"). On CUDA, pscan.py asks associative_scan for
# combine_mode="pointwise"; called outside torch.compile, torch runs that through Dynamo's eager
# backend, which executes its generic algorithm (torch/_higher_order_ops/associative_scan.py,
# _maybe_compile_and_run_fn): the row times that, not a Triton kernel. compile="loop" can fall
# back to one compiled call per chunk where torch cannot compile the loop; its row says so when
# it did.

GPU_SHAPE = (1, 8192, 2048, 16)  # (B, L, ED, N)
GPU_TINY_SHAPE = (1, 40, 8, 4)  # --tiny: the same cases on the CPU, as a dry run
GPU_BUDGET_S = 900  # the whole command, compiling included
GPU_STEPS = 40  # iterations of each step-time run: the first 10 are left out of its ms/step
GPU_RACE_S = 120  # seconds of training of each model in the race
GPU_CASES = {  # selective_scan's keyword arguments
    "loop (scan_sequential)": dict(backend="sequential"),
    "associative_scan (generic, not compiled)": dict(backend="associative"),
    "pscan": dict(backend="pscan"),
    "compiled fused": dict(compile=True),
    'compile="loop"': dict(compile="loop"),  # with a backward it runs as "compiled fused"
}
GPU_TABLE_HEADER = ["(B, L, ED, N)", "path", "pass", "ms", "calls", "first call s", "peak MiB"]


def timed_calls(fn, device, cap_s, repeats):
    """Median ms of up to `repeats` warm calls, stopping once they have used cap_s seconds,
    and the peak memory (MiB) the calls allocate beyond what was live before them."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        live = torch.cuda.memory_allocated()
    times, spent = [], 0.0
    while not times or (len(times) < repeats and spent < cap_s):  # at least one call
        if cuda:  # events on the GPU's own timeline: first kernel to last, launch gaps included
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        spent += times[-1] / 1e3
    peak = (torch.cuda.max_memory_allocated() - live) / 2**20 if cuda else None
    return statistics.median(times), len(times), peak


def gpu_table(device, shape, deadline, repeats, cases=GPU_CASES, emit=None):
    """Forward and forward+backward of selective_scan per case at `shape`. Returns rows, and
    hands each to emit(row) as soon as it is measured."""
    inputs = selective_inputs(*shape, device=device, requires_grad=True)
    rows = []
    for name, kw in cases.items():
        for mode in ("fwd", "fwd+bwd"):
            row = [str(shape), name, mode]
            left = deadline - time.perf_counter()
            if mode == "fwd+bwd" and kw.get("compile") == "loop":
                row += ["as compiled fused", "", "", ""]
            elif left < 5:
                row += ["skipped: out of time", "", "", ""]
            else:
                row = gpu_case(inputs, kw, mode, device, left, repeats, row)
            rows.append(row)
            if emit:
                emit(row)
            for t in inputs:  # after a failure too
                t.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def gpu_case(inputs, kw, mode, device, left, repeats, row):
    def call():
        if mode == "fwd":
            with torch.no_grad():
                mm.selective_scan(*inputs, **kw)
        else:
            mm.selective_scan(*inputs, **kw).sum().backward()
            for t in inputs:  # freed after the call, so each call's peak counts them
                t.grad = None

    try:
        sync(device)
        t0 = time.perf_counter()
        call()  # warm-up; for the compiled cases, the compile
        sync(device)
        first = time.perf_counter() - t0
        # at most a quarter of what is left per case, so the later cases still run
        ms, n, peak = timed_calls(call, device, min(30.0, (left - first) / 4), repeats)
        row[1] = loop_label(row[1], kw)
        return row + [f"{ms:.2f}", str(n), f"{first:.1f}", "" if peak is None else f"{peak:.0f}"]
    except torch.OutOfMemoryError:
        return row + ["out of memory", "", "", ""]
    except Exception as err:  # a failing case must not hide the others' figures
        return row + [f"failed: {type(err).__name__}: {str(err)[:60]}", "", "", ""]


def gpu_table_part(args, which):
    """python bench.py --gpu-part table-eager|table-compiled: one half of the table, each row
    printed as a JSON line the moment it is measured (the parent may kill this process)."""
    device = torch.device("cpu" if args.tiny else "cuda")
    shape = GPU_TINY_SHAPE if args.tiny else GPU_SHAPE
    compiled = which == "table-compiled"
    cases = {k: v for k, v in GPU_CASES.items() if bool(v.get("compile")) == compiled}
    gpu_table(device, shape, time.perf_counter() + args.budget, args.repeats, cases,
              emit=lambda row: print("ROW " + json.dumps(row), flush=True))


def run_capped(cmd, timeout_s):
    """Run cmd in a process group of its own and kill the whole group after timeout_s seconds.
    Returns (stdout and stderr as text, exit status or None when it was killed)."""
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.abspath(__file__)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        return proc.communicate(timeout=timeout_s)[0], proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0], None


def gpu_trainer_run(args, flags, timeout_s):
    """train_shakespeare.py with `flags` and the device's defaults (on the CPU with --tiny: a toy
    model under bf16 autocast, as on a GPU with bf16). Returns a table row and whether the run
    ended cleanly."""
    import re
    import tempfile
    out_dir = tempfile.mkdtemp(prefix="bench_gpu_")
    arch = flags[flags.index("--arch") + 1]
    cmd = [sys.executable, "train_shakespeare.py", "--device", "cpu" if args.tiny else "cuda", "--out-dir", out_dir,
           "--no-sample"] + flags
    if args.data:
        cmd += ["--data", args.data]
    if args.tiny:  # a toy model of two Mamba-2 chunks per block (chunk 64), as the CUDA default has four
        cmd += ["--d-model", "32", "--n-layer", "2", "--block-size", "128", "--batch-size", "8",
                "--eval-iters", "2", "--log-interval", "2", "--dtype", "bf16"] + (["--n-head", "4"] if arch == "gpt" else [])
    print("$ " + shlex.join(["python"] + cmd[1:]), flush=True)
    text, status = run_capped(cmd, timeout_s)
    steady = [(float(rate.replace(",", "")), int(ms)) for step, rate, ms in
              re.findall(r"step (\d+)\S* .*?\| ([\d,]+) tok/s \| (\d+) ms/it", text) if int(step) > 10]
    found = {key: re.findall(pattern, text) for key, pattern in (
        ("params", r"([\d.]+M) parameters"), ("dtype", r"thread\(s\), (\w+)"), ("first", r"first step ([\d.]+)s"),
        ("peak", r"peak GPU memory ([\d.]+) GiB"), ("step", r"step (\d+)"), ("val", r"val ([\d.]+)"))}
    if status != 0:
        print(text[-2000:])
    notes = ["compile failed, ran eagerly"] if "torch.compile failed" in text else []
    notes.append("killed at the deadline" if status is None else f"exit status {status}")
    get = lambda key: found[key][-1] if found[key] else ""
    return [" ".join(flags), get("params"), get("dtype"), get("first"),
            f"{statistics.median(ms for _, ms in steady)}" if steady else "",
            f"{statistics.median(rate for rate, _ in steady):,.0f}" if steady else "", get("peak"), get("step"),
            get("val"), ", ".join(notes) + f", log in {out_dir}"], status == 0


def gpu_tests(marker, timeout_s):
    """pytest -k cuda -m MARKER: the tests that run on CUDA (each skips where there is none)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-k", "cuda", "-m", marker, "-p", "no:cacheprovider"]
    print("$ " + shlex.join(["python"] + cmd[1:]), flush=True)
    text, status = run_capped(cmd, timeout_s)
    lines = text.strip().splitlines()
    print("\n".join(line for line in lines if line.startswith(("FAILED", "ERROR"))) or "", end="")
    print(lines[-1] if lines else "(no output)")
    if status is None:
        print(f"killed at the deadline, after {timeout_s:.0f} s")
    return status in (0, 5)  # 5: nothing selected


def bench_gpu(args):
    """python bench.py gpu: the parts listed above, in that order, within --budget seconds."""
    t_start = time.perf_counter()
    deadline = t_start + args.budget
    if not args.tiny and not torch.cuda.is_available():
        print("bench.py gpu needs a CUDA GPU, and torch sees none here (torch "
              f"{torch.__version__}, cuda {torch.version.cuda}). Nothing was run. For a dry run "
              "of the same steps at a toy size on this machine: python bench.py gpu --tiny")
        sys.exit(1)
    name = torch.cuda.get_device_name() if not args.tiny else platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, {name}"
          f"{', dry run at a toy size on the CPU' if args.tiny else ''}; budget {args.budget:.0f} s")
    if not args.data and not os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                                                         "tinyshakespeare.txt")):
        print("note: no --data and no data/tinyshakespeare.txt: the trainer will try to download the text "
              "(on a machine without network, copy it there or pass --data PATH)")
    header = ["flags", "params", "dtype", "first step s", "ms/step", "tokens/s", "peak GiB", "steps", "last val",
              "run"]
    step_rows, race_rows, ok = [], [], True
    steps = args.steps or (12 if args.tiny else GPU_STEPS)
    race_s = args.race_time or (10 if args.tiny else GPU_RACE_S)

    def left(cap):
        return min(cap, deadline - time.perf_counter())

    def train(rows, flags, cap, title):
        nonlocal ok
        if left(cap) < 15:
            rows.append([" ".join(flags)] + [""] * 8 + ["skipped: out of time"])
            ok = False
        else:
            row, good = gpu_trainer_run(args, flags, left(cap))
            rows.append(row)
            ok = ok and good
        table(title, header, rows)

    def step_time(flags, cap):
        train(step_rows, flags + ["--max-iters", str(steps), "--eval-iters", "4"], cap,
              f"train_shakespeare.py --max-iters {steps} at the {'CPU, toy' if args.tiny else 'CUDA'} defaults: "
              f"median ms/step and tokens/s of the steps after the 10th; first step: start-up and compiling")

    def race(arch):
        train(race_rows, ["--arch", arch, "--max-time", f"{race_s:g}", "--num-evals", "4"], race_s + 60,
              f"the race: each model trained for {race_s} s (its schedule fitted to it), val loss at the end")

    def scan_table(which, cap):
        nonlocal ok
        shape = GPU_TINY_SHAPE if args.tiny else GPU_SHAPE
        title = (f"y = selective_scan(...) at (B, L, ED, N) = {shape}, {which.split('-')[1]} paths, fp32: median "
                 f"ms of warm calls{' (CUDA events)' if not args.tiny else ''}, peak memory beyond the inputs")
        if left(cap) < 15:
            print(f"\n{title}: skipped, out of time")
            ok = False
            return
        cmd = [sys.executable, os.path.abspath(__file__), "--gpu-part", which, "--budget", f"{left(cap) - 5:.0f}",
               "--repeats", str(args.repeats)] + (["--tiny"] if args.tiny else [])
        text, status = run_capped(cmd, left(cap))
        rows = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("ROW ")]
        if status != 0:
            print(text[-2000:])
            ok = False
        table(title + ("" if status == 0 else ", killed at the deadline" if status is None else ", failed"),
              GPU_TABLE_HEADER, rows)

    def tests(marker, cap):
        nonlocal ok
        print(f"\nthe CUDA tests, -m {marker!r}")
        if left(cap) < 15:
            print("skipped: out of time")
            ok = False
        else:
            ok = gpu_tests(marker, left(cap)) and ok

    step_time(["--arch", "mamba"], 60)
    step_time(["--arch", "gpt"], 45)
    step_time(["--arch", "mamba", "--compile"], 240)  # a cold compile of the chunk and its backward
    step_time(["--arch", "gpt", "--compile-model"], 120)
    race("mamba")
    race("gpt")
    tests("not compile", 90)
    step_time(["--arch", "mamba2"], 60)
    step_time(["--arch", "mamba3"], 60)
    scan_table("table-eager", 90)
    scan_table("table-compiled", args.budget)
    tests("compile", args.budget)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s of a {args.budget:.0f} s budget")
    if not ok:
        sys.exit(1)


def check_args(p, args, tables):
    """Refuse a bad argument with one usage line (p.error) before anything runs: a race that
    would train for minutes and then fail must fail at once."""
    known = list(tables) + ["gpu"] + (["all"] if args.what == ["all"] else [])  # "all" only alone
    for what in args.what:
        if what not in known:
            p.error(f"unknown table {what!r}, expected one of {sorted(tables)}; or all, or gpu, alone")
    for name in ("threads", "repeats", "runs", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1, got {value}")
    for name in ("max_time", "race_time", "budget"):
        value = getattr(args, name)
        if value is not None and not (0 < value < math.inf):
            p.error(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
    names = args.racers.split(",")
    if len(names) < 2 or any(n not in RACERS for n in names) or len(set(names)) < len(names):
        p.error(f"--racers takes two or more different names of {', '.join(RACERS)}, got {args.racers!r}")
    if args.archs is not None:
        unknown = [a for a in args.archs.split(",") if a not in ROOFLINE_ARCHS]
        if unknown:
            p.error(f"--archs takes a comma-separated list of {', '.join(ROOFLINE_ARCHS)}, got {args.archs!r}")
    try:
        given = [f.split("=")[0] for f in shlex.split(args.flags or "") if f.startswith("--")]
    except ValueError as err:  # an unclosed quote
        p.error(f"--flags must be the trainer's flags as its command line takes them: {err}, in {args.flags!r}")
    chosen = [f for f in given if f in ("--arch", "--scan-backend")]
    if chosen:
        p.error(f"--flags must not hold {' or '.join(chosen)}: --archs chooses the models, and roofline runs "
                f"every scan backend of Mamba-1")
    if "graphs" in args.what:
        import torch._dynamo as dynamo
        if args.backend not in dynamo.list_backends(exclude_tags=()):
            p.error(f"--backend {args.backend!r} is not a torch.compile backend; expected eager, aot_eager, inductor "
                    f"or another name torch._dynamo.list_backends(exclude_tags=()) gives")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device} is not a device name; expected cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: the tables run on cpu or cuda")
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    if (device.index or 0) >= count:
        p.error(f"--device {args.device}: torch finds {count} {device.type} device(s)")
    return device


# ------------------------------------------------------------------------------------------------
# How long the lesson takes to read: python bench.py reading
# ------------------------------------------------------------------------------------------------
# The README's reading times come from a fixed method, so that they can be checked and kept up to
# date: Python's tokenizer sorts each line of a part into code, comment (a whole-line #) or
# docstring (a string that is a statement of its own); prose is every whitespace-separated word of
# the comment and docstring lines and of the comments after code. Prose reads at 150 words a minute,
# code at 15 to 20 lines a minute; the README's prose at 200 words a minute and its code blocks at
# 30 lines a minute. A part runs from a line to the line before a banner.

# The path: three readings in this order, each a list of parts (label, file, first line's pattern or
# None for line 1, the pattern it stops before); the README counts with the first.
READINGS = (
    ("1. the model", (
        ("pscan.py §1", "pscan.py", None, r"# 2\. The convolution view"),
        ("pscan.py §9", "pscan.py", r"# 9\. One entry point", r"# 10\. Segment sums"),
        ("mamba_minimal.py §1-5", "mamba_minimal.py", None, r"# 6\. Making it fast"))),
    ("2. the parallel scan", (
        ("pscan.py §3-5", "pscan.py", r"# 3\. The combine rule", r"# 6\. The Hillis"),
        ("pscan.py §8", "pscan.py", r"# 8\. The backward", r"# 9\. One entry point"))),
    ("3. the trainer", (
        ("train_shakespeare.py, first part", "train_shakespeare.py", None, r"# Plumbing"),)),
)
READING_PARTS = tuple(part for _, parts in READINGS for part in parts)
READING_OFF_PATH = (
    ("pscan.py §2 (optional)", "pscan.py", r"# 2\. The convolution view", r"# 3\. The combine rule"),
    ("pscan.py §6-7 (optional)", "pscan.py", r"# 6\. The Hillis", r"# 8\. The backward"),
    ("mamba_minimal.py §6", "mamba_minimal.py", r"# 6\. Making it fast", r"# 7\. Loading"),
    ("pscan.py §10 (Mamba-2's and -3's)", "pscan.py", r"# 10\. Segment sums", r"# Appendix: the engine"),
    ("mamba2_minimal.py", "mamba2_minimal.py", None, None),
    ("mamba3_minimal.py §1-4, to the mixer", "mamba3_minimal.py", None, r"# Parameters the official module creates"),
)


def reading_counts(path, first=1, last=None):
    """Lines first..last (1-based, inclusive) of a Python file -> (code lines, prose words)."""
    lines, code, doc, comment, trailing = _line_classes(path)
    last = last or len(lines)
    words = 0
    for r in range(first, last + 1):
        if r in doc or (r in comment and r not in code):
            text = lines[r - 1].strip().lstrip("#").strip().strip('"').strip()
            if not re.fullmatch(r"[-=]+", text):  # a banner's rule is not prose
                words += len(text.split())
        words += trailing.get(r, 0)
    return sum(1 for r in range(first, last + 1) if r in code), words


@functools.lru_cache(maxsize=None)  # reading_counts asks for one file's lines many times
def _line_classes(path):
    """(lines, code rows, docstring rows, comment rows, {row: words of its trailing comment}) of a file,
    by Python's tokenizer."""
    src = open(path, encoding="utf-8").read()
    lines = src.splitlines()
    code, doc, comment, trailing = set(), set(), set(), {}
    tokens = list(tokenize.generate_tokens(io.StringIO(src).readline))
    layout = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER, tokenize.ENCODING)
    for i, t in enumerate(tokens):
        rows = range(t.start[0], t.end[0] + 1)
        if t.type == tokenize.COMMENT:
            if lines[t.start[0] - 1].strip().startswith("#"):
                comment.add(t.start[0])
            else:
                trailing[t.start[0]] = len(t.string.lstrip("#").split())
        elif t.type == tokenize.STRING:
            before = next((u for u in reversed(tokens[:i]) if u.type not in (tokenize.NL, tokenize.COMMENT)), None)
            after = next(u for u in tokens[i + 1:] if u.type not in (tokenize.NL, tokenize.COMMENT))
            statement = before is None or before.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                                           tokenize.ENCODING)
            (doc if statement and after.type in (tokenize.NEWLINE, tokenize.ENDMARKER) else code).update(rows)
        elif t.type not in layout:
            code.update(rows)
    code -= doc
    return lines, code, doc, comment, trailing


def part_lines(path, start, stop):
    """(first, last) line, 1-based and inclusive, of the part of path that starts at the line matching
    start (line 1 if None; the banner's rule above a heading included) and ends before the line
    matching stop (the file's end if None)."""
    lines = open(path, encoding="utf-8").read().splitlines()
    find = lambda pattern: next(i for i, line in enumerate(lines, 1) if re.match(pattern, line))
    first = 1 if start is None else find(start) - 1
    last = len(lines) if stop is None else find(stop) - 2
    return first, last


def minutes(code, words):
    """The method's (fast, slow) minutes: prose at 150 words a minute, code at 20 and at 15 lines."""
    return words / 150 + code / 20, words / 150 + code / 15


def reading_minutes(path, start, stop):
    """(code lines, prose words, minutes fast, minutes slow) of the part of path from start to stop
    (part_lines)."""
    code, words = reading_counts(path, *part_lines(path, start, stop))
    return (code, words) + minutes(code, words)


def functions_called(fn):
    """{(file name, first line of its code)} of every function of this folder's Python files that
    fn() runs, as sys.setprofile sees the calls (autograd runs a CPU backward in the calling thread,
    so the hand-written backwards are seen too)."""
    here = os.path.dirname(os.path.abspath(__file__))
    seen = set()

    def note(frame, event, arg):
        file = frame.f_code.co_filename
        if (event == "call" and file.endswith(".py") and os.path.dirname(os.path.abspath(file)) == here
                and os.path.basename(file) != "bench.py"):  # not the tracer's own run()
            seen.add((os.path.basename(file), frame.f_code.co_firstlineno))

    before = sys.getprofile()
    sys.setprofile(note)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # a run's log and sample
            fn()
    finally:
        sys.setprofile(before)
    return seen


def functions_run(argv):
    """functions_called of train_shakespeare.main(argv), then of a step of recurrent inference
    (section 5's MambaLM.step, which the trainer's sampling skips for its unchecked twin)."""
    import train_shakespeare as ts

    def run():
        ts.main(argv)
        backend = argv[argv.index("--scan-backend") + 1] if "--scan-backend" in argv else "auto"
        model = mm.MambaLM(mm.MambaConfig(d_model=16, n_layer=1, vocab_size=8, scan_backend=backend))
        _, cache = model.prefill(torch.zeros(1, 3, dtype=torch.long))
        model.step(torch.zeros(1, dtype=torch.long), cache)

    return functions_called(run)


def parallel_scan_run():
    """functions_called of the parallel scan the second reading teaches: pscan.scan(backend="pscan"),
    its forward and its backward, at L = 8."""
    def run():
        a, b, h0 = (torch.rand(2, 8, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
        ps.scan(a, b, h0[:, 0], backend="pscan").sum().backward()

    return functions_called(run)


def function_spans(path):
    """{first line of a function's code object (its first decorator's, else its def's): (that line,
    its last line)} of every function and method in path."""
    spans = {}
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            spans[first] = (first, node.end_lineno)
    return spans


def followed_off_path(seen, parts=READING_PARTS):
    """{file: (functions, code lines, prose words)} of the functions in seen that lie outside the
    parts (by default the whole reading path), a function nested in another one counted with it."""
    here = os.path.dirname(os.path.abspath(__file__))
    path_parts = {}
    for _, name, start, stop in parts:
        path_parts.setdefault(name, []).append(part_lines(os.path.join(here, name), start, stop))
    out = {}
    for name in sorted({n for n, _ in seen}):
        spans = function_spans(os.path.join(here, name))
        off = [spans[line] for n, line in seen if n == name and line in spans  # lambdas, comprehensions: their function
               and not any(a <= line <= b for a, b in path_parts.get(name, []))]
        outer = [s for s in off if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in off)]
        counts = [reading_counts(os.path.join(here, name), a, b) for a, b in outer]
        if outer:
            out[name] = (len(outer), sum(c for c, _ in counts), sum(w for _, w in counts))
    return out


def readme_minutes(path="README.md"):
    """(code-block lines, prose words, minutes) of the README: prose at 200 words a minute, code at 30 lines."""
    code = words = 0
    inside = False
    for line in open(path, encoding="utf-8").read().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            code += 1
        else:  # a table's pipes and rules are not words
            words += sum(1 for w in line.split() if not re.fullmatch(r"[|:-]+", w))
    return code, words, words / 200 + code / 30


def bench_reading(args, device):
    """The reading path's minutes by the README's method, reading by reading and part by part, and
    parts off the path; then the code outside each reading that it calls, which a reader who follows
    every call also reads, by the same method."""
    here = os.path.dirname(os.path.abspath(__file__))
    code, words, readme = readme_minutes(os.path.join(here, "README.md"))
    rows = [["README.md", code, words, f"{readme:.1f}", f"{readme:.1f}"]]
    readings = []  # (fast, slow) minutes of each reading, the README with the first
    for label, parts in READINGS:
        low = high = readme if not readings else 0.0
        for part, name, start, stop in parts:
            code, words, fast, slow = reading_minutes(os.path.join(here, name), start, stop)
            rows.append([part, code, words, f"{fast:.1f}", f"{slow:.1f}"])
            low, high = low + fast, high + slow
        readings.append((low, high))
        rows.append([f"**{label}**", "", "", f"{low:.1f}", f"{high:.1f}"])
    rows.append(["the path, in all", "", "", f"{sum(r[0] for r in readings):.1f}",
                 f"{sum(r[1] for r in readings):.1f}"])
    for label, name, start, stop in READING_OFF_PATH:
        code, words, fast, slow = reading_minutes(os.path.join(here, name), start, stop)
        rows.append([label, code, words, f"{fast:.1f}", f"{slow:.1f}"])
    table("Reading time by the README's method: prose 150 words a minute (the README's 200), code 15-20 lines "
          "a minute (the README's code blocks 30)", ["part", "code lines", "prose words", "minutes, fast", "minutes, slow"],
          rows)
    followed_table(readings, args.quick)


def followed_table(readings, quick=False):
    """Run the README's training command for a few seconds (on a text made of the README) with the
    reference switch and without it, and the parallel scan forward and backward (parallel_scan_run),
    and time by the method the functions each reading calls outside itself and the readings before
    it, and not already called by them: what a reader who follows every call reads on top of it.
    The first reading (the model, its minutes readings[0], fast and slow) follows the run's calls
    into the model's files, the second the parallel scan's, the third the run's calls into the
    trainer's file. The last row is the whole path with every function any of them calls outside
    it, each counted once."""
    here = os.path.dirname(os.path.abspath(__file__))
    trainer_file = READINGS[2][1][0][1]  # the third reading's one file
    called_minutes = lambda per_file: minutes(sum(c for _, c, _ in per_file.values()),
                                              sum(w for _, _, w in per_file.values()))
    scan_seen = parallel_scan_run()
    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "text.txt")
        with open(text, "w", encoding="utf-8") as f:
            f.write(open(os.path.join(here, "README.md"), encoding="utf-8").read() * 3)
        rows = []
        for label, flags in (("--scan-backend reference", ["--scan-backend", "reference"]), ("the default", [])):
            seen = functions_run(["--data", text, "--out-dir", os.path.join(tmp, label[:3]), "--max-time",
                                  "1" if quick else "3", "--device", "cpu"] + flags)
            before, followed = (), set()  # the parts of the readings already read, and the calls
            for (reading, parts), (low, high), calls in zip(
                    READINGS, readings, ({c for c in seen if c[0] != trainer_file}, scan_seen,
                                         {c for c in seen if c[0] == trainer_file})):
                before += parts
                per_file = followed_off_path(calls - followed, before)
                followed |= calls
                for name, (n, code, words) in sorted(per_file.items()):
                    rows.append([label, reading, name, n, code, words] + [f"{m:.1f}" for m in minutes(code, words)])
                fast, slow = called_minutes(per_file)
                rows.append([label, f"**{reading}, with its calls**", "", "", "", "", f"{low + fast:.1f}",
                             f"{high + slow:.1f}"])
            fast, slow = called_minutes(followed_off_path(seen | scan_seen))
            rows.append([label, "the path and every call", "", "", "", "",
                         f"{sum(r[0] for r in readings) + fast:.1f}", f"{sum(r[1] for r in readings) + slow:.1f}"])
    table("Following every call, at least: the functions outside the path that `python train_shakespeare.py` "
          "runs on a CPU (a training run of seconds, then its sample), then a MambaLM.step, and the parallel scan "
          "forward and backward, their bodies by the same method; each reading counts what it calls outside "
          "itself and the readings before it, that they did not call",
          ["run", "reading", "file", "functions", "code lines", "prose words", "minutes, fast", "minutes, slow"], rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", help="tables to print: scan (default), depth, crossover, selective, "
                                           "train, profile, race, sweep, generate, decode, load, mamba2_ssd, mamba2_train, mamba2_profile, mamba3, roofline, graphs, "
                                           "reading, "
                                           "all; or gpu")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads (default 1; race: the trainer's own choice unless given)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small shapes only (a smoke test)")
    p.add_argument("--top", type=int, default=15, help="profile: how many ops to list")
    p.add_argument("--backend", default="eager",
                   help="graphs: the torch.compile backend (default eager: Dynamo's graphs without compiling them)")
    r = p.add_argument_group("race (python bench.py race)")
    r.add_argument("--max-time", type=float, default=300.0, help="seconds of training per run")
    r.add_argument("--runs", type=int, default=2, help="runs of each model")
    r.add_argument("--out-dir", help="where the runs' folders go (default out/race)")
    r.add_argument("--racers", default="gpt,mamba",
                   help="comma-separated: gpt, mamba, mamba2, mamba3, mamba_fp32, mamba_bf16 (default gpt,mamba; the "
                        "margin is first - second)")
    r.add_argument("--round", type=int, choices=(1, 2, 3, 4), default=1,
                   help="sweep: SWEEP_GRID (1) or SWEEP_ROUND_2, _3, _4 (2, 3, 4)")
    r.add_argument("--together", action="store_true",
                   help="train a run's models at the same time, one thread each (default: one after the other)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--no-compile", action="store_true", help="decode: leave out the compiled step")
    p.add_argument("--shapes", help="decode: only the shapes whose names contain one of these (comma-separated)")
    p.add_argument("--memory-case", help=argparse.SUPPRESS)
    m = p.add_argument_group("roofline (python bench.py roofline)")
    m.add_argument("--archs", help="comma-separated: mamba, mamba2, mamba3, gpt (default all four)")
    m.add_argument("--flags", help='the trainer\'s flags for another shape, e.g. "--batch-size 16 --block-size 1024"')
    g = p.add_argument_group("gpu (python bench.py gpu)")
    g.add_argument("--tiny", action="store_true",
                   help="dry run of `gpu` on the CPU: the same parts in the same order at a toy size")
    g.add_argument("--steps", type=int, help=f"iterations of each step-time run (default {GPU_STEPS}, --tiny 12)")
    g.add_argument("--race-time", type=float, help=f"seconds of training of each racer (default {GPU_RACE_S}, --tiny 10)")
    g.add_argument("--data", help="the text to train on, for gpu and race (default: the trainer's "
                                  "data/tinyshakespeare.txt, downloaded if missing; a machine without network "
                                  "needs the file or this flag)")
    g.add_argument("--budget", type=float, default=GPU_BUDGET_S,
                   help="seconds for the whole command, compiling included (default %(default)s)")
    g.add_argument("--gpu-part", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_case:
        return memory_case(json.loads(args.memory_case))
    if args.gpu_part:
        return gpu_table_part(args, args.gpu_part)
    tables = {"scan": bench_scan, "depth": bench_depth, "crossover": bench_crossover,
              "selective": bench_selective, "train": bench_train, "profile": bench_profile, "race": bench_race, "sweep": bench_sweep, "generate": bench_generate, "decode": bench_decode,
              "mamba2_ssd": bench_mamba2_ssd, "mamba2_train": bench_mamba2_train,
              "mamba2_profile": bench_mamba2_profile, "mamba3": bench_mamba3, "roofline": bench_roofline, "load": bench_load,
              "graphs": bench_graphs, "reading": bench_reading}
    device = check_args(p, args, tables)
    torch.set_num_threads(args.threads or 1)
    if args.what == ["gpu"]:  # not part of "all": it needs a GPU and runs its own subprocesses
        return bench_gpu(args)
    if "gpu" in args.what:
        p.error("gpu runs on its own: python bench.py gpu")
    whats = args.what or ["scan"]
    if whats == ["all"]:
        whats = [w for w in tables if w not in ("race", "sweep", "load")]  # minutes each: each runs on its own
    if len(whats) > 1:
        # one fresh process per table: the eager backends' speed depends on the allocator's state
        # (the heap's mapped pages), which an earlier table would otherwise leave behind
        flags = [a for a in (sys.argv[1:] if argv is None else argv) if a not in tables and a != "all"]
        for what in whats:
            sys.stdout.flush()
            subprocess.run([sys.executable, os.path.abspath(__file__), what] + flags, check=True)
        return
    print(f"torch {torch.__version__}, {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else f", {platform.processor() or platform.machine()}")
          + f", {torch.get_num_threads()} thread(s)")
    tables[whats[0]](args, device)


if __name__ == "__main__":
    main()
