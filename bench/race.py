"""
bench/race.py: whole training runs of train_shakespeare.py at equal wall-clock time.

    python -m bench race --max-time 300 --runs 2   # GPT vs the default Mamba, whole trainings at equal time
    python -m bench sweep --max-time 300 [--round 2|3|4]  # the grid that chose both models' CPU defaults
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.common import ROOT, table


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
RUN_FILES = ("last.pt", "best.pt", "log.jsonl")  # what a run of the trainer leaves in its --out-dir


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
    trainer = os.path.join(ROOT, "train_shakespeare.py")
    started = []
    for label, flags, out_dir in group:
        for name in RUN_FILES:  # a fresh run: the trainer continues or refuses a run it finds there
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
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
# run-to-run spread in `python -m bench race` on a quiet machine is 0.001-0.003, the GPT's 0.001-0.011).
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
