"""Specification of train_shakespeare.py, on a small text each test writes for itself."""

import argparse
import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import mamba_engine
import train_shakespeare as ts
from mamba_minimal import MambaConfig, MambaLM

HERE = os.path.dirname(os.path.abspath(__file__))
# fp32 whatever the CPU's default --dtype: the tests compare with fp32 and float64 oracles
TINY = ["--d-model", "16", "--n-layer", "1", "--d-state", "4", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "2", "--warmup-iters", "2", "--lr", "1e-2", "--log-interval", "1", "--dtype", "fp32",
        "--no-sample"]  # last: without(TINY, "--no-sample") drops a flag and the word after it


def without(argv, *flags):
    """argv with each of these flags and its value left out."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


@pytest.fixture
def text_file(tmp_path):
    lines = ["First Citizen: we are accounted poor citizens, the patricians good.",
             "MENENIUS: what work's, my countrymen, in hand? where go you?",
             "Second Citizen: soft! who comes here? worthy Menenius Agrippa."]
    text = "\n".join(lines[i % 3] for i in range(120)) + "\n"
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    return str(path)


def run(argv, capsys):
    ts.main(argv)
    return capsys.readouterr().out


def evals(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_short_run_lowers_the_loss_and_writes_checkpoints(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "40", "--eval-interval", "10"] + TINY, capsys)
    records = evals(out_dir)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 4
    assert val[-1] < val[0] - 0.5  # from ~ln(vocab) at the start
    assert {"step", "elapsed", "tokens", "train_loss", "val_loss"} <= set(records[0])
    assert records[-1]["full_val_loss"] > 0
    for name in ("last.pt", "best.pt"):
        ckpt = torch.load(os.path.join(out_dir, name), weights_only=True)
        assert ckpt["vocab"] == "".join(sorted(set(open(text_file).read())))
    assert torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)["step"] == 40
    assert not [f for f in os.listdir(out_dir) if ".tmp" in f]  # atomic writes leave no temp files


def test_resume_continues_exactly_like_an_uninterrupted_run(text_file, tmp_path, capsys):
    common = ["--data", text_file, "--eval-interval", "10", "--lr-decay-iters", "20"] + TINY
    straight = str(tmp_path / "straight")
    out_a = run(common + ["--out-dir", straight, "--max-iters", "20"], capsys)
    broken = str(tmp_path / "broken")
    run(common + ["--out-dir", broken, "--max-iters", "10"], capsys)  # "interrupted" after step 10
    out_b = run(common + ["--out-dir", broken, "--max-iters", "20", "--resume"], capsys)
    assert "resumed from" in out_b and "at step 10" in out_b

    def step_lines(out, first):
        return [l.split("| lr")[0] for l in out.splitlines() if l.startswith(f"step ") and int(l.split()[1].split("/")[0]) >= first]

    assert step_lines(out_b, 11)[0] == step_lines(out_a, 11)[0]  # the next step's loss, to 4 decimals
    assert step_lines(out_b, 11) == step_lines(out_a, 11)
    a = torch.load(os.path.join(straight, "last.pt"), weights_only=True)
    b = torch.load(os.path.join(broken, "last.pt"), weights_only=True)
    assert a["step"] == b["step"] == 20
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert evals(straight)[1]["val_loss"] == [r for r in evals(broken) if r.get("step") == 20][0]["val_loss"]


def test_sample_streams_the_requested_number_of_characters(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "10", "--eval-interval", "10"] + TINY, capsys)
    out = run(["--sample", "--out-dir", out_dir, "--prompt", "First", "--num-chars", "57", "--top-k", "5"], capsys)
    assert out.startswith("First") and len(out) == len("First") + 57 + 1
    with pytest.raises(SystemExit, match="never seen"):
        ts.main(["--sample", "--out-dir", out_dir, "--prompt", "ZZZ~"])


def test_bad_inputs_give_clear_errors_and_overwrite_nothing(text_file, tmp_path, capsys):
    # an --out-dir of the test's own: the default "out" would be created in the working directory,
    # shared with any other run of the suite there
    with pytest.raises(SystemExit, match="does not exist"):
        ts.main(["--data", str(tmp_path / "missing.txt"), "--out-dir", str(tmp_path / "m")] + TINY)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit, match="is empty"):
        ts.main(["--data", str(empty), "--out-dir", str(tmp_path / "e")] + TINY)
    short = tmp_path / "short.txt"
    short.write_text("to be or not to be, that is the question\n")
    with pytest.raises(SystemExit, match="longer than one block"):
        ts.main(["--data", str(short), "--out-dir", str(tmp_path / "s")] + TINY)
    with pytest.raises(SystemExit, match="--resume needs"):
        ts.main(["--data", text_file, "--out-dir", str(tmp_path / "none"), "--resume"] + TINY)
    # a checkpoint from another vocabulary, or another model size, is refused and left untouched
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "10", "--eval-interval", "10"] + TINY, capsys)
    before = open(os.path.join(out_dir, "last.pt"), "rb").read()
    other = tmp_path / "other.txt"
    other.write_text("abcdefghij" * 300)
    with pytest.raises(SystemExit, match="another vocabulary"):
        ts.main(["--data", str(other), "--out-dir", out_dir, "--resume", "--max-iters", "20"] + TINY)
    with pytest.raises(SystemExit, match="another model config"):
        ts.main(["--data", text_file, "--out-dir", out_dir, "--resume", "--max-iters", "20"] + TINY + ["--d-model", "24"])
    assert open(os.path.join(out_dir, "last.pt"), "rb").read() == before


DDP_PROBE = """
import json, os, sys
import torch
sys.path.insert(0, {here!r})
import train_shakespeare as ts

# record, in each process, its own training loss and a checksum of its weights after every step,
# and how many windows it evaluates
losses, weights, evaluated = [], [], []
real_loss_fn, real_step, real_windows = ts.loss_fn, torch.optim.AdamW.step, ts.windows

def loss_fn(*a):
    loss = real_loss_fn(*a)
    if torch.is_grad_enabled():
        losses.append(loss.item())
    return loss

def step(self, *a, **k):
    out = real_step(self, *a, **k)
    weights.append(sum(p.detach().double().sum().item() for g in self.param_groups for p in g["params"]))
    return out

def windows(split, starts, *a):
    if not torch.is_grad_enabled():  # an evaluation (mean_loss), not a training batch
        evaluated.append(len(starts))
    return real_windows(split, starts, *a)

ts.loss_fn, torch.optim.AdamW.step, ts.windows = loss_fn, step, windows
if os.environ.get("PROBE_CLOCK_RATES"):  # a fake clock per process, its steps each at its own rate
    rate = float(os.environ["PROBE_CLOCK_RATES"].split(",")[int(os.environ["RANK"])])
    now, real_train_step = [1000.0], ts.train_step

    def train_step(*a):
        now[0] += rate
        return real_train_step(*a)

    ts.clock, ts.train_step = (lambda: now[0]), train_step
ts.main(sys.argv[1:])
with open(os.path.join(os.environ["PROBE_OUT"], f"rank{{ts.RANK}}.json"), "w") as f:
    json.dump({{"losses": losses, "weights": weights, "evaluated": sum(evaluated)}}, f)
