"""A checkpoint folder from a stranger: whatever it holds, pretrained.load and pretrained.py end with
the right model or a one-line error that names the problem, never run code, never hang, and never
allocate what the weights will replace. The cases are those of the outside review fuzz-3 (F1-F13)."""

import io
import json
import os
import re
import signal
import sys
import types

import pytest
import torch

import mamba_minimal as mm
import pretrained
from test_pretrained import CharTokenizer, ids, tiny

unix_only = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs and /dev/zero are Unix's")


@pytest.fixture
def tokenizer_names(monkeypatch):
    """pretrained.py's tokenizer: CharTokenizer, whatever the name; the names asked for, in order."""
    names = []
    monkeypatch.setattr(pretrained, "load_tokenizer", lambda name: names.append(name) or CharTokenizer())
    return names


def one_line_error(call, kind=ValueError):
    """The error call() raises: of kind, in one line (no traceback text inside, no advice in paragraphs)."""
    with pytest.raises(kind) as err:
        call()
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


@pytest.fixture
def deadline():
    """A load that waits on a FIFO would hang the test run: SIGALRM ends it with an error instead."""
    def stop(signum, frame):
        raise TimeoutError("the loader waited on a file that never ends")
    before = signal.signal(signal.SIGALRM, stop)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


def saved(tmp_path, generation=1, name="ckpt", safe=False):
    model = tiny(generation)
    pretrained.save(model, tmp_path / name, safe_serialization=safe)
    return tmp_path / name, model


def edit_config(folder, change):
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


# ------------------------------------------------------------------------------------------------
# F1: a transformers Mamba-1 config.json whose activation is not SiLU
# ------------------------------------------------------------------------------------------------

def write_transformers_mamba1(folder, hidden_act):
    model = mm.MambaLM(mm.MambaConfig(d_model=16, n_layer=2, vocab_size=32, d_state=4, pad_vocab_size_multiple=1))
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "mamba", "hidden_size": 16, "num_hidden_layers": 2, "vocab_size": 32, "state_size": 4,
        "expand": 2, "conv_kernel": 4, "time_step_rank": 1, "hidden_act": hidden_act}))
    sd = {k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in model.state_dict().items()}
    torch.save(sd, folder / "pytorch_model.bin")
    return model


def test_a_transformers_mamba1_checkpoint_with_another_activation_is_refused(tmp_path):
    # transformers applies ACT2FN[hidden_act] after the conv and on the gate; the mixer computes SiLU
    model = write_transformers_mamba1(tmp_path / "silu", "silu")
    assert torch.equal(pretrained.load(tmp_path / "silu")(ids()), model(ids()))
    write_transformers_mamba1(tmp_path / "gelu", "gelu")
    assert "hidden_act 'gelu' is not supported, only silu" in one_line_error(lambda: pretrained.load(tmp_path / "gelu"))


# ------------------------------------------------------------------------------------------------
# F2: a folder's tokenizer never runs the folder's code
# ------------------------------------------------------------------------------------------------

def test_the_tokenizer_is_loaded_without_remote_code(monkeypatch):
    calls = []
    stand_in = types.ModuleType("transformers")
    stand_in.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda name, **kw: calls.append(kw) or "tok")
    monkeypatch.setitem(sys.modules, "transformers", stand_in)
    assert pretrained.load_tokenizer("some/folder") == "tok"
    assert calls == [{"trust_remote_code": False}]


