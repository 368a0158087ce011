"""
tasks/common.py: what the four synthetic tasks share, written once. Each task's own file holds its
idea, its paper's claim, its data generator and its run; this one holds the rest:

    1. The models       build(): every architecture at one small size, by name
    2. Training         train(): AdamW with a warmup and a cosine decay, the loss on answers only
    3. Evaluation       accuracy(): the fraction of answers right, in one parallel pass
    4. Over seeds       the command line, the table (mean and spread over seeds), the figure

A task's data generator returns (x, y): token ids (b, L) and targets (b, L), where a target is
IGNORE at every position that asks for nothing. The loss and the accuracy read the other
positions only, the answers.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import mamba_engine
from gpt_minimal import GPTConfig, TinyGPT
from mamba2_minimal import Mamba2Config, Mamba2LM
from mamba3_minimal import Mamba3Config, Mamba3LM
from mamba_minimal import MambaConfig, MambaLM, MambaMixer
from tasks.selection_off import SelectionOffMixer

IGNORE = -100  # the target of a position that asks for nothing (cross_entropy's ignore_index)

# ------------------------------------------------------------------------------------------------
# 1. The models
# ------------------------------------------------------------------------------------------------
# One small size for every architecture, far below the papers': 2 layers of width 32 train a hundred
# steps in seconds on one CPU thread.
# Mamba-2 and Mamba-3 use heads of 16 channels, so that width 32 (64 inner channels) has 4 heads,
# and chunks of 16 tokens: at these lengths (33 tokens, one thread) a training step with chunks of
# 16 took 0.5-0.7x the time of one with chunks of 32 or 64.

ARCHS = {
    "mamba": "Mamba-1, selective",
    "mamba-lti": "Mamba-1, selection off (LTI)",
    "mamba2": "Mamba-2",
    "mamba3": "Mamba-3",
    "mamba3-real": "Mamba-3, rotations off",
    "mamba3-march": "Mamba-3, the March 2026 release's A",
    "gpt": "GPT (learned positions)",
}


def build(arch, vocab_size, d_model=32, n_layer=2, d_state=16, max_len=64):
    """A freshly initialised model of the architecture named `arch` (a key of ARCHS). max_len: the
    longest training sequence; the GPT's learned positions stop there, the SSMs have none. Mamba-1
    models, selective or not, run mamba_engine.accelerate's scan and conv: the same numbers, a
    faster training step."""
    common = dict(d_model=d_model, n_layer=n_layer, vocab_size=vocab_size)
    if arch in ("mamba", "mamba-lti"):
        mixer_cls = SelectionOffMixer if arch == "mamba-lti" else MambaMixer
        return mamba_engine.accelerate(MambaLM(MambaConfig(**common, d_state=d_state), mixer_cls))
    if arch == "mamba2":
        return Mamba2LM(Mamba2Config(**common, d_state=d_state, headdim=16, chunk_size=16))
    if arch in ("mamba3", "mamba3-real", "mamba3-march"):
        return Mamba3LM(Mamba3Config(**common, d_state=d_state, headdim=16, chunk_size=16,
                                     rotations_off=arch == "mamba3-real",
                                     A_activation="softplus" if arch == "mamba3-march" else "heavy_tail"))
    if arch == "gpt":
        return TinyGPT(GPTConfig(vocab_size=vocab_size, d_model=d_model, n_layer=n_layer, n_head=4,
                                 block_size=max_len))
    raise ValueError(f"arch must be one of {tuple(ARCHS)}, got {arch!r}")


def vocab_logits(logits, vocab_size):
    """logits (..., V_padded) -> (..., vocab_size) in fp32: the Mamba models pad their vocabulary to a
    multiple of 8, and the padded entries are no answer."""
    return logits[..., :vocab_size].float()


def logits_of(model, x, vocab_size):
    """x (b, L) -> logits (b, L, vocab_size), the padded entries dropped."""
    return vocab_logits(model(x), vocab_size)


# ------------------------------------------------------------------------------------------------
# 2. Training
# ------------------------------------------------------------------------------------------------

LR, WEIGHT_DECAY = 3e-3, 0.1  # every task's unless it names its own (MQAR's learning rate)

def lr_at(step, steps, lr, warmup):
    """Linear warmup over `warmup` steps, then a cosine from lr down to lr/10 at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    ratio = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * ratio)))