"""


def run_ddp_probe(text_file, tmp_path, run_flags, **env):
    """Two processes under torchrun, each running DDP_PROBE: -> (out_dir, the finished process)."""
    out_dir = str(tmp_path / "ddp")
    probe = tmp_path / "probe.py"
    probe.write_text(DDP_PROBE.format(here=HERE))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(probe), "--data", text_file, "--out-dir", out_dir, "--device", "cpu"] + run_flags + TINY
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PROBE_OUT=str(tmp_path), **env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=HERE)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # say where the processes stood, not only that they ran long
        proc.terminate()  # torchrun stops its workers on SIGTERM (a SIGKILL would leave them running)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the two processes ran past 300 s; their output so far:\n{out[-3000:]}\n{err[-3000:]}")
    return out_dir, subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
def test_two_process_ddp_run_averages_gradients_losses_and_evaluations(text_file, tmp_path):
    out_dir, proc = run_ddp_probe(text_file, tmp_path, ["--max-iters", "8", "--eval-interval", "4"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout
    assert proc.stdout.count("step 8/8") == 1  # only rank 0 logs
    ckpt = torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)
    assert ckpt["step"] == 8
    assert [r["step"] for r in evals(out_dir) if "val_loss" in r] == [4, 8]
    assert evals(out_dir)[-1]["tokens"] == 8 * 2 * 4 * 16  # steps x processes x batch x block

    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(r0["weights"]) == len(r1["weights"]) == 8
    assert r0["weights"] == r1["weights"]  # gradients averaged: both processes hold the same model
    assert all(abs(a - b) > 1e-4 for a, b in zip(r0["losses"], r1["losses"]))  # on different windows
    logged = [float(l.split("| loss ")[1].split()[0]) for l in proc.stdout.splitlines() if l.startswith("step ")]
    assert logged == pytest.approx([(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])], abs=6e-5)

    # each process evaluates half of the windows: the logged loss is the mean over all of them
    x, y, vocab = val_windows(text_file, block=16, n_windows=2 * 4)
    assert evals(out_dir)[1]["val_loss"] == pytest.approx(checkpoint_loss(os.path.join(out_dir, "last.pt"), x, y, vocab),
                                                          abs=1e-5)
    x, y, _ = val_windows(text_file, block=16)
    assert evals(out_dir)[-1]["full_val_loss"] == pytest.approx(
        checkpoint_loss(os.path.join(out_dir, "best.pt"), x, y, vocab), abs=1e-5)
    # 2 evaluations of 8 train and 8 val windows, then the full val pass: half of them each
    assert r0["evaluated"] + r1["evaluated"] == 2 * 2 * 8 + len(x)
    assert abs(r0["evaluated"] - r1["evaluated"]) <= 1


@pytest.mark.slow
def test_a_two_process_time_based_run_follows_the_first_processs_clock(text_file, tmp_path):
    # process 0's clock reads 1 s per step, process 1's 1.25 s: on its own clock process 1 would
    # reach the eval point at 4 s at step 4 and the one at 6 s at step 5, and so enter an
    # evaluation's all_reduce while process 0 enters the next step's gradient all_reduce
    out_dir, proc = run_ddp_probe(text_file, tmp_path, ["--max-time", "10", "--num-evals", "5", "--eval-share", "1"],
                                  PROBE_CLOCK_RATES="1.0,1.25")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(r["step"], r["elapsed"]) for r in evals(out_dir) if "val_loss" in r] == \
        [(2, 2), (4, 4), (6, 6), (8, 8), (10, 10)]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(r0["weights"]) == len(r1["weights"]) == 10  # both stop where process 0's clock says
    assert r0["weights"] == r1["weights"]


MAMBA2_TINY = ["--arch", "mamba2", "--headdim", "8", "--d-state", "8"] + without(TINY, "--d-state")


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_compiled_training_follows_the_eager_run(text_file, tmp_path, capsys, arch):
    common = ["--data", text_file, "--max-iters", "6", "--eval-interval", "3"] + (TINY if arch == "mamba" else MAMBA2_TINY)
    run(common + ["--out-dir", str(tmp_path / "eager")], capsys)
    out = run(common + ["--out-dir", str(tmp_path / "compiled"), "--compile"], capsys)
    assert "compiling" in out
    eager = [r["val_loss"] for r in evals(str(tmp_path / "eager")) if "val_loss" in r]
    compiled = [r["val_loss"] for r in evals(str(tmp_path / "compiled")) if "val_loss" in r]
    assert len(eager) == len(compiled) == 2
    for e, c in zip(eager, compiled):
        assert abs(e - c) < 1e-4
    if arch == "mamba":  # the flag reached the model: the fused chunk was compiled
        assert any(fn.__name__ == "_scan_chunk" for fn, _ in mamba_engine._compiled)
    else:
        import mamba2_minimal as m2
        assert m2._compiled_forward.cache_info().currsize > 0


# ------------------------------------------------------------------------------------------------
# The learning-rate schedule and the time budget
# ------------------------------------------------------------------------------------------------

def schedule_args(**kw):
    base = dict(lr=1.0, min_lr=0.1, warmup_iters=4, lr_decay_iters=14, max_time=None)
    return argparse.Namespace(**{**base, **kw})


def test_iteration_schedule_is_linear_warmup_then_cosine_to_min_lr():
    args = schedule_args()
    cosine = lambda r: 0.1 + 0.45 * (1 + math.cos(math.pi * r))  # lr 1 -> min_lr 0.1 over r in [0, 1]
    expected = {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 6: cosine(0.2), 9: 0.55, 13: cosine(0.9), 14: 0.1, 50: 0.1}
    for step, lr in expected.items():
        assert ts.lr_at(args, step, elapsed=123.0) == pytest.approx(lr, abs=1e-12), step


def test_time_schedule_follows_the_fraction_of_the_budget_spent():
    args = schedule_args(max_time=100.0)
    cosine = lambda r: 0.1 + 0.45 * (1 + math.cos(math.pi * r))
    expected = {0.0: 1.0, 10.0: cosine(0.1), 28.0: cosine(0.2 + 0.08), 50.0: 0.55, 91.0: cosine(0.91),
                100.0: 0.1, 130.0: 0.1}
    for elapsed, lr in expected.items():
        assert ts.lr_at(args, step=7, elapsed=elapsed) == pytest.approx(lr, abs=1e-12), elapsed
    # the warmup counts steps, whatever time they took (a first step may compile for a minute):
    # step k ends the warmup's (k+1)/4, times the cosine at the time spent
    for step, elapsed in ((0, 0.0), (0, 30.0), (1, 40.0), (3, 40.0)):
        assert ts.lr_at(args, step, elapsed) == pytest.approx(min(1, (step + 1) / 4) * cosine(elapsed / 100), abs=1e-12)


@pytest.fixture
def lrs(monkeypatch):
    """The learning rate of every optimizer step, read from AdamW itself."""
    seen = []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return seen


def fake_clock(monkeypatch, seconds_per_step, seconds_per_eval=0.0):
    """A clock on which time passes only in training steps and evaluations, as many seconds as given."""
    now = [1000.0]
    real_step, real_evaluate = ts.train_step, ts.evaluate

    def train_step(*a, **k):
        now[0] += seconds_per_step
        return real_step(*a, **k)

    def evaluate(run):
        now[0] += seconds_per_eval
        return real_evaluate(run)

    monkeypatch.setattr(ts, "clock", lambda: now[0])
    monkeypatch.setattr(ts, "train_step", train_step)
    monkeypatch.setattr(ts, "evaluate", evaluate)


def test_time_budget_sets_schedule_evaluations_and_stop(text_file, tmp_path, capsys, monkeypatch, lrs):
    fake_clock(monkeypatch, 1.0)  # every step takes one second
    out_dir = str(tmp_path / "timed")
    args = ["--data", text_file, "--out-dir", out_dir, "--max-time", "10",
            "--num-evals", "5", "--eval-share", "1", "--min-lr", "0.001"] + TINY
    run(args, capsys)
    # step k starts after k seconds: cosine from 0.01 to 0.001 over the 10 s, times the warmup
    # over the first 2 steps (TINY's --warmup-iters)
    expected = [min(1, (k + 1) / 2) * (0.001 + 0.0045 * (1 + math.cos(math.pi * k / 10))) for k in range(10)]
    assert lrs == pytest.approx(expected, abs=1e-15)
    records = evals(out_dir)
    assert [(r["step"], r["elapsed"]) for r in records if "val_loss" in r] == [(2, 2), (4, 4), (6, 6), (8, 8), (10, 10)]
    assert "full_val_loss" in records[-1]
    assert torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)["step"] == 10


def test_a_step_that_passes_several_eval_points_evaluates_once(text_file, tmp_path, capsys, monkeypatch, lrs):
    fake_clock(monkeypatch, 3.0)  # each step passes 1.5 eval points of 2 s
    out_dir = str(tmp_path / "timed")
    run(["--data", text_file, "--out-dir", out_dir, "--max-time", "10", "--num-evals", "5",
         "--eval-share", "1"] + TINY, capsys)
    assert len(lrs) == 4  # 3, 6, 9, 12 s: the fourth step ends past the budget
    assert [r["step"] for r in evals(out_dir) if "val_loss" in r] == [1, 2, 3, 4]


def test_iteration_based_run_ignores_the_clock(text_file, tmp_path, capsys, monkeypatch, lrs):
    fake_clock(monkeypatch, 1000.0)
    out_dir = str(tmp_path / "iters")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "6", "--eval-interval", "3",
         "--lr-decay-iters", "6"] + TINY, capsys)
    cosine = lambda r: 1e-3 + 0.5 * (1 + math.cos(math.pi * r)) * 9e-3
    assert lrs == pytest.approx([5e-3, 1e-2, cosine(0), cosine(0.25), cosine(0.5), cosine(0.75)], abs=1e-15)
    assert [r["step"] for r in evals(out_dir) if "val_loss" in r] == [3, 6]


def test_time_and_iteration_flags_do_not_mix(text_file, tmp_path):
    for extra, match in [(["--max-time", "5", "--max-iters", "5"], "not both"),
                         (["--max-time", "5", "--eval-interval", "5"], "--eval-interval does not apply"),
                         (["--max-iters", "5", "--num-evals", "5"], "--num-evals does not apply"),
                         (["--max-time", "0"], "--max-time must be"),
                         (["--max-time", "nan"], "--max-time must be"),
                         (["--max-time", "5", "--lr-decay-iters", "5"], "--lr-decay-iters does not apply")]:
        with pytest.raises(SystemExit, match=match):
            ts.main(["--data", text_file, "--out-dir", str(tmp_path / "x")] + extra)


def straight_and_interrupted_runs(common, tmp_path, capsys, monkeypatch):
    """A 12 s time-based run on the fake clock, and the same run killed at step 6: their out-dirs."""
    fake_clock(monkeypatch, 1.0)
    straight = str(tmp_path / "straight")
    run(common + ["--out-dir", straight], capsys)
    broken = str(tmp_path / "broken")
    with monkeypatch.context() as m:
        killed_at(m, 6)
        with pytest.raises(KeyboardInterrupt):
            run(common + ["--out-dir", broken], capsys)
    return straight, broken


def test_resume_continues_the_same_time_budget(text_file, tmp_path, capsys, monkeypatch):
    common = ["--data", text_file, "--max-time", "12", "--num-evals", "3", "--eval-share", "1"] + TINY
    straight, broken = straight_and_interrupted_runs(common, tmp_path, capsys, monkeypatch)
    fake_clock(monkeypatch, 1.0)  # a new process: the clock reads anything, only differences count
    out = run(common + ["--out-dir", broken, "--resume"], capsys)
    assert "at step 4" in out
    assert evals(broken) == evals(straight)  # the fake clock makes even "elapsed" equal


def test_resume_takes_the_flags_saved_in_last_pt(text_file, tmp_path, capsys, monkeypatch):
    model = ["--d-model", "16", "--n-layer", "1", "--d-state", "4"]
    flags = ["--max-iters", "20", "--eval-interval", "5", "--block-size", "12", "--batch-size", "6", "--seed", "7",
             "--lr", "0.02", "--warmup-iters", "3", "--eval-iters", "2", "--patience", "9", "--no-sample"]
    straight = str(tmp_path / "straight")
    run(["--data", text_file, "--out-dir", straight] + model + flags, capsys)
    broken = str(tmp_path / "broken")
    with monkeypatch.context() as m:
        killed_at(m, 12)
        with pytest.raises(KeyboardInterrupt):
            run(["--data", text_file, "--out-dir", broken] + model + flags, capsys)
    fake_clock(monkeypatch, 100.0)  # a run that fell back to the (time-based) defaults would end at once
    out = run(["--out-dir", broken, "--resume"], capsys)  # no other flag: all from last.pt, --data too
    assert "at step 10" in out and "note: resuming with" not in out
    assert without_elapsed(evals(broken)) == without_elapsed(evals(straight))
    # a flag given again applies, with a note; the decay length, derived from --max-iters, follows it
    out = run(["--out-dir", broken, "--resume", "--max-iters", "25"], capsys)
    assert "note: resuming with --max-iters 25 (was 20)" in out
    last = torch.load(os.path.join(broken, "last.pt"), weights_only=True)
    assert (last["step"], last["args"]["lr_decay_iters"], last["args"]["batch_size"]) == (25, 25, 6)
    with pytest.raises(SystemExit, match="is an iteration-based run; it cannot resume as the other kind"):
        ts.main(["--out-dir", broken, "--resume", "--max-time", "60"])


def test_a_time_based_run_resumes_on_its_own_budget(text_file, tmp_path, capsys, monkeypatch):
    common = ["--data", text_file, "--max-time", "12", "--num-evals", "3", "--eval-share", "1"] + TINY
    straight, broken = straight_and_interrupted_runs(common, tmp_path, capsys, monkeypatch)
    fake_clock(monkeypatch, 1.0)
    out = run(["--out-dir", broken, "--resume"], capsys)  # not the 300 s default budget
    assert "at step 4" in out
    assert evals(broken) == evals(straight)
    with pytest.raises(SystemExit, match="is a time-based run; it cannot resume as the other kind"):
        ts.main(["--out-dir", broken, "--resume", "--max-iters", "30"])


def test_a_last_pt_without_the_progress_counters_is_a_clear_error(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + TINY, capsys)
    path = os.path.join(out_dir, "last.pt")
    ckpt = torch.load(path, weights_only=True)
    for key in ("bad_evals", "evals_done", "stopped_early"):  # as written before --patience was saved
        del ckpt[key]
    torch.save(ckpt, path)
    with pytest.raises(SystemExit, match=r"lacks \['bad_evals', 'evals_done'\].*cannot continue the run exactly"):
        ts.main(["--out-dir", out_dir, "--resume", "--max-iters", "4"])


# ------------------------------------------------------------------------------------------------
# Independent oracles: the split and the evaluation windows rebuilt here from the text
# ------------------------------------------------------------------------------------------------

def val_windows(text_path, block, n_windows=None, seed=1234):
    """The val split as the trainer defines it (characters sorted into ids, the last 10%), and
    either its fixed random evaluation windows (the first draw of a generator seeded 1234) or,
    with n_windows None, all back-to-back windows of the full-val pass."""
    text = open(text_path, encoding="utf-8").read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    val = data[int(0.9 * len(data)):]
    if n_windows is None:
        starts = torch.arange(0, len(val) - block, block)
    else:
        starts = torch.randint(len(val) - block, (n_windows,), generator=torch.Generator().manual_seed(seed))
    x = torch.stack([val[i:i + block] for i in starts.tolist()])
    y = torch.stack([val[i + 1:i + 1 + block] for i in starts.tolist()])
    return x, y, len(chars)


def checkpoint_loss(path, x, y, vocab):
    """Mean next-character cross-entropy of a saved model on windows (x, y), computed here."""
    ckpt = torch.load(path, weights_only=True)
    model = MambaLM(MambaConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    with torch.no_grad():
        logits = model.eval()(x)[..., :vocab]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


# a run whose val loss, evaluated every step, falls to a best and then rises: patience 3 stops it,
# at step 22 on an AVX-512 CPU and 21 under ATEN_CPU_CAPABILITY=avx2 (rounding steers so unstable a run:
# the tests read the step from the run, and check that it stopped early)
WOBBLY = ["--max-iters", "24", "--eval-interval", "1", "--lr", "0.18", "--min-lr", "0.18", "--patience", "3"]


def without_elapsed(rows):
    """log.jsonl rows minus the wall-clock field: everything else must match between runs."""
    return [{k: v for k, v in r.items() if k != "elapsed"} for r in rows]


def wobbly_run(text_file, out_dir, capsys, extra=()):
    run(["--data", text_file, "--out-dir", out_dir] + without(TINY, "--lr") + WOBBLY + list(extra), capsys)


def test_best_pt_holds_the_best_model_and_full_val_is_its_loss(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    wobbly_run(text_file, out_dir, capsys)
    rows = evals(out_dir)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) < 24 and val[-1] > min(val)  # the premise: an early stop after the best
    x, y, vocab = val_windows(text_file, block=16, n_windows=2 * 4)  # eval_iters x batch
    assert checkpoint_loss(os.path.join(out_dir, "best.pt"), x, y, vocab) == pytest.approx(min(val), abs=1e-5)
    assert checkpoint_loss(os.path.join(out_dir, "last.pt"), x, y, vocab) == pytest.approx(val[-1], abs=1e-5)
    x, y, _ = val_windows(text_file, block=16)
    assert rows[-1]["full_val_loss"] == pytest.approx(checkpoint_loss(os.path.join(out_dir, "best.pt"), x, y, vocab),
                                                      abs=1e-5)


def test_best_pt_follows_the_lowest_val_loss_after_a_partial_recovery(text_file, tmp_path, capsys, monkeypatch):
    # a curve that falls to its best, then recovers part of the way (2.2 is better than the last
    # eval's 2.5 but not than the best 2.0): only the lowest loss so far may count as improved
    val = iter([3.0, 2.0, 2.5, 2.2, 2.6, 2.7, 2.8, 2.9])
    calls = []

    def scripted(*args, **kwargs):  # evaluate() asks for train, then val; finish() for the full val
        calls.append(1)
        return 1.0 if len(calls) % 2 else next(val, 0.5)

    monkeypatch.setattr(ts, "mean_loss", scripted)
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "8", "--eval-interval", "1", "--patience", "3"]
        + TINY, capsys)
    best = torch.load(os.path.join(out_dir, "best.pt"), weights_only=True)
    last = torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)
    assert (best["step"], best["best_val"]) == (2, 2.0)
    assert last["step"] == 5  # three evaluations (2.5, 2.2, 2.6) without beating 2.0


def killed_at(monkeypatch, at_step):
    """Make the next run die (KeyboardInterrupt) as it starts the step numbered at_step + 1."""
    real_get_batch = ts.get_batch

    def get_batch(split, step, *a):
        if step == at_step:
            raise KeyboardInterrupt
        return real_get_batch(split, step, *a)

    monkeypatch.setattr(ts, "get_batch", get_batch)


def stopped_at(out_dir):
    """The step a wobbly run stopped at, early (before WOBBLY's 24 steps, 3 evaluations after its best)."""
    rows = [r for r in evals(out_dir) if "val_loss" in r]
    best = min(range(len(rows)), key=lambda i: rows[i]["val_loss"])
    assert rows[-1]["step"] < 24 and rows[-1]["step"] == rows[best]["step"] + 3, rows  # the premise
    return rows[-1]["step"]


def test_resume_after_a_kill_gives_the_same_log_and_the_same_early_stop(text_file, tmp_path, capsys, monkeypatch):
    straight = str(tmp_path / "straight")
    wobbly_run(text_file, straight, capsys)
    broken = str(tmp_path / "broken")
    with monkeypatch.context() as m:
        killed_at(m, stopped_at(straight) - 1)  # after the eval before the stop: two without improvement
        with pytest.raises(KeyboardInterrupt):
            wobbly_run(text_file, broken, capsys)
    wobbly_run(text_file, broken, capsys, ["--resume"])
    assert without_elapsed(evals(broken)) == without_elapsed(evals(straight))
    x, y, vocab = val_windows(text_file, block=16, n_windows=8)
    for name in ("best.pt", "last.pt"):
        assert checkpoint_loss(os.path.join(broken, name), x, y, vocab) == \
            checkpoint_loss(os.path.join(straight, name), x, y, vocab), name


def test_a_run_that_stopped_early_stays_stopped_on_resume(text_file, tmp_path, capsys, monkeypatch):
    straight = str(tmp_path / "straight")
    wobbly_run(text_file, straight, capsys)
    stop = stopped_at(straight)
    broken = str(tmp_path / "broken")
    with monkeypatch.context() as m:  # killed after the early stop, before the end of the run
        m.setattr(ts, "finish", lambda run: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            wobbly_run(text_file, broken, capsys)
    wobbly_run(text_file, broken, capsys, ["--resume"])
    assert without_elapsed(evals(broken)) == without_elapsed(evals(straight))
    before = {name: open(os.path.join(straight, name), "rb").read() for name in ("best.pt", "last.pt")}
    out = run(["--data", text_file, "--out-dir", straight, "--resume"], capsys)  # a finished run, again
    assert f"stopped early at step {stop}: nothing left to train" in out and "\nstep " not in out
    assert {name: open(os.path.join(straight, name), "rb").read() for name in before} == before
    assert [r["step"] for r in evals(straight)][-2:] == [stop, stop]  # the last eval and the full-val row


def test_a_kill_between_log_row_and_checkpoint_repeats_no_row(text_file, tmp_path, capsys, monkeypatch):
    straight = str(tmp_path / "straight")
    wobbly_run(text_file, straight, capsys)
    broken = str(tmp_path / "broken")
    real_save = ts.atomic_save

    def dies_before_saving_last_at_step_20(obj, path):
        if obj["step"] == 20 and path.endswith("last.pt"):
            raise KeyboardInterrupt  # the row of step 20 is in log.jsonl, last.pt is still step 19
        real_save(obj, path)

    with monkeypatch.context() as m:
        m.setattr(ts, "atomic_save", dies_before_saving_last_at_step_20)
        with pytest.raises(KeyboardInterrupt):
            wobbly_run(text_file, broken, capsys)
    assert [r["step"] for r in evals(broken)][-2:] == [19, 20]
    out = run(["--data", text_file, "--out-dir", broken, "--resume"] + without(TINY, "--lr") + WOBBLY, capsys)
    assert "at step 19" in out
    assert without_elapsed(evals(broken)) == without_elapsed(evals(straight))


def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_no_temporary_file(text_file, tmp_path, capsys,
                                                                                    monkeypatch):
    out_dir = str(tmp_path / "run")
    real_save = torch.save

    def dies_while_writing(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 20 and "last.pt" in str(f):
            with open(f, "wb") as half:
                half.write(b"PK\x03\x04 half a zip")  # the kill lands in the middle of the write
            raise KeyboardInterrupt
        real_save(obj, f, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(torch, "save", dies_while_writing)
        with pytest.raises(KeyboardInterrupt):
            wobbly_run(text_file, out_dir, capsys)
    assert torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)["step"] == 19
    [tmp] = [f for f in os.listdir(out_dir) if ".tmp" in f]
    os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, "last.pt.tmp999999"))  # the killed process's
    out = run(["--data", text_file, "--out-dir", out_dir, "--resume"] + without(TINY, "--lr") + WOBBLY, capsys)
    assert "at step 19" in out
    assert not [f for f in os.listdir(out_dir) if ".tmp" in f]


def test_a_new_run_refuses_an_out_dir_holding_a_run_and_leaves_it_as_it_was(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + TINY, capsys)
    before = {name: open(os.path.join(out_dir, name), "rb").read() for name in os.listdir(out_dir)}
    assert sorted(before) == ["best.pt", "last.pt", "log.jsonl"]
    for name in before:  # any one of the run's files is a run
        folder = tmp_path / f"only_{name}"
        folder.mkdir()
        (folder / name).write_bytes(before[name])
        with pytest.raises(SystemExit, match=f"holds an earlier run \\({name}\\): give --resume to continue it, "
                                             f"--overwrite to replace it, or another --out-dir"):
            ts.main(["--data", text_file, "--out-dir", str(folder), "--max-iters", "2"] + TINY)
    with pytest.raises(SystemExit, match="--resume continues the run in --out-dir, --overwrite replaces it"):
        ts.main(["--data", text_file, "--out-dir", out_dir, "--resume", "--overwrite"])
    assert {name: open(os.path.join(out_dir, name), "rb").read() for name in os.listdir(out_dir)} == before


def test_an_overwriting_run_never_reads_an_earlier_runs_files(text_file, tmp_path, capsys, monkeypatch):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"]
        + TINY + ["--d-model", "24"], capsys)  # an earlier run with a bigger model
    stray = os.path.join(out_dir, "last.pt.tmp4242")
    open(stray, "wb").write(b"left by a killed save")
    # the new run diverges at once: it must stop with a clear error, and not end on (or report,
    # or sample from) the earlier run's best.pt
    with monkeypatch.context() as m:
        m.setattr(ts, "loss_fn", lambda *a: torch.tensor(float("nan"), requires_grad=True))
        with pytest.raises(SystemExit, match="training loss is nan at step 1"):
            run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "4", "--eval-interval", "2", "--overwrite"]
                + TINY, capsys)
    assert sorted(os.listdir(out_dir)) == []
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + TINY, capsys)
    assert [r["step"] for r in evals(out_dir)] == [2, 2]  # one eval row and the final row, nothing older
    assert torch.load(os.path.join(out_dir, "best.pt"), weights_only=True)["config"]["d_model"] == 16


