"""Specification of the lesson as a reader meets it: mamba_minimal.py and the lesson sections of
pscan.py are the code that runs by default, they run copied alone into an empty folder, and imports
run one way through the project (nothing imports a file that imports it, lazy imports included)."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mamba_minimal as mm

ROOT = Path(__file__).resolve().parent
LESSON_SECTIONS_OF_PSCAN = (1, 9)  # pscan.py's docstring: "The model needs 1 and 9"
ALLOWANCE = 50  # lines of the rest of the project that the default model may run (issue 43)


# ------------------------------------------------------------------------------------------------
# the default model runs the lesson's code
# ------------------------------------------------------------------------------------------------

def project_files():
    """Every .py file of the project but the tests: the top level, tasks/ and bench/."""
    files = [p for folder in (ROOT, ROOT / "tasks", ROOT / "bench") if folder.is_dir()
             for p in sorted(folder.glob("*.py"))]
    return [p for p in files if not p.name.startswith("test_") and p.name != "conftest.py"]


def section_lines(path, sections):
    """The line numbers of a file's numbered sections: from a section's banner (a dashed line, then
    "# N. Title") up to the next banner of any kind, a section or the appendix (a dashed or a
    double line), or the end of the file."""
    lines = path.read_text().splitlines()
    banners = [i for i, line in enumerate(lines, start=1) if re.fullmatch(r"# (-{20,}|={20,})", line)]
    starts = {}
    for i in banners:
        title = re.match(r"# (\d+)\. ", lines[i]) if i < len(lines) else None  # the line under the banner
        if title:
            starts[int(title.group(1))] = i
    assert set(sections) <= set(starts), f"{path.name} has no section(s) {set(sections) - set(starts)}"
    wanted = set()
    for n in sections:
        # the next banner opens the next section or closes this one's title; skip the title's own
        end = next((i for i in banners if i > starts[n] + 2), len(lines) + 1)
        wanted.update(range(starts[n], end))
    return wanted


def lines_run(fn):
    """fn() under a line tracer: {(file name, function, line number)} of every line it runs in the
    project's files, and the number of lines it runs in mamba_minimal.py."""
    files = {str(p): p.name for p in project_files()}
    seen = set()

    def local(frame, event, arg):
        if event == "line":
            seen.add((files[frame.f_code.co_filename], frame.f_code.co_name, frame.f_lineno))
        return local

    def calls(frame, event, arg):  # lines are traced in the project's files only
        return local if frame.f_code.co_filename in files else None

    before, before_threads = sys.gettrace(), threading.gettrace()
    threading.settrace(calls)  # autograd may run a backward in a thread of its own
    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(before)
        threading.settrace(before_threads)
    return seen


def outside_the_lesson(seen):
    """The lines of `seen` outside mamba_minimal.py and pscan.py's lesson sections."""
    lesson = section_lines(ROOT / "pscan.py", LESSON_SECTIONS_OF_PSCAN)
    return sorted(s for s in seen if s[0] != "mamba_minimal.py" and not (s[0] == "pscan.py" and s[2] in lesson))


def test_the_default_model_runs_the_lesson_and_at_most_50_lines_of_the_rest():
    # a reader follows the default Mamba-1 through forward, backward and generate: every line that
    # runs is in mamba_minimal.py or pscan.py's sections 1 (the loop) and 9 (scan()), but for an
    # allowance of 50 elsewhere (pscan.py's input checks, appendix E)
    torch.manual_seed(0)
    model = mm.MambaLM(mm.MambaConfig(d_model=32, n_layer=2, vocab_size=21, d_state=8))
    ids = torch.randint(0, 21, (2, 9), generator=torch.Generator().manual_seed(1))

    def use():
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        model.generate(ids[:, :4], max_new_tokens=5, top_k=1)

    seen = lines_run(use)
    outside = outside_the_lesson(seen)
    lesson = [s for s in seen if s[0] == "mamba_minimal.py"]
    print(f"\n{len(outside)} lines outside the lesson ran ({len(lesson)} in mamba_minimal.py):")
    for name in sorted({(f, fn) for f, fn, _ in outside}):
        print(f"  {name[0]} {name[1]}: {sum(1 for s in outside if s[:2] == name)}")
    assert len(lesson) > 100  # the tracer saw the lesson run: forward, backward's inputs, generate
    assert len(outside) <= ALLOWANCE, f"{len(outside)} lines outside the lesson ran: {outside}"


