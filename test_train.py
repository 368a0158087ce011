"""Specification of train_shakespeare.py, on a small text each test writes for itself."""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import train_shakespeare as ts

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--d-model", "16", "--n-layer", "1", "--d-state", "4", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "2", "--warmup-iters", "2", "--lr", "1e-2", "--log-interval", "1", "--no-sample"]


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


TIMED = without(TINY, "--warmup-iters")  # for time-based runs, which warm up by --warmup-frac


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
        ckpt = torch.load(os.path.join(out_dir, name), weights_only=False)
        assert ckpt["vocab"] == "".join(sorted(set(open(text_file).read())))
    assert torch.load(os.path.join(out_dir, "last.pt"), weights_only=False)["step"] == 40
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
    a = torch.load(os.path.join(straight, "last.pt"), weights_only=False)
    b = torch.load(os.path.join(broken, "last.pt"), weights_only=False)
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
    with pytest.raises(SystemExit, match="does not exist"):
        ts.main(["--data", str(tmp_path / "missing.txt")] + TINY)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit, match="is empty"):
        ts.main(["--data", str(empty)] + TINY)
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


def test_two_process_ddp_run_on_cpu_completes(text_file, tmp_path):
    out_dir = str(tmp_path / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "train_shakespeare.py"), "--data", text_file, "--out-dir", out_dir,
           "--device", "cpu", "--max-iters", "8", "--eval-interval", "4"] + TINY
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 process(es)" in proc.stdout
    assert proc.stdout.count("step 8/8") == 1  # only rank 0 logs
    ckpt = torch.load(os.path.join(out_dir, "last.pt"), weights_only=False)
    assert ckpt["step"] == 8
    assert [r["step"] for r in evals(out_dir) if "val_loss" in r] == [4, 8]
    assert evals(out_dir)[-1]["tokens"] == 8 * 2 * 4 * 16  # steps x processes x batch x block


@pytest.mark.compile
def test_compiled_training_follows_the_eager_run(text_file, tmp_path, capsys):
    common = ["--data", text_file, "--max-iters", "6", "--eval-interval", "3"] + TINY
    run(common + ["--out-dir", str(tmp_path / "eager")], capsys)
    out = run(common + ["--out-dir", str(tmp_path / "compiled"), "--compile"], capsys)
    assert "compiling" in out
    eager = [r["val_loss"] for r in evals(str(tmp_path / "eager")) if "val_loss" in r]
    compiled = [r["val_loss"] for r in evals(str(tmp_path / "compiled")) if "val_loss" in r]
    assert len(eager) == len(compiled) == 2
    for e, c in zip(eager, compiled):
        assert abs(e - c) < 1e-4


# ------------------------------------------------------------------------------------------------
# The learning-rate schedule and the time budget
# ------------------------------------------------------------------------------------------------

def schedule_args(**kw):
    base = dict(lr=1.0, min_lr=0.1, warmup_iters=4, lr_decay_iters=14, max_time=None, warmup_frac=0.2)
    return argparse.Namespace(**{**base, **kw})


def test_iteration_schedule_is_linear_warmup_then_cosine_to_min_lr():
    args = schedule_args()
    cosine = lambda r: 0.1 + 0.45 * (1 + math.cos(math.pi * r))  # lr 1 -> min_lr 0.1 over r in [0, 1]
    expected = {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 6: cosine(0.2), 9: 0.55, 13: cosine(0.9), 14: 0.1, 50: 0.1}
    for step, lr in expected.items():
        assert ts.lr_at(args, step, elapsed=123.0) == pytest.approx(lr, abs=1e-12), step


def test_time_schedule_follows_the_fraction_of_the_budget_spent():
    args = schedule_args(max_time=100.0, warmup_frac=0.1)
    cosine = lambda r: 0.1 + 0.45 * (1 + math.cos(math.pi * r))
    expected = {0.0: 0.0, 2.5: 0.25, 5.0: 0.5, 10.0: 1.0, 28.0: cosine(0.2), 55.0: 0.55, 91.0: cosine(0.9),
                100.0: 0.1, 130.0: 0.1}
    for elapsed, lr in expected.items():
        assert ts.lr_at(args, step=7, elapsed=elapsed) == pytest.approx(lr, abs=1e-12), elapsed


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


def fake_clock(monkeypatch, seconds_per_step):
    """The trainer reads the clock once at the start and once per step: each reading advances it."""
    state = {"now": 1000.0}

    def clock():
        state["now"] += seconds_per_step
        return state["now"]

    monkeypatch.setattr(ts, "clock", clock)


def test_time_budget_sets_schedule_evaluations_and_stop(text_file, tmp_path, capsys, monkeypatch, lrs):
    fake_clock(monkeypatch, 1.0)  # every step takes one second
    out_dir = str(tmp_path / "timed")
    args = ["--data", text_file, "--out-dir", out_dir, "--max-time", "10", "--warmup-frac", "0.2",
            "--num-evals", "5", "--min-lr", "0.001"] + TIMED
    run(args, capsys)
    # step k starts after k seconds: warmup to 0.01 over the first 2 s, then cosine to 0.001 by 10 s
    expected = [0.01 * k / 2 if k < 2 else 0.001 + 0.0045 * (1 + math.cos(math.pi * (k - 2) / 8)) for k in range(10)]
    assert lrs == pytest.approx(expected, abs=1e-15)
    records = evals(out_dir)
    assert [(r["step"], r["elapsed"]) for r in records if "val_loss" in r] == [(2, 2), (4, 4), (6, 6), (8, 8), (10, 10)]
    assert "full_val_loss" in records[-1]
    assert torch.load(os.path.join(out_dir, "last.pt"), weights_only=True)["step"] == 10


def test_a_step_that_passes_several_eval_points_evaluates_once(text_file, tmp_path, capsys, monkeypatch, lrs):
    fake_clock(monkeypatch, 3.0)  # each step passes 1.5 eval points of 2 s
    out_dir = str(tmp_path / "timed")
    run(["--data", text_file, "--out-dir", out_dir, "--max-time", "10", "--num-evals", "5"]
        + TIMED, capsys)
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
                         (["--max-time", "5", "--warmup-frac", "1"], "--warmup-frac must")]:
        with pytest.raises(SystemExit, match=match):
            ts.main(["--data", text_file, "--out-dir", str(tmp_path / "x")] + extra)


def test_resume_continues_the_same_time_budget(text_file, tmp_path, capsys, monkeypatch):
    common = ["--data", text_file, "--max-time", "12", "--num-evals", "3"] + TIMED
    fake_clock(monkeypatch, 1.0)
    straight = str(tmp_path / "straight")
    run(common + ["--out-dir", straight], capsys)
    broken = str(tmp_path / "broken")
    real_get_batch = ts.get_batch

    def killed_at_step_6(split, step, *a):
        if step == 6:
            raise KeyboardInterrupt
        return real_get_batch(split, step, *a)

    monkeypatch.setattr(ts, "get_batch", killed_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        run(common + ["--out-dir", broken], capsys)
    monkeypatch.setattr(ts, "get_batch", real_get_batch)
    fake_clock(monkeypatch, 1.0)  # a new process: the clock reads anything, only differences count
    out = run(common + ["--out-dir", broken, "--resume"], capsys)
    assert "at step 4" in out
    assert evals(broken) == evals(straight)  # the fake clock makes even "elapsed" equal
