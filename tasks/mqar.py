"""
tasks/mqar.py: multi-query associative recall (MQAR), accuracy against the size of the state.

    python -m tasks.mqar                            # Mamba-2 at d_state 16, 64, 256, Mamba-1 and Mamba-3 beside it

The idea. A string of key-value pairs, k1 v1 k2 v2 ..., then the keys again in another order, each
asking for its value. An SSM reads the pairs once and must hold them all in its fixed-size state:
the more pairs, the more state it takes. It is the recall that separates attention, which keeps
every token, from a recurrence, which keeps a summary (Arora et al. 2023, "Zoology", arXiv 2312.04927).

The claim (Mamba-2, arXiv 2405.21060, §9.1 and its MQAR figure): a larger state recalls more, and
Mamba-2's SSD makes a large state cheap (its state per head is headdim x d_state, updated by
matmuls, mamba2_minimal.py §2-3): Mamba-2 gains with d_state 16 -> 64 -> 256 and beats Mamba-1,
whose d_state 16 is fixed by what its scan costs.

The data, at a CPU's size: 64 keys and 64 values (disjoint token ids), 8 pairs with distinct keys,
then 8 queries, each key once; the target at a query is its value. Chance: 1/64. Scored: the
fraction of queries answered right with 8 pairs, as trained, and with 16 and 32 pairs (the same
number of queries, drawn from more pairs: more to hold in the same state).
"""

import torch

from tasks import common

# ------------------------------------------------------------------------------------------------
# 1. The data
# ------------------------------------------------------------------------------------------------

KEYS, VALUES = 64, 64  # keys are 0 .. 63, values 64 .. 127
VOCAB = KEYS + VALUES
QUERIES = 8


def mqar_strings(keys, values, asked):
    """keys (b, P) distinct in 0 .. KEYS-1, values (b, P) in KEYS .. KEYS+VALUES-1, asked (b, Q): which
    pairs the queries ask for -> (x, y), each (b, 2P + Q): x = k1 v1 ... kP vP, then the asked keys;
    y = IGNORE but at the queries, where it is the value paired with the key."""
    context = torch.stack([keys, values], dim=2).flatten(1)  # (b, 2P) k1 v1 k2 v2 ...
    x = torch.cat([context, keys.gather(1, asked)], dim=1)  # (b, 2P + Q)
    y = torch.cat([torch.full_like(context, common.IGNORE), values.gather(1, asked)], dim=1)
    return x, y


def mqar_batch(batch, pairs, generator, queries=QUERIES):
    """mqar_strings of random pairs (distinct keys) and `queries` distinct pairs asked for in random
    order, (batch, 2·pairs + queries) each."""
    if not queries <= pairs <= KEYS:
        raise ValueError(f"need queries <= pairs <= {KEYS}, got {queries} queries and {pairs} pairs")
    keys = torch.rand(batch, KEYS, generator=generator).argsort(dim=1)[:, :pairs]  # (batch, pairs) distinct
    values = torch.randint(KEYS, KEYS + VALUES, (batch, pairs), generator=generator)
    asked = torch.rand(batch, pairs, generator=generator).argsort(dim=1)[:, :queries]  # (batch, queries)
    return mqar_strings(keys, values, asked)


# ------------------------------------------------------------------------------------------------
# 2. The run
# ------------------------------------------------------------------------------------------------

# The state sizes each model runs at: the sweep is Mamba-2's; Mamba-1 and Mamba-3 stand beside it at
# d_state 16, Mamba-1's default (its scan keeps a (b, L, 2·d_model, d_state) tensor, so that its step
# grows with d_state, and 256 would take several times a run's budget)
D_STATES = {"mamba2": (16, 64, 256), "mamba": (16,), "mamba3": (16,)}
PAIRS, BATCH, TEST_SEQUENCES, STRETCH = 8, 32, 512, (1, 2, 4)


def run_one(arch, d_state, seed, steps, pairs=PAIRS, d_model=32, n_layer=2, batch=BATCH,
            test_sequences=TEST_SEQUENCES, stretch=STRETCH):
    """Train arch at d_state with one seed on `pairs` pairs, score it with pairs times each factor in
    stretch. -> (accuracy per number of pairs, the loss curve, seconds of training)."""
    torch.manual_seed(seed)
    model = common.build(arch, VOCAB, d_model, n_layer, d_state, max_len=2 * pairs + QUERIES)
    g = torch.Generator().manual_seed(1000 + seed)
    curve, seconds = common.timed(common.train, model, lambda step: mqar_batch(batch, pairs, g), steps, VOCAB)
    test = torch.Generator().manual_seed(123)
    scores = {}
    for factor in stretch:
        x, y = mqar_batch(test_sequences, factor * pairs, test)
        scores[factor * pairs] = common.accuracy(model, x, y, VOCAB)
    return scores, curve, seconds


def main(argv=None):
    args = common.arguments(__doc__, tuple(D_STATES), steps=1500, argv=argv)
    counts = [f * PAIRS for f in STRETCH]
    record, rows = {}, []
    for arch in args.models:
        for d_state in D_STATES.get(arch, (16,)):
            runs = []
            for seed in range(args.seeds):
                scores, curve, seconds = run_one(arch, d_state, seed, args.steps)
                runs.append(dict(seed=seed, scores=scores, curve=curve, seconds=seconds))
                print(f"{arch} d_state {d_state} seed {seed}: " + ", ".join(
                    f"{n} pairs {a:.3f}" for n, a in scores.items()) + f"  ({seconds:.0f} s)", flush=True)
            record.setdefault(arch, {})[d_state] = runs
            rows.append((f"{common.ARCHS[arch]}, d_state {d_state}",
                         {f"{n} pairs": [r["scores"][n] for r in runs] for n in counts}))
            common.save_results(args, "mqar", record)  # after each row: a stopped run keeps the rows it finished
    common.print_table(f"MQAR: accuracy on the {QUERIES} queries, mean [min, max] over {args.seeds} seeds "
                       f"(trained with {PAIRS} pairs; chance {1 / VALUES:.3f})", rows, [f"{n} pairs" for n in counts])
    figure(record, args)


def figure(record, args):
    plt = common.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(STRETCH), figsize=(4 * len(STRETCH), 3.6), squeeze=False)
    for ax, factor in zip(axes[0], STRETCH):
        n = factor * PAIRS
        for arch, by_state in record.items():
            states = sorted(by_state)
            means = [sum(r["scores"][n] for r in by_state[s]) / len(by_state[s]) for s in states]
            line, = ax.plot(states, means, marker="o", label=common.ARCHS[arch])
            for s in states:
                ax.plot([s] * len(by_state[s]), [r["scores"][n] for r in by_state[s]], ls="none", marker=".",
                        color=line.get_color(), alpha=0.4)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("d_state")
        ax.set_title(f"{n} pairs" + (" (as trained)" if factor == 1 else ""))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("query accuracy")
    axes[0][0].legend(fontsize=8)
    common.save_figure(fig, args, "mqar", "MQAR")


if __name__ == "__main__":
    main()
