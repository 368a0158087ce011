"""
python -m bench COMMAND [flags]: the command line of the bench package (its commands: bench/__init__.py).
"""

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import subprocess
import sys

import torch

import bench
from bench import decode, gpu, graphs, load, race, roofline, scan, train
from bench.common import ROOT, bench_command

MAX_SECONDS = 7 * 24 * 3600  # --max-time, --race-time, --budget: a week at most


def commands():
    """{command: function(args, device)}; read from the modules at each call, so that a test can
    stand in for one."""
    return {"scan": scan.bench_scan, "depth": scan.bench_depth, "crossover": scan.bench_crossover,
            "selective": scan.bench_selective, "train": train.bench_train, "profile": train.bench_profile,
            "race": race.bench_race, "sweep": race.bench_sweep, "generate": decode.bench_generate,
            "decode": decode.bench_decode, "mamba2_ssd": scan.bench_mamba2_ssd,
            "mamba2_train": train.bench_mamba2_train, "mamba2_profile": train.bench_mamba2_profile,
            "mamba3": train.bench_mamba3, "roofline": roofline.bench_roofline, "load": load.bench_load,
            "graphs": graphs.bench_graphs}


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
    cores = os.cpu_count() or 1
    if args.threads is not None and args.threads > 4 * cores:  # torch crashes at set_num_threads(100000)
        p.error(f"--threads must be at most 4 x the {cores} cores, got {args.threads}")
    for name in ("max_time", "race_time", "budget"):
        value = getattr(args, name)
        if value is not None and not (0 < value <= MAX_SECONDS):
            p.error(f"--{name.replace('_', '-')} must be a positive number of seconds, at most {MAX_SECONDS} "
                    f"(a week), got {value}")
    names = args.racers.split(",")
    if len(names) < 2 or any(n not in race.RACERS for n in names) or len(set(names)) < len(names):
        p.error(f"--racers takes two or more different names of {', '.join(race.RACERS)}, got {args.racers!r}")
    if args.archs is not None:
        unknown = [a for a in args.archs.split(",") if a not in roofline.ROOFLINE_ARCHS]
        if unknown:
            p.error(f"--archs takes a comma-separated list of {', '.join(roofline.ROOFLINE_ARCHS)}, "
                    f"got {args.archs!r}")
    if args.flags is not None:
        check_trainer_flags(p, args)
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


def check_trainer_flags(p, args):
    """roofline's --flags: the trainer's flags, checked by the trainer itself for each model."""
    try:
        given = [f.split("=")[0] for f in shlex.split(args.flags) if f.startswith("--")]
    except ValueError as err:  # an unclosed quote
        p.error(f"--flags must be the trainer's flags as its command line takes them: {err}, in {args.flags!r}")
    chosen = [f for f in given if f in ("--arch", "--scan-backend")]
    if chosen:
        p.error(f"--flags must not hold {' or '.join(chosen)}: --archs chooses the models, and roofline runs "
                f"every scan backend of Mamba-1")
    for arch in args.archs.split(",") if args.archs else roofline.ROOFLINE_ARCHS:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                roofline.trainer_settings(arch, shlex.split(args.flags))
        except SystemExit as refused:  # the trainer's own message: argparse's line, or sys.exit("error: ...")
            lines = said.getvalue().splitlines() + ([refused.code] if isinstance(refused.code, str) else [])
            errors = [line.split("error: ", 1)[1] for line in lines if "error: " in line]
            reason = errors[-1] if errors else " ".join(lines).strip() or f"exit status {refused.code}"
            p.error(f"--flags {args.flags!r}: train_shakespeare.py --arch {arch} refuses them: {reason}")


def parser():
    p = argparse.ArgumentParser(prog="python -m bench", description=bench.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", help="tables to print: scan (default), depth, crossover, selective, train, "
                                           "profile, race, sweep, generate, decode, load, mamba2_ssd, mamba2_train, "
                                           "mamba2_profile, mamba3, roofline, graphs, all; or gpu")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads (default 1; race: the trainer's own choice unless given)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small shapes only (a smoke test)")
    p.add_argument("--top", type=int, default=15, help="profile: how many ops to list")
    p.add_argument("--backend", default="eager",
                   help="graphs: the torch.compile backend (default eager: Dynamo's graphs without compiling them)")
    r = p.add_argument_group("race (python -m bench race)")
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
    m = p.add_argument_group("roofline (python -m bench roofline)")
    m.add_argument("--archs", help="comma-separated: mamba, mamba2, mamba3, gpt (default all four)")
    m.add_argument("--flags", help='the trainer\'s flags for another shape, e.g. "--batch-size 16 --block-size 1024"')
    g = p.add_argument_group("gpu (python -m bench gpu)")
    g.add_argument("--tiny", action="store_true",
                   help="dry run of `gpu` on the CPU: the same parts in the same order at a toy size")
    g.add_argument("--steps", type=int, help=f"iterations of each step-time run (default {gpu.GPU_STEPS}, --tiny 12)")
    g.add_argument("--race-time", type=float,
                   help=f"seconds of training of each racer (default {gpu.GPU_RACE_S}, --tiny 10)")
    g.add_argument("--data", help="the text to train on, for gpu and race (default: the trainer's "
                                  "data/tinyshakespeare.txt, downloaded if missing; a machine without network "
                                  "needs the file or this flag)")
    g.add_argument("--budget", type=float, default=gpu.GPU_BUDGET_S,
                   help="seconds for the whole command, compiling included (default %(default)s)")
    g.add_argument("--gpu-part", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.memory_case:  # one case of a peak-memory table, in a process of its own
        spec = json.loads(args.memory_case)
        return load.load_case(spec) if spec["kind"] == "load" else scan.memory_case(spec)
    if args.gpu_part:
        return gpu.gpu_table_part(args, args.gpu_part)
    tables = commands()
    device = check_args(p, args, tables)
    torch.set_num_threads(args.threads or 1)
    if args.what == ["gpu"]:  # not part of "all": it needs a GPU and runs its own subprocesses
        return gpu.bench_gpu(args)
    if "gpu" in args.what:
        p.error("gpu runs on its own: python -m bench gpu")
    whats = args.what or ["scan"]
    if whats == ["all"]:
        whats = [w for w in tables if w not in ("race", "sweep", "load")]  # minutes each: each runs on its own
    if len(whats) > 1:
        # one fresh process per table: the eager backends' speed depends on the allocator's state
        # (the heap's mapped pages), which an earlier table would otherwise leave behind
        flags = [a for a in (sys.argv[1:] if argv is None else argv) if a not in tables and a != "all"]
        for what in whats:
            sys.stdout.flush()
            subprocess.run(bench_command(what, *flags), cwd=ROOT, check=True)
        return
    print(f"torch {torch.__version__}, {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda"
             else f", {platform.processor() or platform.machine()}")
          + f", {torch.get_num_threads()} thread(s)")
    tables[whats[0]](args, device)


if __name__ == "__main__":
    main()
