"""
test_tasks.py: the synthetic tasks of tasks/ (the papers' claims on a laptop), in miniature.

Each data generator against strings worked out by hand; each task's pipeline trains a tiny model
for a few steps and its loss goes down; the recurrent evaluation (prefill + step) against the
parallel forward; and the two ablations the tasks need, tasks/selection_off.py's SelectionOffMixer and
Mamba3Config.rotations_off, against what they claim: an LTI layer that is one fixed convolution
(pscan.scan_time_invariant), and a Mamba-3 whose angles are zero.
"""

import errno
import json
import os

import pytest
import torch
import torch.nn.functional as F

import mamba_engine
import pscan
from mamba3_minimal import Mamba3Config, Mamba3LM
from mamba_minimal import MambaConfig, MambaLM, MambaMixer
from tasks import common, induction_heads, mqar, selective_copying, state_tracking
from tasks.selection_off import SelectionOffMixer

N = common.IGNORE  # a position that asks for nothing


# ------------------------------------------------------------------------------------------------
# The data generators, against hand-worked strings
# ------------------------------------------------------------------------------------------------

def test_parity_targets_are_the_running_parity():
    x, y = state_tracking.parity_strings(torch.tensor([[1, 0, 1, 1, 0]]))
    start = state_tracking.PARITY_START
    assert x.tolist() == [[start, 1, 0, 1, 1, 0]]
    assert y.tolist() == [[N, 1, 1, 0, 1, 1]]  # 1, 1+0, 1+0+1, ... mod 2
    _, y_last = state_tracking.parity_strings(torch.tensor([[1, 0, 1, 1, 0]]), last_only=True)
    assert y_last.tolist() == [[N, N, N, N, N, 1]]


def test_arithmetic_is_evaluated_left_to_right_mod_5():
    add, sub, mul = state_tracking.ADD, state_tracking.SUB, state_tracking.MUL
    # 3 + 4 × 2 - 1, left to right: 3, 7 = 2, 2 × 2 = 4, 4 - 1 = 3 (with precedence it would be 10 = 0)
    x, y = state_tracking.arithmetic_strings(torch.tensor([[3, 4, 2, 1]]), torch.tensor([[add, mul, sub]]))
    assert x.tolist() == [[state_tracking.ARITH_START, 3, add, 4, mul, 2, sub, 1]]
    assert y.tolist() == [[N, 3, N, 2, N, 4, N, 3]]
    # 1 - 3 = -2 = 3 mod 5, then × 0 resets to 0
    _, y = state_tracking.arithmetic_strings(torch.tensor([[1, 3, 0]]), torch.tensor([[sub, mul]]))
    assert y.tolist() == [[N, 1, N, 3, N, 0]]


def test_state_tracking_batches_hold_what_their_strings_say():
    g = torch.Generator().manual_seed(0)
    x, y = state_tracking.parity_batch(64, 20, g)
    assert x.shape == y.shape == (64, 21)
    assert torch.equal(y[:, -1], x[:, 1:].sum(1) % 2)
    x, y = state_tracking.arithmetic_batch(64, 6, g, last_only=True)
    assert x.shape == (64, 14) and (y[:, :-1] == N).all() and ((0 <= y[:, -1]) & (y[:, -1] < 5)).all()


def test_selective_copying_targets_are_the_data_tokens_in_order():
    blank, marker = selective_copying.BLANK, selective_copying.MARKER
    x, y = selective_copying.copying_strings(torch.tensor([[5, 2, 7]]), torch.tensor([[1, 4, 6]]), span=8)
    assert x.tolist() == [[blank, 5, blank, blank, 2, blank, 7, blank, marker, marker, marker]]
    assert y.tolist() == [[N] * 8 + [5, 2, 7]]


def test_selective_copying_batches_scatter_the_tokens_they_ask_back():
    g = torch.Generator().manual_seed(0)
    x, y = selective_copying.copying_batch(128, 24, g)
    k = selective_copying.TO_COPY
    region = x[:, :24]
    assert x.shape == (128, 24 + k) and (x[:, 24:] == selective_copying.MARKER).all()
    assert ((region != selective_copying.BLANK).sum(1) == k).all()  # k distinct positions
    # the copy target is the region's non-blank tokens, read left to right
    assert torch.equal(region[region != selective_copying.BLANK].view(128, k), y[:, 24:])
    assert (y[:, :24] == N).all()
    with pytest.raises(ValueError, match="span"):
        selective_copying.copying_batch(2, k - 1, g)


