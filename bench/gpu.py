"""
bench/gpu.py: on a CUDA machine, in one go, within a time budget.

    python -m bench gpu --data data/tinyshakespeare.txt  # a CUDA machine, offline, within --budget s
    python -m bench gpu --tiny    # the same parts in the same order, at a toy size on the CPU

It trains, times the L = 8192 selective scan and runs the CUDA tests, most valuable first; it
needs the Tiny Shakespeare text on the machine (--data, or data/tinyshakespeare.txt, which the
trainer otherwise downloads).
"""

import json
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

import torch

import mamba_engine
from bench.common import ROOT, bench_command, loop_label, selective_inputs, sync, table


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
                mamba_engine.selective_scan(*inputs, **kw)
        else:
            mamba_engine.selective_scan(*inputs, **kw).sum().backward()
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
    """python -m bench --gpu-part table-eager|table-compiled: one half of the table, each row
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
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
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
    out_dir = tempfile.mkdtemp(prefix="bench_gpu_")
    arch = flags[flags.index("--arch") + 1]
    cmd = [sys.executable, "train_shakespeare.py", "--device", "cpu" if args.tiny else "cuda", "--out-dir", out_dir,
           "--no-sample"] + flags
    if args.data:
        cmd += ["--data", args.data]
    if args.tiny:  # a toy model of two Mamba-2 chunks per block (chunk 64), as the CUDA default has four
        cmd += ["--d-model", "32", "--n-layer", "2", "--block-size", "128", "--batch-size", "8",
                "--eval-iters", "2", "--log-interval", "2", "--dtype", "bf16"]
        cmd += ["--n-head", "4"] if arch == "gpt" else []
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
    """python -m bench gpu: the parts listed above, in that order, within --budget seconds."""
    t_start = time.perf_counter()
    deadline = t_start + args.budget
    if not args.tiny and not torch.cuda.is_available():
        print("python -m bench gpu needs a CUDA GPU, and torch sees none here (torch "
              f"{torch.__version__}, cuda {torch.version.cuda}). Nothing was run. For a dry run "
              "of the same steps at a toy size on this machine: python -m bench gpu --tiny")
        sys.exit(1)
    name = torch.cuda.get_device_name() if not args.tiny else platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, {name}"
          f"{', dry run at a toy size on the CPU' if args.tiny else ''}; budget {args.budget:.0f} s")
    if not args.data and not os.path.exists(os.path.join(ROOT, "data", "tinyshakespeare.txt")):
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
        cmd = bench_command("--gpu-part", which, "--budget", f"{left(cap) - 5:.0f}", "--repeats",
                            str(args.repeats), *(["--tiny"] if args.tiny else []))
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