def train(model, batch_at, steps, vocab_size, lr=LR, weight_decay=WEIGHT_DECAY, warmup=100, log_every=50,
          state_passing=False):
    """AdamW on the batches batch_at(step) -> (x, y) for `steps` steps, gradients clipped at norm 1.
    Returns the training loss every log_every steps, as (step, mean loss since the last record).
    state_passing (SSMs only, one batch size throughout): each batch starts from the recurrent state
    the previous one ended in, detached, instead of from zeros, so that training meets the states a
    long string leads to (the remedy of Buitrago Ruiz and Gu, arXiv 2507.02782)."""
    optimizer = torch.optim.AdamW(model.optim_groups(weight_decay), lr=lr, betas=(0.9, 0.98))
    model.train()
    curve, running, cache = [], [], None
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x, y = batch_at(step)
        if state_passing:
            logits, cache = model(x, want_cache=True, cache=cache)
            logits = vocab_logits(logits, vocab_size)
            # the next batch starts from this state, but no gradient flows back into this batch
            cache = [type(layer)(t.detach() for t in layer) for layer in cache]
        else:
            logits = logits_of(model, x, vocab_size)  # (b, L, V)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append((step + 1, sum(running) / len(running)))
            running = []
    return curve


# ------------------------------------------------------------------------------------------------
# 3. Evaluation
# ------------------------------------------------------------------------------------------------

@torch.no_grad()
def accuracy(model, x, y, vocab_size, batch_size=256):
    """The fraction of answers (positions where y is not IGNORE) that the model's argmax gets right,
    over the test set x, y (n, L), in batches of batch_size sequences."""
    model.eval()
    right = total = 0
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        pred = logits_of(model, xb, vocab_size).argmax(-1)  # (b, L)
        asked = yb != IGNORE
        right += (pred[asked] == yb[asked]).sum().item()
        total += asked.sum().item()
    model.train()
    return right / total


@torch.no_grad()
def last_logits_by_steps(model, x, prefix, vocab_size):
    """The logits at the last position of x (b, L), computed as a model generates: prefill reads the
    first `prefix` tokens in one parallel pass, then step() advances the recurrent state one token
    at a time, in O(1) time and memory per token whatever the position. -> (b, vocab_size)"""
    model.eval()
    logits, cache = model.prefill(x[:, :prefix])
    logits = logits[:, -1]
    for token in x[:, prefix:].unbind(1):
        logits = model.step(token, cache)
    model.train()
    return vocab_logits(logits, vocab_size)


# ------------------------------------------------------------------------------------------------
# 4. Over seeds: the command line, the table, the figure
# ------------------------------------------------------------------------------------------------

