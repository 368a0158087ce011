"""
tasks/mqar.py: the size of the state bounds how much a recurrent model can recall.

    python -m tasks.mqar                            # Mamba-2 at d_state 16, 64 and 256, 3 seeds each

The claim (Mamba-2, arXiv 2405.21060, §9.1 and its MQAR figure): on multi-query associative recall,
Mamba-2's accuracy rises with d_state (16, 64, 256); the paper adds that SSD makes the large state
cheap (a d_state-256 run of this task trains about 3.3x as long as a d_state-16 one).

The mechanism: the state's size bounds recall. A Mamba-2 head keeps a (headdim, d_state) matrix and
adds x_t·B_t^T to it at every token (mamba2_minimal.py §2): B_t, computed through the short conv from
the token before, is the key and x_t the value; at a query, C_t is the key asked for and h·C_t reads
its value back. As a rule of thumb, d_state-long keys can be told apart cleanly for about d_state
pairs; past that they overlap and each read mixes in other values (B and C are shared by the heads,
so more heads widen the values, not the keys). A rule of thumb only: two layers and nonlinear reads
do better than it, and at width 64 a d_state-16 model recalls 32 pairs at 0.97 (two seeds).

The ablation: the state size itself, everything else fixed: the same Mamba-2 at d_state 16, 64 and
256, trained alike. `--models mamba,mamba3` adds Mamba-1 and Mamba-3 at d_state 16.

The data (after Zoology, Arora et al. 2023, arXiv 2312.04927): 64 keys and 64 values (disjoint
token ids), P pairs k1 v1 ... kP vP with distinct keys, then every key again in a random order, each
asking for its value. Training draws P from 4 to 32 at every step (a curriculum: few pairs teach the
binding of a value to its key, many fill the state); width 32, 2 layers, lr 1e-2, 3,000 steps.
Chance: 1/64. Scored: the fraction of queries answered right with 8, 16 and 32 pairs.

What it shows (RESULTS.md has the table, the machine and the times; 2-6.5 minutes a model and seed
on one thread, d_state 256 the longest): every seed at every size learns the binding (0.99-1.00 with
8 pairs); with 32 pairs, d_state 16 answers 0.70-0.92 of the queries, d_state 64 0.998 and 256 all
(width 32: at width 64 the small state is not the bound, see below).

What was tried, each a `python -m tasks.mqar` command with the options shown (RESULTS.md has the
numbers): the command at commit 46e3c57 (8 pairs, width 32, lr 3e-3, 1,500 steps) learned the binding
on 1 run of 15; `--fewest 32 --width 64 --lr 3e-3 --d-states 16 --steps 2000 --seeds 1` did not learn
it; `--width 64 --lr 3e-3` learned it at d_state 16 on 1 seed of 3 and at d_state 64 on 2 of 2;
`--width 64 --d-states 16 --seeds 2`, at lr 1e-2, learned it and held 32 pairs nearly whole (0.974, 0.970),
so at width 64 a d_state-16 state is not the bound. Width 32 at lr 1e-2 learns on every seed and leaves
d_state 16 too small for 32 pairs: the default. In these runs the learning rate decided whether the
binding was learned, and the width whether 32 pairs fill a d_state-16 state.
"""

import sys

import torch

from tasks import common

# ------------------------------------------------------------------------------------------------
# 1. The data
# ------------------------------------------------------------------------------------------------

KEYS, VALUES = 64, 64  # keys are 0 .. 63, values 64 .. 127
VOCAB = KEYS + VALUES


def mqar_strings(keys, values, asked):
    """keys (b, P) distinct in 0 .. KEYS-1, values (b, P) in KEYS .. KEYS+VALUES-1, asked (b, Q): which
    pairs the queries ask for -> (x, y), each (b, 2P + Q): x = k1 v1 ... kP vP, then the asked keys;
    y = IGNORE but at the queries, where it is the value paired with the key."""
    context = torch.stack([keys, values], dim=2).flatten(1)  # (b, 2P) k1 v1 k2 v2 ...
    x = torch.cat([context, keys.gather(1, asked)], dim=1)  # (b, 2P + Q)
    y = torch.cat([torch.full_like(context, common.IGNORE), values.gather(1, asked)], dim=1)
    return x, y


def mqar_batch(batch, pairs, generator, queries=None):
    """mqar_strings of random pairs (distinct keys) and `queries` distinct pairs asked for in random
    order (every pair by default), (batch, 2·pairs + queries) each."""
    queries = pairs if queries is None else queries
    if not 1 <= queries <= pairs <= KEYS:
        raise ValueError(f"need queries <= pairs <= {KEYS}, got {queries} queries and {pairs} pairs")
    keys = torch.rand(batch, KEYS, generator=generator).argsort(dim=1)[:, :pairs]  # (batch, pairs) distinct
    values = torch.randint(KEYS, KEYS + VALUES, (batch, pairs), generator=generator)
    asked = torch.rand(batch, pairs, generator=generator).argsort(dim=1)[:, :queries]  # (batch, queries)
    return mqar_strings(keys, values, asked)


