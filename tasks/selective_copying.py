"""
tasks/selective_copying.py: only a selective layer can copy tokens that sit at random places.

    python -m tasks.selective_copying               # Mamba-1 with and without selection, 3 seeds

The claim (Mamba, arXiv 2312.00752, §3.1, §4.1.1, Table 1): a time-invariant (LTI) layer such as
S4 cannot pick tokens out by their content; making Δ, B and C functions of the token (S6) can.

The mechanism: selection is a content-dependent Δ. At a data token the model can make Δ large (the
state takes the token in) and at a noise token near 0 (exp(Δ·A) = 1: the state passes it by
untouched), wherever the tokens fall. An LTI layer's output is the input convolved with one fixed
kernel (pscan.py section 2): it can learn where tokens lie in the strings it was trained on, but a
string with the same tokens at other distances is, to it, another task.

The ablation: the same Mamba-1 model twice, once as it is and once with the mixer of
tasks/selection_off.py (MambaLM(cfg, mixer_cls=SelectionOffMixer)), where Δ, B and C are learned
constants, an S4D-style LTI layer, the rest of the block (the short conv, the gate) unchanged.
Table 1 of the paper does the same inside its blocks: only S6 solves the task.

The data, in the paper's form at a smaller size: a region of `span` positions holding 8 data
tokens (from 8 symbols) at random positions, noise (one blank token) elsewhere, then 8 markers;
the target at the k-th marker is the k-th data token. Chance: 1/8. Scored: the fraction of data
tokens copied right, at the training span and at 2x and 4x it (the same 8 tokens, spread wider).

What it shows (RESULTS.md has the table, the machine and the times; about 3.5 minutes a model and
seed on one thread): after 6,000 steps the selective model copies the tokens at the trained span on
3 of 3 seeds (1.000, two slips in 4,096 on one seed) and keeps most of them at 2x (0.86-0.98); the LTI
model reaches 0.80-0.85 at the trained span and 0.18-0.31 at 2x (chance 0.125). At 1,500 steps
neither had finished learning (0.65 and 0.52: this command at commit 46e3c57, Intel).
"""

import torch

from tasks import common

# ------------------------------------------------------------------------------------------------
# 1. The data
# ------------------------------------------------------------------------------------------------

SYMBOLS = 8  # data tokens are 1 .. SYMBOLS
BLANK, MARKER = 0, SYMBOLS + 1
VOCAB = SYMBOLS + 2
TO_COPY = 8  # data tokens per string


def copying_strings(data, where, span):
    """data (b, k) tokens in 1 .. SYMBOLS at the positions where (b, k), increasing, of a region of
    `span` positions -> (x, y), each (b, span + k): x = the region (BLANK elsewhere), then k MARKERs;
    y = IGNORE but at the markers, where it is the data tokens in the order they appeared."""
    batch, k = data.shape
    region = torch.full((batch, span), BLANK).scatter(1, where, data)  # (b, span)
    x = torch.cat([region, torch.full((batch, k), MARKER)], dim=1)  # (b, span + k)
    y = torch.cat([torch.full((batch, span), common.IGNORE), data], dim=1)
    return x, y


def copying_batch(batch, span, generator, to_copy=TO_COPY):
    """copying_strings of random data tokens at random positions, (batch, span + to_copy) each."""
    if to_copy > span:
        raise ValueError(f"the span ({span}) must hold the {to_copy} tokens to copy")
    data = torch.randint(1, SYMBOLS + 1, (batch, to_copy), generator=generator)
    # to_copy distinct positions of the region, in increasing order
    where = torch.rand(batch, span, generator=generator).argsort(dim=1)[:, :to_copy].sort(dim=1).values
    return copying_strings(data, where, span)


# ------------------------------------------------------------------------------------------------
# 2. The run
# ------------------------------------------------------------------------------------------------

MODELS = ("mamba", "mamba-lti")
SPAN, WIDTH, BATCH, TEST_SEQUENCES, STRETCH = 32, 32, 32, 512, (1, 2, 4)


def run_one(arch, seed, steps, span=SPAN, d_model=WIDTH, n_layer=2, d_state=16, lr=common.LR,
            weight_decay=common.WEIGHT_DECAY, batch=BATCH,
            test_sequences=TEST_SEQUENCES, stretch=STRETCH):
    """Train arch with one seed at `span`, score it at span times each factor in stretch.
    -> (accuracy per span, the loss curve, seconds of training)."""
    torch.manual_seed(seed)
    model = common.build(arch, VOCAB, d_model, n_layer, d_state, max_len=span + TO_COPY)
    g = torch.Generator().manual_seed(1000 + seed)
    curve, seconds = common.timed(common.train, model, lambda step: copying_batch(batch, span, g), steps, VOCAB,
                                  lr=lr, weight_decay=weight_decay)
    test = torch.Generator().manual_seed(123)
    scores = {}
    for factor in stretch:
        x, y = copying_batch(test_sequences, factor * span, test)
        scores[factor * span] = common.accuracy(model, x, y, VOCAB)
    return scores, curve, seconds


def main(argv=None):
    args = common.arguments(__doc__, MODELS, steps=6000, argv=argv)
    spans = [f * SPAN for f in STRETCH]
    record, rows = {}, []
    for arch in args.models:
        runs = []
        for seed in range(args.seeds):
            scores, curve, seconds = run_one(arch, seed, args.steps, **common.overrides(args))
            runs.append(dict(seed=seed, scores=scores, curve=curve, seconds=seconds))
            print(f"{arch} seed {seed}: " + ", ".join(f"span {n} {a:.3f}" for n, a in scores.items())
                  + f"  ({seconds:.0f} s)", flush=True)
        record[arch] = runs
        rows.append((common.ARCHS[arch], {f"span {n}": [r["scores"][n] for r in runs] for n in spans}))
        common.save_results(args, "selective_copying", record)  # after each model: a stopped run keeps them
    common.print_table(f"Selective copying: accuracy on the {TO_COPY} copied tokens, mean [min, max] over "
                       f"{args.seeds} seeds (trained at span {SPAN}; chance {1 / SYMBOLS:.3f})",
                       rows, [f"span {n}" for n in spans])
    figure(record, args)


def figure(record, args):
    plt = common.pyplot()
    if plt is None:
        return
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.6))
    for arch, runs in record.items():
        color = None
        for r in runs:
            steps, losses = zip(*r["curve"])
            line, = ax_loss.plot(steps, losses, color=color, alpha=0.7, lw=1,
                                 label=common.ARCHS[arch] if color is None else None)
            color = line.get_color()
        spans = list(runs[0]["scores"])
        ax_acc.plot(spans, [sum(r["scores"][n] for r in runs) / len(runs) for n in spans], marker="o",
                    color=color, label=common.ARCHS[arch])
    ax_loss.set_xlabel("training step")
    ax_loss.set_ylabel("training loss")
    ax_loss.legend(fontsize=8)
    ax_acc.axhline(1 / SYMBOLS, color="grey", ls=":", lw=1)
    ax_acc.set_xscale("log", base=2)
    ax_acc.set_ylim(0, 1.02)
    ax_acc.set_xlabel(f"span of the region (trained at {SPAN}; dotted: chance)")
    ax_acc.set_ylabel("copy accuracy, mean over seeds")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    common.save_figure(fig, args, "selective_copying", "Selective copying", WIDTH)


if __name__ == "__main__":
    main()