def test_a_tokenizer_with_code_of_its_own_is_refused_even_when_the_user_says_yes(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    folder, _ = saved(tmp_path)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"}))
    ran = tmp_path / "ran"
    (folder / "evil_tok.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # transformers' prompt, answered yes
    with pytest.raises(SystemExit) as stop:
        pretrained.main(["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "1"])
    assert "asks to run Python files of its own (auto_map), which is refused" in str(stop.value)
    assert not ran.exists()


# ------------------------------------------------------------------------------------------------
# F3: sizes checked against the checkpoint before anything is built, and nothing built for real
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("generation", [1, 2, 3])
@pytest.mark.parametrize("field, value, message", [
    ("n_layer", 10 ** 6, "n_layer = 1000000, but the checkpoint holds 2 layers"),
    ("n_layer", 2 ** 70, f"n_layer = {2 ** 70}, but the checkpoint holds 2 layers"),
    ("d_model", 10 ** 9, r"backbone.embedding.weight has shape .*d_model = 1000000000 need"),
    ("vocab_size", 10 ** 12, r"vocab_size = 1000000000000 \(padded to 1000000000000\)"),
])
def test_sizes_the_checkpoint_fixes_are_compared_before_the_model_is_built(tmp_path, monkeypatch, generation,
                                                                          field, value, message):
    folder, _ = saved(tmp_path, generation)
    edit_config(folder, lambda c: c.update({field: value}))
    monkeypatch.setattr(mm.Mamba, "__init__", lambda *a, **kw: pytest.fail("built before the sizes were checked"))
    with pytest.raises(ValueError, match=message):
        pretrained.load(folder)


@pytest.mark.parametrize("generation, field, value, message", [
    (1, "d_state", 10 ** 9, r"A_log has shape \(32, 4\), the config expects \(32, 1000000000\)"),
    (1, "d_state", 2 ** 70, f"too large to build \\(d_state = {2 ** 70}\\)"),
    (1, "expand", 2 ** 62, f"too large to build \\(expand = {2 ** 62}\\)"),
    (2, "headdim", 2 ** 40, "must be a multiple of headdim"),
    (3, "d_state", 10 ** 9, "has shape"),
    (3, "d_state", 2 ** 70, "too large to build"),
])
def test_other_huge_sizes_are_refused_by_name_without_memory(tmp_path, generation, field, value, message):
    folder, _ = saved(tmp_path, generation)
    edit_config(folder, lambda c: c["ssm_cfg"].update({field: value}))
    assert re.search(message, one_line_error(lambda: pretrained.load(folder)))


@pytest.mark.parametrize("generation", [1, 2, 3])
def test_loading_makes_no_parameter_in_real_memory(tmp_path, monkeypatch, generation):
    # every Parameter made while the model is built holds meta tensors: nn.Linear's torch.empty and
    # the SSM parameters' inits never touch real memory, whatever sizes config.json asks for
    # (until the checkpoint's own tensors are handed to it by load_state_dict)
    folder, model = saved(tmp_path, generation)
    devices, assigning = [], []
    new, load_state_dict = torch.nn.Parameter.__new__, torch.nn.Module.load_state_dict

    def recorded(cls, data=None, requires_grad=True):
        if not assigning:
            devices.append(data.device.type)
        return new(cls, data, requires_grad)

    monkeypatch.setattr(torch.nn.Parameter, "__new__", recorded)
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", lambda *a, **kw: assigning.append(1) or load_state_dict(*a, **kw))
    loaded = pretrained.load(folder)
    assert devices and set(devices) == {"meta"}, devices
    monkeypatch.undo()
    assert torch.equal(loaded(ids()), model(ids()))


# ------------------------------------------------------------------------------------------------
# F4: files that are not regular files; JSON read with a bound
# ------------------------------------------------------------------------------------------------

@unix_only
@pytest.mark.parametrize("name", ["config.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "shard.bin"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_without_waiting(tmp_path, deadline, name):
    folder, model = saved(tmp_path)
    if name != "config.json":
        os.remove(folder / "pytorch_model.bin")
    if name == "shard.bin":
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"weight_map": {k: "shard.bin" for k in model.state_dict()}}))
    if (folder / name).exists():
        os.remove(folder / name)
    os.mkfifo(folder / name)
    assert f"{name} is a FIFO; a checkpoint's files must be regular files" in one_line_error(
        lambda: pretrained.load(folder))


@unix_only
@pytest.mark.parametrize("target", ["/dev/zero", "/dev/null"])
def test_a_config_json_linked_to_a_device_is_refused(tmp_path, deadline, target):
    folder, _ = saved(tmp_path)
    os.remove(folder / "config.json")
    os.symlink(target, folder / "config.json")
    assert "config.json is a device" in one_line_error(lambda: pretrained.load(folder))


@unix_only
def test_a_tokenizer_file_that_is_a_fifo_is_refused_before_transformers_opens_it(tmp_path, deadline, tokenizer_names):
    folder, _ = saved(tmp_path)
    os.mkfifo(folder / "tokenizer.json")
    with pytest.raises(SystemExit, match="tokenizer.json is a FIFO; a checkpoint's files must be regular files"):
        pretrained.main(["generate", str(folder), "--prompt", "a", "--max-new-tokens", "1"])
    assert tokenizer_names == []


def test_a_config_json_that_is_a_folder_is_refused(tmp_path):
    folder, _ = saved(tmp_path)
    os.remove(folder / "config.json")
    (folder / "config.json").mkdir()
    assert "config.json is a folder" in one_line_error(lambda: pretrained.load(folder))


def test_a_config_json_larger_than_the_bound_is_refused_unread(tmp_path, monkeypatch):
    folder, _ = saved(tmp_path)
    monkeypatch.setattr(pretrained, "MAX_JSON_BYTES", 1000)
    (folder / "config.json").write_text(" " * 1001 + "{}")
    assert "config.json is larger than" in one_line_error(lambda: pretrained.load(folder))


@unix_only
def test_symbolic_links_to_regular_files_load_as_the_hub_cache_makes_them(tmp_path):
    folder, model = saved(tmp_path, safe=False)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in ("config.json", "pytorch_model.bin"):
        os.replace(folder / name, blobs / name)
        os.symlink(os.path.relpath(blobs / name, folder), folder / name)
    assert torch.equal(pretrained.load(folder)(ids()), model(ids()))


# ------------------------------------------------------------------------------------------------
# F6, F7, F12, F13: what the weights files hold
# ------------------------------------------------------------------------------------------------

def with_tensor(folder, model, name, tensor):
    sd = dict(model.state_dict())
    sd[name] = tensor
    torch.save(sd, folder / "pytorch_model.bin")


KEY = "backbone.layers.0.mixer.in_proj.weight"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_are_refused_by_name(tmp_path, bad):
    folder, model = saved(tmp_path)
    w = model.state_dict()[KEY].clone()
    w[3, 2] = bad
    with_tensor(folder, model, KEY, w)
    assert f"checkpoint tensor {KEY} holds NaN or infinite values" in one_line_error(lambda: pretrained.load(folder))


def test_weights_beyond_the_range_of_the_asked_dtype_are_refused(tmp_path):
    # 1e5 is finite in fp32 and inf in fp16 (largest 65504)
    folder, model = saved(tmp_path)
    w = model.state_dict()[KEY].clone()
    w[0, 0] = 1e5
    with_tensor(folder, model, KEY, w)
    assert pretrained.load(folder, dtype=torch.float32).state_dict()[KEY][0, 0] == 1e5
    assert "holds NaN or infinite values in torch.float16" in one_line_error(
        lambda: pretrained.load(folder, dtype=torch.float16))


@pytest.mark.parametrize("make", [lambda w: torch.empty_like(w, device="meta"), lambda w: w.to_sparse()],
                         ids=["meta", "sparse"])
def test_meta_and_sparse_tensors_are_refused(tmp_path, make):
    folder, model = saved(tmp_path)
    with_tensor(folder, model, KEY, make(model.state_dict()[KEY]))
    assert f"checkpoint tensor {KEY} in" in one_line_error(lambda: pretrained.load(folder))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64])
@pytest.mark.parametrize("safe", [False, True])
def test_tensors_that_are_not_floating_point_are_refused(tmp_path, dtype, safe):
    save_file = pytest.importorskip("safetensors.torch").save_file if safe else None
    folder, model = saved(tmp_path, safe=safe)
    bad = model.state_dict()[KEY].to(dtype)
    if safe:
        sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file({**sd, KEY: bad}, str(folder / "model.safetensors"))
    else:
        with_tensor(folder, model, KEY, bad)
    assert f"checkpoint tensor {KEY} is {dtype}" in one_line_error(lambda: pretrained.load(folder))


class Exec:
    def __reduce__(self):
        return exec, ("import os; os.environ['PRETRAINED_TEST_RAN'] = 'yes'",)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_refused_pickle_is_reported_in_one_line(tmp_path, monkeypatch, sharded):
    monkeypatch.delenv("PRETRAINED_TEST_RAN", raising=False)
    folder, model = saved(tmp_path)
    name = "pytorch_model.bin"
    if sharded:
        os.remove(folder / name)
        name = "shard.bin"
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {KEY: name}}))
    torch.save({**model.state_dict(), "extra": Exec()}, folder / name)
    message = one_line_error(lambda: pretrained.load(folder))
    assert f"{name} could not be read: a pickle of more than tensors (it would call exec) is refused" in message
    assert "add_safe_globals" not in message and "PRETRAINED_TEST_RAN" not in os.environ


