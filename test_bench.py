"""Specification of bench.py's GPU paths, run on a CPU: what a CUDA machine would meet first."""

import argparse
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import bench
import mamba_minimal as mm
import train_shakespeare as ts

HERE = os.path.dirname(os.path.abspath(__file__))


def compile_with_dynamo_only(monkeypatch):
    """torch.compile through Dynamo's eager backend: the same graphs, guards and recompile limit
    as with Inductor, in seconds instead of minutes, since nothing is generated."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, fullgraph=False, options=None, **kw:
                        real(fn, backend="eager", dynamic=dynamic, fullgraph=fullgraph))
    monkeypatch.setattr(mm, "_compiled", {})  # compiled functions made with the real backend
    torch._dynamo.reset()


@pytest.mark.compile
def test_bench_selective_compiles_each_shape_within_the_recompile_limit(monkeypatch, capsys):
    # bench.py selective on CUDA times three shapes, each with about four graphs of the compiled
    # chunk (no grad, autograd from a zero and from a carried state, the recomputing backward's
    # forward); the chunk is compiled with fullgraph=True, so past torch's limit of 8 graphs the
    # next compile fails (FailOnRecompileLimitHit) instead of running eagerly
    compile_with_dynamo_only(monkeypatch)
    args = argparse.Namespace(quick=False, repeats=1, no_memory=True)
    bench.bench_selective(args, torch.device("cpu"), shapes=[(1, 8, 4, 2), (2, 8, 4, 2), (1, 24, 4, 2)])
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
    out, status = bench.run_capped([sys.executable, "-c", script], 1.5)
    assert status is None and "started" in out and time.perf_counter() - t0 < 10
    time.sleep(4)
    assert not marker.exists()


PARTS = ["--arch mamba --max-iters", "--arch gpt --max-iters", "--arch mamba --compile --max-iters",
         "--arch gpt --compile-model --max-iters", "--arch mamba --max-time", "--arch gpt --max-time",
         "-m 'not compile'", "--arch mamba2 --max-iters", "--arch mamba3 --max-iters", "eager paths",
         "compiled paths", "-m compile"]


def bench_gpu_tiny(text_file, budget, steps):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "bench.py", "gpu", "--tiny", "--data", text_file, "--budget", str(budget),
                          "--steps", str(steps), "--race-time", "3", "--repeats", "2"],
                         cwd=HERE, capture_output=True, text=True, timeout=budget + 120)
    return out.stdout + out.stderr, out.returncode, time.perf_counter() - t0


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("".join(f"line {i}: to be, or not to be, that is the question.\n" for i in range(300)))
    return str(path)


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
def test_bench_graphs_counts_one_compile_per_graph_and_none_after_the_first_step(monkeypatch, capsys):
    # Dynamo only (the eager backend): Mamba-1's fused path makes its two graphs (the chunk and its
    # backward) at the first training step and none after, evaluation and a smaller batch included;
    # Mamba-3 and the GPT compiled whole are one graph per grad mode and batch size, with no break
    monkeypatch.setattr(bench, "GRAPH_CASES", ("mamba --compile", "mamba3 --compile-model", "gpt --compile-model"))
    bench.bench_graphs(argparse.Namespace(backend="eager"), torch.device("cpu"))
    out = capsys.readouterr().out
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in out.splitlines() if line.startswith("|"))}
    assert rows["mamba --compile"][:6] == ["2", "0", "0", "2 / 0 / 0 / 0", "0 / 0 / 0 / 0", "0 / 0 / 0 / 0"], out
    for case in ("mamba3 --compile-model", "gpt --compile-model"):
        assert rows[case][:5] == ["3", "0", "2", "1 / 0 / 1 / 1", "0 / 0 / 0 / 0"], out


def test_a_compile_loop_row_says_when_it_fell_back_to_per_chunk_calls(monkeypatch):
    monkeypatch.setattr(mm, "_compiled_loop_works", True)
    assert bench.loop_label('compile="loop"', dict(compile="loop")) == 'compile="loop"'
    monkeypatch.setattr(mm, "_compiled_loop_works", False)  # as after a failed compile of the loop
    assert "fell back" in bench.loop_label('compile="loop"', dict(compile="loop"))
    assert bench.loop_label("compiled fused", dict(compile=True)) == "compiled fused"


def test_bench_decode_builds_transformers_twins_that_generate_the_same_tokens(capsys):
    # bench.py decode compares speeds only after checking that both implementations, on the same
    # weights, produce the same greedy tokens; this runs that check for Mamba-1 and Mamba-2
    pytest.importorskip("transformers")
    for generation, kw in ((1, dict(d_model=32, n_layer=2, vocab_size=50, d_state=4)),
                           (2, dict(d_model=64, n_layer=2, vocab_size=50, d_state=16, headdim=32, ngroups=1))):
        torch.manual_seed(0)
        ours, why = bench.decode_model(generation, kw)
        hf = bench.transformers_peer(ours, generation)
        prompt = torch.randint(0, 50, (1, 7))
        with torch.no_grad():
            theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, min_new_tokens=6,
                                 do_sample=False)
            torch.testing.assert_close(hf(prompt).logits, ours(prompt), atol=1e-4, rtol=1e-4)
        assert torch.equal(ours.generate(prompt, 6, top_k=1), theirs)
    args = argparse.Namespace(quick=True, repeats=1, threads=1, no_compile=True, shapes=None)
    bench.bench_decode(args, torch.device("cpu"))
    assert "| mamba3 128 x 7, d_state 32 |       1 |           ours |" in capsys.readouterr().out


def test_the_roofline_counter_counts_bytes_flops_and_kernels_as_by_hand():
    # bench.py roofline's StepCounter on ops whose traffic is easy to count: a bf16 matmul reads
    # its two operands and writes its result (2 bytes each) and does 2·m·k·n FLOPs; an in-place
    # multiply-add reads its tensor, its operands (a broadcast one once) and writes its tensor;
    # a view moves nothing; a copy reads and writes; zeros only writes
    a, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16)
    h, u, row = torch.randn(3, 5), torch.randn(3, 5), torch.randn(1, 5)
    with bench.StepCounter() as counter:
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
    counter, _, _ = bench.roofline_step("mamba", flags, "sequential")
    step_slices = [k for k in counter.kernels if k["op"] == "addcmul_" and k["shape"] == (b, 2 * d_model, N)]
    assert len(step_slices) == 2 * (L - 1) * n_layer
    assert {k["bytes"] for k in step_slices} == {4 * b * 2 * d_model * N * 4}
    assert {k["phase"] for k in step_slices} == {"forward", "backward"}
    # the ideal fused scan: one kernel each way per layer instead of the scan's many, fewer bytes
    ideal, _, _ = bench.roofline_step("mamba", flags, "ideal")
    assert sum(k["op"].startswith("ideal") for k in ideal.kernels) == 2 * n_layer
    assert sum(k["bytes"] for k in ideal.kernels) < sum(k["bytes"] for k in counter.kernels)
    assert 0 < ideal.peak < counter.peak


def test_bench_roofline_prints_every_architecture(capsys):
    args = argparse.Namespace(flags="--batch-size 2 --block-size 8 --d-model 96 --n-layer 1", archs=None)
    bench.bench_roofline(args, torch.device("cpu"))
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
    bench.bench_load(argparse.Namespace(quick=True), torch.device("cpu"))
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("|") and "---" not in line][1:]
    assert [row.split("|")[1].strip() for row in rows] == ["from_pretrained", "fp32 model, load, cast"], out
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
]


@pytest.mark.parametrize("argv,named", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bench_refuses_a_bad_argument_with_one_error_line_before_running(argv, named, monkeypatch, capsys):
    ran = []
    for name in ("train_runs", "bench_scan", "bench_profile", "bench_gpu", "bench_roofline", "bench_sweep"):
        monkeypatch.setattr(bench, name, lambda *a, name=name: ran.append(name))
    with pytest.raises(SystemExit) as exit:
        bench.main(argv)
    assert exit.value.code == 2 and ran == []
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1] and named in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_graphs_takes_its_default_backend_and_the_other_torch_compile_backends(monkeypatch, capsys):
    # torch._dynamo tags eager and aot_eager "debug": list_backends() without exclude_tags=() leaves
    # them out, and would refuse graphs' own default
    ran = []
    monkeypatch.setattr(bench, "bench_graphs", lambda args, device: ran.append(args.backend))
    for argv in (["graphs"], ["graphs", "--backend", "aot_eager"], ["graphs", "--backend", "inductor"]):
        bench.main(argv)
    assert ran == ["eager", "aot_eager", "inductor"]


def test_decode_names_its_shapes_when_none_matches(capsys):
    with pytest.raises(SystemExit, match=r"no shape of --quick matches --shapes 'nothing'; the shapes are: mamba3"):
        bench.main(["decode", "--quick", "--shapes", "nothing"])


def test_a_race_verdict_needs_a_spread_over_two_runs_or_more():
    labels = ["GPT (yardstick)", "mamba (default)"]
    one = bench.race_verdict(0.0860, 0.0, 1, labels)
    assert "no verdict" in one and "ahead" not in one and "tie" not in one
    assert bench.race_verdict(0.0860, 0.01, 2, labels).endswith("mamba (default) ahead")
    assert bench.race_verdict(-0.0860, 0.01, 2, labels).endswith("GPT (yardstick) ahead")
    assert "a tie" in bench.race_verdict(0.005, 0.01, 3, labels)


def test_a_sweep_point_replaces_the_flags_of_its_base_and_names_each_once():
    base = ["--n-layer", "5", "--d-model", "160", "--d-state", "4"]
    assert bench.with_flags(base, ["--d-state", "2", "--lr", "1e-3"]) == \
        ["--n-layer", "5", "--d-model", "160", "--d-state", "2", "--lr", "1e-3"]
    assert bench.with_flags(base, []) == base
    for base, grid in bench.SWEEP_ROUNDS.values():  # every point is "--name value" pairs
        for flags in [base["mamba"], base["gpt"]] + grid["mamba"] + grid["gpt"]:
            assert len(flags) % 2 == 0 and all(f.startswith("--") for f in flags[::2]), flags


def test_reading_counts_code_lines_and_prose_words_as_the_readme_method_says(tmp_path):
    path = tmp_path / "lesson.py"
    path.write_text('"""A module docstring of six words."""\n'
                    "# a comment of five words\n"
                    "x = 1  # three trailing words\n"
                    "# ----------\n"
                    "def f():\n"
                    '    """Two words."""\n'
                    '    return "not a docstring"\n')
    # by hand: code lines 3, 5 and 7; prose 6 + 5 + 3 + 2 words, the rule of dashes being no prose
    assert bench.reading_counts(str(path)) == (3, 16)
    assert bench.reading_counts(str(path), 3, 4) == (1, 3)
    readme = tmp_path / "README.md"
    readme.write_text("Two hundred words.\n```\ncode\nmore code\n```\n")
    assert bench.readme_minutes(str(readme)) == (2, 3, pytest.approx(3 / 200 + 2 / 30))


def test_a_part_runs_from_its_banner_to_the_line_before_the_next_banner(tmp_path):
    path = tmp_path / "lesson.py"
    path.write_text("x = 1\n"                 # 1
                    "\n"                       # 2
                    "# -----\n"                # 3  the banner's rule: part of the part it opens
                    "# 2. Second\n"            # 4
                    "# -----\n"                # 5
                    "y = 2\n"                  # 6
                    "\n"                       # 7  the part's last line
                    "# -----\n"                # 8
                    "# 3. Third\n"             # 9
                    "z = 3\n")                 # 10
    assert bench.part_lines(str(path), None, r"# 2\.") == (1, 2)
    assert bench.part_lines(str(path), r"# 2\.", r"# 3\.") == (3, 7)
    assert bench.part_lines(str(path), r"# 3\.", None) == (8, 10)


def test_the_readme_method_counts_no_table_rule_or_pipe_as_a_word(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("| scan | work |\n|---|:---:|\n| the loop | L |\n")
    assert bench.readme_minutes(str(readme)) == (0, 5, pytest.approx(5 / 200))  # scan, work, the, loop, L


def test_a_decorated_function_is_found_at_its_first_decorator(tmp_path):
    # a function's code object starts at its first decorator, which is what sys.setprofile reports
    path = tmp_path / "lesson.py"
    path.write_text("import functools\n"
                    "\n"
                    "@functools.lru_cache\n"
                    "@staticmethod\n"
                    "def f():\n"
                    "    return 1\n"
                    "def g():\n"
                    "    return 2\n")
    assert bench.function_spans(str(path)) == {3: (3, 6), 7: (7, 8)}
    assert ts.mean_loss.__wrapped__.__code__.co_firstlineno in bench.function_spans(ts.__file__)  # @torch.no_grad()


def test_bench_reading_prints_the_path_the_readme_times(capsys):
    bench.main(["reading"])
    out = capsys.readouterr().out
    row_pattern = r"\s*\|\s+\|\s+\|\s+([\d.]+) \|\s+([\d.]+) \|"  # a subtotal: no counts, two minutes
    figures = lambda label: [float(m) for m in re.search(re.escape(label) + row_pattern, out).groups()]
    readme = " ".join(open(os.path.join(HERE, "README.md"), encoding="utf-8").read().split())
    close = lambda printed, claimed: all(abs(p - int(c)) <= 0.55 for p, c in zip(printed, claimed))
    claimed = re.search(r"Three readings, in this order, (\d+)-(\d+) minutes by a fixed method", readme).groups()
    assert close(figures("the path, in all"), claimed), claimed
    # each reading's row of the README's table
    for (label, _), name in zip(bench.READINGS, ("Mamba-1", "The parallel scan", "The trainer")):
        row = re.search(r"\| \d\. " + name + r"[^|]*\|[^|]*\| (\d+)-(\d+) min \|", readme)
        assert row and close(figures(f"**{label}**"), row.groups()), (label, row)
    # what following every call adds, as the README says it, from the table's counts of code lines and
    # words at the method's rates: the model's calls with the switch and without, the scan's, the trainer's
    said = re.search(r"Following every call adds at least (\d+)-(\d+) minutes to reading 1 by the method with the "
                     r"switch \(the checks\), (\d+)-(\d+) without \(§6's engine, the tree\); "
                     r"(\d+)-?(\d*) to reading 2 \(pscan's appendix A\), (\d+)-(\d+) to reading 3", readme)
    rows = {}  # (run, reading, file or total) -> [functions, code lines, prose words, minutes fast, minutes slow]
    for row in re.finditer(r"^\|\s*(--scan-backend reference|the default) \|\s*([^|]+?) \|\s*([^|]*?) \|([^\n]*)$",
                           out, flags=re.M):
        rows[row.group(1), row.group(2), row.group(3)] = [c.strip() for c in row.group(4).split("|")][:-1]
    runs = ("--scan-backend reference", "the default")
    readings = [label for label, _ in bench.READINGS]
    for (run, reading), i in zip(((runs[0], readings[0]), (runs[1], readings[0]), (runs[0], readings[1]),
                                  (runs[0], readings[2])), (1, 3, 5, 7)):
        files = [k[2] for k in rows if k[:2] == (run, reading)]
        assert files, (run, reading)
        code, words = (sum(int(rows[run, reading, name][k]) for name in files) for k in (1, 2))
        fast, slow = bench.minutes(code, words)
        claimed = int(said.group(i)), int(said.group(i + 1) or said.group(i))  # "3": 3-3
        assert (round(fast), round(slow)) == claimed, (run, reading, fast, slow)
    for run in runs:  # a reading with its calls: its minutes and what its calls add
        for reading in readings:
            low, high = figures(f"**{reading}**")
            files = [k[2] for k in rows if k[:2] == (run, reading)]
            fast, slow = bench.minutes(*(sum(int(rows[run, reading, name][k]) for name in files) for k in (1, 2)))
            total = rows[run, f"**{reading}, with its calls**", ""]
            assert abs(low + fast - float(total[3])) <= 0.11, (run, reading)
            assert abs(high + slow - float(total[4])) <= 0.11, (run, reading)
        # the whole path with every call counts each function once: no more than the readings' sums
        whole = rows[run, "the path and every call", ""]
        sums = [sum(float(rows[run, f"**{r}, with its calls**", ""][k]) for r in readings) for k in (3, 4)]
        path = figures("the path, in all")
        assert all(p <= float(w) <= s + 0.11 for p, w, s in zip(path, whole[3:], sums)), (run, whole, sums)


def test_following_the_calls_counts_each_function_off_the_path_once():
    first = lambda f: f.__code__.co_firstlineno
    inside = ("pscan.py", first(bench.ps._check_inputs))  # appendix E: off the path
    on_path = ("pscan.py", first(bench.ps._brent_kung_))  # section 5: on the path, not counted again
    nowhere = ("bench.py", 0)  # no function starts at line 0 (a lambda's line, say): ignored
    counted = bench.followed_off_path({inside, on_path, nowhere})
    span = bench.function_spans(os.path.join(HERE, "pscan.py"))[inside[1]]
    assert counted == {"pscan.py": (1,) + bench.reading_counts(os.path.join(HERE, "pscan.py"), *span)}
    # the first reading alone (pscan.py sections 1 and 9, the model): section 5's tree lies outside it
    first_reading = bench.READINGS[0][1]
    assert bench.followed_off_path({inside, on_path}, first_reading)["pscan.py"][0] == 2
    # a function defined inside another off-path one is read with it, not twice
    need = next(c for c in ts.check_numbers.__code__.co_consts if hasattr(c, "co_firstlineno"))  # nested
    both = {("train_shakespeare.py", first(ts.check_numbers)), ("train_shakespeare.py", need.co_firstlineno)}
    assert bench.followed_off_path(both)["train_shakespeare.py"][0] == 1
    # and its lines once: the outer function's body by the method, which holds the nested one
    outer = bench.function_spans(ts.__file__)[first(ts.check_numbers)]
    assert bench.followed_off_path(both) == {"train_shakespeare.py": (1,) + bench.reading_counts(ts.__file__, *outer)}


def test_the_reference_switch_runs_no_engine_code_and_the_default_does(tmp_path):
    # what a reader following every call opens, traced: with scan_backend="reference" no function of
    # mamba_minimal.py section 6 runs (only the appendix's checks), by default its CPU backward does
    text = tmp_path / "text.txt"
    text.write_text(open(os.path.join(HERE, "README.md"), encoding="utf-8").read() * 3, encoding="utf-8")
    engine = {f.__code__.co_firstlineno for f in (bench.mm._cpu_forward, bench.mm._cpu_backward,
                                                  bench.mm.selective_scan)}
    runs = {}
    for name, flags in (("reference", ["--scan-backend", "reference"]), ("default", [])):
        seen = bench.functions_run(["--data", str(text), "--out-dir", str(tmp_path / name), "--max-time", "1",
                                    "--device", "cpu", "--no-sample"] + flags)
        runs[name] = {line for file, line in seen if file == "mamba_minimal.py"}
    assert not runs["reference"] & engine
    assert engine <= runs["default"]
    assert bench.mm.selective_scan_reference.__code__.co_firstlineno in runs["reference"]
