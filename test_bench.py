"""Specification of the bench package (python -m bench): its GPU paths run on a CPU (what a CUDA machine
would meet first), its models and counts, and its command line."""

import argparse
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import mamba_engine
from bench import common, decode, gpu, graphs, load, race, roofline, scan, train
from bench.__main__ import main

HERE = os.path.dirname(os.path.abspath(__file__))


def compile_with_dynamo_only(monkeypatch):
    """torch.compile through Dynamo's eager backend: the same graphs, guards and recompile limit
    as with Inductor, in seconds instead of minutes, since nothing is generated."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, fullgraph=False, options=None, **kw:
                        real(fn, backend="eager", dynamic=dynamic, fullgraph=fullgraph))
    monkeypatch.setattr(mamba_engine, "_compiled", {})  # compiled functions made with the real backend
    torch._dynamo.reset()


@pytest.mark.compile
@pytest.mark.slow  # about 20 s
def test_bench_selective_compiles_each_shape_within_the_recompile_limit(monkeypatch, capsys):
    # python -m bench selective on CUDA times three shapes, each with about four graphs of the compiled
    # chunk (no grad, autograd from a zero and from a carried state, the recomputing backward's
    # forward); the chunk is compiled with fullgraph=True, so past torch's limit of 8 graphs the
    # next compile fails (FailOnRecompileLimitHit) instead of running eagerly
    compile_with_dynamo_only(monkeypatch)
    args = argparse.Namespace(quick=False, repeats=1, no_memory=True)
    scan.bench_selective(args, torch.device("cpu"), shapes=[(1, 8, 4, 2), (2, 8, 4, 2), (1, 24, 4, 2)])
    out = capsys.readouterr().out
    assert out.count("| compiled + recompute |") == 3
    torch._dynamo.reset()


def test_run_capped_kills_every_process_the_part_started_at_the_deadline(tmp_path):
    # a part's compile workers are its children: the deadline must stop them too
    marker = tmp_path / "still running"
    worker = tmp_path / "worker.py"
    worker.write_text(f"import time\ntime.sleep(3)\nopen({str(marker)!r}, 'w').close()\n")
    script = (f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(worker)!r}])\n"
              "print('started', flush=True)\ntime.sleep(60)\n")
    t0 = time.perf_counter()
    out, status = gpu.run_capped([sys.executable, "-c", script], 1.5)
    assert status is None and "started" in out and time.perf_counter() - t0 < 10
    time.sleep(4)
    assert not marker.exists()


PARTS = ["--arch mamba --max-iters", "--arch gpt --max-iters", "--arch mamba --compile --max-iters",
         "--arch gpt --compile-model --max-iters", "--arch mamba --max-time", "--arch gpt --max-time",
         "-m 'not compile'", "--arch mamba2 --max-iters", "--arch mamba3 --max-iters", "eager paths",
         "compiled paths", "-m compile"]


def bench_gpu_tiny(text_file, budget, steps):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "bench", "gpu", "--tiny", "--data", text_file, "--budget", str(budget),
                          "--steps", str(steps), "--race-time", "3", "--repeats", "2"],
                         cwd=HERE, capture_output=True, text=True, timeout=budget + 120)
    return out.stdout + out.stderr, out.returncode, time.perf_counter() - t0


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("".join(f"line {i}: to be, or not to be, that is the question.\n" for i in range(300)))
    return str(path)


@pytest.mark.slow  # about 30 s: a 25 s budget
def test_bench_gpu_tiny_keeps_the_order_and_the_budget(text_file):
    # a budget too short for everything: what fits runs in the order of the CUDA run, the rest is
    # killed or skipped, and the command ends within its budget, compiling included
    budget = 25
    out, status, seconds = bench_gpu_tiny(text_file, budget, 2)
    assert seconds < budget + 15, out
    seen = [out.find(part) for part in PARTS]
    started = [i for i in seen if i >= 0]
    assert seen[0] >= 0 and started == sorted(started), out
    # CPU autocast, as on CUDA, to the last step
    assert re.search(r"\| +--arch mamba --max-iters 2 --eval-iters 4 \| +[\d.]+M \| +bf16 \|.*\| +2 \|", out), out
    if -1 in seen or "killed at the deadline" in out:
        assert status == 1


@pytest.mark.compile
@pytest.mark.slow  # minutes: every part, its compiles included
def test_bench_gpu_tiny_runs_every_part_in_order_on_the_cpu(text_file):
    out, status, _ = bench_gpu_tiny(text_file, 900, 14)
    assert status == 0, out
    positions = [out.find(part) for part in PARTS]
    assert -1 not in positions and positions == sorted(positions), out
    rows = [line for line in out.splitlines() if line.startswith("|") and "---" not in line]
    assert not [r for r in rows if "failed" in r or "killed" in r or "skipped" in r], out
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    for flags in ("--arch mamba", "--arch gpt", "--arch mamba --compile", "--arch gpt --compile-model",
                  "--arch mamba2", "--arch mamba3"):
        row = next(c for c in cells if c[0].startswith(f"{flags} --max-iters"))
        # CPU bf16 autocast, to the end; ms/step of steps 12 and 14 (the log's every second step)
        assert row[2] == "bf16" and row[4] and row[7] == "14", row
    for arch in ("mamba", "gpt"):  # the racers trained and evaluated
        row = next(c for c in cells if c[0].startswith(f"--arch {arch} --max-time"))
        assert row[2] == "bf16" and float(row[8]) > 0, row
    assert "fell back" not in out  # compile="loop" compiled its loop


@pytest.mark.compile
@pytest.mark.slow  # about 35 s
def test_bench_graphs_counts_one_compile_per_graph_and_none_after_the_first_step(monkeypatch, capsys):
    # Dynamo only (the eager backend): Mamba-1's fused path makes its two graphs (the chunk and its
    # backward) at the first training step and none after, evaluation and a smaller batch included;
    # Mamba-3 and the GPT compiled whole are one graph per grad mode and batch size, with no break
    monkeypatch.setattr(graphs, "GRAPH_CASES", ("mamba --compile", "mamba3 --compile-model", "gpt --compile-model"))
    graphs.bench_graphs(argparse.Namespace(backend="eager"), torch.device("cpu"))
    out = capsys.readouterr().out
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in out.splitlines() if line.startswith("|"))}
    assert rows["mamba --compile"][:6] == ["2", "0", "0", "2 / 0 / 0 / 0", "0 / 0 / 0 / 0", "0 / 0 / 0 / 0"], out
    for case in ("mamba3 --compile-model", "gpt --compile-model"):
        assert rows[case][:5] == ["3", "0", "2", "1 / 0 / 1 / 1", "0 / 0 / 0 / 0"], out


def test_a_compile_loop_row_says_when_it_fell_back_to_per_chunk_calls(monkeypatch):
    monkeypatch.setattr(mamba_engine, "_compiled_loop_works", True)
    assert common.loop_label('compile="loop"', dict(compile="loop")) == 'compile="loop"'
    monkeypatch.setattr(mamba_engine, "_compiled_loop_works", False)  # as after a failed compile of the loop
    assert "fell back" in common.loop_label('compile="loop"', dict(compile="loop"))
    assert common.loop_label("compiled fused", dict(compile=True)) == "compiled fused"


def test_bench_decode_builds_transformers_twins_that_generate_the_same_tokens(capsys):
    # python -m bench decode compares speeds only after checking that both implementations, on the same
    # weights, produce the same greedy tokens; this runs that check for Mamba-1 and Mamba-2
    pytest.importorskip("transformers")
    for generation, kw in ((1, dict(d_model=32, n_layer=2, vocab_size=50, d_state=4)),
                           (2, dict(d_model=64, n_layer=2, vocab_size=50, d_state=16, headdim=32, ngroups=1))):
        torch.manual_seed(0)
        ours = decode.decode_model(generation, kw)
        hf = decode.transformers_peer(ours, generation)
        prompt = torch.randint(0, 50, (1, 7))
        with torch.no_grad():
            theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, min_new_tokens=6,
                                 do_sample=False)
            torch.testing.assert_close(hf(prompt).logits, ours(prompt), atol=1e-4, rtol=1e-4)
        assert torch.equal(ours.generate(prompt, 6, top_k=1), theirs)
    args = argparse.Namespace(quick=True, repeats=1, threads=1, no_compile=True, shapes=None)
    decode.bench_decode(args, torch.device("cpu"))
    assert "| mamba3 128 x 7, d_state 32 |       1 |           ours |" in capsys.readouterr().out


def test_the_roofline_counter_counts_bytes_flops_and_kernels_as_by_hand():
    # python -m bench roofline's StepCounter on ops whose traffic is easy to count: a bf16 matmul reads
    # its two operands and writes its result (2 bytes each) and does 2·m·k·n FLOPs; an in-place
    # multiply-add reads its tensor, its operands (a broadcast one once) and writes its tensor;
    # a view moves nothing; a copy reads and writes; zeros only writes
    a, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16)
    h, u, row = torch.randn(3, 5), torch.randn(3, 5), torch.randn(1, 5)
    with roofline.StepCounter() as counter:
        a @ w
        h.addcmul_(u, row.expand(3, 5))  # h (3, 5) fp32 in place, u (3, 5), one row read for 3
        h[:, 1:].t()
        h.t().contiguous()
        torch.zeros(7, 2)
    ops = [(k["op"], k["bytes"], k["flops"], k["half"]) for k in counter.kernels]
    assert ops == [("mm", 2 * (8 * 16 + 16 * 4 + 8 * 4), 2 * 8 * 16 * 4, True),
                   ("addcmul_", 4 * (15 + 15 + 5 + 15), 0, False),
                   ("clone", 4 * (15 + 15), 0, False),
                   ("zeros", 4 * 14, 0, False)], ops


def test_the_roofline_models_each_scan_pass_of_a_tiny_step():
    # A tiny Mamba-1 step with the loop: each layer runs L - 1 steps of the recurrence forward and
    # L - 1 back, each one kernel over a (b, ED, N) slice that reads three slices and writes one
    b, L, d_model, n_layer, N = 2, 8, 8, 2, 4
    flags = ["--batch-size", str(b), "--block-size", str(L), "--d-model", str(d_model), "--n-layer", str(n_layer),
             "--d-state", str(N)]
    counter, _, _ = roofline.roofline_step("mamba", flags, "sequential")
    step_slices = [k for k in counter.kernels if k["op"] == "addcmul_" and k["shape"] == (b, 2 * d_model, N)]
    assert len(step_slices) == 2 * (L - 1) * n_layer
    assert {k["bytes"] for k in step_slices} == {4 * b * 2 * d_model * N * 4}
    assert {k["phase"] for k in step_slices} == {"forward", "backward"}
    # the ideal fused scan: one kernel each way per layer instead of the scan's many, fewer bytes
    ideal, _, _ = roofline.roofline_step("mamba", flags, "ideal")
    assert sum(k["op"].startswith("ideal") for k in ideal.kernels) == 2 * n_layer
    assert sum(k["bytes"] for k in ideal.kernels) < sum(k["bytes"] for k in counter.kernels)
    assert 0 < ideal.peak < counter.peak


def test_bench_roofline_prints_every_architecture(capsys):
    args = argparse.Namespace(flags="--batch-size 2 --block-size 8 --d-model 96 --n-layer 1", archs=None)
    roofline.bench_roofline(args, torch.device("cpu"))
    out = capsys.readouterr().out
    assert "MODELLED, not measured" in out
    rows = [line for line in out.splitlines() if line.startswith("|") and "---" not in line][1:]
    names = [row.split("|")[1].strip() for row in rows]
    assert [n.split(" ")[0] for n in names] == ["mamba"] * 6 + ["mamba2", "mamba3", "gpt"], names
    assert sum("= auto" in n for n in names) == 1
    assert any("ideal fused scan" in n for n in names) and any("CPU form" in n for n in names)



def test_bench_load_measures_both_loads_of_a_bf16_checkpoint(capsys):
    # the meta-device load holds the bf16 weights about once; an fp32 build, load and cast holds
    # more: the toy shape only checks that both run and are printed (RESULTS.md has the 1.4B figures)
    load.bench_load(argparse.Namespace(quick=True), torch.device("cpu"))
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("|") and "---" not in line][1:]
    assert [row.split("|")[1].strip() for row in rows] == ["pretrained.load", "fp32 model, load, cast"], out
    assert all(float(row.split("|")[2]) >= 0 for row in rows), out


BAD_ARGS = [  # each refused with one usage line, before anything runs
    (["race", "--racers", "gpt,gpt"], "--racers"),  # one label for two racers: the summary would lose one
    (["race", "--racers", "gpt,mamba,gpt"], "--racers"),
    (["race", "--racers", "gpt,llama"], "--racers"),
    (["race", "--racers", "gpt"], "--racers"),
    (["race", "--runs", "0"], "--runs"), (["race", "--runs", "-1"], "--runs"),
    (["scan", "--repeats", "0"], "--repeats"), (["profile", "--repeats", "-3"], "--repeats"),
    (["scan", "--threads", "0"], "--threads"), (["scan", "--threads", "-1"], "--threads"),
    (["gpu", "--tiny", "--steps", "0"], "--steps"),
    (["race", "--max-time", "0"], "--max-time"), (["race", "--max-time", "-2"], "--max-time"),
    (["race", "--max-time", "nan"], "--max-time"), (["sweep", "--max-time", "inf"], "--max-time"),
    (["gpu", "--tiny", "--race-time", "0"], "--race-time"),
    (["gpu", "--tiny", "--budget", "0"], "--budget"), (["gpu", "--tiny", "--budget", "-5"], "--budget"),
    (["scan", "--device", "foo"], "--device"), (["scan", "--device", "meta"], "--device"),
    (["scan", "--device", "cuda:99"], "--device"),
    (["scann"], "unknown table 'scann'"), (["all", "scan"], "unknown table 'all'"),
    (["roofline", "--archs", "mamba,mamba4"], "--archs"),
    (["roofline", "--flags", '"x'], "No closing quotation"),
    (["roofline", "--archs", "mamba", "--flags", "--arch gpt"], "must not hold --arch"),
    (["roofline", "--flags", "--batch-size 8 --scan-backend=pscan"], "must not hold --scan-backend"),
    (["graphs", "--backend", "nonsense"], "--backend 'nonsense' is not a torch.compile backend"),
    (["scan", "--threads", "100000"], "--threads must be at most 4 x"),  # torch segfaults at such a count
    (["gpu", "--tiny", "--budget", "1e308"], "--budget"), (["gpu", "--tiny", "--race-time", "1e308"], "--race-time"),
    (["race", "--max-time", "1e308"], "--max-time"),
    # roofline's --flags, checked by the trainer for each model before anything runs
    (["roofline", "--flags", "--d-model -5"], "refuses them: --d-model must be at least 1"),
    (["roofline", "--archs", "gpt", "--flags", "--d-modle 5"], "refuses them: unrecognized arguments: --d-modle"),
]


@pytest.mark.parametrize("argv,named", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bench_refuses_a_bad_argument_with_one_error_line_before_running(argv, named, monkeypatch, capsys):
    ran = []
    for module, name in ((race, "train_runs"), (scan, "bench_scan"), (train, "bench_profile"), (gpu, "bench_gpu"),
                         (roofline, "bench_roofline"), (race, "bench_sweep")):
        monkeypatch.setattr(module, name, lambda *a, name=name: ran.append(name))
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and ran == []
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1] and named in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_graphs_takes_its_default_backend_and_the_other_torch_compile_backends(monkeypatch, capsys):
    # torch._dynamo tags eager and aot_eager "debug": list_backends() without exclude_tags=() leaves
    # them out, and would refuse graphs' own default
    ran = []
    monkeypatch.setattr(graphs, "bench_graphs", lambda args, device: ran.append(args.backend))
    for argv in (["graphs"], ["graphs", "--backend", "aot_eager"], ["graphs", "--backend", "inductor"]):
        main(argv)
    assert ran == ["eager", "aot_eager", "inductor"]


def test_decode_names_its_shapes_when_none_matches(capsys):
    with pytest.raises(SystemExit, match=r"no shape of --quick matches --shapes 'nothing'; the shapes are: mamba3"):
        main(["decode", "--quick", "--shapes", "nothing"])


def test_a_race_verdict_needs_a_spread_over_two_runs_or_more():
    labels = ["GPT (yardstick)", "mamba (default)"]
    one = race.race_verdict(0.0860, 0.0, 1, labels)
    assert "no verdict" in one and "ahead" not in one and "tie" not in one
    assert race.race_verdict(0.0860, 0.01, 2, labels).endswith("mamba (default) ahead")
    assert race.race_verdict(-0.0860, 0.01, 2, labels).endswith("GPT (yardstick) ahead")
    assert "a tie" in race.race_verdict(0.005, 0.01, 3, labels)


def test_a_sweep_point_replaces_the_flags_of_its_base_and_names_each_once():
    base = ["--n-layer", "5", "--d-model", "160", "--d-state", "4"]
    assert race.with_flags(base, ["--d-state", "2", "--lr", "1e-3"]) == \
        ["--n-layer", "5", "--d-model", "160", "--d-state", "2", "--lr", "1e-3"]
    assert race.with_flags(base, []) == base
    for base, grid in race.SWEEP_ROUNDS.values():  # every point is "--name value" pairs
        for flags in [base["mamba"], base["gpt"]] + grid["mamba"] + grid["gpt"]:
            assert len(flags) % 2 == 0 and all(f.startswith("--") for f in flags[::2]), flags


def test_roofline_refuses_a_size_no_tensor_can_hold_in_one_line():
    # a width the trainer takes, but whose in_proj no tensor can hold: one line naming the flags
    with pytest.raises(SystemExit) as exit:
        main(["roofline", "--archs", "mamba2", "--flags", "--d-model 1000000000"])
    assert str(exit.value.code).startswith("error: roofline cannot count mamba2's step with --flags "
                                           "'--d-model 1000000000': RuntimeError: "), exit.value.code
    assert "\n" not in str(exit.value.code)


def test_a_race_starts_each_run_afresh_in_its_folder(tmp_path, monkeypatch):
    # the trainer continues or refuses a run it finds in --out-dir: the race's runs of an earlier
    # race (log, checkpoints) go first, so that each run trains from the start for --max-time
    out_dir = tmp_path / "mamba-0"
    out_dir.mkdir()
    for name in ("last.pt", "best.pt", "log.jsonl"):
        (out_dir / name).write_text("an earlier run's\n")
    found = []

    class Trainer:  # stands in for train_shakespeare.py: notes what it finds, logs two evaluations
        def __init__(self, cmd, **kw):
            folder = cmd[cmd.index("--out-dir") + 1]
            found.append(sorted(os.listdir(folder)))
            with open(os.path.join(folder, "log.jsonl"), "w") as f:
                f.write('{"step": 5, "elapsed": 1.0, "val_loss": 3.0}\n{"step": 10, "elapsed": 2.0, "val_loss": 2.5}\n')
            self.returncode = 0

        def wait(self):
            return 0

    monkeypatch.setattr(race.subprocess, "Popen", Trainer)
    args = argparse.Namespace(max_time=2.0, data=None, together=False)
    runs = list(race.train_runs([("mamba (default)", [], str(out_dir))], args, torch.device("cpu"), {}))
    assert found == [[]]
    assert runs == [("mamba (default)", [(1.0, 3.0), (2.0, 2.5)], (10, 200.0))]


def test_the_training_table_runs_mamba_1_through_the_engine_as_the_trainer_does(monkeypatch):
    # every Mamba-1 row but the read path runs mamba_engine's scan (accelerate), with the backend or
    # compile its name says; the read path runs the lesson's own selective_scan_reference
    import mamba_minimal as mm
    seen = {}
    monkeypatch.setattr(train, "training_step_table", lambda title, models, *a, **k: seen.update(models))
    train.bench_train(argparse.Namespace(quick=True), torch.device("cpu"))
    expected = {"mamba default (d_state 2, auto)": "auto", "mamba d_state 4": "auto", "mamba d_state 16": "auto",
                "mamba sequential": "sequential", "mamba pscan": "pscan", "mamba fused eager": "fused"}
    for name, backend in expected.items():
        mixers = [m for m in seen[name].modules() if isinstance(m, mm.MambaMixer)]
        assert mixers and all(m.scan_fn.keywords["backend"] == backend and m.scan_fn.keywords["compile"] is False
                              and m.conv_fn == mamba_engine._CausalConv.apply for m in mixers), name
    reference = [m for m in seen["mamba as built (the lesson, not accelerated)"].modules() if isinstance(m, mm.MambaMixer)]
    assert reference and all(m.scan_fn == mm.selective_scan_reference for m in reference)


def test_the_compiled_decode_row_times_its_compile_apart_from_its_tokens(monkeypatch, capsys):
    # a stand-in compile that takes 3 s on the first token: the row's note counts it, and its decode
    # rate does not, which would put 8 tokens under 8 / 3 = 2.7 tokens/s
    compiled = []

    def slow_compile(model):
        eager = model._step

        def step(token_ids, cache):
            if not compiled:
                time.sleep(3)
                compiled.append(True)
            return eager(token_ids, cache)
        model._step = step
        return model

    monkeypatch.setattr(decode.mamba_engine, "compile_decode", slow_compile)
    decode.bench_decode(argparse.Namespace(quick=True, repeats=1, threads=1, no_compile=False, shapes=None),
                        torch.device("cpu"))
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("|") and "ours, compiled step" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(re.fullmatch(r"compiling took (\d+) s", cells[5]).group(1)) >= 3, row
    assert float(cells[4].split()[0]) > 2 * 8 / 3, row


def test_the_gpt_yardstick_runs_copied_alone_into_an_empty_folder(tmp_path):
    # gpt_minimal.py imports torch only: alone in a folder it builds, trains a step and samples
    import shutil
    shutil.copy(os.path.join(HERE, "gpt_minimal.py"), tmp_path)
    script = ("import sys, torch, gpt_minimal as g\n"
              "m = g.TinyGPT(g.GPTConfig(vocab_size=11, d_model=16, n_layer=1, n_head=2, block_size=8))\n"
              "ids = torch.randint(0, 11, (2, 9))\n"
              "loss = torch.nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())\n"
              "loss.backward()\n"
              "tokens = list(m.generate_stream(ids[:1], 12, temperature=0.8, top_k=5, top_p=0.9))\n"
              "assert len(tokens) == 12 and all(0 <= t.item() < 11 for t in tokens)\n"
              "assert not {'mamba_minimal', 'pscan'} & set(sys.modules)\n"
              "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_gpt_yardstick_samples_as_the_mamba_models_do():
    # the GPT's own sampler against mamba_minimal.sample_next, the same generator state each: the
    # same tokens, greedy, with temperature, top_k and top_p
    import gpt_minimal
    import mamba_minimal as mm
    logits = torch.randn(4, 40)
    for temperature, top_k, top_p in ((0, None, None), (1.0, 1, None), (1.0, None, None), (0.7, 5, None),
                                      (1.3, None, 0.8), (0.5, 3, 0.6), (1e-46, None, None), (1.0, None, 1e-300)):
        ours = gpt_minimal.sample(logits, temperature, top_k, top_p, torch.Generator().manual_seed(1))
        theirs = mm.sample_next(logits, temperature, top_k, top_p, torch.Generator().manual_seed(1))
        assert torch.equal(ours, theirs), (temperature, top_k, top_p)