def test_a_nan_val_loss_stops_the_run(text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ts, "mean_loss", lambda *a: float("nan"))
    with pytest.raises(SystemExit, match="val loss is nan at step 2"):
        run(["--data", text_file, "--out-dir", str(tmp_path / "r"), "--max-iters", "4", "--eval-interval", "2"]
            + TINY, capsys)


class RunsCode:
    """Unpickling this object opens (creates) a file: what a hostile checkpoint could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_checkpoints_are_loaded_without_running_their_pickle(text_file, tmp_path, capsys):
    proof = tmp_path / "proof"
    torch.save({"x": RunsCode(str(proof))}, tmp_path / "proof.pt")
    torch.load(tmp_path / "proof.pt", weights_only=False)
    assert proof.exists()  # the crafted file does run code when fully unpickled
    marker = tmp_path / "marker"
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    hostile = {"model": RunsCode(str(marker)), "config": {}, "vocab": "abc", "step": 1}
    for name in ("best.pt", "last.pt"):
        torch.save(hostile, out_dir / name)
    with pytest.raises(SystemExit, match="cannot load checkpoint .*best.pt"):
        ts.main(["--sample", "--out-dir", str(out_dir)])
    with pytest.raises(SystemExit, match="cannot load checkpoint .*last.pt"):
        ts.main(["--data", text_file, "--out-dir", str(out_dir), "--resume"] + TINY)
    assert not marker.exists()


def test_resume_from_a_truncated_checkpoint_is_a_clear_error(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + TINY, capsys)
    path = os.path.join(out_dir, "last.pt")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    with pytest.raises(SystemExit, match="cannot load checkpoint .*last.pt: it is truncated"):
        ts.main(["--data", text_file, "--out-dir", out_dir, "--resume", "--max-iters", "4"] + TINY)


@pytest.mark.parametrize("extra, match", [
    (["--d-state", "0"], "--d-state must be at least 1, got 0"),
    (["--lr=-1e-3"], "--lr must be a positive finite number"),
    (["--lr", "nan"], "--lr must be a positive finite number"),
    (["--lr", "inf"], "--lr must be a positive finite number"),
    (["--min-lr=-1"], "--min-lr must be a finite number >= 0"),
    (["--patience=-1"], "--patience must be 0 or more"),
    (["--grad-clip", "nan"], "--grad-clip must be a finite number >= 0"),
    (["--lr", "1e300"], "--lr must be a positive finite number .at most float32's"),  # AdamW's fp32 overflowed
    (["--seed", str(10 ** 14)], r"--seed must be in \[0, 2\*\*32\)"),  # the batch seeds overflowed int64
    (["--device", "foo"], "--device foo is not a device name"),
    (["--device", "meta"], "--device meta: the trainer runs on cpu, cuda or mps"),
    (["--device", "cuda:7"], r"--device cuda:7: torch finds \d cuda device"),
])
def test_bad_numbers_are_refused_at_the_start(text_file, tmp_path, extra, match):
    with pytest.raises(SystemExit, match=match):
        ts.main(["--data", text_file, "--out-dir", str(tmp_path / "r")] + TINY + extra)
    assert not os.path.exists(tmp_path / "r")


def test_bad_data_files_are_clear_errors(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 10)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Ça va très bien, merci.\n".encode("latin-1") * 100)
    for path, match in [(binary, "holds NUL bytes: a binary file"), (latin1, "is not UTF-8 text"),
                        (tmp_path, "is a directory; expected a UTF-8 text file")]:
        with pytest.raises(SystemExit, match=match):
            ts.main(["--data", str(path), "--out-dir", str(tmp_path / "r")] + TINY)


def test_an_out_dir_that_cannot_be_written_fails_before_training(text_file, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    with pytest.raises(SystemExit, match="is a file; expected a directory"):
        ts.main(["--data", text_file, "--out-dir", str(a_file)] + TINY)
    with pytest.raises(SystemExit, match="cannot write to --out-dir"):
        ts.main(["--data", text_file, "--out-dir", str(a_file / "sub")] + TINY)
    assert capsys.readouterr().out == ""  # not one step ran
    if os.geteuid() != 0:  # root writes into read-only directories
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(SystemExit, match="cannot write to --out-dir"):
            ts.main(["--data", text_file, "--out-dir", str(ro)] + TINY)


@pytest.mark.parametrize("extra, match", [
    (["--temperature=-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--top-k", "0"], "--top-k must be at least 1"),
    (["--num-chars=-5"], "--num-chars must be 0 or more"),
])
def test_bad_sampling_arguments_are_refused_before_the_prompt_is_printed(text_file, tmp_path, capsys, extra, match):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + TINY, capsys)
    with pytest.raises(SystemExit, match=match):
        ts.main(["--sample", "--out-dir", out_dir, "--prompt", "First"] + extra)
    assert capsys.readouterr().out == ""


def test_a_text_without_a_newline_trains_and_samples(tmp_path, capsys):
    text = tmp_path / "one_line.txt"
    text.write_text("to be or not to be, that is the question; " * 60)
    out_dir = str(tmp_path / "run")
    out = run(["--data", str(text), "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"]
              + without(TINY, "--no-sample"), capsys)  # the end-of-run sample starts from " ", the first character
    assert out.split("-" * 80 + "\n")[1].startswith(" ") and len(out.split("-" * 80 + "\n")[1]) == 1 + 300 + 1
    out = run(["--sample", "--out-dir", out_dir, "--num-chars", "20"], capsys)
    assert out.startswith(" ") and len(out) == 1 + 20 + 1


def test_a_checkpoint_that_contradicts_itself_is_a_clear_error(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + TINY, capsys)
    ckpt = torch.load(os.path.join(out_dir, "best.pt"), weights_only=True)
    torch.save({**ckpt, "config": {**ckpt["config"], "d_model": 24}}, tmp_path / "other_size.pt")
    with pytest.raises(SystemExit, match="other_size.pt's weights do not match its own config"):
        ts.main(["--sample", "--checkpoint", str(tmp_path / "other_size.pt")])
    torch.save({**ckpt, "arch": "rnn"}, tmp_path / "rnn.pt")
    with pytest.raises(SystemExit, match="holds an unknown architecture 'rnn'"):
        ts.main(["--sample", "--checkpoint", str(tmp_path / "rnn.pt")])


def test_resume_skips_log_lines_with_damaged_bytes(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    common = ["--data", text_file, "--out-dir", out_dir, "--eval-interval", "2"] + TINY
    run(common + ["--max-iters", "2"], capsys)
    with open(os.path.join(out_dir, "log.jsonl"), "ab") as f:
        f.write(b'{"step": 3, "val_loss": 1.0\xff\xfe}\n\xff\n')  # not UTF-8: a disk fault
    run(common + ["--max-iters", "4", "--resume"], capsys)
    assert [(r["step"], "val_loss" in r) for r in evals(out_dir)] == [(2, True), (4, True), (4, False)]


def test_the_batch_windows_depend_on_the_rank(monkeypatch):
    args = argparse.Namespace(seed=1337, block_size=8, batch_size=6)
    split = torch.arange(10_000)
    monkeypatch.setattr(ts, "RANK", 0)
    x0, _ = ts.get_batch(split, 5, args, "cpu")
    monkeypatch.setattr(ts, "RANK", 1)
    x1, _ = ts.get_batch(split, 5, args, "cpu")
    x1_again, _ = ts.get_batch(split, 5, args, "cpu")
    assert torch.equal(x1, x1_again)  # a function of (seed, rank, step): resumable
    assert not torch.equal(x0[:, 0], x1[:, 0])  # each process trains on its own windows


def test_cuda_batches_are_pinned_and_copied_without_waiting(monkeypatch):
    # a blocking copy from pageable memory would make the loop wait for the GPU at every step;
    # a CPU-only build has no CUDA device, so the two calls are recorded instead of made
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, **kw: calls.append((str(device), kw)) or self)
    x, y = ts.windows(torch.arange(100), torch.tensor([3, 50]), 8, torch.device("cuda"))
    monkeypatch.undo()
    assert calls == ["pin", ("cuda", {"non_blocking": True})] * 2
    assert torch.equal(x, torch.stack([torch.arange(3, 11), torch.arange(50, 58)]))
    assert torch.equal(y, x + 1)
    if torch.cuda.is_available():  # and the real copy, where there is a GPU
        x_gpu, y_gpu = ts.windows(torch.arange(100), torch.tensor([3, 50]), 8, torch.device("cuda"))
        assert x_gpu.is_cuda and torch.equal(x_gpu.cpu(), x) and torch.equal(y_gpu.cpu(), y)


# ------------------------------------------------------------------------------------------------
# The architectures: Mamba, Mamba-2 and the GPT yardstick on the same data, windows and log
# ------------------------------------------------------------------------------------------------

def defaults_for(argv):
    args = ts.parse_args(argv)
    ts.fill_defaults(args, torch.device("cpu"))
    return args


def test_gpt_defaults_are_nanogpts_readme_cpu_run_at_the_swept_shape():
    args = defaults_for(["--arch", "gpt"])
    nanogpt = dict(block_size=64, batch_size=12, lr=1e-3, min_lr=1e-4,
                   beta2=0.99, weight_decay=0.1, warmup_iters=100, grad_clip=1.0, eval_iters=20)
    assert {k: getattr(args, k) for k in nanogpt} == nanogpt
    assert (args.n_layer, args.n_head, args.d_model) == (2, 6, 192)  # python -m bench sweep's winner at 300 s
    assert (args.max_time, args.max_iters) == (300.0, None)  # the same budget as every model, schedule fitted
    readme = defaults_for(["--arch", "gpt", "--n-layer", "4", "--n-head", "4", "--d-model", "128",
                           "--max-iters", "2000"])  # nanoGPT's README run itself
    assert (readme.n_layer, readme.n_head, readme.d_model) == (4, 4, 128)
    assert (readme.max_iters, readme.lr_decay_iters, readme.max_time) == (2000, 2000, None)
    mamba = defaults_for([])  # the CPU default measured in the README: 5 minutes at d_state 2
    assert (mamba.arch, mamba.d_state, mamba.beta2, mamba.lr) == ("mamba", 2, 0.95, 6e-3)
    assert (mamba.max_time, mamba.max_iters) == (300.0, None)
    assert defaults_for(["--max-iters", "7"]).max_time is None  # asking for steps makes it iteration-based
    for argv, match in [(["--arch", "gpt", "--d-state", "8"], "--d-state does not apply to --arch gpt"),
                        (["--headdim", "8"], "--headdim does not apply to --arch mamba"),
                        (["--arch", "gpt", "--compile"], "--compile does not apply to --arch gpt"),
                        (["--n-head", "2"], "--n-head does not apply to --arch mamba")]:
        with pytest.raises(SystemExit, match=match):
            defaults_for(argv)


def test_the_gpt_yardstick_is_causal_and_nanogpt_sized():
    from gpt_minimal import GPTConfig, TinyGPT
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=65))
    assert sum(p.numel() for p in model.parameters()) - model.pos.weight.numel() == 795_904  # nanoGPT's "0.80M"
    ids = torch.randint(0, 65, (2, 20))
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 65
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :12], b[:, :12])  # no position sees a later token
    assert not torch.allclose(a[:, 12:], b[:, 12:])


GPT_TINY = ["--arch", "gpt", "--d-model", "16", "--n-layer", "1", "--n-head", "2", "--block-size", "16",
            "--batch-size", "4", "--eval-iters", "2", "--warmup-iters", "2", "--lr", "1e-2", "--lr-decay-iters", "1000",
            "--log-interval", "1", "--dtype", "fp32", "--no-sample"]


def trains_resumes_and_samples(arch, tiny, build, text_file, tmp_path, capsys, monkeypatch):
    """What every --arch must do, checked the same way: learn, log val losses that its saved best
    model reproduces on windows rebuilt here, resume into the uninterrupted run's exact log with
    the architecture read from the checkpoint, and sample. Returns the best checkpoint."""
    common = ["--data", text_file, "--max-iters", "20", "--eval-interval", "5"] + tiny
    straight = str(tmp_path / "straight")
    run(common + ["--out-dir", straight], capsys)
    rows = evals(straight)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 4 and val[-1] < val[0] - 0.3
    ckpt = torch.load(os.path.join(straight, "best.pt"), weights_only=True)
    assert ckpt["arch"] == arch
    model = build(ckpt["config"])
    model.load_state_dict(ckpt["model"])
    x, y, vocab = val_windows(text_file, block=16, n_windows=8)
    with torch.no_grad():
        logits = model.eval()(x)[..., :vocab]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert loss == pytest.approx(min(val), abs=1e-5)
    broken = str(tmp_path / "broken")
    with monkeypatch.context() as m:
        killed_at(m, 12)
        with pytest.raises(KeyboardInterrupt):
            run(common + ["--out-dir", broken], capsys)
    run(["--data", text_file, "--out-dir", broken, "--resume", "--max-iters", "20", "--eval-interval", "5"]
        + without(tiny, "--arch"), capsys)
    assert without_elapsed(evals(broken)) == without_elapsed(rows)
    out = run(["--sample", "--out-dir", straight, "--prompt", "First", "--num-chars", "40"], capsys)
    assert out.startswith("First") and len(out) == len("First") + 40 + 1
    if arch != "mamba":
        with pytest.raises(SystemExit, match=f"holds a {arch} model, not mamba"):
            ts.main(["--data", text_file, "--out-dir", broken, "--resume", "--arch", "mamba"])
    return ckpt


def test_gpt_trains_resumes_and_samples_on_the_same_windows(text_file, tmp_path, capsys, monkeypatch):
    from gpt_minimal import GPTConfig, TinyGPT
    ckpt = trains_resumes_and_samples("gpt", GPT_TINY, lambda config: TinyGPT(GPTConfig(**config)),
                                      text_file, tmp_path, capsys, monkeypatch)
    assert ckpt["config"]["n_head"] == 2
    groups = ckpt["optimizer"]["param_groups"]
    assert [(tuple(g["betas"]), g["weight_decay"]) for g in groups] == [((0.9, 0.99), 0.1), ((0.9, 0.99), 0.0)]


def test_mamba2_trains_resumes_and_samples(text_file, tmp_path, capsys, monkeypatch):
    pytest.importorskip("mamba2_minimal")
    from mamba2_minimal import Mamba2Config, Mamba2LM
    ckpt = trains_resumes_and_samples("mamba2", MAMBA2_TINY, lambda config: Mamba2LM(Mamba2Config(**config)),
                                      text_file, tmp_path, capsys, monkeypatch)
    assert (ckpt["config"]["headdim"], ckpt["config"]["d_state"], ckpt["config"]["d_model"]) == (8, 8, 16)


def test_mamba2_training_step_under_bf16_autocast_follows_the_float64_loop(monkeypatch):
    # the CUDA default's situation on a CPU: bf16 autocast, and a block of several SSD chunks
    # (here block 96 and the trainer's chunk of 64: two chunks, the second one padded)
    import copy

    import mamba2_minimal as m2
    from test_mamba2 import reference_ssd
    args = ts.parse_args(["--arch", "mamba2", "--d-model", "32", "--n-layer", "2", "--d-state", "8",
                          "--headdim", "16", "--block-size", "96", "--grad-clip", "0"])
    ts.fill_defaults(args, torch.device("cpu"))
    torch.manual_seed(0)
    model = ts.build_model("mamba2", ts.model_kwargs(args, 20))
    assert model.cfg.chunk_size == 64
    ids = torch.randint(0, 20, (2, 97), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]  # (2, 96) each

    reference = copy.deepcopy(model).double()

    def loop(x, dt, A, B, C, chunk_size, D=None, h0=None, return_last_state=False, scan_backend="auto"):
        y, h = reference_ssd(x, dt, A, B, C, D, h0)
        return (y, h) if return_last_state else y

    with monkeypatch.context() as m:
        m.setattr(m2, "ssd", loop)  # the oracle: the per-head float64 loop in every layer
        loss_ref = ts.loss_fn(reference, x, y, 20, contextlib.nullcontext())
        grads_ref = torch.autograd.grad(loss_ref, list(reference.parameters()))

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = ts.train_step(model, optimizer, x, y, 20, args, ts.precision(torch.device("cpu"), "bf16")[0])
    # bf16 matmuls keep about 3 significant digits
    assert abs(loss.item() - loss_ref.item()) < 1e-2 * loss_ref.item()
    for (name, p), g_ref in zip(model.named_parameters(), grads_ref):
        assert (p.grad.double() - g_ref).norm() <= 0.05 * g_ref.norm() + 1e-6, name


def test_dtype_defaults_to_bf16_where_the_gpu_has_it_fp16_on_older_gpus_fp32_elsewhere(monkeypatch):
    asked = []

    def bf16_supported(has_it):
        return lambda including_emulation=True: asked.append(including_emulation) or has_it

    monkeypatch.setattr(ts, "cpu_computes_in_bf16", lambda: False)  # the CPU's own case: below
    assert ts.default_dtype(torch.device("cpu"), "mamba") == "fp32" and defaults_for([]).dtype == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16_supported(True))
    args = ts.parse_args([])
    ts.fill_defaults(args, torch.device("cuda"))
    assert args.dtype == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16_supported(False))  # a T4 or V100
    assert ts.default_dtype(torch.device("cuda"), "mamba") == "fp16"
    assert asked == [False, False]  # emulated bf16 (slow) does not count
    args = ts.parse_args(["--dtype", "fp32"])
    ts.fill_defaults(args, torch.device("cuda"))
    assert args.dtype == "fp32"
    with pytest.raises(SystemExit):
        ts.parse_args(["--dtype", "float16"])


def test_dtype_sets_autocast_and_fp16_trains_with_a_loss_scaler(monkeypatch):
    cpu = torch.device("cpu")
    autocast, scaler = ts.precision(cpu, "fp32")
    with autocast:
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32 and scaler is None
    autocast, scaler = ts.precision(cpu, "bf16")
    with autocast:
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16 and scaler is None
    autocast, scaler = ts.precision(cpu, "fp16")
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() > 1
    with monkeypatch.context() as m:  # a device without autocast: a clear error, not an fp32 run
        m.setattr(torch.amp, "is_autocast_available", lambda device_type: False)
        with pytest.raises(SystemExit, match="--dtype bf16 needs torch.autocast on cpu"):
            ts.precision(cpu, "bf16")
    # one fp16 step with the scaler: the clipped gradients are the true ones, not the scaled ones
    args = ts.parse_args(["--d-model", "16", "--n-layer", "1", "--d-state", "4", "--grad-clip", "0.5"])
    ts.fill_defaults(args, cpu)
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layer=1, vocab_size=20, d_state=4))
    ids = torch.randint(0, 20, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    reference = MambaLM(MambaConfig(d_model=16, n_layer=1, vocab_size=20, d_state=4)).double()
    reference.load_state_dict(model.state_dict())
    loss_ref = ts.loss_fn(reference, x, y, 20, contextlib.nullcontext())
    grads_ref = torch.autograd.grad(loss_ref, list(reference.parameters()))
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads_ref))
    assert norm > 0.5  # so that clipping acts
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = ts.train_step(model, optimizer, x, y, 20, args, autocast, scaler)
    assert abs(loss.item() - loss_ref.item()) < 1e-2 * loss_ref.item()
    for (name, p), g_ref in zip(model.named_parameters(), grads_ref):
        assert (p.grad.double() - g_ref * 0.5 / norm).norm() <= 0.02 * (g_ref * 0.5 / norm).norm() + 1e-6, name


def test_an_autocast_that_torch_turns_off_is_an_error_not_an_fp32_run(monkeypatch):
    # where torch has no autocast of that dtype on the device it warns and hands back a disabled
    # context, which changes nothing: the run would train in fp32 under a bf16 or fp16 label
    real = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda device_type, dtype=None, enabled=True:
                        real(device_type, dtype=dtype, enabled=False))
    for dtype in ("bf16", "fp16"):
        with pytest.raises(SystemExit, match=f"has no {dtype} autocast on cpu; use --dtype fp32"):
            ts.precision(torch.device("cpu"), dtype)


def test_an_fp16_run_keeps_its_loss_scale_in_the_checkpoint(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "fp16")
    out = run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "4", "--eval-interval", "2"]
              + TINY + ["--dtype", "fp16"], capsys)
    assert "thread(s), fp16" in out
    assert all(math.isfinite(r["val_loss"]) for r in evals(out_dir) if "val_loss" in r)
    ckpt = torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)
    assert ckpt["args"]["dtype"] == "fp16" and ckpt["scaler"]["scale"] > 1


# ------------------------------------------------------------------------------------------------
# --compile where no compiler works
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--compile", "--compile-model", "mamba2 --compile"])
def test_a_failing_compiler_falls_back_to_eager_with_a_note(text_file, tmp_path, capsys, monkeypatch, flag):
    # The fallback runs the very code of an eager run, so the two logs are equal to the bit: the
    # whole model eagerly (--compile-model), Mamba-2's mixer eagerly (its compiled function calls the
    # eager one), and for Mamba's --compile the fused path eagerly, which is --scan-backend fused:
    # the same functions (mamba_engine._maybe_compiled returns _scan_chunk itself when not compiling).
    # The default eager Mamba runs another scan, equal to the fused one only to rounding.
    import mamba2_minimal as m2

    def broken_compile(fn, *a, **k):  # what a machine without a C++ compiler does at the first call
        def fails(*args, **kwargs):
            raise RuntimeError("InductorError: CppCompileError: no working C++ compiler found\nmore")
        if isinstance(fn, torch.nn.Module):
            return type("Broken", (torch.nn.Module,), {"forward": lambda self, *a, **k: fails()})()
        return fails

    tiny = MAMBA2_TINY if flag.startswith("mamba2") else TINY
    common = ["--data", text_file, "--max-iters", "4", "--eval-interval", "2"] + tiny
    run(common + ["--out-dir", str(tmp_path / "eager")] + (["--scan-backend", "fused"] if flag == "--compile" else []),
        capsys)
    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(mamba_engine, "_compiled", {})  # no compiled function from an earlier test
    monkeypatch.setattr(m2, "_compiled_forward", functools.cache(m2._compiled_forward.__wrapped__))
    if flag == "--compile-model":  # the trainer's torch.compile of the whole model: the trainer falls back
        out = run(common + ["--out-dir", str(tmp_path / "fallback"), flag.split()[-1]], capsys)
        notes = [l for l in out.splitlines() if l.startswith("note: torch.compile failed")]
        assert len(notes) == 1 and "no working C++ compiler found); training eagerly" in notes[0]
    else:  # --compile: the model's compiled functions fall back themselves (mamba_engine.CompiledOrEager)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(common + ["--out-dir", str(tmp_path / "fallback"), flag.split()[-1]], capsys)
        notes = [str(w.message) for w in caught if issubclass(w.category, mamba_engine.CompileFallbackWarning)]
        assert len(notes) == 1 and "no working C++ compiler found); it runs eagerly from now on" in notes[0], notes
    assert without_elapsed(evals(str(tmp_path / "fallback"))) == without_elapsed(evals(str(tmp_path / "eager")))


@pytest.mark.parametrize("flag", ["--compile-model", "mamba2 --compile"])
def test_a_compiler_that_fails_only_at_the_first_evaluation_falls_back_before_training(
        text_file, tmp_path, capsys, monkeypatch, flag):
    # an evaluation runs without autograd, which compiles graphs of its own: the one-time check
    # before the loop runs both kinds, so such a failure is caught there, not at the first evaluation.
    # Mamba-2's --compile compiles its mixer for training only: its evaluation runs eagerly, and
    # such a compiler never fails it (Mamba-1's --compile is left out: its compiled chunk runs
    # inside an autograd Function, without autograd in training too)
    import mamba2_minimal as m2

    def compile_failing_without_grad(fn, *a, **k):
        def call(*args, **kwargs):
            if not torch.is_grad_enabled():
                raise RuntimeError("InductorError: a graph without autograd does not compile")
            return fn(*args, **kwargs)
        if isinstance(fn, torch.nn.Module):
            return type("Compiled", (torch.nn.Module,), {"forward": lambda self, *a, **k: call(*a, **k)})()
        return call

    common = ["--data", text_file, "--max-iters", "4", "--eval-interval", "2"] + \
        (MAMBA2_TINY if flag.startswith("mamba2") else TINY)
    run(common + ["--out-dir", str(tmp_path / "eager")], capsys)
    monkeypatch.setattr(torch, "compile", compile_failing_without_grad)
    monkeypatch.setattr(m2, "_compiled_forward", functools.cache(m2._compiled_forward.__wrapped__))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(common + ["--out-dir", str(tmp_path / "fallback"), flag.split()[-1]], capsys)
    notes = [l for l in out.splitlines() if l.startswith("note: torch.compile failed")]
    if flag == "--compile-model":
        assert len(notes) == 1 and out.index(notes[0]) < out.index("step 1/4")
    else:
        assert not notes and not [w for w in caught if "torch.compile failed" in str(w.message)]
    assert without_elapsed(evals(str(tmp_path / "fallback"))) == without_elapsed(evals(str(tmp_path / "eager")))


def test_an_error_after_the_first_step_is_not_swallowed(text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **k: fn)  # a "compiler" that works, instantly
    monkeypatch.setattr(mamba_engine, "_compiled", {})
    real_step, calls = ts.train_step, []

    def fails_once_at_step_3(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a real bug")  # a retry would succeed: it must not be tried
        return real_step(*args)

    monkeypatch.setattr(ts, "train_step", fails_once_at_step_3)
    with pytest.raises(RuntimeError, match="a real bug"):
        run(["--data", text_file, "--out-dir", str(tmp_path / "r"), "--max-iters", "4", "--compile"] + TINY, capsys)


MAMBA3_TINY = ["--arch", "mamba3", "--headdim", "8", "--d-state", "8"] + without(TINY, "--d-state")


@pytest.mark.parametrize("mimo", [[], ["--mimo-rank", "2"]], ids=["siso", "mimo2"])
def test_mamba3_trains_resumes_and_samples(text_file, tmp_path, capsys, monkeypatch, mimo):
    pytest.importorskip("mamba3_minimal")
    from mamba3_minimal import Mamba3Config, Mamba3LM
    ckpt = trains_resumes_and_samples("mamba3", MAMBA3_TINY + mimo, lambda config: Mamba3LM(Mamba3Config(**config)),
                                      text_file, tmp_path, capsys, monkeypatch)
    config = ckpt["config"]
    assert (config["headdim"], config["d_state"], config["is_mimo"], config["mimo_rank"]) == \
        (8, 8, bool(mimo), 2 if mimo else 1)


def test_a_mamba3_checkpoint_saved_before_the_heavy_tail_A_samples_with_softplus(text_file, tmp_path, capsys):
    # checkpoints written before Mamba-3's A followed official main have no A_activation in their
    # config; their weights were trained with -softplus(dd_A), and must run with it
    out_dir = str(tmp_path / "m3")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + MAMBA3_TINY, capsys)
    path = os.path.join(out_dir, "best.pt")
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["config"]["A_activation"] == "heavy_tail"  # what a checkpoint of today says
    del ckpt["config"]["A_activation"]
    torch.save(ckpt, path)
    model, _ = ts.load_for_sampling(ts.parse_args(["--sample", "--out-dir", out_dir]), torch.device("cpu"))
    assert model.cfg.A_activation == "softplus"


def test_mamba3_defaults_and_its_flags():
    args = defaults_for(["--arch", "mamba3"])  # the CPU default chosen with python -m bench mamba3
    assert (args.d_state, args.headdim, args.mimo_rank, args.max_time) == (32, 64, None, 300.0)
    for argv, match in [(["--arch", "mamba2", "--mimo-rank", "2"], "--mimo-rank does not apply to --arch mamba2"),
                        (["--arch", "mamba3", "--compile"], "--compile does not apply to --arch mamba3"),
                        (["--arch", "mamba3", "--mimo-rank", "0"], "--mimo-rank must be at least 1")]:
        with pytest.raises(SystemExit, match=match):
            defaults_for(argv)


# ------------------------------------------------------------------------------------------------
# Flags that only some models have, and the fused path's
# ------------------------------------------------------------------------------------------------

def test_model_flags_of_another_arch_or_of_the_unused_fused_path_are_refused():
    for argv, match in [(["--arch", "mamba2", "--no-recompute"], "--no-recompute does not apply to --arch mamba2"),
                        (["--arch", "mamba3", "--no-recompute"], "--no-recompute does not apply to --arch mamba3"),
                        (["--arch", "gpt", "--no-recompute"], "--no-recompute does not apply to --arch gpt"),
                        (["--arch", "gpt", "--chunk-size", "8"], "--chunk-size does not apply to --arch gpt"),
                        (["--no-recompute"], "--no-recompute applies to the fused path only"),
                        (["--chunk-size", "8"], "--chunk-size applies to the fused path only"),
                        (["--compile", "--chunk-size", "0"], "--chunk-size must be at least 1"),
                        (["--scan-backend", "reference", "--compile"],
                         "--scan-backend reference runs the lesson's code, --compile the fused path")]:
        with pytest.raises(SystemExit, match=match):
            defaults_for(argv)
    for argv in (["--compile", "--chunk-size", "8"], ["--scan-backend", "fused", "--no-recompute"]):
        defaults_for(argv)  # the fused path takes them


def test_chunk_size_and_no_recompute_reach_the_fused_path(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "fused")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2",
         "--scan-backend", "fused", "--chunk-size", "4", "--no-recompute"] + TINY, capsys)
    assert torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)["step"] == 2
    args = defaults_for(["--scan-backend", "fused", "--chunk-size", "4", "--no-recompute"])
    mixer = ts.build_model("mamba", ts.model_kwargs(args, 5), ts.run_options(args)).backbone.layers[0].mixer
    assert mixer.scan_fn.keywords == dict(backend="fused", compile=False, chunk_size=4, recompute=False)
    args = defaults_for([])  # the default: mamba_engine.py's hand-written backward, at its own chunk size
    mixer = ts.build_model("mamba", ts.model_kwargs(args, 5), ts.run_options(args)).backbone.layers[0].mixer
    assert mixer.scan_fn.keywords == dict(backend="auto", compile=False, chunk_size=mamba_engine.CHUNK_SIZE,
                                          recompute=True)


# ------------------------------------------------------------------------------------------------
# torchrun and the device; the text on a machine without a network
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device, match", [
    ("cuda:1", "--device cuda:1 under torchrun: each process takes the GPU of its LOCAL_RANK"),
    ("mps", "--device mps under torchrun"),
])
def test_torchrun_refuses_a_device_that_names_one_gpu_for_every_process(monkeypatch, device, match):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(ts, "RANK", 0)  # restored after the test
    monkeypatch.setattr(ts, "WORLD", 1)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("no process group may start"))
    with pytest.raises(SystemExit, match=match):
        ts.start_processes(ts.parse_args(["--device", device]))


def test_torchrun_with_device_cuda_needs_a_gpu_per_process(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(ts, "RANK", 0)
    monkeypatch.setattr(ts, "WORLD", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU for two processes
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("no process group may start"))
    with pytest.raises(SystemExit, match="process 1 needs cuda:1, and torch finds 1 cuda device"):
        ts.start_processes(ts.parse_args(["--device", "cuda"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never gloo on a CPU instead
    with pytest.raises(SystemExit, match="process 1 needs cuda:1, and torch finds 0 cuda device"):
        ts.start_processes(ts.parse_args(["--device", "cuda"]))


@pytest.mark.parametrize("cuda, mps, expected", [(2, True, "cuda"), (0, True, "mps"), (0, False, "cpu")])
def test_device_auto_takes_cuda_then_mps_then_the_cpu_and_a_named_device_must_exist(monkeypatch, cuda, mps, expected):
    # the order --help and pick_device's docstring give; a device torch does not find is an error
    # line at the start, not a crash at the first tensor moved there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert ts.pick_device("auto") == torch.device(expected)
    for name, found in [("cuda", cuda), ("cuda:1", cuda), ("mps", int(mps))]:
        kind, _, index = name.partition(":")
        if int(index or 0) < found:
            assert ts.pick_device(name) == torch.device(name)
        else:
            with pytest.raises(SystemExit, match=f"--device {name}: torch finds {found} {kind} device"):
                ts.pick_device(name)


def test_the_text_is_downloaded_into_data_once_and_a_cut_download_leaves_no_text(tmp_path, monkeypatch):
    text = "ROMEO: the downloaded text.\n" * 50
    urls = []

    class Response:  # urlopen's answer, a context manager
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return text.encode()

    monkeypatch.setattr(ts.urllib.request, "urlopen", lambda url, timeout: urls.append(url) or Response())
    monkeypatch.chdir(tmp_path)  # a checkout without data/

    class FullDisk:  # a file that takes half of what is written, then the disk is full
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:len(data) // 2])
            self.f.flush()
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(ts, "open", lambda path, mode="r": FullDisk(path, mode) if "w" in mode else open(path, mode),
                        raising=False)
    with pytest.raises(OSError, match="No space left on device"):
        ts.read_text(None)
    assert not os.path.exists(os.path.join("data", "tinyshakespeare.txt"))  # no half text for the next run
    monkeypatch.delattr(ts, "open")
    assert ts.read_text(None) == text and urls == [ts.DATA_URL] * 2
    assert ts.read_text(None) == text and len(urls) == 2  # then read from data/, not downloaded again


def test_without_a_network_the_error_names_the_file_to_copy_and_data(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(ts.urllib.request, "urlopen", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        ts.main(["--out-dir", str(tmp_path / "r")] + TINY)
    message = str(exit_info.value)
    assert message.startswith("error: could not download") and "--data PATH" in message
    assert os.path.join(str(tmp_path), "data", "tinyshakespeare.txt") in message  # where, in full


# ------------------------------------------------------------------------------------------------
# A full disk, damaged checkpoints, a deleted best.pt
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 135424")],
                         ids=["OSError", "RuntimeError"])
def test_a_full_disk_during_a_save_keeps_the_last_good_checkpoint(text_file, tmp_path, capsys, monkeypatch, error):
    out_dir = str(tmp_path / "run")
    real_save = torch.save

    def disk_fills_up(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 20 and "last.pt" in str(f):
            with open(f, "wb") as half:
                half.write(b"PK\x03\x04 half a zip")  # the disk fills up in the middle of the write
            raise error
        real_save(obj, f, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(torch, "save", disk_fills_up)
        with pytest.raises(SystemExit, match=r"error: could not write .*last\.pt \(disk full\?\)"):
            wobbly_run(text_file, out_dir, capsys)
    assert not [f for f in os.listdir(out_dir) if ".tmp" in f]  # the temporary is gone
    assert torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)["step"] == 19  # the last good one
    out = run(["--data", text_file, "--out-dir", out_dir, "--resume"] + without(TINY, "--lr") + WOBBLY, capsys)
    assert "at step 19" in out


def edited(out_dir, name, tmp_path, **changes):
    """A copy of out_dir/name with some fields changed (args.KEY for a saved flag), in a folder of its own."""
    ckpt = torch.load(os.path.join(out_dir, name), weights_only=True)
    for key, value in changes.items():
        if key.startswith("args_"):
            ckpt["args"] = {**ckpt["args"], key[5:]: value}
        else:
            ckpt[key] = value
    folder = tmp_path / f"edited{len(os.listdir(tmp_path))}"
    folder.mkdir()
    for other in ("best.pt", "last.pt"):
        torch.save(ckpt if other == name else torch.load(os.path.join(out_dir, other), weights_only=True),
                   folder / other)
    return str(folder)


@pytest.mark.parametrize("changes, match", [
    (dict(vocab="abc"), "its vocab has 3 characters, its config's vocab_size is"),
    (dict(vocab=40), "its vocab is 40, not a string"),
    (dict(config=[1, 2]), "its config is list, not a dict"),
    (dict(model={"w": 3}), "its model is not a dict of tensors"),
    (dict(arch=["mamba"]), r"holds an unknown architecture \['mamba'\]"),
])
def test_a_hand_edited_checkpoint_is_called_damaged_when_sampled(text_file, tmp_path, capsys, changes, match):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + TINY, capsys)
    folder = edited(out_dir, "best.pt", tmp_path, **changes)
    with pytest.raises(SystemExit, match=match):
        ts.main(["--sample", "--out-dir", folder, "--num-chars", "5"])


@pytest.mark.parametrize("changes, match", [
    (dict(step="5"), "is damaged: its step is '5'"),
    (dict(stopped_early=1), "is damaged: its stopped_early is 1"),
    (dict(best_val="low"), "is damaged: its best_val is 'low'"),
    (dict(vocab=7), "is damaged: its vocab is 7"),
    (dict(config=[]), "is damaged: its config is list"),
    (dict(args_given=5), "is damaged: its list of given flags is 5"),
    (dict(args_max_iters="20"), "is damaged: its flag --max-iters is '20'"),
    (dict(args_dtype="fp8"), "is damaged: its flag --dtype is 'fp8'"),
    (dict(args_compile="yes"), "is damaged: its flag --compile is 'yes'"),
    (dict(torch_rng=torch.zeros(3, dtype=torch.uint8)), "is damaged: its torch_rng is not torch's random state"),
    (dict(optimizer={"state": {}, "param_groups": [{"params": [0]}]}), "is damaged: its weights or optimizer state"),
])
def test_a_hand_edited_last_pt_is_called_damaged_on_resume(text_file, tmp_path, capsys, changes, match):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + TINY, capsys)
    folder = edited(out_dir, "last.pt", tmp_path, **changes)
    with pytest.raises(SystemExit, match=match):
        ts.main(["--data", text_file, "--out-dir", folder, "--resume", "--max-iters", "4"])


@pytest.mark.slow  # a process of its own for each
@pytest.mark.parametrize("group, dim, damage", [
    (0, 2, lambda m: torch.zeros(3, 3)),  # another size
    (1, 1, lambda m: torch.zeros(m.numel() + 1)),  # a 1-D parameter's (a norm, a bias), in the group without decay
    (0, 2, lambda m: m.t().contiguous()),  # the right size, transposed
], ids=["other_size", "one_dim_no_decay", "transposed"])
def test_optimizer_moments_of_other_shapes_are_called_damaged_on_resume(text_file, tmp_path, capsys, group, dim,
                                                                        damage):
    # load_state_dict takes them; a fused AdamW step would then read out of bounds and crash the
    # process without a message, so the resume runs in a process of its own. Every parameter's
    # moments are checked, whatever their group or number of dims
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + TINY, capsys)
    ckpt = torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)
    state, groups = ckpt["optimizer"]["state"], ckpt["optimizer"]["param_groups"]
    moments = state[next(i for i in groups[group]["params"] if state[i]["exp_avg"].dim() == dim)]
    shape = tuple(moments["exp_avg"].shape)
    for key in ("exp_avg", "exp_avg_sq"):
        moments[key] = damage(moments[key])
    folder = edited(out_dir, "last.pt", tmp_path, optimizer=ckpt["optimizer"])
    done = subprocess.run([sys.executable, os.path.join(HERE, "train_shakespeare.py"), "--data", text_file,
                           "--out-dir", folder, "--resume", "--max-iters", "4"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert (f"is damaged: its weights or optimizer state do not fit its own model (its exp_avg has shape "
            f"{tuple(moments['exp_avg'].shape)} for a parameter of {shape})") in done.stderr, done.stderr[-2000:]


def test_resume_after_best_pt_was_deleted_writes_a_new_one(text_file, tmp_path, capsys, monkeypatch):
    val = iter([2.0, 1.0, 1.5])  # the best at step 4; after the resume, 1.5 at step 6 is no better

    def scripted(*args, **kwargs):  # evaluate() asks for train, then val; finish() for the full val
        scripted.calls += 1
        return 1.0 if scripted.calls % 2 else next(val, 0.5)

    scripted.calls = 0
    monkeypatch.setattr(ts, "mean_loss", scripted)
    out_dir = str(tmp_path / "run")
    common = ["--data", text_file, "--out-dir", out_dir, "--eval-interval", "2"] + TINY
    run(common + ["--max-iters", "4"], capsys)
    os.remove(os.path.join(out_dir, "best.pt"))
    scripted.calls = 0
    out = run(common + ["--max-iters", "6", "--resume"], capsys)
    assert f"note: {os.path.join(out_dir, 'best.pt')} is missing" in out
    assert torch.load(os.path.join(out_dir, "best.pt"), weights_only=True)["step"] == 6  # the next evaluation's
    os.remove(os.path.join(out_dir, "best.pt"))  # and a run with nothing left to train says so
    with pytest.raises(SystemExit, match="best.pt is missing, so the run has no best model"):
        run(common + ["--max-iters", "6", "--resume"], capsys)


# ------------------------------------------------------------------------------------------------
# Sampling, the batches and the GPT yardstick: the properties the documentation states
# ------------------------------------------------------------------------------------------------

def test_sample_reads_best_pt_by_default(text_file, tmp_path, capsys, monkeypatch):
    val = iter([3.0, 2.0, 2.5, 2.2, 2.6])  # best at step 2, last at step 5

    def scripted(*args, **kwargs):  # evaluate() asks for train, then val
        scripted.calls += 1
        return 1.0 if scripted.calls % 2 else next(val, 0.5)

    scripted.calls = 0
    out_dir = str(tmp_path / "run")
    with monkeypatch.context() as m:
        m.setattr(ts, "mean_loss", scripted)
        run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "5", "--eval-interval", "1"] + TINY, capsys)
    _, ckpt = ts.load_for_sampling(ts.parse_args(["--sample", "--out-dir", out_dir]), torch.device("cpu"))
    assert ckpt["step"] == 2  # best.pt, not last.pt (step 5)


def test_sampling_defaults_are_the_documented_ones():
    args = defaults_for([])
    assert (args.temperature, args.top_k, args.num_chars, args.prompt) == (0.8, None, 500, None)
    assert ts.checked_prompt(None, "\nab") == "\n" and ts.checked_prompt(None, "ab") == "a"


def test_training_windows_stay_inside_the_split():
    args = argparse.Namespace(seed=1, block_size=8, batch_size=64)
    split = torch.arange(10)  # a window of 8 and its next-character target fit at starts 0 and 1 only
    starts = set()
    for step in range(20):
        x, y = ts.get_batch(split, step, args, "cpu")
        assert torch.equal(y, x + 1)
        starts |= set(x[:, 0].tolist())
    assert starts == {0, 1}


def test_the_gpt_init_is_nanogpts():
    from gpt_minimal import GPTConfig, TinyGPT
    torch.manual_seed(0)
    n_layer = 4
    model = TinyGPT(GPTConfig(vocab_size=65, d_model=128, n_layer=n_layer, n_head=4))
    residual = 0.02 / math.sqrt(2 * n_layer)  # the projections that write into the residual stream
    for name, p in model.named_parameters():
        if p.dim() == 2:
            expected = residual if name.endswith(("proj.weight", "out.weight")) else 0.02
            # the std of at least 8,192 normal draws is within 2% of the truth (about 7 standard errors)
            assert abs(p.std().item() / expected - 1) < 0.05, name


def test_the_gpt_uses_its_position_embedding():
    from gpt_minimal import GPTConfig, TinyGPT
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=65, d_model=32, n_layer=1, n_head=2, block_size=16))
    ids = torch.full((1, 8), 5)  # the same token everywhere: only the positions tell them apart
    with torch.no_grad():
        out = model(ids)
    assert (out[0, 1] - out[0, 6]).abs().max() > 1e-3  # without positions: equal to rounding


def test_the_gpt_decays_exactly_its_matrices():
    from gpt_minimal import GPTConfig, TinyGPT
    model = TinyGPT(GPTConfig(vocab_size=65, d_model=32, n_layer=2, n_head=2))
    decay, no_decay = model.optim_groups(0.1)
    names = {id(p): n for n, p in model.named_parameters()}  # the tied head appears once
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert sorted(names[id(p)] for p in decay["params"]) == sorted(n for n, p in model.named_parameters()
                                                                   if p.dim() == 2)
    assert sorted(names[id(p)] for p in no_decay["params"]) == sorted(n for n, p in model.named_parameters()
                                                                      if p.dim() < 2)


# ------------------------------------------------------------------------------------------------
# The precision a CPU defaults to
# ------------------------------------------------------------------------------------------------

def test_a_cpu_defaults_to_bf16_for_mamba_and_its_gpt_yardstick_only_with_bf16_instructions(monkeypatch):
    monkeypatch.delenv("MAMBA_CPU_BF16", raising=False)  # the detection itself, whatever the suite forces
    for found, expected in [({"avx512_bf16": True, "amx_bf16": False}, True), ({"amx_bf16": True}, True),
                            ({"avx512_f": True, "avx512_bf16": False}, False), ({"bf16": True}, False)]:
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda found=found: found, raising=False)
        assert ts.cpu_computes_in_bf16() is expected, found
        for arch in ("mamba", "gpt"):  # raced against each other: like with like
            assert defaults_for(["--arch", arch]).dtype == ("bf16" if expected else "fp32")
        for arch in ("mamba2", "mamba3"):  # raced in fp32 only: unchanged
            assert defaults_for(["--arch", arch]).dtype == "fp32"
        assert ts.default_dtype(torch.device("mps"), "mamba") == "fp32"
    monkeypatch.delattr(torch.cpu, "get_capabilities")  # an older torch: its own check of the same flag
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert ts.cpu_computes_in_bf16() is True


def test_mamba_cpu_bf16_overrides_the_detection_so_the_suite_runs_both_ways(monkeypatch):
    for found in ({"avx512_bf16": True}, {}):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda found=found: found, raising=False)
        monkeypatch.setenv("MAMBA_CPU_BF16", "0")
        assert ts.cpu_computes_in_bf16() is False and defaults_for([]).dtype == "fp32"
        monkeypatch.setenv("MAMBA_CPU_BF16", "1")
        assert ts.cpu_computes_in_bf16() is True and defaults_for([]).dtype == "bf16"
    monkeypatch.setenv("MAMBA_CPU_BF16", "yes")
    with pytest.raises(SystemExit, match="MAMBA_CPU_BF16 must be 0 or 1, got 'yes'"):
        defaults_for([])


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "mamba3", "gpt"])
def test_apple_mps_takes_the_cpu_settings_of_every_architecture(arch):
    # --device auto picks MPS on Apple silicon; its settings are the CPU's, per architecture, and the
    # model builds (torch.device("mps") needs no Mac to be named)
    on_mps, on_cpu = (ts.parse_args(["--arch", arch]) for _ in range(2))
    ts.fill_defaults(on_mps, torch.device("mps"))
    ts.fill_defaults(on_cpu, torch.device("cpu"))
    differs = {k for k in vars(on_cpu) if getattr(on_cpu, k) != getattr(on_mps, k)}
    assert differs <= {"dtype"}, differs  # bf16 needs a CPU with bf16 instructions; MPS trains in fp32
    assert on_mps.dtype == "fp32"
    ts.build_model(arch, ts.model_kwargs(on_mps, 65))


# ------------------------------------------------------------------------------------------------
# What a run says it does: the yardstick's size, evaluation's share, resuming and sampling
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_gpt_yardstick_has_mambas_size_on_every_device(device, monkeypatch):
    monkeypatch.setattr(ts, "cpu_computes_in_bf16", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    counts = {}
    for arch in ("mamba", "gpt"):
        args = ts.parse_args(["--arch", arch])
        ts.fill_defaults(args, torch.device(device))
        with torch.device("meta"):  # sizes only: nothing allocated
            model = ts.build_model(arch, ts.model_kwargs(args, 65), ts.run_options(args))
        counts[arch] = sum(p.numel() for p in model.parameters())
    # the GPT's count from its shape, as nanoGPT's model.py adds it up: 12 d^2 a layer (attention 4 d^2,
    # MLP 8 d^2), the tied token embedding and the position embedding, a LayerNorm weight per norm
    d, n, block = args.d_model, args.n_layer, args.block_size
    assert counts["gpt"] == 12 * d * d * n + (65 + block) * d + (2 * n + 1) * d
    assert abs(counts["gpt"] / counts["mamba"] - 1) <= 0.10, counts


def test_evaluation_takes_a_bounded_share_and_the_speed_counts_training_only(text_file, tmp_path, capsys,
                                                                            monkeypatch):
    # every step takes 1 s and every evaluation 2 s: ten evaluation points in 50 s would be 20 s of
    # evaluating, 29% of the run; --eval-share 0.1 keeps the points that fit (--eval-share 1, all of
    # them, is what the schedule tests above run)
    fake_clock(monkeypatch, 1.0, seconds_per_eval=2.0)
    out_dir = str(tmp_path / "timed")
    out = run(["--data", text_file, "--out-dir", out_dir, "--max-time", "50", "--num-evals", "10",
               "--log-interval", "5"] + without(TINY, "--log-interval"), capsys)
    rows = [r for r in evals(out_dir) if "val_loss" in r]
    n_evals, elapsed = len(rows), rows[-1]["elapsed"]  # a row's elapsed includes its evaluation
    assert 2 <= n_evals < 10 and elapsed == 50 + 2  # some points, and the end of the budget
    assert rows[-1]["step"] == 50 - 2 * (n_evals - 1)  # the budget counts evaluating
    assert 2.0 * n_evals <= 0.1 * elapsed, (n_evals, elapsed)
    speeds = [l.split("| ")[4] for l in out.splitlines() if l.startswith("step ") and "ms/it" in l]
    assert speeds and set(speeds) == {"1000 ms/it "}, speeds  # evaluations not counted
    assert "evaluating took 2.0s" in out and f"evaluating took {2 * n_evals}s of the run's" in out


def test_resuming_a_finished_run_says_its_budget_is_spent(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    common = ["--data", text_file, "--out-dir", out_dir, "--eval-interval", "2"] + TINY
    run(common + ["--max-iters", "4"], capsys)
    out = run(common + ["--max-iters", "4", "--resume"], capsys)
    assert "budget is spent (step 4 of --max-iters 4): nothing to train" in out and "\nstep " not in out
    assert "resume with a larger --max-iters" in out


def cosine(lr, min_lr, ratio):
    return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)


@pytest.mark.parametrize("kill_at", [6, None], ids=["killed_midway", "finished"])
def test_a_larger_budget_on_resume_continues_the_learning_rate(text_file, tmp_path, capsys, monkeypatch, lrs,
                                                              kill_at):
    # a 10 s run, on a fake clock of 1 s a step, resumed with --max-time 20: the cosine goes on from
    # the rate it had reached, down to --min-lr at 20 s, instead of jumping up to the 20 s cosine's
    common = ["--data", text_file, "--out-dir", str(tmp_path / "r"), "--num-evals", "5", "--eval-share", "1",
              "--warmup-iters", "0", "--lr", "0.01", "--min-lr", "0.001"] + without(TINY, "--warmup-iters", "--lr")
    fake_clock(monkeypatch, 1.0)
    with monkeypatch.context() as m:
        if kill_at:
            killed_at(m, kill_at)
        with pytest.raises(KeyboardInterrupt) if kill_at else contextlib.nullcontext():
            run(common + ["--max-time", "10"], capsys)
    first = len(lrs)
    stood = torch.load(str(tmp_path / "r" / "last.pt"), weights_only=True)["elapsed"]  # where it resumes
    fake_clock(monkeypatch, 1.0)
    out = run(common + ["--max-time", "20", "--resume"], capsys)
    assert "goes on from" in out
    top = cosine(0.01, 0.001, min(stood / 10, 1))  # the 10 s schedule's rate where the run stood
    expected = [cosine(top, 0.001, (t - stood) / (20 - stood)) for t in range(int(stood), 20)]
    assert lrs[first:] == pytest.approx(expected, abs=1e-15)
    assert abs(lrs[first] - cosine(0.01, 0.001, stood / 10)) < 2e-3  # no jump (a step's change at most)


def test_sample_says_which_checkpoint_arch_and_step_it_samples(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "gpt")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + GPT_TINY, capsys)
    ts.main(["--sample", "--out-dir", out_dir, "--prompt", "First", "--num-chars", "5"])
    captured = capsys.readouterr()
    assert captured.out.startswith("First") and len(captured.out) == 5 + 5 + 1  # the sample alone on stdout
    assert f"sampling {os.path.join(out_dir, 'best.pt')}: gpt, " in captured.err and ", step 2, val " in captured.err


def test_a_temperature_that_underflows_float32_samples_greedily(text_file, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    run(["--data", text_file, "--out-dir", out_dir, "--max-iters", "2", "--eval-interval", "2"] + TINY, capsys)
    greedy = run(["--sample", "--out-dir", out_dir, "--prompt", "First", "--num-chars", "20", "--top-k", "1"], capsys)
    for temperature in ("1e-45", "1e-38", "0"):  # logits / 1e-38 overflow float32 (mamba_minimal._sample)
        assert run(["--sample", "--out-dir", out_dir, "--prompt", "First", "--num-chars", "20",
                    "--temperature", temperature], capsys) == greedy


def test_a_log_that_cannot_be_written_is_a_one_line_error(text_file, tmp_path, capsys, monkeypatch):
    out_dir = str(tmp_path / "run")
    common = ["--data", text_file, "--out-dir", out_dir, "--eval-interval", "2"] + TINY
    run(common + ["--max-iters", "2"], capsys)
    real_open = open

    def no_space(path, mode="r", **kw):
        if "log.jsonl" in str(path) and mode != "r":
            raise OSError(28, "No space left on device")
        return real_open(path, mode, **kw)

    monkeypatch.setattr(ts, "open", no_space, raising=False)
    with pytest.raises(SystemExit, match=r"could not write .*log\.jsonl \(disk full or read-only\?\): No space"):
        run(common + ["--max-iters", "4", "--resume"], capsys)  # the log rewritten on resume
    assert sorted(os.listdir(out_dir)) == ["best.pt", "last.pt", "log.jsonl"]  # no temporary left
    monkeypatch.setattr(ts, "truncate_log", lambda *a: None)
    with pytest.raises(SystemExit, match=r"could not write .*log\.jsonl \(disk full or read-only\?\)"):
        run(common + ["--max-iters", "4", "--resume"], capsys)  # a row appended at the next evaluation


def test_a_checkpoint_of_the_trainer_before_mamba_engine_samples_and_resumes(text_file, tmp_path, capsys):
    # the trainer once saved Mamba's run options, and the plain values of the hybrid fields, in the
    # config; MambaConfig has neither now
    out_dir = str(tmp_path / "run")
    common = ["--data", text_file, "--out-dir", out_dir, "--eval-interval", "2"] + TINY
    run(common + ["--max-iters", "2"], capsys)
    old = dict(scan_backend="auto", compile_scan=False, chunk_size=16, recompute=True, d_intermediate=0,
               attn_layer_idx=[], attn_cfg={}, rms_norm=True, selection_off=False)
    for name in ("best.pt", "last.pt"):
        ckpt = torch.load(os.path.join(out_dir, name), weights_only=True)
        torch.save({**ckpt, "config": {**ckpt["config"], **old}}, os.path.join(out_dir, name))
    out = run(["--sample", "--out-dir", out_dir, "--prompt", "First", "--num-chars", "5"], capsys)
    assert out.startswith("First") and len(out) == 5 + 5 + 1
    run(common + ["--max-iters", "4", "--resume"], capsys)
    assert torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)["step"] == 4
    ckpt = torch.load(os.path.join(out_dir, "best.pt"), weights_only=True)
    torch.save({**ckpt, "config": {**ckpt["config"], "d_intermediate": 8}}, tmp_path / "hybrid.pt")
    with pytest.raises(SystemExit, match="cannot build the mamba model: .*d_intermediate"):
        ts.main(["--sample", "--checkpoint", str(tmp_path / "hybrid.pt")])
