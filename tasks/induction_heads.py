"""
tasks/induction_heads.py: induction heads, trained at one length and tested far beyond it.

    python -m tasks.induction_heads                 # Mamba-1, Mamba-2, Mamba-3 and the GPT, 3 seeds

The idea. Random tokens, and somewhere among them a special trigger token followed by one token,
the answer. At the end the trigger comes again, and the model must say the token that followed it
the first time: find an earlier occurrence of the current token and copy what came next, the
associative recall that an "induction head" of a Transformer does (Olsson et al. 2022).

The claim (Mamba, arXiv 2312.00752, §4.1.2, Table 2 and its figure): trained on strings of 256
tokens, Mamba solves the task at every test length up to 2^20 tokens (4,000x), where the attention
baselines fall off soon past the training length. A selective state can keep the one token after
the trigger and ignore all the others however many come; nothing in it depends on the position.

How it is tested: beyond the training length, through the recurrent form a model generates with
(prefill on the first training-length tokens, then one O(1) step per token, mamba_minimal.py section 5),
so the memory used does not grow with the test length. The GPT yardstick (gpt_minimal.py) has
learned position embeddings, one per position up to its block size, the training length: it has
no way to read a longer string, and is reported as not applicable (n/a) there.

The data, at a CPU's size: 16 symbols and the trigger; strings of 16 tokens for training (the
paper's 256 would make every step 16x dearer), tested at 16 and at 16x, 64x and 256x that, 4,096
tokens. Only the last position is scored. Chance: 1/16.
"""

import torch

from tasks import common

# ------------------------------------------------------------------------------------------------
# 1. The data
# ------------------------------------------------------------------------------------------------

SYMBOLS = 16  # ordinary tokens 0 .. 15
TRIGGER = SYMBOLS
VOCAB = SYMBOLS + 1


def induction_strings(symbols, p):
    """symbols (b, L) in 0 .. SYMBOLS-1 and the trigger's positions p (b,), p <= L - 3 -> (x, y), each
    (b, L): the symbols with TRIGGER at p and at the last position; y = IGNORE but at the last
    position, where it is the answer, the symbol after the first TRIGGER."""
    rows = torch.arange(len(p))
    x = symbols.clone()
    x[rows, p] = TRIGGER
    x[:, -1] = TRIGGER
    y = torch.full_like(x, common.IGNORE)
    y[:, -1] = x[rows, p + 1]
    return x, y


def induction_batch(batch, length, generator):
    """induction_strings of random symbols and trigger positions, (batch, length) each."""
    if length < 4:
        raise ValueError(f"an induction string needs at least 4 tokens, got length {length}")
    symbols = torch.randint(0, SYMBOLS, (batch, length), generator=generator)
    p = torch.randint(0, length - 2, (batch,), generator=generator)  # the answer at p + 1 < length - 1
    return induction_strings(symbols, p)


# ------------------------------------------------------------------------------------------------
# 2. The run
# ------------------------------------------------------------------------------------------------

MODELS = ("mamba", "mamba2", "mamba3", "gpt")
LENGTH, BATCH, TEST_SEQUENCES, STRETCH = 16, 32, 256, (1, 16, 64, 256)


def run_one(arch, seed, steps, length=LENGTH, d_model=32, n_layer=2, d_state=16, batch=BATCH,
            test_sequences=TEST_SEQUENCES, stretch=STRETCH):
    """Train arch with one seed at `length`, score it at length times each factor in stretch (the
    factor 1 with the parallel forward, the others prefill + step). -> (accuracy per length, the
    loss curve, seconds of training)."""
    torch.manual_seed(seed)
    model = common.build(arch, VOCAB, d_model, n_layer, d_state, max_len=length)
    g = torch.Generator().manual_seed(1000 + seed)
    curve, seconds = common.timed(common.train, model, lambda step: induction_batch(batch, length, g), steps, VOCAB)
    test = torch.Generator().manual_seed(123)
    scores = {}
    for factor in stretch:
        x, y = induction_batch(test_sequences, factor * length, test)
        if factor == 1:
            scores[length] = common.accuracy(model, x, y, VOCAB)
        elif arch == "gpt":
            scores[factor * length] = None  # no position embedding past the training length
        else:
            pred = common.last_logits_by_steps(model, x, length, VOCAB).argmax(-1)  # (n,)
            scores[factor * length] = (pred == y[:, -1]).float().mean().item()
    return scores, curve, seconds


def main(argv=None):
    args = common.arguments(__doc__, MODELS, steps=1500, argv=argv)
    lengths = [f * LENGTH for f in STRETCH]
    record, rows = {}, []
    for arch in args.models:
        runs = []
        for seed in range(args.seeds):
            (scores, curve, seconds), total = common.timed(run_one, arch, seed, args.steps)
            runs.append(dict(seed=seed, scores=scores, curve=curve, seconds=seconds, with_tests=total))
            print(f"{arch} seed {seed}: " + ", ".join(
                f"{n} tokens {'n/a' if a is None else f'{a:.3f}'}" for n, a in scores.items())
                + f"  ({seconds:.0f} s training, {total:.0f} s with the tests)", flush=True)
        record[arch] = runs
        rows.append((common.ARCHS[arch], {f"{n} tokens": [r["scores"][n] for r in runs] for n in lengths}))
        common.save_results(args, "induction_heads", record)  # after each model: a stopped run keeps them
    common.print_table(f"Induction heads: last-position accuracy, mean [min, max] over {args.seeds} seeds "
                       f"(trained at {LENGTH} tokens; chance {1 / SYMBOLS:.3f}; n/a: the GPT's positions stop "
                       f"at {LENGTH})", rows, [f"{n} tokens" for n in lengths])
    figure(record, args)


def figure(record, args):
    plt = common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for arch, runs in record.items():
        lengths = [n for n in runs[0]["scores"] if runs[0]["scores"][n] is not None]
        means = [sum(r["scores"][n] for r in runs) / len(runs) for n in lengths]
        line, = ax.plot(lengths, means, marker="o", label=common.ARCHS[arch])
        for r in runs:
            ax.plot(lengths, [r["scores"][n] for n in lengths], color=line.get_color(), alpha=0.25, lw=0.8)
    ax.axvline(LENGTH, color="grey", ls=":", lw=1)
    ax.axhline(1 / SYMBOLS, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"test length in tokens (dotted: trained at {LENGTH}; dashed: chance)")
    ax.set_ylabel("last-position accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    common.save_figure(fig, args, "induction_heads", "Induction heads")


if __name__ == "__main__":
    main()