def test_induction_answer_is_the_token_after_the_first_trigger():
    t = induction_heads.TRIGGER
    x, y = induction_heads.induction_strings(torch.tensor([[3, 9, 4, 4, 1, 8, 2]]), torch.tensor([2]))
    assert x.tolist() == [[3, 9, t, 4, 1, 8, t]]
    assert y.tolist() == [[N, N, N, N, N, N, 4]]


def test_induction_batches_have_the_trigger_exactly_twice():
    g = torch.Generator().manual_seed(0)
    x, y = induction_heads.induction_batch(256, 12, g)
    t = induction_heads.TRIGGER
    assert ((x == t).sum(1) == 2).all() and (x[:, -1] == t).all()
    first = (x == t).int().argmax(1)  # the first trigger
    assert (first <= 12 - 3).all()
    assert torch.equal(y[:, -1], x[torch.arange(256), first + 1]) and (y[:, :-1] == N).all()


def test_mqar_answers_are_the_values_paired_with_the_asked_keys():
    keys, values = torch.tensor([[5, 0, 9]]), torch.tensor([[70, 64, 100]])
    x, y = mqar.mqar_strings(keys, values, torch.tensor([[2, 0]]))
    assert x.tolist() == [[5, 70, 0, 64, 9, 100, 9, 5]]
    assert y.tolist() == [[N, N, N, N, N, N, 100, 70]]


def test_mqar_batches_have_distinct_keys_and_consistent_answers():
    g = torch.Generator().manual_seed(0)
    pairs, q = 20, 8
    x, y = mqar.mqar_batch(64, pairs, g, queries=q)
    keys, values = x[:, 0:2 * pairs:2], x[:, 1:2 * pairs:2]
    assert x.shape == (64, 2 * pairs + q)
    assert all(len(set(row.tolist())) == pairs for row in keys)
    assert ((keys < mqar.KEYS) & (values >= mqar.KEYS)).all()
    for row in range(64):  # every query's target is the value its key was paired with
        table = dict(zip(keys[row].tolist(), values[row].tolist()))
        assert [table[k] for k in x[row, 2 * pairs:].tolist()] == y[row, 2 * pairs:].tolist()
    assert len(set(x[0, 2 * pairs:].tolist())) == q  # each key asked once
    x, _ = mqar.mqar_batch(64, pairs, g)  # by default every pair is asked for, each once
    assert x.shape == (64, 3 * pairs) and all(sorted(row[2 * pairs:].tolist()) == sorted(row[:2 * pairs:2].tolist())
                                              for row in x)
    with pytest.raises(ValueError, match="pairs"):
        mqar.mqar_batch(2, q - 1, g, queries=q)


def test_arithmetic_batches_draw_every_number_and_every_operation():
    g = torch.Generator().manual_seed(0)
    x, _ = state_tracking.arithmetic_batch(64, 6, g)
    numbers, ops = x[:, 1::2], x[:, 2::2]
    assert set(numbers.unique().tolist()) == set(range(state_tracking.MODULUS))
    assert set(ops.unique().tolist()) == {state_tracking.ADD, state_tracking.SUB, state_tracking.MUL}


def test_parity_batches_can_ask_for_the_last_bit_only():
    # the length-generalization score reads one answer per string, the parity of all its bits
    g = torch.Generator().manual_seed(0)
    x, y = state_tracking.parity_batch(64, 20, g, last_only=True)
    assert (y[:, :-1] == N).all() and torch.equal(y[:, -1], x[:, 1:].sum(1) % 2)


def test_mqar_asks_its_keys_in_random_order():
    # queries in the order the pairs appeared would be an easier task (a queue, not a lookup)
    g = torch.Generator().manual_seed(0)
    pairs = 20
    x, _ = mqar.mqar_batch(64, pairs, g)
    keys = x[:, 0:2 * pairs:2]  # (64, pairs)
    where = (x[:, 2 * pairs:, None] == keys[:, None, :]).int().argmax(-1)  # (64, queries): each query's pair
    in_order = (where.diff(dim=1) > 0).all(dim=1)  # (64,)
    assert in_order.sum() < 4  # by chance 1/20! of rows, about 0


