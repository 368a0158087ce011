"""
plot_curves.py: validation loss against wall-clock seconds, one line per training run.

    python plot_curves.py --run "Mamba eager=out/log.jsonl" --run "GPT=gpt/log.jsonl" -o curves.png

Each run is a log.jsonl written by train_shakespeare.py: one JSON object per evaluation with
step, elapsed (seconds of training so far), tokens, train_loss and val_loss, and a last one with
full_val_loss. Wall-clock seconds, not steps, on the x axis: that is what a user waits for, and
it is where a model that learns more per step but pays more per step wins or loses.

matplotlib is needed by this script only (pip install matplotlib); the library, the trainer and
the tests never import it.
"""

import argparse
import json
import math
import os
import sys


def read_log(path):
    """The evaluations of one run: lists of (elapsed seconds, val loss), and the full-val loss."""
    if not os.path.isfile(path):
        raise ValueError(f"no log file at {path}")
    points, full_val = [], None
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {n}: not JSON ({err})") from None
            if "full_val_loss" in record:
                full_val = record["full_val_loss"]
            elif "val_loss" in record and "elapsed" in record:
                points.append((record["elapsed"], record["val_loss"]))
    if not points:
        raise ValueError(f"{path} holds no evaluation records (objects with 'elapsed' and 'val_loss')")
    return points, full_val


def parse_run(spec):
    """'LABEL=PATH' -> (label, path); a bare PATH is labelled by its folder."""
    label, sep, path = spec.rpartition("=")
    if not sep:
        path = spec
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    if not label or not path:
        raise ValueError(f"--run expects LABEL=PATH/log.jsonl, got {spec!r}")
    return label, path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, metavar="LABEL=PATH",
                   help="a run's label and its log.jsonl (repeat for each run)")
    p.add_argument("-o", "--out", default="curves.png", help="the PNG to write")
    p.add_argument("--title", default="Tiny Shakespeare, char-level: val loss against training time")
    p.add_argument("--max-seconds", type=float, help="cut the x axis here (e.g. 300)")
    p.add_argument("--ymax", type=float, help="cut the y axis here, so that the first evaluations do not squash the rest")
    args = p.parse_args(argv)
    try:
        runs = [(label, *read_log(path)) for label, path in map(parse_run, args.run)]
    except ValueError as err:
        sys.exit(f"error: {err}")
    try:
        import matplotlib
        matplotlib.use("Agg")  # write a file; no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plot_curves.py needs matplotlib, which is not installed: pip install matplotlib\n"
                 "(only this script uses it; training and the tests do not)")

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points, full_val in runs:
        seconds, losses = zip(*points)
        best = min(losses)
        ax.plot(seconds, losses, marker="o", markersize=3, label=f"{label} (best {best:.3f})")
        if full_val is not None and not math.isnan(full_val):
            # the full-val figure is another measurement (every window of the split): a marker at
            # the run's end, not a point of the curve
            ax.plot([seconds[-1]], [full_val], marker="*", markersize=10, color=ax.lines[-1].get_color())
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("val loss (fixed windows)")
    ax.set_title(args.title)
    ax.set_xlim(0, args.max_seconds)  # from 0: the time before the first evaluation counts too
    if args.ymax:
        ax.set_ylim(top=args.ymax)
    ax.grid(alpha=0.3)
    ax.legend(title="★ full val split, best checkpoint" if any(r[2] is not None for r in runs) else None)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