# ------------------------------------------------------------------------------------------------
# 2. The run
# ------------------------------------------------------------------------------------------------

# The state sizes each model runs at: the sweep is Mamba-2's. `--models mamba,mamba3` adds Mamba-1 and
# Mamba-3 at d_state 16 (Mamba-1's scan keeps a (b, L, 2·d_model, d_state) tensor: its step grows with
# d_state, and 256 would take several times a run's budget).
D_STATES = {"mamba2": (16, 64, 256), "mamba": (16,), "mamba3": (16,)}
MODELS = ("mamba2",)
PAIRS, FEWEST, WIDTH, LR, BATCH, TEST_SEQUENCES, TESTED = 32, 4, 32, 1e-2, 32, 512, (8, 16, 32)


def run_one(arch, d_state, seed, steps, pairs=PAIRS, fewest=FEWEST, d_model=WIDTH, n_layer=2, lr=LR, weight_decay=common.WEIGHT_DECAY,
            batch=BATCH, test_sequences=TEST_SEQUENCES, tested=TESTED):
    """Train arch at d_state with one seed, on strings of `fewest` to `pairs` pairs (drawn anew at every
    step, every pair asked for), then score it with each number of pairs in `tested`.
    -> (accuracy per number of pairs, the loss curve, seconds of training)."""
    torch.manual_seed(seed)
    model = common.build(arch, VOCAB, d_model, n_layer, d_state, max_len=3 * max(pairs, *tested))
    g = torch.Generator().manual_seed(1000 + seed)

    def batch_at(step):  # a curriculum: few pairs teach the binding, many fill the state
        return mqar_batch(batch, int(torch.randint(fewest, pairs + 1, (), generator=g)), g)

    curve, seconds = common.timed(common.train, model, batch_at, steps, VOCAB, lr=lr, weight_decay=weight_decay)
    test = torch.Generator().manual_seed(123)
    scores = {n: common.accuracy(model, *mqar_batch(test_sequences, n, test), VOCAB) for n in tested}
    return scores, curve, seconds


def main(argv=None):
    def extra(p):
        p.add_argument("--d-states", help="comma-separated d_state values, for every model (default: "
                       + ", ".join(f"{m} {'/'.join(map(str, s))}" for m, s in D_STATES.items()) + ")")
        p.add_argument("--fewest", type=int, default=FEWEST,
                       help=f"the fewest pairs a training string holds; the most is {PAIRS} (default: %(default)s)")

    args = common.arguments(__doc__, MODELS, steps=3000, argv=argv, extra=extra)
    try:
        d_states = None if args.d_states is None else [int(n) for n in args.d_states.split(",")]
    except ValueError:
        sys.exit(f"error: --d-states takes comma-separated whole numbers, got {args.d_states!r}")
    if d_states is not None and (not d_states or min(d_states) < 1):
        sys.exit(f"error: --d-states takes positive numbers, got {args.d_states!r}")
    if not 1 <= args.fewest <= PAIRS:
        sys.exit(f"error: --fewest must be from 1 to {PAIRS}, got {args.fewest}")
    record, rows = {}, []
    for arch in args.models:
        for d_state in d_states or D_STATES.get(arch, (16,)):
            runs = []
            for seed in range(args.seeds):
                scores, curve, seconds = run_one(arch, d_state, seed, args.steps, fewest=args.fewest,
                                                 **common.overrides(args))
                runs.append(dict(seed=seed, scores=scores, curve=curve, seconds=seconds))
                print(f"{arch} d_state {d_state} seed {seed}: " + ", ".join(
                    f"{n} pairs {a:.3f}" for n, a in scores.items()) + f"  ({seconds:.0f} s)", flush=True)
            record.setdefault(arch, {})[d_state] = runs
            rows.append((f"{common.ARCHS[arch]}, d_state {d_state}",
                         {f"{n} pairs": [r["scores"][n] for r in runs] for n in TESTED}))
            common.save_results(args, "mqar", record)  # after each row: a stopped run keeps the rows it finished
    common.print_table(f"MQAR: accuracy on the queries, mean [min, max] over {args.seeds} seeds (trained on "
                       f"{args.fewest}-{PAIRS} pairs; chance {1 / VALUES:.3f})", rows, [f"{n} pairs" for n in TESTED])
    figure(record, args)


def figure(record, args):
    plt = common.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(TESTED), figsize=(4 * len(TESTED), 3.6), squeeze=False)
    for ax, n in zip(axes[0], TESTED):
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
        ax.set_title(f"{n} pairs")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("query accuracy")
    axes[0][0].legend(fontsize=8)
    common.save_figure(fig, args, "mqar", "MQAR", width=WIDTH)


if __name__ == "__main__":
    main()