def test_a_damaged_pickle_is_reported_by_the_line_that_says_why(tmp_path):
    folder, _ = saved(tmp_path)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04\x95 not a checkpoint")
    message = one_line_error(lambda: pretrained.load(folder))
    assert "could not be read as a PyTorch state dict (truncated or not a checkpoint?): Unsupported operand" in message
    assert "weights_only" not in message  # torch's advice to load it with weights_only=False


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    folder, model = saved(tmp_path)
    os.remove(folder / "pytorch_model.bin")
    sd = model.state_dict()
    torch.save(sd, folder / "a.bin")
    torch.save({KEY: sd[KEY] + 1}, folder / "b.bin")
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {**{k: "a.bin" for k in sd}, KEY: "b.bin"}}))
    assert f"checkpoint tensor {KEY} is in both a.bin and b.bin" in one_line_error(lambda: pretrained.load(folder))


def test_a_tensor_under_both_layouts_names_is_refused(tmp_path):
    folder, model = saved(tmp_path)
    sd = dict(model.state_dict())
    sd["backbone.embeddings.weight"] = sd["backbone.embedding.weight"] + 1
    torch.save(sd, folder / "pytorch_model.bin")
    assert "backbone.embedding.weight is given twice (as backbone.embedding.* and backbone.embeddings.*)" in one_line_error(
        lambda: pretrained.load(folder))