# ------------------------------------------------------------------------------------------------
# The pipeline: a tiny model learns, the table and the evaluations
# ------------------------------------------------------------------------------------------------

TINY = dict(d_model=16, n_layer=1, d_state=4)


@pytest.mark.parametrize("task", ["selective_copying", "induction_heads", "mqar", "parity", "arithmetic"])
def test_a_tiny_model_learns_each_task(task):
    # the loss of the first 10 steps against that of the last 10, 60 steps of a 1-layer Mamba of
    # width 16 (induction, with one answer per string, at a higher learning rate)
    g = torch.Generator().manual_seed(0)
    make, vocab, lr = {
        "selective_copying": (lambda: selective_copying.copying_batch(16, 12, g), selective_copying.VOCAB, 1e-2),
        "induction_heads": (lambda: induction_heads.induction_batch(32, 8, g), induction_heads.VOCAB, 3e-2),
        "mqar": (lambda: mqar.mqar_batch(16, 16, g), mqar.VOCAB, 1e-2),
        "parity": (lambda: state_tracking.parity_batch(16, 8, g), state_tracking.PARITY_VOCAB, 1e-2),
        "arithmetic": (lambda: state_tracking.arithmetic_batch(16, 4, g), state_tracking.ARITH_VOCAB, 1e-2),
    }[task]
    model = common.build("mamba", vocab, **TINY, max_len=64)
    curve = common.train(model, lambda step: make(), steps=60, vocab_size=vocab, lr=lr, warmup=5, log_every=10)
    assert curve[-1][1] < 0.95 * curve[0][1], curve


@pytest.mark.parametrize("arch", list(common.ARCHS))
def test_every_architecture_builds_trains_and_scores(arch):
    model = common.build(arch, 5, **TINY, max_len=10)
    x = torch.randint(0, 5, (4, 10))
    y = torch.randint(0, 5, (4, 10))
    curve = common.train(model, lambda step: (x, y), steps=2, vocab_size=5, warmup=1, log_every=1)
    assert len(curve) == 2
    assert 0 <= common.accuracy(model, x, y, 5) <= 1


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "mamba3"])
def test_state_passing_trains_each_batch_as_the_continuation_of_the_last(arch):
    # the oracle: with the learning rate at 0 the weights stay put, so the second batch's loss under
    # state passing is the loss on the second half of the two batches read as one string
    torch.manual_seed(0)
    model = common.build(arch, 7, **TINY, max_len=24).double()
    x = torch.randint(0, 7, (3, 24))
    y = torch.randint(0, 7, (3, 24))
    halves = [(x[:, :12], y[:, :12]), (x[:, 12:], y[:, 12:])]
    curve = common.train(model, lambda step: halves[step], steps=2, vocab_size=7, lr=0.0, warmup=1,
                         log_every=1, state_passing=True)
    with torch.no_grad():
        whole = model(x)[:, 12:, :7]
    expected = F.cross_entropy(whole.flatten(0, 1), y[:, 12:].flatten())
    assert curve[1][1] == pytest.approx(expected.item(), rel=1e-6)  # the loss is taken in fp32
    fresh = common.train(model, lambda step: halves[step], steps=2, vocab_size=7, lr=0.0, warmup=1, log_every=1)
    assert abs(fresh[1][1] - expected.item()) > 1e-4  # from zeros: another loss


def test_induction_state_passing_is_refused_for_the_gpt_and_recorded_otherwise(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="GPT has none"):
        induction_heads.main(["--models", "gpt", "--state-passing", "--steps", "1", "--seeds", "1",
                              "--out-dir", str(tmp_path)])
    seen = []
    monkeypatch.setattr(induction_heads, "run_one", lambda arch, seed, steps, state_passing: seen.append(
        state_passing) or ({64: 1.0, 1024: 1.0, 4096: 1.0, 16384: 1.0}, [(1, 1.0)], 0.0))
    induction_heads.main(["--models", "mamba", "--state-passing", "--seeds", "1", "--out-dir", str(tmp_path)])
    assert seen == [True]
    assert json.loads((tmp_path / "induction_heads.json").read_text())["settings"]["state_passing"] is True


