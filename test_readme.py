"""README.md's code runs as written: each ```python block alone, the trainer's commands and flags parse,
and the page keeps to a front page's size."""

import os
import re
import shlex
import sys

import pytest
import torch

import train_shakespeare as ts

HERE = os.path.dirname(os.path.abspath(__file__))
# A line that names something the reader must supply (a download) carries this comment, visible in the
# README; the test leaves out exactly those lines.
PLACEHOLDER = "# placeholder:"


def readme_text():
    return open(os.path.join(HERE, "README.md"), encoding="utf-8").read()


def readme_blocks(language):
    return re.findall(rf"^```{language}\n(.*?)^```", readme_text(), flags=re.S | re.M)


PYTHON_BLOCKS = readme_blocks("python")


def test_the_readme_has_the_python_blocks_this_file_runs():
    assert len(PYTHON_BLOCKS) >= 1
    placeholders = [line for block in PYTHON_BLOCKS for line in block.splitlines() if PLACEHOLDER in line]
    assert placeholders and all("pretrained.load(" in line for line in placeholders)


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_a_readme_python_block_runs_alone(index, tmp_path, monkeypatch):
    # a fresh namespace, in an empty folder, with the repository importable: what a reader who
    # pastes the block into a file of its own gets
    code = "\n".join(line for line in PYTHON_BLOCKS[index].splitlines() if PLACEHOLDER not in line)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [HERE] + sys.path)
    torch.manual_seed(0)
    exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})


def trainer_commands():
    """The trainer's argument lists in the README: its bash commands, and each `--flag ...` fragment of
    the sentence that lists more runs (--help exits, and is left out)."""
    commands = []
    for block in readme_blocks("bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if "train_shakespeare.py" in words:
                commands.append(words[words.index("train_shakespeare.py") + 1:])
    more_runs = readme_text().split("More runs:", 1)[1].split("\n\n", 1)[0]
    commands += [shlex.split(f) for f in re.findall(r"`(--[^`]*)`", more_runs) if f != "--help"]
    return commands


def test_the_readme_trainer_commands_parse_and_resolve():
    # each one's flags exist and pass the trainer's start-up checks (on a CPU)
    commands = trainer_commands()
    assert [] in commands and len(commands) >= 6  # the default run is one of them
    for argv in commands:
        ts.fill_defaults(ts.parse_args(argv), torch.device("cpu"))


def test_the_readme_fits_the_front_page_budget():
    # a front page, not a results file: measurements go to RESULTS.md
    text = readme_text()
    assert len(text.splitlines()) <= 150 and len(text.split()) <= 1500, (len(text.splitlines()), len(text.split()))
