"""
bench/common.py: what every table shares. Timing (interleaved medians), printing a table, peak
memory in a subprocess of its own, the selective scan's inputs, and the trainer's default models
with the step every training table times.
"""

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import mamba_engine
import mamba_minimal as mm
from gpt_minimal import GPTConfig, TinyGPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: `python -m bench` runs from it


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(cases, repeats, device, warmup=1):
    """cases: {name: fn}. Returns {name: median ms}, running the cases round-robin, so that a noisy
    machine slows them all alike and their ratios stay meaningful."""
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


def bench_command(*args):
    """The command line of `python -m bench ARGS` with this Python, run from the repository."""
    return [sys.executable, "-m", "bench", *args]


# ------------------------------------------------------------------------------------------------
# Peak memory, one subprocess per case (Linux: /proc/self/status)
# ------------------------------------------------------------------------------------------------

def _proc_status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_bytes(run):
    """Peak resident memory above the current level while `run()` executes (Linux, CPU): VmHWM
    after resetting it with /proc/self/clear_refs."""
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap memory back, so RSS = live memory
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    base = _proc_status_kb("VmRSS")
    run()
    return (_proc_status_kb("VmHWM") - base) * 1024


def memory_in_subprocess(spec):
    """Run `python -m bench --memory-case SPEC` and return the JSON it prints."""
    # every allocation of 64 KiB or more gets its own mapping, returned to the OS when freed, so
    # the resident set follows the live tensors instead of glibc's heap
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(bench_command("--memory-case", json.dumps(spec)), cwd=ROOT, capture_output=True,
                         text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# The selective scan's inputs, and its compiled loop's fallback
# ------------------------------------------------------------------------------------------------

def selective_inputs(B, L, D, N, device="cpu", requires_grad=False):
    """x, delta, A, B, C, D, z of mamba_engine.selective_scan at (batch B, length L, channels D,
    state N): a decaying A, small positive steps delta, seeded."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, L, D, generator=g)
    delta = torch.nn.functional.softplus(torch.randn(B, L, D, generator=g) - 2)
    A = -torch.arange(1, N + 1.0).repeat(D, 1)
    Bm, Cm = torch.randn(B, L, N, generator=g), torch.randn(B, L, N, generator=g)
    Dv, z = torch.ones(D), torch.randn(B, L, D, generator=g)
    return [t.to(device).requires_grad_(requires_grad) for t in (x, delta, A, Bm, Cm, Dv, z)]


def loop_label(name, kw):
    """A row's name, saying so where compile="loop" fell back to one compiled call per chunk
    (mamba_engine warns once and then runs the per-chunk path, whose figures the row shows)."""
    if kw.get("compile") == "loop" and not mamba_engine._compiled_loop_works:
        return f"{name} [fell back: one compiled call per chunk]"
    return name


# ------------------------------------------------------------------------------------------------
# The trainer's default models, and one training step
# ------------------------------------------------------------------------------------------------

def trainer_default(arch, *keys):
    """The values of keys (flag names: d_model, n_layer, ...) in train_shakespeare.py's CPU
    defaults for arch ("mamba" or "gpt")."""
    import train_shakespeare as ts
    args = ts.parse_args(["--arch", arch])
    ts.fill_defaults(args, torch.device("cpu"))
    return {key: getattr(args, key) for key in keys}


def trainer_mamba(vocab, engine=None, **kw):
    """The trainer's default CPU Mamba (its d_model, n_layer and d_state; kw overriding them), run
    by mamba_engine as the trainer runs it: engine holds accelerate's options (by default the
    hand-written backward over pscan.scan's choice; backend="reference" the lesson's own code)."""
    torch.manual_seed(0)
    shape = trainer_default("mamba", "d_model", "n_layer", "d_state")
    model = mm.MambaLM(mm.MambaConfig(**dict(shape, vocab_size=vocab, **kw)))
    return mamba_engine.accelerate(model, **(engine or {}))


def trainer_gpt(vocab, block, **kw):
    """The trainer's default CPU GPT yardstick (its d_model, n_layer and n_head), kw overriding them."""
    torch.manual_seed(0)
    shape = trainer_default("gpt", "d_model", "n_layer", "n_head")
    return TinyGPT(GPTConfig(**dict(shape, vocab_size=vocab, block_size=block, **kw)))


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