class AnyScores(dict):
    """The scores of a run that was not trained: 0.5 at whatever length the table asks for."""

    def __missing__(self, key):
        return 0.5


@pytest.mark.parametrize("task,argv", [(selective_copying, []), (induction_heads, []),
                                       (mqar, ["--d-states", "8,32", "--fewest", "20"]),
                                       (state_tracking, ["--task", "arithmetic"])])
def test_width_learning_rate_and_weight_decay_reach_the_training(task, argv, tmp_path, monkeypatch, capsys):
    seen = []

    def run_one(*args, **kwargs):
        seen.append((args, kwargs))
        return AnyScores(), [(1, 1.0)], 0.0

    monkeypatch.setattr(task, "run_one", run_one)
    monkeypatch.setattr(task, "figure", lambda *args: None)  # nothing was trained to draw
    task.main(argv + ["--models", "mamba", "--seeds", "1", "--width", "48", "--lr", "0.02", "--weight-decay", "0",
                      "--out-dir", str(tmp_path)])
    assert seen and all(k["d_model"] == 48 and k["lr"] == 0.02 and k["weight_decay"] == 0 for _, k in seen)
    if task is mqar:  # one row per d_state asked for, each with the fewest pairs asked for
        assert [a[1] for a, _ in seen] == [8, 32] and all(k["fewest"] == 20 for _, k in seen)
    seen.clear()
    task.main(argv + ["--models", "mamba", "--seeds", "1", "--out-dir", str(tmp_path)])
    assert all("lr" not in k and "weight_decay" not in k for _, k in seen)  # the task's own


def test_accuracy_counts_only_the_answers():
    class Says(torch.nn.Module):  # predicts token 1 everywhere
        def forward(self, x):
            return F.one_hot(torch.ones_like(x), 3).float()

    y = torch.tensor([[N, 1, 0, N], [1, N, N, 2]])
    assert common.accuracy(Says(), torch.zeros(2, 4, dtype=torch.long), y, 3) == pytest.approx(2 / 4)


@pytest.mark.parametrize("arch", ["mamba", "mamba-lti", "mamba2", "mamba3", "mamba3-real"])
def test_recurrent_evaluation_matches_the_parallel_forward(arch):
    # prefill on a prefix, then one step per token: the last logits of one parallel pass
    model = common.build(arch, 7, **TINY, max_len=8).double()
    x = torch.randint(0, 7, (3, 21))
    by_steps = common.last_logits_by_steps(model, x, prefix=8, vocab_size=7)
    with torch.no_grad():
        parallel = model(x)[:, -1, :7]
    torch.testing.assert_close(by_steps, parallel.float(), rtol=1e-5, atol=1e-5)


def test_the_table_reports_mean_min_max_and_not_applicable(capsys):
    assert common.spread([0.5, 1.0, 0.75]) == "0.750 [0.50, 1.00]"
    assert common.spread([None, None]) == "n/a"
    common.print_table("t", [("m", {"a": [1.0], "b": [None]})], ["a", "b"])
    assert "| m | 1.000 [1.00, 1.00] | n/a |" in capsys.readouterr().out


def test_a_short_run_of_each_task_scores_at_every_length():
    common_args = dict(d_model=16, n_layer=1, d_state=4, batch=4, test_sequences=4)
    scores, curve, _ = selective_copying.run_one("mamba-lti", 0, 2, span=8, stretch=(1, 2), **common_args)
    assert list(scores) == [8, 16] and len(curve) == 1
    scores, _, _ = induction_heads.run_one("mamba3", 0, 2, length=6, stretch=(1, 3), **common_args)
    assert list(scores) == [6, 18] and all(0 <= a <= 1 for a in scores.values())
    scores, _, _ = induction_heads.run_one("gpt", 0, 2, length=6, stretch=(1, 3), **common_args)
    assert scores[18] is None  # the GPT's learned positions stop at the training length
    scores, _, _ = mqar.run_one("mamba2", 8, 0, 2, pairs=8, tested=(4, 8), **{k: v for k, v in common_args.items()
                                                                              if k != "d_state"})
    assert list(scores) == [4, 8]
    scores, _, _ = state_tracking.run_one("parity", "mamba3-real", 0, 2, stretch=(1, 2), **common_args)
    assert list(scores) == [32, 64]