def arguments(description, models, steps, extra=None, argv=None):
    """The options every task takes; `extra(parser)` adds a task's own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None if models is None else ",".join(models),
                   help=f"comma-separated, from {', '.join(ARCHS)} (default: "
                        + ("each task's own" if models is None else "%(default)s") + ")")
    p.add_argument("--seeds", type=int, default=3, help="runs per model, seeds 0 .. SEEDS-1 (default: %(default)s)")
    p.add_argument("--steps", type=int, default=steps, help="training steps per run (default: "
                   + ("each task's own" if steps is None else "%(default)s") + ")")
    p.add_argument("--width", type=int, help="d_model of every model (default: the task's own)")
    p.add_argument("--lr", type=float, help="the peak learning rate (default: the task's own)")
    p.add_argument("--weight-decay", type=float, help=f"AdamW's weight decay (default: {WEIGHT_DECAY})")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--out-dir", default="out/tasks", help="where the results (JSON) and the figure go")
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    if args.models is not None:  # None: each task's own
        args.models = [m for m in args.models.split(",") if m]
        for m in args.models:
            if m not in ARCHS:
                p.error(f"unknown model {m!r}: choose from {', '.join(ARCHS)}")
        if not args.models or len(set(args.models)) < len(args.models):
            p.error(f"--models needs one or more different names, got {','.join(args.models)!r}")
    if args.seeds < 1 or args.threads < 1 or any(v is not None and v <= 0 for v in (args.steps, args.width, args.lr)):
        p.error("--seeds, --steps, --threads, --width and --lr must be positive")
    if args.weight_decay is not None and args.weight_decay < 0:
        p.error("--weight-decay must be 0 or more")
    cores = os.cpu_count() or 1
    if args.threads > 4 * cores:  # torch crashes (SIGSEGV) far above the cores
        p.error(f"--threads {args.threads} is more than 4 x the {cores} cores this machine has")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        p.error(f"--out-dir {args.out_dir} is a file; it must be a folder (created if missing)")
    try:  # now, not after the first model has trained for minutes
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as err:
        p.error(f"--out-dir {args.out_dir}: {err.strerror or err}")
    probe = os.path.join(args.out_dir, f".write-test{os.getpid()}")
    try:  # a byte, not an empty file: a full disk still makes empty files
        with open(probe, "w") as f:
            f.write("x")
    except OSError as err:
        p.error(f"--out-dir {args.out_dir} cannot be written: {err.strerror or err}")
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    torch.set_num_threads(args.threads)
    return args


def overrides(args):
    """The run_one keywords that --width, --lr and --weight-decay set; a task's own values stand for
    the options not given."""
    given = dict(d_model=args.width, lr=args.lr, weight_decay=args.weight_decay)
    return {k: v for k, v in given.items() if v is not None}


def machine():
    """What ran it, for the record and the figure: the CPU, the threads, torch."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} thread(s), torch {torch.__version__}"


def spread(values):
    """'mean [min, max]' of the values over seeds; '-' when there are none (not applicable)."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{statistics.fmean(values):.3f} [{min(values):.2f}, {max(values):.2f}]"


def print_table(title, rows, columns):
    """rows: (label, {column: [value per seed]}); prints a Markdown table of mean [min, max]."""
    print(f"\n{title}\n")
    print("| model | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for label, cells in rows:
        print(f"| {label} | " + " | ".join(spread(cells.get(c, [])) for c in columns) + " |")


def write_file(path, write):
    """write(tmp) writes the file at the path tmp; then tmp is renamed to path, so that a reader never
    sees half a file. A full or read-only disk ends the command with one line (the lines printed
    after each run keep its numbers), and no temporary file is left."""
    tmp = path + ".tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # made at the start, unless removed since
        write(tmp)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        sys.exit(f"error: could not write {path} (disk full or read-only?): {err.strerror or err}")
    print(f"wrote {path}")


def save_results(args, name, record, **settings):
    """Writes out_dir/name.json: every run's numbers (record), the machine and the settings (the
    command line's, updated with `settings`)."""
    path = os.path.join(args.out_dir, f"{name}.json")

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(dict(runs=record, machine=machine(), settings={**vars(args), **settings}), f, indent=1)

    write_file(path, write)
    return path


def pyplot():
    """matplotlib.pyplot writing files, or None when matplotlib is not installed (it is optional:
    the tasks print their tables without it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure (pip install matplotlib for one)")
        return None
    return plt


def save_figure(fig, args, name, title, width=32, size=None):
    """Titles fig with the task, the run's settings (size: the model's and the steps', by default 2
    layers of `width` and --steps) and the machine, and writes out_dir/name.png."""
    size = size or f"2 layers of width {args.width or width}, {args.steps} steps"
    fig.suptitle(f"{title}, {size}, {args.seeds} seeds "
                 f"(python -m tasks.{name})\n{machine()}", fontsize=8)
    fig.tight_layout()
    write_file(os.path.join(args.out_dir, f"{name}.png"), lambda tmp: fig.savefig(tmp, dpi=90, format="png"))


def timed(fn, *args, **kwargs):
    """fn's result and the seconds it took."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start