def test_the_tracer_counts_what_the_engine_runs():
    # the same count for a model that mamba_engine.accelerate opted in: far beyond the allowance,
    # so the test above would see the default path wander off into the engine
    import mamba_engine
    torch.manual_seed(0)
    model = mamba_engine.accelerate(mm.MambaLM(mm.MambaConfig(d_model=32, n_layer=2, vocab_size=21, d_state=8)))
    ids = torch.randint(0, 21, (2, 9), generator=torch.Generator().manual_seed(1))
    outside = outside_the_lesson(lines_run(lambda: model(ids).sum().backward()))
    assert len(outside) > ALLOWANCE and any(f == "mamba_engine.py" for f, _, _ in outside)


def test_pscans_lesson_sections_are_the_loop_and_the_entry_point():
    # the ranges the tracer test exempts hold what pscan.py's docstring says the model needs
    pscan_file = ROOT / "pscan.py"
    text = pscan_file.read_text().splitlines()
    lesson = section_lines(pscan_file, LESSON_SECTIONS_OF_PSCAN)
    defined = {node.name for node in ast.parse(pscan_file.read_text()).body
               if isinstance(node, ast.FunctionDef) and node.lineno in lesson}
    assert defined == {"scan_sequential", "scan"}, defined
    assert not any(text[i - 1].startswith("# Appendix") for i in lesson)


# ------------------------------------------------------------------------------------------------
# pscan.py and mamba_minimal.py, copied alone, train, save, load and generate
# ------------------------------------------------------------------------------------------------

COPIER = textwrap.dedent('''
    import json, os, sys
    import torch
    import torch.nn.functional as F
    from mamba_minimal import MambaConfig, MambaLM

    repo = sys.argv[1]
    here = os.path.realpath(os.getcwd())
    # only this folder's files are importable: not the project's, wherever it is
    assert not any(os.path.realpath(p or ".") == os.path.realpath(repo) for p in sys.path), sys.path
    import importlib.util
    assert importlib.util.find_spec("mamba_engine") is None and importlib.util.find_spec("hybrid") is None
    assert os.path.dirname(os.path.realpath(sys.modules["mamba_minimal"].__file__)) == here
    assert os.path.dirname(os.path.realpath(sys.modules["pscan"].__file__)) == here

    text = "the quick brown fox jumps over the lazy dog. " * 20
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    torch.manual_seed(0)
    cfg = MambaConfig(d_model=32, n_layer=2, vocab_size=len(chars), d_state=8)
    model = MambaLM(cfg)
    optimizer = torch.optim.AdamW(model.optim_groups(0.1), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(25):
        starts = torch.randint(0, len(data) - 33, (8,), generator=g)
        batch = torch.stack([data[s:s + 33] for s in starts])
        logits = model(batch[:, :-1])[..., :cfg.vocab_size]
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    # saved atomically: a crash while writing leaves the old file, never half of a new one
    path = os.path.join(here, "model.pt")
    torch.save(model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)
    fresh = MambaLM(cfg)
    fresh.load_state_dict(torch.load(path, weights_only=True), strict=True)
    model.eval()
    fresh.eval()
    prompt = data[:10].unsqueeze(0)
    with torch.no_grad():
        same = torch.equal(model(prompt), fresh(prompt))
    out = fresh.generate(prompt, max_new_tokens=20, top_k=1)
    print(json.dumps({"losses": losses, "same_logits": same,
                      "tied": fresh.lm_head.weight is fresh.backbone.embedding.weight,
                      "generated": "".join(chars[i] for i in out[0].tolist()),
                      "same_tokens": torch.equal(out, model.generate(prompt, max_new_tokens=20, top_k=1))}))
''')