def test_main_writes_its_results(tmp_path, monkeypatch, capsys):
    # the whole command at the smallest size: one seed, one step, short strings
    monkeypatch.setattr(state_tracking, "TEST_SEQUENCES", 4)
    monkeypatch.setattr(state_tracking, "BATCH", 4)
    state_tracking.main(["--task", "parity", "--models", "mamba2", "--seeds", "1", "--steps", "1",
                         "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| Mamba-2 |" in out and (tmp_path / "parity.json").exists()
    settings = json.loads((tmp_path / "parity.json").read_text())["settings"]
    assert (settings["steps"], settings["d_model"], settings["n_layer"]) == (1, 32, 2)
    with pytest.raises(SystemExit):
        state_tracking.main(["--models", "mamba4"])


def test_each_state_tracking_task_trains_at_its_own_size_unless_told(tmp_path, monkeypatch, capsys):
    # parity: 2 layers of width 32, 1,500 steps; arithmetic: 4 layers of width 64, 3,000 steps
    calls, models = [], {}

    def run_one(task, arch, seed, steps, d_model, n_layer):
        calls.append((task, steps, d_model, n_layer))
        models.setdefault(task, []).append(arch)
        return {n: 0.5 for n in (16, 32, 64, 128, 256)}, [(1, 1.0)], 0.0

    monkeypatch.setattr(state_tracking, "run_one", run_one)
    state_tracking.main(["--seeds", "1", "--out-dir", str(tmp_path)])
    assert calls == [("parity", 1500, 32, 2)] * 4 + [("arithmetic", 3000, 64, 4)] * 3  # 4 and 3 models
    assert models == {"parity": ["mamba3", "mamba3-real", "mamba2", "mamba"],
                      "arithmetic": ["mamba3", "mamba3-real", "mamba2"]}
    calls.clear()
    state_tracking.main(["--models", "mamba2", "--seeds", "1", "--steps", "7", "--out-dir", str(tmp_path)])
    assert [c[1] for c in calls] == [7, 7]


@pytest.mark.parametrize("task", [induction_heads, mqar, selective_copying, state_tracking])
@pytest.mark.parametrize("argv,named", [(["--models", ""], "--models"), (["--models", ","], "--models"),
                                        (["--models", "mamba,mamba2,mamba"], "--models"),
                                        (["--out-dir", "FILE"], "is a file; it must be a folder"),
                                        (["--out-dir", "FILE/sub"], "--out-dir")])
def test_a_bad_task_command_line_ends_in_one_error_line_before_training(task, argv, named, tmp_path, monkeypatch,
                                                                        capsys):
    # an empty or repeated model list, or an out dir that cannot be made: refused at once, not after
    # the first model has trained (a repeated model would train twice and overwrite its own runs)
    (tmp_path / "FILE").write_text("")
    argv = [a.replace("FILE", str(tmp_path / "FILE")) for a in argv]
    monkeypatch.setattr(common, "train", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(SystemExit) as exit:
        task.main(argv + ["--steps", "1", "--seeds", "1"])
    assert exit.value.code == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("task", [induction_heads, mqar, selective_copying, state_tracking])
def test_threads_far_above_the_cores_are_refused_before_torch_sees_them(task, tmp_path, monkeypatch, capsys):
    # torch segfaults at set_num_threads(100000) (fuzz-3 F10): more than 4 threads a core is refused by
    # name, and 4 a core is taken
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(common, "train", lambda *a, **k: pytest.fail("trained"))
    most = 4 * (os.cpu_count() or 1)
    with pytest.raises(SystemExit) as exit:
        task.main(["--threads", str(most + 1), "--steps", "1", "--seeds", "1", "--out-dir", str(tmp_path)])
    assert exit.value.code == 2 and threads == []
    assert f"--threads {most + 1} is more than 4 x the" in capsys.readouterr().err.strip().splitlines()[-1]
    common.arguments("d", ["mamba"], 1, argv=["--threads", str(most), "--out-dir", str(tmp_path)])
    assert threads == [most]


def refusing_writes(tmp_path, error):
    """An open() for common that raises error (an errno) for every file opened for writing under
    tmp_path, as a full or read-only disk does, and opens the rest."""
    def fake_open(path, mode="r", *args, **kwargs):
        if str(path).startswith(str(tmp_path)) and mode[0] in "wa":
            raise OSError(error, os.strerror(error), str(path))
        return open(path, mode, *args, **kwargs)
    return fake_open


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS])
def test_an_out_dir_that_takes_no_file_is_refused_before_training(error, tmp_path, monkeypatch, capsys):
    # fuzz-3 F8: the folder can be made on a full or read-only disk, and the results could not be
    # written after minutes of training; a file written at the start finds it out
    monkeypatch.setattr(common, "open", refusing_writes(tmp_path, error), raising=False)
    monkeypatch.setattr(common, "train", lambda *a, **k: pytest.fail("trained"))
    with pytest.raises(SystemExit) as exit:
        mqar.main(["--models", "mamba", "--steps", "1", "--seeds", "1", "--out-dir", str(tmp_path / "out")])
    assert exit.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--out-dir {tmp_path / 'out'} cannot be written: {os.strerror(error)}" in last
    assert os.listdir(tmp_path / "out") == []  # no probe left behind


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS])
def test_results_that_cannot_be_written_end_in_one_error_line(error, tmp_path, monkeypatch):
    # a disk that fills up (or is remounted read-only) during the run: the results JSON and the
    # figure end the command with one line naming the file, and leave no temporary file
    args = common.arguments("d", ["mamba"], 1, argv=["--out-dir", str(tmp_path)])
    monkeypatch.setattr(common, "open", refusing_writes(tmp_path, error), raising=False)
    with pytest.raises(SystemExit) as exit:
        common.save_results(args, "mqar", {"mamba": []})
    assert exit.value.code == f"error: could not write {tmp_path / 'mqar.json'} (disk full or read-only?): " \
                              f"{os.strerror(error)}"

    class Figure:  # matplotlib's Figure as save_figure uses it, on the same disk
        def suptitle(self, *a, **k):
            pass

        def tight_layout(self):
            pass

        def savefig(self, path, **k):
            with common.open(path, "wb"):
                pass

    with pytest.raises(SystemExit) as exit:
        common.save_figure(Figure(), args, "mqar", "MQAR")
    assert exit.value.code == f"error: could not write {tmp_path / 'mqar.png'} (disk full or read-only?): " \
                              f"{os.strerror(error)}"
    assert os.listdir(tmp_path) == []


