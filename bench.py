"""
bench.py: side-by-side timings and memory of the scan backends.

    python bench.py scan          # h = scan(a, b): every backend vs the loop and a memory floor

Every table is measured in one process with the candidates interleaved (round-robin, median of
the repeats), so a noisy machine slows them all alike and the ratios stay meaningful. One thread
by default (--threads), as on the machine the README's numbers come from.
Peak memory is read from /proc/self/status (VmHWM after resetting it with /proc/self/clear_refs),
one subprocess per case, so it is Linux only.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import pscan as ps


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
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    base = _proc_status_kb("VmRSS")
    run()
    return (_proc_status_kb("VmHWM") - base) * 1024


def memory_in_subprocess(spec):
    """Run `python bench.py --memory-case SPEC` and return the JSON it prints."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--memory-case", json.dumps(spec)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_case(spec):
    torch.set_num_threads(1)
    if spec["kind"] == "scan":
        B, L, D, N = spec["shape"]
        a = torch.rand(B, L, D, N, requires_grad=True)
        b = torch.randn(B, L, D, N, requires_grad=True)
        grad = torch.randn(B, L, D, N)
        fn = SCAN_BACKENDS[spec["backend"]]

        def run():
            fn(a, b).backward(grad)

        run()  # warm-up: first-touch allocations of the allocator and kernels
        a.grad = b.grad = None
        extra = peak_extra_bytes(run)
        print(json.dumps({"tensors": extra / a.numel() / a.element_size()}))
    else:
        raise ValueError(f"unknown memory case {spec}")


# ------------------------------------------------------------------------------------------------
# h = scan(a, b)
# ------------------------------------------------------------------------------------------------

SCAN_BACKENDS = {
    "loop": ps.scan_sequential,
    "pscan": ps.pscan,
    "associative": ps.scan_associative,
}


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
    # cost per step: does an awkward length cost more per step than a power of two?
    per_step = {}
    for r in rows:
        if r[2] == "pscan" and r[0] in ("(1, 3000, 256, 16)", "(1, 4096, 256, 16)"):
            L = int(r[0].split(",")[1])
            per_step[L] = (float(r[3]) / L, float(r[6]) / L)
    if len(per_step) == 2:
        print(f"\npscan cost per step, L=3000 / L=4096: forward {per_step[3000][0] / per_step[4096][0]:.2f}x, "
              f"forward+backward {per_step[3000][1] / per_step[4096][1]:.2f}x")
    if mem_rows:
        table("peak memory of forward+backward, in (B, L, D, N) tensors beyond the inputs a, b and "
              "the incoming gradient", ["(B, L, D, N)", "backend", "tensors"], mem_rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", help="tables to print: scan (default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small shapes only (a smoke test)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--memory-case", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_case:
        return memory_case(json.loads(args.memory_case))
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else f", {platform.processor() or platform.machine()}")
          + f", {torch.get_num_threads()} thread(s)")
    tables = {"scan": bench_scan}
    for what in args.what or ["scan"]:
        if what not in tables:
            p.error(f"unknown table {what!r}, expected one of {sorted(tables)}")
        tables[what](args, device)


if __name__ == "__main__":
    main()