# ------------------------------------------------------------------------------------------------
# F11: crafted config.json and index files that reached tracebacks or named the wrong value
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["config.json", "pytorch_model.bin.index.json"])
def test_json_nested_too_deeply_is_refused_by_name(tmp_path, name):
    folder, _ = saved(tmp_path)
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    if name != "config.json":
        os.remove(folder / "pytorch_model.bin")
    assert f"{name} nests its JSON too deeply" in one_line_error(lambda: pretrained.load(folder))


def test_a_config_json_that_is_not_utf8_is_named(tmp_path):
    folder, _ = saved(tmp_path)
    (folder / "config.json").write_bytes(b'{"d_model": "caf\xe9"}')
    assert "config.json is not UTF-8 text (byte 0xe9" in one_line_error(lambda: pretrained.load(folder))


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(hidden_size=None), "Mamba2Config.d_model must be a positive integer, got None"),
    (lambda c: c.update(expand=None), "Mamba2Config.expand must be a positive integer, got None"),
    (lambda c: c.update(head_dim={}), r"Mamba2Config.headdim must be a positive integer, got \{\}"),
    (lambda c: c.update(num_heads={}), r"num_heads \* head_dim = \{\} \* 16 must equal"),
    (lambda c: c.update(time_step_limit=[0, {"__float__": "bogus"}]), "dt_limit must hold numbers"),
])
def test_a_transformers_mamba2_config_with_mistyped_sizes_is_refused_by_name(tmp_path, change, message):
    folder, model = saved(tmp_path, 2)
    config = {"model_type": "mamba2", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 32, "state_size": 8,
              "expand": 2, "head_dim": 16, "num_heads": 4, "n_groups": 2, "chunk_size": 8, "tie_word_embeddings": True}
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        pretrained.load(folder)


@pytest.mark.parametrize("field, value", [("rmsnorm", [1]), ("rmsnorm", "yes"), ("norm_before_gate", None),
                                          ("D_has_hdim", "no")])
