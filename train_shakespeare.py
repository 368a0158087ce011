"""
train_shakespeare.py: train a character-level model on Tiny Shakespeare, then sample from it.

    python train_shakespeare.py                                  # Mamba; on a CPU 5 minutes of training
    python train_shakespeare.py --arch gpt --out-dir out-gpt     # the GPT yardstick, Mamba's size (or mamba2, mamba3)
    python train_shakespeare.py --sample --prompt "ROMEO:"       # generate from out/best.pt
    torchrun --nproc_per_node=2 train_shakespeare.py             # data parallel (gloo on CPU, nccl on CUDA)

It reads as nanoGPT's train.py does: settings, data, model, the training loop, evaluation, sampling;
after main(), the plumbing that makes a run safe to interrupt and resume. A run is time-based (--max-time,
the CPU default: the learning rate, the evaluations and the stop follow the share of the budget spent) or
iteration-based (--max-iters, the CUDA default).
"""

import argparse
import json
import math
import os
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mamba_engine
from mamba_engine import FUSED_BACKENDS, SCAN_BACKENDS
from mamba_minimal import MambaConfig, MambaLM

# ------------------------------------------------------------------------------------------------
# Settings: defaults per device and architecture; every one has a flag (--d-model sets d_model)

DEFAULTS = {
    # 0.83M parameters, 5 minutes: what won `python -m bench sweep` at that budget, as the GPT's below
    "cpu": dict(d_model=160, n_layer=5, d_state=2, block_size=64, batch_size=12, lr=6e-3, beta2=0.95,
                warmup_iters=50, eval_interval=100, eval_iters=20, scan_backend="auto", max_time=300.0,
                num_evals=10),
    # 5.81M parameters: the width and depth of nanoGPT's baby GPT. An evaluation is 2 x eval_iters
    # forwards, each about half a training step at most: 20 steps' worth every 250, 8%
    "cuda": dict(d_model=384, n_layer=6, d_state=16, block_size=256, batch_size=64, max_iters=5000, lr=2e-3,
                 beta2=0.95, warmup_iters=200, eval_interval=250, eval_iters=20, scan_backend="auto",
                 max_time=None, num_evals=20),
}
# What each other architecture changes in DEFAULTS, per device
ARCH_DEFAULTS = {
    "mamba": {},
    # Mamba-2: a larger state is cheap (the scan runs as matmuls); python -m bench mamba2_train
    "mamba2": {"cpu": dict(d_model=128, n_layer=7, d_state=64, headdim=64), "cuda": dict(d_state=64, headdim=64)},
    # Mamba-3 at d_state 32: a CPU step costs about 1.04x Mamba-2's at 64 (python -m bench mamba3)
    "mamba3": {"cpu": dict(d_model=128, n_layer=7, d_state=32, headdim=64), "cuda": dict(d_state=64, headdim=64)},
    # The yardstick (gpt_minimal.py), within 10% of Mamba's parameters: nanoGPT's Shakespeare settings (config/
    # train_shakespeare_char.py) without dropout. On a CPU 2 x 192 (0.91M), the shape that won the sweep at 300 s;
    # on a GPU the baby GPT's 6 layers and 6 heads at width 288 (6.07M): its width 384 (--d-model 384) has 10.75M
    "gpt": {"cpu": dict(d_model=192, n_layer=2, n_head=6, lr=1e-3, min_lr=1e-4, beta2=0.99, warmup_iters=100,
                        d_state=None, scan_backend=None),
            "cuda": dict(d_model=288, n_layer=6, n_head=6, lr=1e-3, min_lr=1e-4, beta2=0.99, warmup_iters=100,
                         max_iters=5000, lr_decay_iters=5000, max_time=None, d_state=None, scan_backend=None)},
}
# The same on every device, for every architecture
COMMON = dict(seed=1337, weight_decay=0.1, grad_clip=1.0, log_interval=10, patience=0, eval_share=0.1,
              temperature=0.8, num_chars=500)


def parse_args(argv=None):
    """The flags, None where left out; args.given names those given (--resume takes the rest from last.pt)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    unset = object()  # argparse fills in a default only where the namespace lacks the attribute
    seen = parser.parse_args(argv, argparse.Namespace(**{k: unset for k in vars(args)}))
    args.given = sorted(k for k, v in vars(seen).items() if v is not unset)
    return args


def fill_defaults(args, device):
    """Every flag left out takes its default for the device and the architecture."""
    args.arch = args.arch or "mamba"
    kind = "cuda" if device.type == "cuda" else "cpu"  # Apple's MPS takes the CPU's settings
    defaults = {**COMMON, **DEFAULTS[kind], **ARCH_DEFAULTS[args.arch].get(kind, {})}
    if args.max_iters is not None:
        defaults["max_time"] = None  # asking for iterations makes the run iteration-based
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_time is not None:
        args.max_iters = None  # a time-based run: the budget alone says when to stop
    args.lr_decay_iters = args.max_iters if args.lr_decay_iters is None else args.lr_decay_iters
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    args.dtype = args.dtype or default_dtype(device, args.arch)
    check_flags(args)  # a flag that does not apply, or a number out of range, ends the run at once


def default_dtype(device, arch):
    """bf16 where the device computes in it (on a CPU for Mamba and the GPT it races only), else fp16 or fp32."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return "bf16" if device.type == "cpu" and arch in ("mamba", "gpt") and cpu_computes_in_bf16() else "fp32"