def test_learning_rate_warms_up_then_follows_a_cosine_to_a_tenth():
    # hand-computed: lr 1, 100 warmup steps of 1000
    assert common.lr_at(0, 1000, 1.0, 100) == pytest.approx(0.01)
    assert common.lr_at(49, 1000, 1.0, 100) == pytest.approx(0.5)
    assert common.lr_at(99, 1000, 1.0, 100) == pytest.approx(1.0)
    assert common.lr_at(100, 1000, 1.0, 100) == pytest.approx(1.0)  # the cosine's top
    assert common.lr_at(550, 1000, 1.0, 100) == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert common.lr_at(1000, 1000, 2.0, 100) == pytest.approx(0.2)  # the bottom: a tenth of lr


def test_logits_of_drops_the_padded_vocabulary():
    # the Mamba models pad 10 tokens to 16 logits; an answer must be one of the 10
    model = common.build("mamba", 10, **TINY)
    x = torch.randint(0, 10, (2, 5))
    got = common.logits_of(model, x, 10)
    assert got.shape == (2, 5, 10) and got.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(got, model(x)[..., :10].float())


def test_each_architecture_name_builds_its_model():
    for arch, selection_off in (("mamba", False), ("mamba-lti", True)):
        model = common.build(arch, 5, **TINY)
        assert isinstance(model, MambaLM)
        for layer in model.backbone.layers:  # each mixer runs mamba_engine.py's scan and conv
            assert isinstance(layer.mixer, SelectionOffMixer) is selection_off
            assert layer.mixer.scan_fn is not MambaMixer.scan_fn and layer.mixer.conv_fn is not MambaMixer.conv_fn
    for arch, rotations_off, A in (("mamba3", False, "heavy_tail"), ("mamba3-real", True, "heavy_tail"),
                                   ("mamba3-march", False, "softplus")):
        model = common.build(arch, 5, **TINY)
        assert isinstance(model, Mamba3LM) and model.cfg.rotations_off is rotations_off
        assert model.cfg.A_activation == A