def test_a_mamba2_option_supported_at_one_value_names_the_value_given(tmp_path, field, value):
    folder, _ = saved(tmp_path, 2)
    edit_config(folder, lambda c: c["ssm_cfg"].update({field: value}))
    assert f"ssm_cfg.{field} = {value!r} is not supported" in one_line_error(lambda: pretrained.load(folder))


@pytest.mark.parametrize("config, message", [
    ({"hidden_size": 8, "model_type": ["mamba"]}, "describes a transformers ['mamba'] model"),
    ({"d_model": 8, "ssm_cfg": {"layer": ["Mamba1"]}}, "ssm_cfg.layer must be Mamba1, Mamba2 or Mamba3, got ['Mamba1']"),
])
def test_generation_of_names_values_of_the_wrong_type(config, message):
    assert message in one_line_error(lambda: pretrained.generation_of(config))


@pytest.mark.parametrize("index, message", [({"weight_map": []}, "must be JSON with a weight_map"),
                                            ([1], "must be JSON with a weight_map"),
                                            ({"weight_map": {"a": 3}}, "lists the shard 3"),
                                            ({"weight_map": {"a": ""}}, "lists the shard ''")])
def test_an_index_of_the_wrong_shape_is_refused_by_name(tmp_path, index, message):
    folder, _ = saved(tmp_path)
    os.remove(folder / "pytorch_model.bin")
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert message in one_line_error(lambda: pretrained.load(folder))


@pytest.mark.parametrize("path_or_id", ["", "a/b/../c\0", "not a hub id", "owner/name/extra", "owner/na me"])
def test_what_is_neither_a_folder_nor_a_hub_id_is_refused_before_any_download(monkeypatch, path_or_id):
    hub = types.ModuleType("huggingface_hub")
    hub.list_repo_files = hub.snapshot_download = lambda *a, **kw: pytest.fail(f"asked the hub for {path_or_id!r}")
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    one_line_error(lambda: pretrained.load(path_or_id), (ValueError, FileNotFoundError))


@pytest.mark.parametrize("kwargs, message", [
    ({"cls": [1]}, "cls must be None, MambaLM, Mamba2LM or Mamba3LM"),
    ({"cls": dict}, "cls must be None, MambaLM, Mamba2LM or Mamba3LM"),
    ({"device": "gpu0"}, "device gpu0 is not a device name"),
    ({"device": 3.5}, "device 3.5 is not a device name"),
])
def test_load_arguments_of_the_wrong_kind_are_refused_by_name(tmp_path, kwargs, message):
    folder, _ = saved(tmp_path)
    assert message in one_line_error(lambda: pretrained.load(folder, **kwargs))


@pytest.mark.parametrize("args, message", [
    (("MODEL", 3), "folder must be a path, got int"),
    (("MODEL", "FOLDER", "yes"), "safe_serialization must be True, False or None, got 'yes'"),
    ((None, "FOLDER"), "save writes a MambaLM, Mamba2LM or Mamba3LM, got a NoneType"),
])
def test_save_arguments_of_the_wrong_kind_are_refused_by_name(tmp_path, args, message):
    args = tuple({"MODEL": tiny(1), "FOLDER": str(tmp_path / "out")}.get(a, a) if isinstance(a, str) else a
                 for a in args)
    assert message in one_line_error(lambda: pretrained.save(*args))
    assert not (tmp_path / "out").exists()


def test_save_into_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "exists and is not a folder" in one_line_error(lambda: pretrained.save(tiny(1), tmp_path / "file"))


# ------------------------------------------------------------------------------------------------
# F9, F10, F11: the command's flags
# ------------------------------------------------------------------------------------------------

def generated(capsys, folder, *flags):
    pretrained.main(["generate", str(folder), "--prompt", "the cat", "--max-new-tokens", "6", *flags])
    return capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--temperature", "1e-45"], ["--temperature", "1e-300"], ["--top-p", "1e-300"],
                                   ["--temperature", "1e-46", "--top-p", "1e-40"]])
def test_temperatures_and_top_p_that_underflow_float32_decode_greedily(tmp_path, capsys, tokenizer_names, flags):
    # greedy is the limit of both; divided in float32 they would give NaN, or drop every token
    folder, _ = saved(tmp_path)
    assert generated(capsys, folder, *flags) == generated(capsys, folder, "--temperature", "0")


