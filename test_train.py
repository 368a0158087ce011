"""Specification of train_shakespeare.py, on a small text each test writes for itself."""

import json
import os
import subprocess
import sys

import pytest
import torch

import train_shakespeare as ts

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--d-model", "16", "--n-layer", "1", "--d-state", "4", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "2", "--warmup-iters", "2", "--lr", "1e-2", "--log-interval", "1", "--no-sample"]


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