def cpu_computes_in_bf16():
    """Whether the CPU has AVX-512-BF16 or AMX-BF16. MAMBA_CPU_BF16=0 says no, =1 yes, whatever the CPU."""
    forced = os.environ.get("MAMBA_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    if forced is not None:
        sys.exit(f"error: MAMBA_CPU_BF16 must be 0 or 1, got {forced!r}")
    if hasattr(torch.cpu, "get_capabilities"):  # torch 2.9 and later
        found = torch.cpu.get_capabilities()
        return bool(found.get("avx512_bf16") or found.get("amx_bf16"))
    older = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(older and older())


# ------------------------------------------------------------------------------------------------
# Data: characters to ids, 90% to train on, 10% to validate on
RANK, WORLD = 0, 1  # this process, of how many (torchrun sets them at the start)
DEFAULT_DATA = os.path.join("data", "tinyshakespeare.txt")
DATA_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def read_text(path):
    """The training text: the file at path, or Tiny Shakespeare (downloaded on first use) for None."""
    if path is None:
        path = DEFAULT_DATA
        missing = not os.path.exists(path)
        if missing and RANK == 0:
            print(f"downloading Tiny Shakespeare to {path} ...", flush=True)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                with urllib.request.urlopen(DATA_URL, timeout=30) as r:
                    data = r.read()
            except OSError as err:  # no network: data/ is git-ignored, so a copied checkout lacks the file
                sys.exit(f"error: could not download {DATA_URL} ({err}).\nWithout a network, copy Tiny Shakespeare "
                         f"(or any UTF-8 text) to {os.path.abspath(path)}, or pass --data PATH.")
            with open(path + ".part", "wb") as f:
                f.write(data)
            os.replace(path + ".part", path)
        if missing and WORLD > 1:
            dist.barrier()  # the other processes wait for the file
    if os.path.isdir(path):
        sys.exit(f"error: --data {path} is a directory; expected a UTF-8 text file")
    if not os.path.isfile(path):
        sys.exit(f"error: data file {path} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    if not raw:
        sys.exit(f"error: data file {path} is empty")
    if b"\0" in raw:
        sys.exit(f"error: data file {path} holds NUL bytes: a binary file, expected UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        sys.exit(f"error: data file {path} is not UTF-8 text (byte {raw[err.start]:#04x} at offset "
                 f"{err.start}); convert it, e.g. with iconv -t UTF-8")


def load_data(args):
    """(vocabulary, train ids, val ids) of --data, or of Tiny Shakespeare (downloaded if missing)."""
    text = read_text(args.data)
    chars = "".join(sorted(set(text)))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n_train = int(0.9 * len(data))
    if len(data) - n_train <= args.block_size:
        sys.exit(f"error: the text has {len(text)} characters; its 10% validation split ({len(data) - n_train}) "
                 f"must be longer than one block ({args.block_size}). Use a longer text or a smaller --block-size.")
    return chars, data[:n_train], data[n_train:]


def get_batch(split, step, args, device):
    """Random windows, a function of (seed, rank, step) alone: a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + RANK * 10_007 + step)
    ix = torch.randint(len(split) - args.block_size, (args.batch_size,), generator=g)
    return windows(split, ix, args.block_size, device)


def windows(split, starts, block_size, device):
    starts = starts.tolist()
    x = torch.stack([split[i:i + block_size] for i in starts])  # (b, L), L = block_size
    y = torch.stack([split[i + 1:i + 1 + block_size] for i in starts])  # (b, L): the next characters
    if torch.device(device).type == "cuda":  # from pinned memory the copy is asynchronous: the loop goes on
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# ------------------------------------------------------------------------------------------------
# Model: Mamba (mamba_minimal.py), Mamba-2, Mamba-3, the GPT yardstick (gpt_minimal.py). A checkpoint
# holds the architecture's fields; how the model runs (the engine, compiling) may change on resume.

def model_kwargs(args, vocab_size):
    """The architecture's config fields, e.g. MambaConfig(**model_kwargs(args, 65))."""
    kw = dict(d_model=args.d_model, n_layer=args.n_layer, vocab_size=vocab_size)
    if args.arch == "mamba":
        kw.update(d_state=args.d_state)
    elif args.arch == "mamba2":  # chunks of 64: the official 256 would pad a 64-character block four times
        kw.update(d_state=args.d_state, headdim=args.headdim, chunk_size=min(64, args.block_size))
    elif args.arch == "mamba3":  # Mamba-2's chunk length (SISO); MIMO divides it by the rank
        rank = args.mimo_rank or 1
        kw.update(d_state=args.d_state, headdim=args.headdim, is_mimo=args.mimo_rank is not None,
                  mimo_rank=rank, chunk_size=max(1, min(64, args.block_size) // rank))
    else:
        kw.update(n_head=args.n_head, block_size=args.block_size)
    return kw


def run_options(args):
    """How the model runs (run_as's options): Mamba's engine, Mamba-2's compiled mixer."""
    if args.arch == "mamba":
        return dict(backend=args.scan_backend, compile=args.compile, recompute=args.recompute,
                    **({"chunk_size": args.chunk_size} if args.chunk_size else {}))
    return dict(compile=args.compile)


def build_model(arch, config, options=None):
    """The model of --arch from its config fields (the flags' or a checkpoint's), run as options say."""
    config_class, model_class = arch_classes(arch)
    try:
        return run_as(model_class(config_class(**config_fields(config, arch))), arch, options or {})
    except (TypeError, ValueError) as err:
        sys.exit(f"error: cannot build the {arch} model: {err}")


def run_as(model, arch, options):
    """Mamba opts in to mamba_engine.py (a step 1.3-1.4x the lesson's speed); compile: Mamba-2's mixers too."""
    if arch == "mamba":
        return mamba_engine.accelerate(model, **options)
    if arch == "mamba2":
        model.cfg.compile_mixer = bool(options.get("compile"))
    return model


def arch_classes(arch):
    """(config class, model class). Mamba-2, Mamba-3 and the GPT are imported only when asked for."""
    if arch == "mamba":
        return MambaConfig, MambaLM
    try:
        if arch == "mamba2":
            from mamba2_minimal import Mamba2Config, Mamba2LM
            return Mamba2Config, Mamba2LM
        if arch == "mamba3":
            from mamba3_minimal import Mamba3Config, Mamba3LM
            return Mamba3Config, Mamba3LM
        from gpt_minimal import GPTConfig, TinyGPT
        return GPTConfig, TinyGPT
    except ImportError as err:
        sys.exit(f"error: --arch {arch} needs {err.name}.py next to this script ({err})")


# How a model runs, not what it is: never part of a checkpoint's config. Older checkpoints hold these
# in Mamba's config, with the plain values of hybrid.py's fields: both are dropped on loading.
RUN_FIELDS = ("scan_backend", "compile_scan", "chunk_size", "recompute", "compile_mixer")
PLAIN_FIELDS = dict(d_intermediate=0, attn_layer_idx=[], attn_cfg={}, rms_norm=True, selection_off=False)


def config_fields(config, arch):
    """A checkpoint's config as the config class takes it."""
    known = {f.name for f in fields(arch_classes(arch)[0])}
    run = RUN_FIELDS if arch == "mamba" else ("compile_mixer",)
    return {k: v for k, v in config.items() if k not in run and (k in known or PLAIN_FIELDS.get(k, ...) != v)}


# ------------------------------------------------------------------------------------------------
# The training loop

def lr_at(args, step, elapsed, decay_start=-1.0, decay_lr=0.0):
    """nanoGPT's get_lr: warmup, then a cosine to --min-lr over the steps or seconds of the budget."""
    warm = min(1.0, (step + 1) / args.warmup_iters) if args.warmup_iters else 1.0
    if args.max_time is None:
        if step < args.warmup_iters:
            return args.lr * warm
        at, start, end = step, args.warmup_iters, args.lr_decay_iters
    else:
        at, start, end = elapsed, 0.0, args.max_time
    start, top = (decay_start, decay_lr) if decay_start >= 0 else (start, args.lr)
    if at >= end:
        return args.min_lr * warm
    ratio = (at - start) / (end - start)  # 0 -> 1 over the decay
    return warm * (args.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (top - args.min_lr))


def loss_fn(model, x, y, vocab_size, autocast):
    with autocast:
        logits = model(x)  # (b, L, padded vocab)
    logits = logits[..., :vocab_size].float()  # entries past the vocabulary are padding
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train_step(model, optimizer, x, y, vocab_size, args, autocast, scaler=None):
    """One AdamW step on (x, y), through fp16's GradScaler if given; the loss, unread (reading waits)."""
    loss = loss_fn(model, x, y, vocab_size, autocast)
    optimizer.zero_grad(set_to_none=True)
    (loss if scaler is None else scaler.scale(loss)).backward()
    if scaler is not None:
        scaler.unscale_(optimizer)  # the true gradients, for clipping
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)  # skipped if a gradient overflowed
        scaler.update()
    return loss


@dataclass
class Progress:
    """Where a run stands. Every checkpoint holds it, so --resume continues exactly from here."""
    step: int = 0
    best_val: float = math.inf
    bad_evals: int = 0  # evaluations since the best one (for --patience)
    elapsed: float = 0.0  # seconds of training, compiling and evaluating: what --max-time counts
    tokens: int = 0
    evals_done: int = 0  # time-based runs: how many of the budget's evaluation points have passed
    stopped_early: bool = False  # --patience ended the run
    eval_time: float = 0.0  # seconds of elapsed spent evaluating
    eval_cost: float = 0.0  # the cheapest evaluation's seconds
    decay_start: float = -1.0  # lr_at's: >= 0 after a resume that changed the budget
    decay_lr: float = 0.0


class Run:
    """What a training run holds: its data, model, optimizer and progress."""

    def __init__(self, args, device, ddp, ckpt=None):
        self.args, self.device = args, device
        self.chars, self.train_data, self.val_data = load_data(args)
        self.vocab_size = len(self.chars)
        # the same windows at every evaluation: the curve measures the model, not the windows drawn
        g = torch.Generator().manual_seed(1234)
        n_eval = args.eval_iters * args.batch_size
        self.val_starts = torch.randint(len(self.val_data) - args.block_size, (n_eval,), generator=g)
        self.train_starts = torch.randint(len(self.train_data) - args.block_size, (n_eval,), generator=g)
        self.raw_model = build_model(args.arch, model_kwargs(args, self.vocab_size), run_options(args)).to(device)
        # fused: AdamW's update as a few kernels, not op by op
        self.optimizer = torch.optim.AdamW(self.raw_model.optim_groups(args.weight_decay), lr=args.lr,
                                           betas=(0.9, args.beta2), fused=device.type in ("cpu", "cuda"))
        self.autocast, self.scaler = precision(device, args.dtype)  # --dtype's autocast; fp16's GradScaler
        self.p = Progress()
        self.paths = {name: os.path.join(args.out_dir, name) for name in RUN_FILES}
        if ckpt is not None:
            resume(self, ckpt)  # model, optimizer, random state and progress of last.pt
        n_params = sum(p.numel() for p in self.raw_model.parameters())
        log(f"{n_params / 1e6:.2f}M parameters, vocab {self.vocab_size}, {len(self.train_data):,} train / "
            f"{len(self.val_data):,} val characters, device {device}, {WORLD} process(es), "
            f"{torch.get_num_threads()} thread(s), {args.dtype}")
        self.model = torch.compile(self.raw_model) if args.compile_model else self.raw_model
        if ddp:  # DDP averages the gradients of all processes during backward
            self.model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None)


def train(run):
    args, p = run.args, run.p
    tokens_per_step = args.batch_size * args.block_size * WORLD
    t_start, elapsed_before, step_at_start = clock(), p.elapsed, p.step
    last_line = (p.step, p.elapsed - p.eval_time)  # (step, seconds of training) at the last log line

    def elapsed_now():  # a time-based run under torchrun: process 0's clock (processes deciding apart hang)
        elapsed = elapsed_before + clock() - t_start
        if args.max_time is None or WORLD == 1:
            return elapsed
        elapsed = torch.tensor([elapsed], dtype=torch.float64, device=run.device)
        dist.broadcast(elapsed, src=0)
        return elapsed.item()

    if args.compile or args.compile_model:
        compile_now(run)  # or, where no compiler works, go on eagerly
    while not p.stopped_early and (p.step < args.max_iters if args.max_time is None else p.elapsed < args.max_time):
        lr = lr_at(args, p.step, p.elapsed, p.decay_start, p.decay_lr)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(run.train_data, p.step, args, run.device)
        loss = train_step(run.model, run.optimizer, x, y, run.vocab_size, args, run.autocast, run.scaler)
        p.step += 1
        p.tokens += tokens_per_step
        p.elapsed = elapsed_now()  # the only clock reading of a step
        first_step = p.step == step_at_start + 1  # holds start-up costs and any compiling: no rate from it
        if p.step % args.log_interval == 0 or first_step:  # reading the loss waits for the step
            dt = (p.elapsed - p.eval_time - last_line[1]) / (p.step - last_line[0])  # training only
            last_line = (p.step, p.elapsed - p.eval_time)
            loss_value = loss.detach().float().clone()  # averaged over the processes, each saw its own batch
            if WORLD > 1:
                dist.all_reduce(loss_value)
            loss_value = (loss_value / WORLD).item()
            if not math.isfinite(loss_value):
                sys.exit(f"error: the training loss is {loss_value} at step {p.step}: the run diverged; "
                         f"try a lower --lr (now {args.lr:g}) or a --grad-clip")
            if args.max_time is None:
                where, left = f"step {p.step}/{args.max_iters}", dt * (args.max_iters - p.step)
            else:
                where, left = f"step {p.step} ({p.elapsed / args.max_time:.0%})", args.max_time - p.elapsed
            speed = (f"first step {dt:.1f}s" if first_step else
                     f"{tokens_per_step / dt:,.0f} tok/s | {dt * 1e3:.0f} ms/it | eta {left:.0f}s")
            log(f"{where} | loss {loss_value:.4f} | lr {lr:.2e} | {speed} | elapsed {p.elapsed:.0f}s")
        if evaluation_due(args, p):
            before = p.elapsed
            losses = evaluate(run)
            p.elapsed = elapsed_now()
            took = p.elapsed - before
            p.eval_cost = min(p.eval_cost or took, took)  # a slower one than this is the machine's doing
            p.eval_time += took
            record(run, took, **losses)


# ------------------------------------------------------------------------------------------------
# Evaluation

def evaluation_due(args, p):
    """Every --eval-interval steps, or at --num-evals fractions of --max-time if within --eval-share; the end."""
    if args.max_time is None:
        return p.step % args.eval_interval == 0 or p.step == args.max_iters
    if p.elapsed >= args.max_time:
        return True
    points = min(args.num_evals, int(p.elapsed * args.num_evals / args.max_time))
    if points <= p.evals_done:
        return False
    p.evals_done = points  # once, if one long step passes several points
    if args.eval_share >= 1:
        return True
    # this evaluation and the one at the end, at the cheapest one's cost (before it, --eval-iters steps)
    cost = p.eval_cost or args.eval_iters * (p.elapsed - p.eval_time) / p.step
    return p.eval_time + 2 * cost <= args.eval_share * p.elapsed


@torch.no_grad()
def mean_loss(model, split, starts, vocab_size, args, device, autocast):
    """Mean loss over fixed windows, split across processes and averaged."""
    model.eval()
    mine = starts[RANK::WORLD]
    loss_sum = torch.zeros((), device=device)
    for i in range(0, len(mine), args.batch_size):
        x, y = windows(split, mine[i:i + args.batch_size], args.block_size, device)
        loss_sum += loss_fn(model, x, y, vocab_size, autocast) * len(x)
    total = torch.stack([loss_sum, torch.tensor(float(len(mine)), device=device)])  # (sum of losses, count)
    if WORLD > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def evaluate(run):
    return {name: mean_loss(run.model, split, starts, run.vocab_size, run.args, run.device, run.autocast)
            for name, split, starts in (("train_loss", run.train_data, run.train_starts),
                                        ("val_loss", run.val_data, run.val_starts))}


def record(run, took, train_loss, val_loss):
    """An evaluation's log line and log.jsonl row; best.pt if it is the best so far, and last.pt."""
    args, p = run.args, run.p
    if not math.isfinite(val_loss):
        sys.exit(f"error: the val loss is {val_loss} at step {p.step}: the run diverged; try a lower --lr "
                 f"(now {args.lr:g})")
    improved = val_loss < p.best_val
    p.best_val = min(p.best_val, val_loss)
    p.bad_evals = 0 if improved else p.bad_evals + 1
    p.stopped_early = bool(args.patience) and p.bad_evals >= args.patience  # in last.pt: stays stopped
    log(f"eval step {p.step}: train {train_loss:.4f}, val {val_loss:.4f}{' (best)' if improved else ''}, "
        f"{p.elapsed:.0f}s | evaluating took {took:.1f}s, {p.eval_time / p.elapsed:.0%} of the time so far")
    if p.stopped_early:
        log(f"early stop: val loss has not improved for {p.bad_evals} evaluations")
    if RANK == 0:
        append_log(run, train_loss=train_loss, val_loss=val_loss)
        if improved:
            save_checkpoint(run, run.paths["best.pt"])
        save_checkpoint(run, run.paths["last.pt"])


def finish(run):
    """The best checkpoint's loss on the whole val split, and a sample from it."""
    args, p, paths = run.args, run.p, run.paths
    if WORLD > 1:
        dist.barrier()  # rank 0 has written best.pt
    if not os.path.exists(paths["best.pt"]):  # deleted by hand after the last evaluation
        sys.exit(f"error: {paths['best.pt']} is missing, so the run has no best model to evaluate and "
                 f"sample (its last model is in {paths['last.pt']}: --sample --checkpoint {paths['last.pt']})")
    best = load_checkpoint(paths["best.pt"])
    # a model of its own, not compiled: the split's last batch may be a single window, which would
    # compile again (torch specializes a batch of 1)
    model = build_model(args.arch, best["config"], {**run_options(args), "compile": False}).to(run.device)
    model.load_state_dict(best["model"])
    starts = torch.arange(0, len(run.val_data) - args.block_size, args.block_size)
    t0 = time.perf_counter()
    full_val = mean_loss(model, run.val_data, starts, run.vocab_size, args, run.device, run.autocast)
    log(f"full val split ({len(starts) * args.block_size:,} characters in windows of {args.block_size}): loss "
        f"{full_val:.4f} (best checkpoint, step {best['step']}), {time.perf_counter() - t0:.1f}s")
    log(f"evaluating took {p.eval_time:.0f}s of the run's {p.elapsed:.0f}s ({p.eval_time / max(p.elapsed, 1e-9):.0%})")
    if run.device.type == "cuda":  # training's peak: what a GPU must hold for these settings
        log(f"peak GPU memory {torch.cuda.max_memory_allocated(run.device) / 2**30:.2f} GiB "
            f"(torch.cuda.max_memory_allocated, --dtype {args.dtype})")
    if RANK == 0:
        append_log(run, full_val_loss=full_val)
        if not args.no_sample:
            print("-" * 80)
            sample(model.eval(), run.chars, None, 300, args.temperature, args.top_k, run.device)


# ------------------------------------------------------------------------------------------------
# Sampling

def checked_prompt(prompt, chars):
    """The prompt, by default a newline (or the text's first character); unknown characters: ValueError."""
    if not prompt:
        prompt = "\n" if "\n" in chars else chars[0]
    unknown = sorted(set(prompt) - set(chars))
    if unknown:
        raise ValueError(f"the prompt uses characters the model has never seen: {unknown}")
    return prompt


def sample(model, chars, prompt, num_chars, temperature, top_k, device, out=None):
    """Stream num_chars characters after the prompt (Mamba: one O(1) recurrent step each)."""
    out = out or sys.stdout
    prompt = checked_prompt(prompt, chars)
    ids = torch.tensor([[chars.index(c) for c in prompt]], device=device)
    out.write(prompt)
    for token in model.generate_stream(ids, num_chars, temperature=temperature, top_k=top_k):
        out.write(chars[token.item()])
        out.flush()
    out.write("\n")


def load_for_sampling(args, device):
    """--sample: the checkpoint's model, uncompiled (a prompt is read once), and the checkpoint."""
    path = args.checkpoint or os.path.join(args.out_dir, "best.pt")
    if not os.path.exists(path):
        sys.exit(f"error: no checkpoint at {path}; train first or pass --checkpoint")
    ckpt = load_checkpoint(path)
    try:
        checked_prompt(args.prompt, ckpt["vocab"])
    except ValueError as err:
        sys.exit(f"error: {err}")
    arch = ckpt.get("arch", "mamba")
    model = build_model(arch, ckpt["config"], {"compile": False})
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, TypeError, AttributeError) as err:
        sys.exit(f"error: {path}'s weights do not match its own config (a damaged or hand-made checkpoint): "
                 f"{first_line(err)}")
    print(f"sampling {path}: {arch}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, step "
          f"{ckpt.get('step', '?')}, val {ckpt.get('best_val', math.nan):.4f}", file=sys.stderr, flush=True)
    return model.to(device).eval(), ckpt


def main(argv=None):
    args = parse_args(argv)
    ddp, device = start_processes(args)  # the device (--device, else CUDA, MPS, CPU), torchrun's processes
    ckpt = read_last_checkpoint(args) if args.resume and not args.sample else None
    fill_defaults(args, device)
    torch.manual_seed(args.seed)
    if args.sample:
        model, sampled = load_for_sampling(args, device)
        if RANK == 0:
            sample(model, sampled["vocab"], args.prompt, args.num_chars, args.temperature, args.top_k, device)
    else:
        prepare_out_dir(args)  # writable; an earlier run there is continued (--resume) or replaced (--overwrite)
        run = Run(args, device, ddp, ckpt)
        train(run)
        finish(run)
        del run  # and with it DDP's hold on the process group, which would outlive destroy_process_group
    # With torchrun: a last barrier, then a teardown that cannot hang. Waited for asynchronously, so that
    # gloo's worker, the last to let go of the barrier, does not wait for the GIL this thread holds in the
    # group's destructor (pytorch/pytorch#56297); tearing gloo down while a peer is busy can abort it.
    if ddp:
        barrier = dist.barrier(async_op=True)
        barrier.wait()
        dist.destroy_process_group()  # the group's last reference: its destructor ends gloo's threads
        del barrier


# ================================================================================================
# Plumbing: the command line and its checks, the device and precision, compiling, the log, atomic
# checkpoints, exact resumption, and torchrun's processes.

def build_parser():
    """The command line's flags, one per setting (--d-model sets d_model)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help=f"a UTF-8 text file (default {DEFAULT_DATA}, downloaded if missing)")
    p.add_argument("--out-dir", default="out", help="where checkpoints and log.jsonl go")
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    p.add_argument("--seed", type=int)
    m = p.add_argument_group("model (defaults depend on the device and the architecture)")
    m.add_argument("--arch", choices=["mamba", "mamba2", "mamba3", "gpt"], help="gpt: the yardstick, Mamba's size")
    m.add_argument("--d-model", type=int)
    m.add_argument("--n-layer", type=int)
    m.add_argument("--d-state", type=int, help="mamba, mamba2, mamba3: the SSM state size N")
    m.add_argument("--headdim", type=int, help="mamba2, mamba3: channels per head")
    m.add_argument("--mimo-rank", type=int, help="mamba3: MIMO of this rank R (default: SISO)")
    m.add_argument("--n-head", type=int, help="gpt: attention heads")
    m.add_argument("--scan-backend", choices=SCAN_BACKENDS, help="mamba: mamba_engine.accelerate's backend")
    m.add_argument("--compile", action="store_true", help="mamba: the scan's fused path, compiled; mamba2: each mixer")
    m.add_argument("--chunk-size", type=int, help="mamba, fused path: steps per chunk (default 16)")
    m.add_argument("--no-recompute", dest="recompute", action="store_false", help="mamba, fused path: plain autograd")
    m.add_argument("--compile-model", action="store_true", help="torch.compile the whole model")
    t = p.add_argument_group("training (defaults depend on the device)")
    t.add_argument("--block-size", type=int)
    t.add_argument("--batch-size", type=int, help="per process")
    t.add_argument("--max-iters", type=int, help="train this many steps (iteration-based run)")
    t.add_argument("--max-time", type=float, help="or this many seconds, compiling and evaluating included")
    t.add_argument("--lr", type=float, help="peak learning rate")
    t.add_argument("--min-lr", type=float, help="final learning rate (default lr / 10)")
    t.add_argument("--warmup-iters", type=int, help="steps of linear warmup (time-based runs too)")
    t.add_argument("--lr-decay-iters", type=int, help="iteration-based: steps of the cosine (default max-iters)")
    t.add_argument("--beta2", type=float, help="AdamW's second-moment decay")
    t.add_argument("--weight-decay", type=float)
    t.add_argument("--grad-clip", type=float)
    t.add_argument("--eval-interval", type=int, help="iteration-based: steps between evaluations")
    t.add_argument("--num-evals", type=int, help="time-based: evaluation points, at equal fractions of the budget")
    t.add_argument("--eval-share", type=float, help="time-based: the share of time evaluation may take (1: all)")
    t.add_argument("--eval-iters", type=int, help="batches of fixed train and val windows per evaluation")
    t.add_argument("--log-interval", type=int)
    t.add_argument("--patience", type=int, help="stop after this many evals without improvement (0: never)")
    t.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="the matmuls' (autocast); default bf16 where the "
                   "device computes in it (MAMBA_CPU_BF16=0/1 overrides a CPU's detection), else fp16 or fp32")
    t.add_argument("--resume", action="store_true", help="continue <out-dir>/last.pt (a flag given again applies)")
    t.add_argument("--overwrite", action="store_true", help="replace the run in --out-dir")
    t.add_argument("--no-sample", action="store_true", help="skip the sample at the end of training")
    s = p.add_argument_group("sampling")
    s.add_argument("--sample", action="store_true", help="only load a checkpoint and generate")
    s.add_argument("--checkpoint", help="checkpoint to sample from (default <out-dir>/best.pt)")
    s.add_argument("--prompt", help="the text to continue (default: a newline, or the text's first character)")
    s.add_argument("--num-chars", type=int)
    s.add_argument("--temperature", type=float, help="0: greedy")
    s.add_argument("--top-k", type=int)
    return p


def flag(key):  # the command-line name of args.key
    return "--no-recompute" if key == "recompute" else "--" + key.replace("_", "-")


ARCH_FLAGS = {"d_state": ("mamba", "mamba2", "mamba3"), "headdim": ("mamba2", "mamba3"), "n_head": ("gpt",),
              "scan_backend": ("mamba",), "compile": ("mamba", "mamba2"), "mimo_rank": ("mamba3",),
              "chunk_size": ("mamba",), "recompute": ("mamba",)}  # flags that only some architectures have
FUSED_FLAGS = ("chunk_size", "recompute")  # mamba: the fused path's (--compile or --scan-backend fused)
ITERATION_FLAGS = ("max_iters", "lr_decay_iters", "eval_interval")
TIME_FLAGS = ("max_time", "num_evals", "eval_share")


def check_flags(args):
    """Refuse flags that would be silently ignored, and numbers that would fail minutes later."""
    given = set(args.given)
    if {"max_iters", "max_time"} <= given:
        sys.exit("error: give --max-iters (an iteration-based run) or --max-time (a time-based run), not both")
    if args.resume and args.overwrite:
        sys.exit("error: --resume continues the run in --out-dir, --overwrite replaces it: choose one")
    wrong = [k for k, archs in ARCH_FLAGS.items() if k in given and args.arch not in archs]
    if wrong:
        sys.exit(f"error: {', '.join(flag(k) for k in wrong)} does not apply to --arch {args.arch}")
    if args.scan_backend == "reference" and args.compile:
        sys.exit("error: --scan-backend reference runs the lesson's code, --compile the fused path: choose one")
    unfused = [k for k in FUSED_FLAGS if k in given]
    if unfused and not (args.compile or args.scan_backend in FUSED_BACKENDS):
        sys.exit(f"error: {', '.join(flag(k) for k in unfused)} applies to the fused path only: add --compile "
                 f"or --scan-backend fused")
    wrong = [k for k in given if k in (ITERATION_FLAGS if args.max_time is not None else TIME_FLAGS)]
    if wrong:
        kind = "a time-based (--max-time)" if args.max_time is not None else "an iteration-based (--max-iters)"
        sys.exit(f"error: {', '.join(flag(k) for k in wrong)} does not apply to {kind} run")

    def need(ok, key, what):
        if not ok:
            sys.exit(f"error: {flag(key)} must be {what}, got {getattr(args, key)}")

    for key in ("d_model", "n_layer", "d_state", "headdim", "mimo_rank", "n_head", "chunk_size", "block_size",
                "batch_size", "max_iters", "eval_interval", "eval_iters", "log_interval", "num_evals"):
        need(getattr(args, key) is None or getattr(args, key) >= 1, key, "at least 1")
    for key in ("warmup_iters", "lr_decay_iters", "patience", "num_chars"):
        need(getattr(args, key) is None or getattr(args, key) >= 0, key, "0 or more")
    need(args.max_time is None or 0 < args.max_time < math.inf, "max_time", "a positive number of seconds")
    need(0 < args.eval_share <= 1, "eval_share", "in (0, 1]")
    fp32_max = torch.finfo(torch.float32).max  # the optimizer computes in the parameters' fp32
    need(0 < args.lr <= fp32_max, "lr", f"a positive finite number (at most float32's {fp32_max:.2e})")
    for key in ("min_lr", "weight_decay", "grad_clip", "temperature"):
        need(0 <= getattr(args, key) <= fp32_max, key, f"a finite number >= 0 (at most float32's {fp32_max:.2e})")
    need(0 <= args.seed < 2 ** 32, "seed", "in [0, 2**32)")  # the batch seeds derived from it fit in 64 bits
    need(args.top_k is None or args.top_k >= 1, "top_k", "at least 1")
    need(0 <= args.beta2 < 1, "beta2", "in [0, 1)")


def pick_device(name):
    """--device: "auto" takes CUDA, then MPS (Apple silicon), then the CPU; a name is checked."""
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        sys.exit(f"error: --device {name} is not a device name; expected auto, cpu, cuda, cuda:N or mps")
    if device.type not in ("cpu", "cuda", "mps"):
        sys.exit(f"error: --device {name}: the trainer runs on cpu, cuda or mps")
    count = {"cpu": 1, "cuda": torch.cuda.device_count(), "mps": int(mps)}[device.type]
    if (device.index or 0) >= count:
        sys.exit(f"error: --device {name}: torch finds {count} {device.type} device(s)")
    return device


def start_processes(args):
    """(ddp, device): --device's, or under torchrun process k on cuda:k (nccl) or on the CPU (gloo)."""
    global RANK, WORLD
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False, pick_device(args.device)
    if args.device not in ("auto", "cpu", "cuda"):
        sys.exit(f"error: --device {args.device} under torchrun: each process takes the GPU of its LOCAL_RANK; "
                 f"give --device cuda (and CUDA_VISIBLE_DEVICES to choose the GPUs) or --device cpu")
    RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local >= count:
            sys.exit(f"error: torchrun process {local} needs cuda:{local}, and torch finds {count} cuda "
                     f"device(s): run at most {count} process(es) per machine, or give --device cpu")
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return True, torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")


def precision(device, dtype):
    """(autocast, GradScaler or None) for --dtype: fp16 (range 65504) needs loss scaling, bf16 not."""
    if dtype == "fp32":
        return torch.autocast(device.type, enabled=False), None
    if not torch.amp.is_autocast_available(device.type):
        sys.exit(f"error: --dtype {dtype} needs torch.autocast on {device.type}, which this torch "
                 f"{torch.__version__} does not have; use --dtype fp32")
    autocast = torch.autocast(device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    if not getattr(autocast, "_enabled", True):  # torch turned it off with a warning: no such autocast here
        sys.exit(f"error: --dtype {dtype}: torch {torch.__version__} has no {dtype} autocast on {device.type}; "
                 f"use --dtype fp32")
    return autocast, torch.amp.GradScaler(device.type) if dtype == "fp16" else None


def compile_now(run):
    """The compiling first calls before the loop; where no compiler works, a note and eager training."""
    args = run.args
    log("compiling before the first step: tens of seconds on a CPU ...")
    x, y = get_batch(run.train_data, run.p.step, args, run.device)
    try:
        loss_fn(run.model, x, y, run.vocab_size, run.autocast).backward()
        run.model.eval()
        with torch.no_grad():
            loss_fn(run.model, x, y, run.vocab_size, run.autocast)
    except Exception as err:  # whatever the compiler raised: the eager model is tried next
        log(f"note: torch.compile failed here ({type(err).__name__}: {first_line(err)}); training eagerly")
        args.compile = args.compile_model = False
        run_as(run.raw_model, args.arch, run_options(args))
        run.model = run.raw_model if WORLD == 1 else torch.nn.parallel.DistributedDataParallel(
            run.raw_model, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    finally:
        run.model.train()
        run.optimizer.zero_grad(set_to_none=True)


def clock():  # the loop reads time only here (once per step and per evaluation): a test can fake it
    return time.perf_counter()


def log(*a):
    if RANK == 0:
        print(*a, flush=True)


def first_line(err):
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


RUN_FILES = ("last.pt", "best.pt", "log.jsonl")


def prepare_out_dir(args):
    """Fail now if --out-dir cannot be written; an earlier run there is never deleted unasked."""
    out = args.out_dir
    if os.path.exists(out) and not os.path.isdir(out):
        sys.exit(f"error: --out-dir {out} is a file; expected a directory (it is created if missing)")
    earlier = [name for name in RUN_FILES if os.path.exists(os.path.join(out, name))]
    if earlier and not (args.resume or args.overwrite):
        sys.exit(f"error: --out-dir {out} holds an earlier run ({', '.join(earlier)}): give --resume to continue "
                 f"it, --overwrite to replace it, or another --out-dir")
    if RANK != 0:
        return
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write-test{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as err:
        sys.exit(f"error: cannot write to --out-dir {out} ({err.strerror or err})")
    for name in os.listdir(out):  # a save that was killed leaves a temporary file
        if name.startswith(tuple(f"{f}.tmp" for f in RUN_FILES)) or (args.overwrite and name in RUN_FILES):
            os.remove(os.path.join(out, name))


def write_text(path, text, append=False):
    """Write text atomically (a temporary file, then a rename) or append it; a full disk: one line."""
    tmp = path if append else f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "a" if append else "w", encoding="utf-8") as f:
            f.write(text)
        if not append:
            os.replace(tmp, path)
    except OSError as err:
        if not append and os.path.exists(tmp):
            os.remove(tmp)
        sys.exit(f"error: could not write {path} (disk full or read-only?): {err.strerror or err}")


def atomic_save(obj, path):
    """torch.save to a temporary file, then a rename: a failed save leaves the earlier checkpoint."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # a full disk: torch's zip writer raises RuntimeError
        if os.path.exists(tmp):
            os.remove(tmp)
        sys.exit(f"error: could not write {path} (disk full?): {type(err).__name__}: {first_line(err)}")


def save_checkpoint(run, path):
    config = {k: v for k, v in vars(run.raw_model.cfg).items() if k != "compile_mixer"}
    atomic_save({"model": run.raw_model.state_dict(), "optimizer": run.optimizer.state_dict(),
                 "arch": run.args.arch, "config": config, "vocab": run.chars, "torch_rng": torch.get_rng_state(),
                 "args": vars(run.args), **asdict(run.p),
                 **({"scaler": run.scaler.state_dict()} if run.scaler is not None else {})}, path)


def append_log(run, **losses):  # one JSON object per line in log.jsonl
    row = {"step": run.p.step, "elapsed": round(run.p.elapsed, 2), "tokens": run.p.tokens, **losses}
    write_text(run.paths["log.jsonl"], json.dumps(row) + "\n", append=True)


def load_checkpoint(path):
    """A checkpoint, checked; weights_only: a full unpickle would run whatever code the file names."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated zip, a foreign pickle, a directory ...
        sys.exit(f"error: cannot load checkpoint {path}: it is truncated, not a checkpoint, or holds "
                 f"objects other than tensors and plain values ({type(err).__name__}: {first_line(err)})")
    missing = [k for k in ("model", "config", "vocab") if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        sys.exit(f"error: {path} is not a checkpoint of this trainer (it lacks {missing})")
    arch, config, vocab, model = ckpt.get("arch", "mamba"), ckpt["config"], ckpt["vocab"], ckpt["model"]
    if not isinstance(arch, str) or arch not in ARCH_DEFAULTS:
        sys.exit(f"error: {path} holds an unknown architecture {arch!r} (this trainer builds "
                 f"{', '.join(ARCH_DEFAULTS)})")
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        damaged(path, f"its config is {type(config).__name__}, not a dict of fields")
    if not isinstance(vocab, str) or not vocab:
        damaged(path, f"its vocab is {vocab!r}, not a string of characters")
    if config.get("vocab_size") != len(vocab):
        damaged(path, f"its vocab has {len(vocab)} characters, its config's vocab_size is {config.get('vocab_size')!r}")
    if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        damaged(path, "its model is not a dict of tensors")
    if arch == "mamba3" and "A_activation" not in config:  # saved before Mamba-3's A followed official
        config["A_activation"] = "softplus"  # main: its weights were trained with -softplus(dd_A)
    return ckpt


def damaged(path, what):
    sys.exit(f"error: {path} is damaged: {what}")


def fits(value, kind):
    """A value read from a checkpoint is of the kind a flag or a counter has (bool is not an int)."""
    return isinstance(value, (int, float) if kind is float else kind) and (kind is bool or not isinstance(value, bool))


NOT_RESUMED = ("resume", "overwrite", "given", "out_dir", "device", "sample", "checkpoint", "prompt", "num_chars")
DERIVED = {"min_lr": "lr", "lr_decay_iters": "max_iters"}  # by default computed from another flag


def read_last_checkpoint(args):
    """--resume: last.pt and its flags, read before the defaults, since its architecture decides them."""
    path = os.path.join(args.out_dir, "last.pt")
    if not os.path.exists(path):
        sys.exit(f"error: --resume needs {path}, which does not exist")
    ckpt = load_checkpoint(path)
    arch = ckpt.get("arch", "mamba")
    if args.arch not in (None, arch):
        sys.exit(f"error: {path} holds a {arch} model, not {args.arch}; drop --arch to resume it")
    args.arch = arch
    saved = ckpt.get("args")  # each flag not given again takes its value from last.pt; one given applies
    if not isinstance(saved, dict):
        log(f"note: {path} does not record its run's flags; the flags given and the defaults apply")
        return ckpt
    given = saved.get("given", [])
    if not isinstance(given, (list, tuple)) or not all(isinstance(k, str) for k in given):
        damaged(path, f"its list of given flags is {given!r}")
    for action in build_parser()._actions:  # each saved flag has its flag's type and choices
        value = saved.get(action.dest)
        kind = bool if isinstance(action.const, bool) else action.type or str  # store_true/false: bool
        if action.dest != "help" and value is not None and (
                not fits(value, kind) or (action.choices is not None and value not in action.choices)):
            damaged(path, f"its flag {flag(action.dest)} is {value!r}")
    time_based = saved.get("max_time") is not None
    kind, other = (TIME_FLAGS, ITERATION_FLAGS) if time_based else (ITERATION_FLAGS, TIME_FLAGS)
    switched = [k for k in other if k in args.given and getattr(args, k) is not None]
    if switched:
        sys.exit(f"error: {path} is {'a time-based' if time_based else 'an iteration-based'} run; it cannot "
                 f"resume as the other kind ({', '.join(flag(k) for k in switched)}): give "
                 f"{' / '.join(flag(k) for k in kind)} to change its budget, or use a new --out-dir")
    changed = []
    for key, value in saved.items():
        applies = args.arch in ARCH_FLAGS.get(key, (args.arch,))  # a flag of another arch stays unset
        if key in NOT_RESUMED or key in other or not hasattr(args, key) or not applies:
            continue
        if key in args.given:
            if getattr(args, key) != value:
                changed.append(f"{flag(key)} {getattr(args, key)} (was {value})")
        elif not (key in DERIVED and key not in given and DERIVED[key] in args.given):
            setattr(args, key, value)  # a derived value follows its flag, if that is given again
    if changed:
        log(f"note: resuming with {', '.join(changed)}")
    return ckpt


def resume(run, ckpt):
    """Continue the run saved in ckpt exactly: model, optimizer, random state, progress, log."""
    path, args = run.paths["last.pt"], run.args
    missing = [k for k in ("optimizer", "torch_rng", "step", "best_val", "bad_evals", "elapsed", "tokens",
                           "evals_done") if k not in ckpt]
    if missing:
        sys.exit(f"error: {path} lacks {missing}, which this trainer saves in every last.pt (a checkpoint of "
                 f"an older version of it, or not a last.pt), so it cannot continue the run exactly; start a "
                 f"new run in another --out-dir, or sample from it with --sample --checkpoint {path}")
    if ckpt["vocab"] != run.chars:
        sys.exit(f"error: {path} was trained on another vocabulary ({len(ckpt['vocab'])} characters, this "
                 f"text has {len(run.chars)}); use the same --data or a new --out-dir")

    def identity(config):  # the fields that make the model (Mamba-2's chunk_size, scan_backend only say how)
        return {k: v for k, v in config_fields(config, args.arch).items() if k not in ("chunk_size", "scan_backend")}
    if identity(ckpt["config"]) != identity(vars(run.raw_model.cfg)):
        sys.exit(f"error: {path} holds another model config {ckpt['config']}; resume with the same model "
                 f"flags or use a new --out-dir")
    wrong = [f.name for f in fields(Progress) if f.name in ckpt and not fits(ckpt[f.name], f.type)]
    if wrong:
        damaged(path, ", ".join(f"its {k} is {ckpt[k]!r}" for k in wrong))
    rng = ckpt["torch_rng"]
    if not (isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8 and rng.shape == torch.get_rng_state().shape):
        damaged(path, "its torch_rng is not torch's random state")
    try:
        run.raw_model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
        for param, state in run.optimizer.state.items():  # load_state_dict does not check the moments' shapes,
            for key, value in state.items():  # and a fused AdamW step would read out of bounds
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                    raise ValueError(f"its {key} has shape {tuple(value.shape)} for a parameter of "
                                     f"{tuple(param.shape)}")
        if run.scaler is not None and ckpt.get("scaler"):
            run.scaler.load_state_dict(ckpt["scaler"])
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as err:
        damaged(path, f"its weights or optimizer state do not fit its own model ({first_line(err)})")
    torch.set_rng_state(rng)
    p = run.p = Progress(**{f.name: ckpt[f.name] for f in fields(Progress) if f.name in ckpt})
    if RANK == 0:
        truncate_log(run.paths["log.jsonl"], p.step)
    log(f"resumed from {path} at step {p.step} (best val {p.best_val:.4f})")
    saved = ckpt.get("args")  # a changed budget: the cosine goes on from the run's learning rate, without a jump
    key = "max_time" if args.max_time is not None else "lr_decay_iters"
    old = saved.get(key) if isinstance(saved, dict) else None
    if old is not None and old != getattr(args, key) and not (args.max_time is None and p.step <= args.warmup_iters):
        before = argparse.Namespace(**{**vars(args), key: old})
        p.decay_lr = lr_at(before, max(p.step, args.warmup_iters), p.elapsed, p.decay_start, p.decay_lr)
        p.decay_start = p.elapsed if args.max_time is not None else p.step
        log(f"note: {flag(key)} {getattr(args, key):g} (was {old:g}): the learning rate goes on from "
            f"{p.decay_lr:.2e}, its value at {'step ' if args.max_time is None else ''}{p.decay_start:g}"
            f"{'' if args.max_time is None else 's'}, down to --min-lr {args.min_lr:.2e} at the new end")
    if p.stopped_early:
        log(f"the run stopped early at step {p.step}: nothing left to train (another --out-dir starts a new run)")
    elif p.step >= args.max_iters if args.max_time is None else p.elapsed >= args.max_time:
        budget, key = ((f"step {p.step} of --max-iters {args.max_iters}", "--max-iters") if args.max_time is None
                       else (f"{p.elapsed:.0f}s of --max-time {args.max_time:g}", "--max-time"))
        log(f"the run's budget is spent ({budget}): nothing to train. To train on, resume with a larger {key}: "
            f"the learning rate goes on from its last value")
    if not os.path.exists(run.paths["best.pt"]):  # deleted by hand: the next evaluation writes a new one
        log(f"note: {run.paths['best.pt']} is missing; the run goes on with its best val reset to infinity, "
            f"so that its next evaluation writes a new best.pt")
        p.best_val, p.bad_evals = math.inf, 0


def truncate_log(log_path, step):
    """Keep the evaluation rows up to the checkpoint's step: the resumed run writes the later ones again."""
    rows = []
    if os.path.exists(log_path):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the kill
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int) and "val_loss" in row \
                        and row["step"] <= step:
                    rows.append(line if line.endswith("\n") else line + "\n")
    write_text(log_path, "".join(rows))



if __name__ == "__main__":
    main()