@pytest.mark.parametrize("flags, message", [
    (["--threads", str(4 * (os.cpu_count() or 1) + 1)], "is more than 4 x the"),
    (["--seed", str(2 ** 64)], "--seed must lie in [0, 2**64)"),
    (["--seed", "-1"], "--seed must lie in [0, 2**64)"),
])
def test_flags_beyond_what_torch_takes_are_refused_by_name(tmp_path, capsys, monkeypatch, tokenizer_names, flags, message):
    # torch.set_num_threads(100000) ends the process (a segfault, or a panic in tokenizers' pool)
    folder, _ = saved(tmp_path)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: pytest.fail(f"set_num_threads({n}) was called"))
    with pytest.raises(SystemExit):
        pretrained.main(["generate", str(folder), "--prompt", "a"] + flags)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# The sweep over the rooms' entry points (issue 46 item 4): what it found, each now one clear error
# ------------------------------------------------------------------------------------------------

def test_a_transformers_config_without_model_type_loads_by_its_fields(tmp_path):
    # transformers writes model_type; a hand-made config.json may leave it out, and its fields say which
    model = write_transformers_mamba1(tmp_path / "ckpt", "silu")
    edit_config(tmp_path / "ckpt", lambda c: c.pop("model_type"))
    assert torch.equal(pretrained.load(tmp_path / "ckpt", cls=mm.MambaLM)(ids()), model(ids()))
    edit_config(tmp_path / "ckpt", lambda c: c.update(architectures=7))
    assert torch.equal(pretrained.load(tmp_path / "ckpt")(ids()), model(ids()))


def test_the_rooms_refuse_what_is_not_a_model_or_a_tensor_in_one_line():
    import hybrid
    import mamba_engine
    backbone = mm.Mamba(mm.MambaConfig(d_model=16, n_layer=2))
    cases = [
        (lambda: mamba_engine.accelerate(None), "accelerate takes a built model"),
        (lambda: mamba_engine.compile_decode("model"), "compile_decode takes a built language model"),
        (lambda: mamba_engine.selective_scan(None, None, None, None, None), "x must be a tensor"),
        (lambda: hybrid.HybridMambaConfig(attn_layer_idx=[[1]]), "attn_layer_idx must be a list of distinct"),
        (lambda: mm.MambaLM(mm.MambaConfig())(None), "input_ids must be a tensor of shape"),
        (lambda: backbone(torch.zeros(2, 5)), "shape \\(b, L, d_model\\) with d_model = 16"),
        (lambda: backbone(torch.zeros(2, 5, 16, dtype=torch.complex64)), "floating-point"),
        (lambda: backbone.step(torch.zeros(2, 16), None), "one entry per layer \\(2\\)"),
        (lambda: backbone.step(torch.zeros(2, 16), []), "one entry per layer \\(2\\)"),
        (lambda: mamba_engine.selective_scan(torch.zeros(1, 3, 4), torch.ones(1, 3, 4), -torch.ones(4, 2),
                                             torch.zeros(1, 3, 2, device="meta"), torch.zeros(1, 3, 2)),
         "inputs must all be on x's device, cpu; got B on meta"),
        (lambda: mm.MambaLM(mm.MambaConfig()).generate(torch.tensor([[1]]), 2, generator="x"),
         "generator must be a torch.Generator or None"),
    ]
    for call, message in cases:
        assert re.search(message, one_line_error(call)), message


def test_temperatures_and_top_p_that_underflow_float32_sample_the_greedy_token():
    # 1e-46 is 0 in fp32: dividing by it gave NaN probabilities; a top_p that is 0 in fp32 dropped every token
    torch.manual_seed(0)
    logits = torch.randn(4, 9)
    greedy = logits.argmax(-1)
    for temperature, top_p in ((1e-46, None), (1e-300, None), (1.0, 1e-300), (1e-30, None)):
        assert torch.equal(mm.sample_next(logits, temperature, top_p=top_p), greedy), (temperature, top_p)