# ------------------------------------------------------------------------------------------------
# SelectionOffMixer (tasks/selection_off.py): Δ, B and C learned constants, the layer one fixed convolution
# ------------------------------------------------------------------------------------------------

def lti_mixer_by_convolution(mixer, hidden):
    """The oracle, in float64 from the mixer's parameters: in_proj, the causal conv (F.conv1d),
    SiLU, then the SSM as a convolution with the fixed kernel exp(Δ·A)^k (pscan.scan_time_invariant,
    an FFT), read out with C, plus D·x, gated by SiLU(z), out_proj."""
    b, L, _ = hidden.shape
    x, z = (hidden @ mixer.in_proj.weight.t()).chunk(2, dim=-1)  # (b, L, ED)
    w = mixer.conv1d.weight  # (ED, 1, d_conv)
    x = F.conv1d(x.transpose(1, 2), w, mixer.conv1d.bias, padding=w.shape[-1] - 1, groups=w.shape[0])
    x = F.silu(x[..., :L].transpose(1, 2))  # (b, L, ED)
    delta = F.softplus(mixer.dt_bias)  # (ED,) the same at every step
    A = -torch.exp(mixer.A_log)  # (ED, N)
    a = torch.exp(delta[:, None] * A).expand(b, *A.shape)  # (b, ED, N) constant in time
    u = (delta * x)[..., None] * mixer.B  # (b, L, ED, N)  Δ·B·x
    h = pscan.scan_time_invariant(a, u)  # (b, L, ED, N)
    y = (h * mixer.C).sum(-1) + mixer.D * x  # (b, L, ED)
    return (y * F.silu(z)) @ mixer.out_proj.weight.t()


@pytest.mark.parametrize("backend", ["reference", "auto", "sequential", "pscan", "fused"])
def test_selection_off_makes_the_ssm_one_fixed_convolution(backend):
    torch.manual_seed(1)
    model = MambaLM(MambaConfig(d_model=8, n_layer=1, vocab_size=5, d_state=4), mixer_cls=SelectionOffMixer)
    if backend != "reference":  # "reference": mamba_minimal.py's scan, as the model is built
        mamba_engine.accelerate(model, backend=backend)
    mixer = model.double().backbone.layers[0].mixer
    with torch.no_grad():  # away from the init (B = 1, D = 1) so that each parameter shows
        for p in (mixer.B, mixer.C, mixer.D, mixer.dt_bias):
            p.add_(0.3 * torch.randn_like(p))
    hidden = torch.randn(2, 37, 8, dtype=torch.float64)
    torch.testing.assert_close(mixer(hidden), lti_mixer_by_convolution(mixer, hidden), rtol=1e-9, atol=1e-10)


