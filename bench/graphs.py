"""
bench/graphs.py: what torch.compile makes of each model: graphs, graph breaks and recompiles.

    python -m bench graphs [--backend eager|aot_eager|inductor]
"""

import contextlib
import logging
import re
import time
from collections import Counter

import torch

import mamba_engine
import mamba_minimal as mm
from bench.common import table
from gpt_minimal import GPTConfig, TinyGPT


# torch.compile's front end, Dynamo, turns Python into graphs and hands each to a compiler
# (Inductor by default). Where it cannot follow the code it breaks the graph: the piece between
# two graphs runs eagerly, and each graph is a separate compile and a separate call. A compiled
# graph is guarded (input shapes, dtypes, grad mode, ...); a call that fails its guards compiles
# again (a recompile). This table counts both, per phase of a training run: the first and the
# second training step (the second must compile nothing), an evaluation under no_grad, and an
# evaluation of a smaller last batch. Dynamo decides the graphs and the breaks before any
# compiler sees them, so by default every graph goes to Dynamo's "eager" backend, which runs it
# as it is (seconds, where Inductor takes minutes on a CPU); --backend inductor compiles for real.
# The models are small (d_model 32, 2 layers, block 128, batch 4 then 3) and run under bf16
# autocast, as the trainer runs them on a GPU.

GRAPH_CASES = ("mamba --compile", "mamba2 --compile", "mamba --compile-model", "mamba --compile --compile-model",
               "mamba2 --compile-model", "mamba3 --compile-model", "gpt --compile-model")


@contextlib.contextmanager
def compiled_with(backend):
    """torch.compile with `backend` for every function compiled inside (the models' own compiles
    included), from empty caches and counters."""
    import mamba2_minimal as m2
    real_compile = torch.compile

    def compile_with(fn=None, **kw):
        if backend != "inductor":
            kw = {k: v for k, v in kw.items() if k not in ("options", "mode")}  # Inductor's settings
        return real_compile(fn, **dict(kw, backend=backend))

    def reset():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch._dynamo.utils.clear_compilation_metrics()
        mamba_engine._compiled.clear()
        m2._compiled_forward.cache_clear()

    torch.compile = compile_with
    torch._logging.set_logs(dynamo=logging.ERROR)  # the table says what the graph-break warnings would
    reset()
    try:
        yield
    finally:
        torch.compile = real_compile
        torch._logging.set_logs()
        reset()


def compiles_so_far():
    """(graphs, graph breaks, recompile reasons) that Dynamo has counted since compiled_with began."""
    counters = torch._dynamo.utils.counters
    reasons = [m.recompile_reason for m in torch._dynamo.utils.get_compilation_metrics() if m.recompile_reason]
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), reasons


def short(reason):
    """A Dynamo message on one line, without its explanation and the frame numbers of guards."""
    reason = " ".join(str(reason).split()).split(" Explanation:")[0]
    return re.sub(r"(^|- )\d+/\d+: ", r"\1", reason)[:150]


def graph_model(case, vocab, block):
    """The model of a GRAPH_CASES row, small, and the function the run calls."""
    import mamba2_minimal as m2
    import mamba3_minimal as m3
    arch, *flags = case.split()
    torch.manual_seed(0)
    small = dict(d_model=32, n_layer=2, vocab_size=vocab)
    if arch == "mamba":  # d_state 16 and chunks of 16, the CUDA default's, run by mamba_engine as the trainer does
        model = mamba_engine.accelerate(mm.MambaLM(mm.MambaConfig(**small, d_state=16)), compile="--compile" in flags)
    elif arch == "mamba2":  # chunks of 64 as the trainer's: two per block
        model = m2.Mamba2LM(m2.Mamba2Config(**small, d_state=16, headdim=16, chunk_size=64,
                                            compile_mixer="--compile" in flags))
    elif arch == "mamba3":
        model = m3.Mamba3LM(m3.Mamba3Config(**small, d_state=16, headdim=16, chunk_size=64))
    else:
        model = TinyGPT(GPTConfig(d_model=32, n_layer=2, n_head=4, vocab_size=vocab, block_size=block))
    return model, torch.compile(model) if "--compile-model" in flags else model


def bench_graphs(args, device):
    """Dynamo's graphs, graph breaks and recompiles for each of GRAPH_CASES, phase by phase."""
    vocab, block, batch = 65, 128, 4
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, block + 1), device=device)
    phases = ("train step 1", "train step 2", "eval (no_grad)", "eval, last batch of 3")
    rows, notes = [], {}
    for case in GRAPH_CASES:
        with compiled_with(args.backend):
            model, run = graph_model(case, vocab, block)
            model.to(device)
            per_phase, t0 = [], time.perf_counter()
            for phase in phases:
                before = compiles_so_far()
                x = ids[:3] if phase.endswith("of 3") else ids
                with torch.set_grad_enabled(phase.startswith("train")), autocast:
                    logits = run(x[:, :-1])
                if phase.startswith("train"):
                    loss = torch.nn.functional.cross_entropy(logits[..., :vocab].float().flatten(0, 1),
                                                             x[:, 1:].flatten())
                    loss.backward()
                after = compiles_so_far()
                per_phase.append([after[i] - before[i] for i in range(2)] + [len(after[2]) - len(before[2])])
            graphs, breaks, recompiles = compiles_so_far()
            rows.append([case, str(graphs), str(breaks), str(len(recompiles))]
                        + [" / ".join(str(p[i]) for p in per_phase) for i in range(3)]
                        + [f"{time.perf_counter() - t0:.0f}"])
            broke = Counter()
            for reason, n in torch._dynamo.utils.counters["graph_break"].items():
                broke[short(reason)] += n
            notes[case] = [f"break x{n}: {r}" for r, n in broke.items()]
            notes[case] += [f"recompile x{n}: {r}" for r, n in Counter(map(short, recompiles)).items()]
    table(f"torch.compile (backend {args.backend!r}) of small models (d_model 32, 2 layers, block {block}) "
          f"under bf16 autocast; phases: {'; '.join(phases)}",
          ["case", "graphs", "breaks", "recompiles", "graphs by phase", "breaks by phase", "recompiles by phase",
           "s"], rows)
    for case, lines in notes.items():
        if lines:
            print(f"\n{case}:\n  " + "\n  ".join(lines))