def test_pscan_and_mamba_minimal_copied_alone_train_save_load_and_generate(tmp_path):
    for name in ("pscan.py", "mamba_minimal.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "copier.py").write_text(COPIER)
    # -s: no user site-packages; PYTHONPATH the folder alone; the project's folder is not the cwd
    env = {"PYTHONPATH": str(tmp_path), "PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-s", "copier.py", str(ROOT)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    losses = result["losses"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses  # it learned
    assert result["same_logits"] and result["tied"] and result["same_tokens"], result
    assert result["generated"].startswith("the quick ") and len(result["generated"]) == 30, result
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".py") == ["copier.py", "mamba_minimal.py",
                                                                                "pscan.py"]


# ------------------------------------------------------------------------------------------------
# imports run one way
# ------------------------------------------------------------------------------------------------

def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def imports_of(path, modules):
    """The project modules that a file imports anywhere in it: at the top, inside a function (a
    lazy import) or under a condition. {name: line of the first import}."""
    found = {}
    package = module_name(path).rpartition(".")[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from .y import z
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if base else alias.name for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:  # a.b.c imports a.b imports a, whichever is ours
                name = name.rpartition(".")[0]
            if name and name != module_name(path):
                found.setdefault(name, node.lineno)
    return found


def import_graph():
    files = [p for folder in (ROOT, ROOT / "tasks", ROOT / "bench") if folder.is_dir()
             for p in sorted(folder.glob("*.py"))]
    modules = {module_name(p): p for p in files}
    return {name: imports_of(path, modules) for name, path in modules.items()}


def cycles(graph):
    """Every import cycle found by a depth-first search, each as the list of modules around it."""
    found, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node, path):
        state[node] = 1
        for other in graph.get(node, {}):
            if state.get(other) == 1:
                found.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_imports_run_one_way_lazy_imports_included():
    graph = import_graph()
    assert {"mamba_minimal", "mamba_engine", "pscan"} <= set(graph)
    assert "pscan" in graph["mamba_minimal"] and "mamba_minimal" in graph["mamba_engine"]  # the parser sees imports
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}" for c in found)


def test_the_lesson_imports_torch_pscan_and_the_standard_library_only():
    # a file copied with the ones it imports runs: mamba_minimal.py needs pscan.py and torch,
    # pscan.py torch alone (and neither imports anything, anywhere, that a copier lacks)
    allowed = set(sys.stdlib_module_names) | {"torch"}
    for name, own in (("mamba_minimal.py", {"pscan"}), ("pscan.py", set())):
        tree = ast.parse((ROOT / name).read_text())
        top = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                top.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: a relative import at line {node.lineno}"
                top.add(node.module.split(".")[0])
        assert top - allowed - own == set(), f"{name} imports {sorted(top - allowed - own)}"


def test_the_lesson_is_at_most_900_lines():
    assert len((ROOT / "mamba_minimal.py").read_text().splitlines()) <= 900


def test_the_lesson_reads_top_to_bottom_without_a_forward_reference():
    # every module-level name a function or class of mamba_minimal.py uses is defined above it
    tree = ast.parse((ROOT / "mamba_minimal.py").read_text())
    defined = {}
    for node in tree.body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
            t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        for name in names:
            defined.setdefault(name, node.lineno)
    ahead = [f"line {use.lineno}: {node.name} uses {use.id}, defined at line {defined[use.id]}"
             for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
             for use in ast.walk(node) if isinstance(use, ast.Name) and isinstance(use.ctx, ast.Load)
             and defined.get(use.id, 0) > node.lineno]
    assert not ahead, ahead


@pytest.mark.parametrize("generation", [1, 2, 3])
def test_the_backbone_of_every_generation_maps_vectors_to_vectors_and_steps_as_its_forward(generation):
    # (b, L, d_model) -> (b, L, d_model) with no embedding, its official init, and an O(1) step: the
    # step after a forward over the first L - 1 positions gives the forward's last output (float64:
    # the two orders of the same sums differ by rounding only)
    import mamba2_minimal as m2
    import mamba3_minimal as m3
    cfg, mixer_cls = {
        1: (mm.MambaConfig(d_model=16, n_layer=2, d_state=4), mm.MambaMixer),
        2: (m2.Mamba2Config(d_model=32, n_layer=2, vocab_size=11, headdim=16, d_state=8, chunk_size=4), m2.Mamba2Mixer),
        3: (m3.Mamba3Config(d_model=16, n_layer=2, vocab_size=11, headdim=8, d_state=8, chunk_size=4), m3.Mamba3Mixer),
    }[generation]
    backbone = mm.Mamba(cfg, mixer_cls).double()
    assert not hasattr(backbone, "embedding")
    x = torch.randn(2, 9, cfg.d_model, dtype=torch.float64)
    full = backbone(x)
    assert full.shape == x.shape
    first, cache = backbone(x[:, :8], want_cache=True)
    last = backbone.step(x[:, 8], cache)
    assert (first - full[:, :8]).abs().max() < 1e-12
    assert (last - full[:, 8]).abs().max() < 1e-12