def test_selection_off_parameters_are_constants_and_the_selective_ones_are_gone():
    model = MambaLM(MambaConfig(d_model=8, n_layer=2, vocab_size=5, d_state=4), mixer_cls=SelectionOffMixer)
    mixer = model.backbone.layers[0].mixer
    names = {n for n, _ in mixer.named_parameters()}
    assert names == {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "B", "C", "A_log", "D",
                     "out_proj.weight"}
    assert mixer.B.shape == mixer.C.shape == (4,) and mixer.dt_bias.shape == (16,)
    dt = F.softplus(mixer.dt_bias)  # the official Δ init: in [dt_min, dt_max]
    assert ((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all()
    # A_log, D, dt_bias, B and C take no weight decay, as per-channel constants
    decayed = {id(p) for g in model.optim_groups(0.1) if g["weight_decay"] > 0 for p in g["params"]}
    assert not any(id(p) in decayed for p in (mixer.B, mixer.C, mixer.dt_bias, mixer.A_log, mixer.D))


def test_a_checkpoint_without_selection_off_loads_strictly_and_the_two_do_not_mix(tmp_path):
    # the official parameter names, written out: the ablation adds nothing to a default model
    official = {"in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                "dt_proj.bias", "A_log", "D", "out_proj.weight"}
    cfg = dict(d_model=8, n_layer=1, vocab_size=5, d_state=4)
    selective = MambaLM(MambaConfig(**cfg))
    assert {n for n, _ in selective.backbone.layers[0].mixer.named_parameters()} == official
    torch.save(selective.state_dict(), tmp_path / "selective.pt")
    MambaLM(MambaConfig(**cfg)).load_state_dict(torch.load(tmp_path / "selective.pt", weights_only=True))
    # an LTI model saves and loads itself; a checkpoint of the one kind is refused by the other
    lti = MambaLM(MambaConfig(**cfg), mixer_cls=SelectionOffMixer)
    torch.save(lti.state_dict(), tmp_path / "lti.pt")
    again = MambaLM(MambaConfig(**cfg), mixer_cls=SelectionOffMixer)
    again.load_state_dict(torch.load(tmp_path / "lti.pt", weights_only=True))
    ids = torch.randint(0, 5, (2, 9))
    torch.testing.assert_close(again(ids), lti(ids), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="x_proj"):
        lti.load_state_dict(selective.state_dict())
    with pytest.raises(RuntimeError, match="dt_bias"):
        selective.load_state_dict(lti.state_dict())


def test_selection_off_starts_as_s4d_and_trains_every_constant():
    # S4D's init (arXiv 2206.11893, section 3): B = 1 and a random normal C; and Δ, B and C are
    # parameters like any other, so a loss reaches each of them
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=8, n_layer=1, vocab_size=5, d_state=64), mixer_cls=SelectionOffMixer)
    mixer = model.backbone.layers[0].mixer
    assert torch.equal(mixer.B, torch.ones(64))
    assert 0.7 < mixer.C.std().item() < 1.3 and abs(mixer.C.mean().item()) < 0.4  # N(0, 1), 64 draws
    F.cross_entropy(model(torch.randint(0, 5, (2, 9))).flatten(0, 1), torch.randint(0, 5, (18,))).backward()
    for name in ("dt_bias", "B", "C", "A_log", "D"):
        grad = getattr(mixer, name).grad
        assert grad is not None and grad.abs().max() > 0, name


# ------------------------------------------------------------------------------------------------
# Mamba3Config.rotations_off: the angles are zero
# ------------------------------------------------------------------------------------------------

def test_rotations_off_equals_the_model_with_zero_angles_and_rotations_on_differ():
    torch.manual_seed(2)
    cfg = dict(d_model=16, n_layer=2, vocab_size=7, d_state=8, headdim=8, chunk_size=4)
    off = Mamba3LM(Mamba3Config(**cfg, rotations_off=True)).double()
    on = Mamba3LM(Mamba3Config(**cfg)).double()
    on.load_state_dict(off.state_dict())  # the same parameters: the option adds and removes none
    ids = torch.randint(0, 7, (2, 13))
    with torch.no_grad():
        with_rotations = on(ids)
        zeroed = Mamba3LM(Mamba3Config(**cfg)).double()
        zeroed.load_state_dict(off.state_dict())
        for layer in zeroed.backbone.layers:  # in_proj's last num_rope_angles rows give θ = π·tanh(·)
            layer.mixer.in_proj.weight[-zeroed.cfg.num_rope_angles:] = 0
        torch.testing.assert_close(off(ids), zeroed(ids), rtol=0, atol=1e-12)
        assert (off(ids) - with_rotations).abs().max() > 1e-3
        # and the recurrent step, which reads the same angles
        _, cache_off = off.prefill(ids[:, :5])
        _, cache_zeroed = zeroed.prefill(ids[:, :5])
        torch.testing.assert_close(off.step(ids[:, 5], cache_off), zeroed.step(ids[:, 5], cache_zeroed))
        assert all((c[0] == 0).all() for c in cache_off)  # the accumulated angles stay 0


def test_rotations_off_must_be_a_bool():
    with pytest.raises(ValueError, match="rotations_off"):
        Mamba3Config(d_model=16, n_layer=1, vocab_size=5, rotations_off=1)
