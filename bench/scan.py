"""
bench/scan.py: the scans on their own, outside any model.

    python -m bench scan        # h = scan(a, b): every pscan.py backend vs the loop and a memory floor
    python -m bench depth       # work and depth of each scan, counted, beside its CPU time
    python -m bench crossover   # forward only: from which width the loop beats pscan on a CPU
    python -m bench selective   # selective_scan: the eager backends vs the fused path
    python -m bench mamba2_ssd  # Mamba-2's SSD and block vs Mamba-1's scan and block, eager and compiled

Peak memory is measured in a subprocess per case (memory_case), Linux only.
"""

import json
import sys
import time

import torch

import mamba_engine
import mamba_minimal as mm
import pscan as ps
from bench.common import interleaved, loop_label, memory_in_subprocess, peak_extra_bytes, selective_inputs, sync, table
from bench.roofline import LAUNCH_US


def memory_case(spec):
    """One forward+backward of a scan in this (sub)process; prints its peak memory as JSON."""
    torch.set_num_threads(1)
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
            mamba_engine.selective_scan(*inputs, **spec["kwargs"]).sum().backward()
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

SELECTIVE_VARIANTS = {
    "sequential": dict(backend="sequential"),
    "pscan": dict(backend="pscan"),
    "fused eager": dict(backend="fused", recompute=False),
    "fused eager + recompute": dict(backend="fused", recompute=True),
    "compiled": dict(compile=True, recompute=False),
    "compiled + recompute": dict(compile=True, recompute=True),
    "compiled, loop too": dict(compile="loop", recompute=False),  # forward only, long shape only
}


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
                mamba_engine.selective_scan(*inputs, **kw)

        def fb(kw):
            for t in inputs:
                t.grad = None
            mamba_engine.selective_scan(*inputs, **kw).sum().backward()

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
# Mamba-2's SSD against Mamba-1's selective scan
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
        cfg1 = mm.MambaConfig(d_model=d_model, n_layer=1, vocab_size=65)
        mixer1 = {c: mamba_engine.accelerate(mm.MambaMixer(cfg1), compile=c).to(device) for c in (False, True)}
        mixer2 = {(T, c): m2.Mamba2Mixer(m2.Mamba2Config(d_model=d_model, n_layer=1, vocab_size=65, headdim=32,
                                                         d_state=64, chunk_size=T, compile_mixer=c)).to(device)
                  for T in (64, 256) for c in (False, True)}
        cases = {  # path: (eager, compiled)
            "Mamba-1 scan (N 16), pscan | compiled fused":
                (lambda: mamba_engine.selective_scan(*sel, backend="pscan"),
                 lambda: mamba_engine.selective_scan(*sel, compile=True)),
            "Mamba-2 SSD (N 64), chunk 64":
                (lambda: m2.ssd(*ssd_in[:5], 64, ssd_in[5]), lambda: ssd_compiled(*ssd_in[:5], 64, ssd_in[5])),
            "Mamba-2 SSD, chunk 256":
                (lambda: m2.ssd(*ssd_in[:5], 256, ssd_in[5]), lambda: ssd_compiled(*ssd_in[:5], 256, ssd_in[5])),
            "Mamba-1 block (default) | compile=True": (lambda: mixer1[False](u), lambda: mixer1[True](u)),
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
            ref = ("Mamba-1 block (default) | compile=True" if "block" in k
                   else "Mamba-1 scan (N 16), pscan | compiled fused")
            cells = []
            for t in (t_f, t_b):
                for kind in ("eager", "compiled"):
                    cells.append(f"{t[(k, kind)]:.1f} ({t[(ref, 'eager')] / t[(k, kind)]:.2f}x)")
            rows.append([f"({b}, {L})", k] + cells)
    table(f"Mamba-2 SSD vs Mamba-1's selective scan, d_model {d_model} (ED 256: Mamba-2 as 8 heads of 32): median "
          "ms (speed-up over the eager Mamba-1 scan, or the eager Mamba-1 block for block rows); a path 'a | b' runs "
          "a eagerly and b compiled",
          ["(B, L)", "path", "fwd eager", "fwd compiled", "fwd+bwd eager", "fwd+bwd compiled"], rows)
