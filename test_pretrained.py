"""Checkpoints as users meet them: hub repositories (sharded, both formats), loading in half
precision without an fp32 copy, pretrained.save round trips in every dtype, the loader's messages,
and pretrained.py (generate and score with a tokenizer), for the three generations."""

import copy
import json
import os
import re
import shutil
import sys
import types
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

import mamba2_minimal as m2
import hybrid
import mamba3_minimal as m3
import mamba_engine
import mamba_minimal as mm
import pretrained

VOCAB = 29  # padded to 32 (pad_vocab_size_multiple 8): ids 29..31 are never produced


def tiny(generation, seed=0, **kw):
    """A tiny model of each generation, its SSM parameters moved off their init values."""
    torch.manual_seed(seed)
    if generation == 1 and set(kw) & {"d_intermediate", "attn_layer_idx", "attn_cfg", "rms_norm"}:
        model = hybrid.HybridMambaLM(hybrid.HybridMambaConfig(d_model=16, n_layer=2, vocab_size=VOCAB, d_state=4, **kw))
    elif generation == 1:
        model = mm.MambaLM(mm.MambaConfig(d_model=16, n_layer=2, vocab_size=VOCAB, d_state=4, **kw))
    elif generation == 2:
        model = m2.Mamba2LM(m2.Mamba2Config(d_model=32, n_layer=2, vocab_size=VOCAB, d_state=8, headdim=16,
                                            ngroups=2, chunk_size=8, **kw))
    else:
        model = m3.Mamba3LM(m3.Mamba3Config(d_model=32, n_layer=2, vocab_size=VOCAB, d_state=8, headdim=16,
                                            chunk_size=8, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith(("A_log", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


CLASSES = {1: mm.MambaLM, 2: m2.Mamba2LM, 3: m3.Mamba3LM}
KEEP_FP32 = {1: ("mixer.A_log", "mixer.D"), 2: ("mixer.A_log", "mixer.D"), 3: m3._FP32_PARAMETERS}


def in_dtype(model, generation, dtype):
    """The model as the official loaders hold it in dtype: the fp32 list stays fp32 under fp16/bf16."""
    for name, p in model.named_parameters():
        keep = name.endswith(KEEP_FP32[generation]) and dtype in (torch.float16, torch.bfloat16)
        p.data = p.data.to(torch.float32 if keep else dtype)
    return model


def ids(b=2, L=9, seed=1):
    return torch.randint(0, VOCAB, (b, L), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# a hub id: what is downloaded (huggingface_hub's own file filter over a simulated repository)
# ------------------------------------------------------------------------------------------------

def shard(folder, model, fmt):
    """The model's weights in folder as two shards and their index, as transformers writes them."""
    sd = model.state_dict()
    if fmt == "safetensors":
        save = pytest.importorskip("safetensors.torch").save_file
        del sd["lm_head.weight"]  # tied: stored once
    else:
        save = torch.save
    names = sorted(sd)
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        name = f"model-0000{i + 1}-of-00002.{fmt}"
        save({k: sd[k].clone().contiguous() for k in part}, str(folder / name))
        weight_map.update({k: name for k in part})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def fake_hub(monkeypatch, repo, tmp_path, listing_fails=False):
    """huggingface_hub's list_repo_files and snapshot_download, answered from the local folder repo:
    the download copies what filter_repo_objects keeps of the repository's files."""
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub.utils import filter_repo_objects
    downloaded = []

    def list_repo_files(repo_id, **kw):
        if listing_fails:
            raise ConnectionError("offline")
        return sorted(os.listdir(repo))

    def snapshot_download(repo_id, allow_patterns=None, **kw):
        snapshot = tmp_path / "snapshot"
        shutil.rmtree(snapshot, ignore_errors=True)
        snapshot.mkdir()
        for name in filter_repo_objects(sorted(os.listdir(repo)), allow_patterns=allow_patterns):
            shutil.copy(repo / name, snapshot / name)
            downloaded.append(name)
        return str(snapshot)

    monkeypatch.setattr(hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    return downloaded


@pytest.mark.parametrize("generation", [1, 2, 3])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_sharded_hub_repository_loads_with_its_index(tmp_path, monkeypatch, generation, fmt):
    # fuzz-2 N1: the shards came without their index.json, and the loader could not find them
    model = tiny(generation)
    repo = tmp_path / "repo"
    pretrained.save(model, repo, safe_serialization=False)
    os.remove(repo / "pytorch_model.bin")
    shard(repo, model, fmt)
    downloaded = fake_hub(monkeypatch, repo, tmp_path)
    loaded = pretrained.load("owner/sharded", cls=CLASSES[generation])
    assert sorted(downloaded) == sorted(os.listdir(repo))
    assert torch.equal(loaded(ids()), model(ids()))


def test_a_hub_repository_with_both_formats_downloads_one(tmp_path, monkeypatch):
    model = tiny(1)
    repo = tmp_path / "repo"
    pretrained.save(model, repo, safe_serialization=False)
    pytest.importorskip("safetensors")
    shutil.copy(repo / "pytorch_model.bin", tmp_path / "saved.bin")
    pretrained.save(model, repo, safe_serialization=True)  # removes the .bin
    shutil.copy(tmp_path / "saved.bin", repo / "pytorch_model.bin")
    downloaded = fake_hub(monkeypatch, repo, tmp_path)
    assert torch.equal(pretrained.load("owner/both", cls=mm.MambaLM)(ids()), model(ids()))
    assert sorted(downloaded) == ["config.json", "model.safetensors"]  # safetensors first, as transformers
    # without the safetensors package: the .bin, never a file it cannot read
    monkeypatch.setattr(pretrained, "_safetensors_installed", lambda: False)
    downloaded.clear()
    assert torch.equal(pretrained.load("owner/both", cls=mm.MambaLM)(ids()), model(ids()))
    assert sorted(downloaded) == ["config.json", "pytorch_model.bin"]
    # the file list unknown (offline): both formats may come from the cache; the loader picks one
    assert set(pretrained._download_patterns(None)) >= {"config.json", "*.safetensors", "*.bin",
                                                "model.safetensors.index.json", "pytorch_model.bin.index.json"}


# ------------------------------------------------------------------------------------------------
# dtype and device: no fp32 model beside a half-precision one
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("generation", [1, 2, 3])
def test_a_bf16_checkpoint_loads_in_bf16_into_the_files_own_tensors(tmp_path, monkeypatch, generation):
    # the parameters are the tensors read from the file: no other copy of the weights was made,
    # in particular no fp32 model that the weights were copied into
    model = in_dtype(tiny(generation), generation, torch.bfloat16)
    pretrained.save(model, tmp_path, safe_serialization=False)
    read = {}
    real_read = pretrained._read_weights
    monkeypatch.setattr(pretrained, "_read_weights", lambda path: read.setdefault(path, real_read(path)))
    built = []
    real_init = mm.Mamba._init_weights  # the backbone's official init, every generation's
    monkeypatch.setattr(mm.Mamba, "_init_weights", lambda self, n_layer: built.append(
        {p.device.type for p in self.parameters()}) or real_init(self, n_layer))
    loaded = pretrained.load(tmp_path, cls=CLASSES[generation], dtype=torch.bfloat16)
    assert built == [{"meta"}]  # built without memory for its parameters
    (file_sd,) = read.values()
    for name, p in loaded.named_parameters():
        assert p.dtype == model.state_dict()[name].dtype, name
        assert torch.equal(p, model.state_dict()[name]), name
        assert p.data_ptr() == file_sd[name].data_ptr(), name
    assert loaded.lm_head.weight is loaded.backbone.embedding.weight
    assert len(list(loaded.parameters())) == len(file_sd) - 1  # the tied head counted once
    assert torch.equal(loaded(ids()), model(ids()))


class BufferMixer(mm.MambaMixer):
    """A mixer with a value computed at construction and saved in no checkpoint, as rotary
    frequencies are: loading must leave it as construction made it."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.register_buffer("freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)


class BufferLM(mm.MambaLM):
    def __init__(self, cfg):
        super().__init__(cfg, mixer_cls=BufferMixer)


def test_buffers_computed_at_construction_survive_loading(tmp_path):
    model = BufferLM(mm.MambaConfig(d_model=16, n_layer=2, vocab_size=VOCAB, d_state=4))
    pretrained.save(model, tmp_path)
    for dtype in (None, torch.bfloat16):
        cfg = pretrained.config_from_dict(pretrained.read_config_json(tmp_path))
        loaded = pretrained.load_weights(BufferLM, cfg, tmp_path, dtype=dtype)
        for layer in loaded.backbone.layers:
            assert layer.mixer.freq.device.type == "cpu"
            torch.testing.assert_close(layer.mixer.freq, 1.0 / 10000 ** (torch.tensor([0.0, 2, 4, 6]) / 8),
                                       rtol=0, atol=0)


@pytest.mark.parametrize("generation", [1, 2, 3])
def test_the_meta_device_loader_gives_a_usable_model(tmp_path, generation):
    # training after loading: gradients reach every parameter once, the tied one included, and
    # an optimizer step changes the head with the embedding
    model = tiny(generation)
    pretrained.save(model, tmp_path)
    loaded = pretrained.load(tmp_path, cls=CLASSES[generation]).train()
    assert all(p.requires_grad and p.device.type == "cpu" for p in loaded.parameters())
    # one Parameter for the tied pair: two over one storage would each get an optimizer state
    assert loaded.lm_head.weight is loaded.backbone.embedding.weight
    assert len(list(loaded.parameters())) == len(list(model.parameters()))
    loss = F.cross_entropy(loaded(ids()).flatten(0, 1), ids(seed=2).flatten())
    loss.backward()
    assert all(p.grad is not None for p in loaded.parameters())
    torch.optim.SGD(loaded.parameters(), lr=0.1).step()
    assert torch.equal(loaded.lm_head.weight, loaded.backbone.embedding.weight)
    assert not torch.equal(loaded.lm_head.weight, model.lm_head.weight)


# ------------------------------------------------------------------------------------------------
# pretrained.save: the official layout, every dtype, both formats, written atomically
# ------------------------------------------------------------------------------------------------

# The official MambaLMHeadModel config (mamba_ssm/models/config_mamba.py, official main e9594ce) and
# the arguments of each official mixer (modules/mamba_simple.py Mamba, mamba2.py Mamba2, mamba3.py
# Mamba3), written out: a config.json with any other key fails MambaConfig(**config) there.
OFFICIAL_TOP = {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "attn_cfg",
                "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings"}
OFFICIAL_MIXER = {
    1: {"d_state", "d_conv", "expand", "dt_rank", "dt_min", "dt_max", "dt_init", "dt_scale", "dt_init_floor",
        "conv_bias", "bias", "use_fast_path"},
    2: {"d_state", "d_conv", "conv_init", "expand", "headdim", "d_ssm", "ngroups", "A_init_range", "D_has_hdim",
        "rmsnorm", "norm_before_gate", "dt_min", "dt_max", "dt_init_floor", "dt_limit", "bias", "conv_bias",
        "chunk_size", "use_mem_eff_path"},
    3: {"d_state", "expand", "headdim", "ngroups", "rope_fraction", "dt_min", "dt_max", "dt_init_floor", "A_floor",
        "is_outproj_norm", "is_mimo", "mimo_rank", "chunk_size", "dropout"},
}


@pytest.mark.parametrize("generation", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("safe", [True, False])
def test_save_round_trips_in_every_dtype(tmp_path, generation, dtype, safe):
    if safe:
        pytest.importorskip("safetensors")
    model = in_dtype(tiny(generation), generation, dtype)
    pretrained.save(model, tmp_path, safe_serialization=safe)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors" if safe else "pytorch_model.bin"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config) <= OFFICIAL_TOP and config["ssm_cfg"]["layer"] == f"Mamba{generation}"
    assert set(config["ssm_cfg"]) - {"layer"} <= OFFICIAL_MIXER[generation]
    loaded = pretrained.load(tmp_path, cls=CLASSES[generation], dtype=dtype)
    assert asdict(loaded.cfg) == asdict(model.cfg)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, t in model.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == t.dtype and torch.equal(got, t), name
    # the same model: the same outputs to the bit, from a copy in torch's own memory (safetensors 0.8
    # maps the file, less aligned, and a kernel may round a last bit otherwise there: _read_weights)
    assert torch.equal(copy.deepcopy(loaded)(ids()), model(ids()))
    # without a dtype: fp32, as the official loader builds its model, from the saved values
    for name, t in pretrained.load(tmp_path, cls=CLASSES[generation]).state_dict().items():
        assert t.dtype == torch.float32 and torch.equal(t, model.state_dict()[name].float()), name


@pytest.mark.parametrize("generation", [1, 2, 3])
def test_a_hybrid_model_round_trips_with_its_attention_and_mlp_layers(tmp_path, generation):
    # attention in layer 1 (GQA, partial rotary, a conv over qkv, an MLP inside), gated MLPs after
    # every mixer: the official hybrid config.json fields, and their weights, through the meta build
    hybrid = dict(d_intermediate=24, attn_layer_idx=[1], attn_cfg=dict(
        num_heads=4, num_heads_kv=2, head_dim=6, rotary_emb_dim=4, d_conv=3, mlp_dim=40, causal=True))
    model = in_dtype(tiny(generation, **hybrid), generation, torch.bfloat16)
    pretrained.save(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config) <= OFFICIAL_TOP and config["attn_layer_idx"] == [1] and config["d_intermediate"] == 24
    loaded = pretrained.load(tmp_path, cls=CLASSES[generation], dtype=torch.bfloat16)
    assert asdict(loaded.cfg) == asdict(model.cfg)
    for name, t in model.state_dict().items():
        assert loaded.state_dict()[name].dtype == t.dtype and torch.equal(loaded.state_dict()[name], t), name
    assert torch.equal(loaded(ids()), model(ids()))


def test_saved_configs_keep_what_is_not_a_default(tmp_path):
    model = tiny(2, dt_limit=(0.0, 0.5), A_init_range=(2, 4), norm_epsilon=1e-4, tie_embeddings=False)
    pretrained.save(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["ssm_cfg"]["dt_limit"] == [0.0, 0.5] and config["norm_epsilon"] == 1e-4
    assert "scan_backend" not in config and "compile_mixer" not in config  # how to run, not what it is
    loaded = pretrained.load(tmp_path, cls=m2.Mamba2LM)
    assert asdict(loaded.cfg) == asdict(model.cfg)
    assert torch.equal(loaded(ids()), model(ids()))
    # Mamba-1's chunk_size says how the fused scan runs: not saved
    fused = mamba_engine.accelerate(mm.MambaLM(mm.MambaConfig(d_model=16, n_layer=1, vocab_size=VOCAB)),
                                    backend="fused", chunk_size=5)
    pretrained.save(fused, tmp_path)
    assert "chunk_size" not in json.loads((tmp_path / "config.json").read_text())


def test_asking_for_safetensors_without_the_package_names_it_and_keeps_the_saved_weights(tmp_path, monkeypatch):
    # and the weights already in the folder are kept: they were removed before the import failed
    old = tiny(1, seed=0)
    pretrained.save(old, tmp_path, safe_serialization=False)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors fails, as when not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match="needs the safetensors package: pip install safetensors .*"
                                          "safe_serialization=False"):
        pretrained.save(tiny(1, seed=1), tmp_path, safe_serialization=True)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "pytorch_model.bin"]
    assert torch.equal(pretrained.load(tmp_path, cls=mm.MambaLM)(ids()), old(ids()))

def test_save_replaces_the_other_format_and_is_atomic(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    old, new = tiny(1, seed=0), tiny(1, seed=1)
    pretrained.save(old, tmp_path, safe_serialization=True)
    pretrained.save(new, tmp_path, safe_serialization=False)
    # a stale model.safetensors would be read before the new pytorch_model.bin
    assert sorted(os.listdir(tmp_path)) == ["config.json", "pytorch_model.bin"]
    assert torch.equal(pretrained.load(tmp_path, cls=mm.MambaLM)(ids()), new(ids()))

    def torn_save(obj, path):  # half a file, then the process dies
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(KeyboardInterrupt):
        pretrained.save(old, tmp_path, safe_serialization=False)
    # no half-written file under any name, and the checkpoint that was there is still whole
    assert sorted(os.listdir(tmp_path)) == ["config.json", "pytorch_model.bin"]
    assert torch.equal(pretrained.load(tmp_path, cls=mm.MambaLM)(ids()), new(ids()))
    monkeypatch.undo()
    pretrained.save(new, tmp_path, safe_serialization=False)
    assert torch.equal(pretrained.load(tmp_path, cls=mm.MambaLM)(ids()), new(ids()))


def safetensors_stand_in(monkeypatch):
    """A stand-in for the safetensors package whose save_file writes a file that is not a checkpoint:
    pretrained.save's steps around it run with or without the package."""
    def save_file(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"not a checkpoint")

    stand_in = types.ModuleType("safetensors.torch")
    stand_in.save_file = save_file
    monkeypatch.setitem(sys.modules, "safetensors", types.ModuleType("safetensors"))
    monkeypatch.setitem(sys.modules, "safetensors.torch", stand_in)
    monkeypatch.setattr(pretrained, "_safetensors_installed", lambda: True)


def test_a_save_that_fails_at_its_last_steps_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    # the new file is written beside the old weights and then takes its name; the other format's
    # file, which a loader might read instead, goes only once the new file has its name. A save
    # refused at the new file's rename (Windows refuses a file that a virus scanner holds open) or
    # at the old file (open, or memory-mapped by the loader) leaves the checkpoint that was there
    # and nothing else; a save that finishes leaves no file of the other format, which a loader
    # without the safetensors package would read
    old, new = tiny(1, seed=0), tiny(1, seed=1)

    safetensors_stand_in(monkeypatch)
    replace, remove = os.replace, os.remove

    def refused(path):
        raise PermissionError(13, "Permission denied", path)

    def new_file(path):  # the new weights, before they take their name
        return ".tmp" in path

    def old_file(path):
        return path.endswith(".bin")

    for safe, moved, removed in ((False, new_file, None), (True, new_file, None), (True, old_file, old_file)):
        folder = tmp_path / f"{safe}_{moved is old_file}"
        pretrained.save(old, folder, safe_serialization=False)
        with monkeypatch.context() as m:  # which file os.replace may not move, os.remove not remove
            m.setattr(os, "replace", lambda src, dst: refused(src) if moved(src) else replace(src, dst))
            m.setattr(os, "remove", lambda path: refused(path) if removed and removed(path) else remove(path))
            with pytest.raises(PermissionError):
                pretrained.save(new, folder, safe_serialization=safe)
        assert sorted(os.listdir(folder)) == ["config.json", "pytorch_model.bin"], folder.name
        assert torch.equal(pretrained.load(folder, cls=mm.MambaLM)(ids()), old(ids())), folder.name
    pretrained.save(new, tmp_path / "True_False", safe_serialization=True)
    assert sorted(os.listdir(tmp_path / "True_False")) == ["config.json", "model.safetensors"]


def test_a_full_disk_at_config_json_leaves_the_old_checkpoint_and_a_stale_file_left_is_only_warned(
        tmp_path, monkeypatch):
    # config.json is written first, so a full disk there stops the save before the weights change;
    # with the weights first, the folder held the new weights and the old config.json, which a
    # model of another width cannot load. And once the new checkpoint is whole, an old-format file
    # that will not go (held open) is a warning, not an error: the folder loads the new model
    old, new = tiny(1, seed=0), tiny(1, seed=1, expand=3)  # another shape: a mixed folder cannot load
    full = OSError(28, "No space left on device")
    pretrained.save(old, tmp_path, safe_serialization=False)
    with monkeypatch.context() as m:
        m.setattr(pretrained, "_write_json", lambda path, d: (_ for _ in ()).throw(full))
        with pytest.raises(OSError, match="No space left"):
            pretrained.save(new, tmp_path, safe_serialization=False)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "pytorch_model.bin"]
    assert torch.equal(pretrained.load(tmp_path, cls=mm.MambaLM)(ids()), old(ids()))

    safetensors_stand_in(monkeypatch)
    folder = tmp_path / "other_format"
    pretrained.save(old, folder, safe_serialization=True)  # model.safetensors, which the new .bin replaces
    remove = os.remove
    with monkeypatch.context() as m:
        m.setattr(os, "remove", lambda path: (_ for _ in ()).throw(PermissionError(13, "Permission denied", path))
                  if ".old" in path else remove(path))
        with pytest.warns(UserWarning, match=r"could not remove .*model\.safetensors\.old\d+ .*delete it by hand"):
            pretrained.save(new, folder, safe_serialization=False)
    left = sorted(os.listdir(folder))
    assert left[0] == "config.json" and re.fullmatch(r"model\.safetensors\.old\d+", left[1]) and \
        left[2:] == ["pytorch_model.bin"], left
    assert torch.equal(pretrained.load(folder, cls=mm.MambaLM)(ids()), new(ids()))

    # the rename of the new file refused and the old file's way back refused too: the error stands,
    # and a warning says where the old weights are
    folder = tmp_path / "nothing_moves"
    pretrained.save(old, folder, safe_serialization=True)
    replace = os.replace
    with monkeypatch.context() as m:
        m.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(PermissionError(13, "Permission denied", src))
                  if ".tmp" in src or ".old" in src else replace(src, dst))
        with pytest.raises(PermissionError), \
                pytest.warns(UserWarning, match=r"could not put .*model\.safetensors back .*old weights are in "
                                                r".*model\.safetensors\.old\d+"):
            pretrained.save(new, folder, safe_serialization=False)


# ------------------------------------------------------------------------------------------------
# the loader's messages (fuzz-2 N13)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("generation", [1, 2, 3])
def test_bad_dtypes_and_unknown_overrides_are_refused_by_name(tmp_path, generation):
    pretrained.save(tiny(generation), tmp_path)
    cls = CLASSES[generation]
    for dtype in (torch.int64, torch.bool, "bf16"):
        with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
            pretrained.load(tmp_path, cls=cls, dtype=dtype)
    with pytest.raises(ValueError, match=r"unknown Mamba\d?Config fields \['frobnicate'\]"):
        pretrained.load(tmp_path, cls=cls, frobnicate=3)
    # an override that is a field: how to run for Mamba-2 and -3, and a model field of Mamba-1's
    # (whose ways to run are mamba_engine.accelerate's arguments, not config fields)
    name, value = ("scan_backend", "sequential") if generation > 1 else ("norm_epsilon", 1e-4)
    assert getattr(pretrained.load(tmp_path, cls=cls, **{name: value}).cfg, name) == value


@pytest.mark.parametrize("generation, field", [(1, "tie_embeddings"), (1, "residual_in_fp32"), (1, "conv_bias"),
                                               (2, "tie_embeddings"), (2, "residual_in_fp32"), (2, "bias")])
def test_booleans_given_as_strings_are_refused(tmp_path, generation, field):
    pretrained.save(tiny(generation), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    where = config["ssm_cfg"] if field in config["ssm_cfg"] else config
    where[field] = "no"  # a non-empty string: true to Python
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{field} must be True or False, got 'no'"):
        pretrained.load(tmp_path, cls=CLASSES[generation])


@pytest.mark.parametrize("generation, field", [(g, f) for g in (1, 2, 3) for f in ("dt_min", "dt_max", "dt_init_floor")]
                         + [(1, "dt_scale"), (3, "A_floor")])
@pytest.mark.parametrize("value", [None, "0.01", [0.01], float("nan")])
def test_init_numbers_that_are_not_numbers_are_refused_by_name(tmp_path, generation, field, value):
    # they reach the Δ init (dt_bias_init) and Mamba-3's A: a TypeError deep inside, or, for a NaN
    # floor, a model whose every Δ is NaN
    pretrained.save(tiny(generation), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["ssm_cfg"][field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{field} must be .*, got {re.escape(repr(value))}"):
        pretrained.load(tmp_path, cls=CLASSES[generation])


@pytest.mark.parametrize("generation", [1, 2, 3])
def test_an_infinite_dt_init_floor_is_refused_by_name(tmp_path, generation):
    # json reads Infinity; as the floor of the Δ init it makes every dt_bias inf, so every Δ and
    # every output of the model NaN
    pretrained.save(tiny(generation), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["ssm_cfg"]["dt_init_floor"] = float("inf")
    (tmp_path / "config.json").write_text(json.dumps(config))  # written as Infinity
    with pytest.raises(ValueError, match="dt_init_floor must be a number >= 0, got inf"):
        pretrained.load(tmp_path, cls=CLASSES[generation])


def test_an_ssm_cfg_that_is_an_empty_list_is_refused_and_null_is_the_default(tmp_path):
    pretrained.save(tiny(1), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["ssm_cfg"] = None  # the official default: Mamba-1 with its defaults
    assert pretrained.config_from_dict(config).d_state == mm.MambaConfig.d_state
    config["ssm_cfg"] = []
    with pytest.raises(ValueError, match="ssm_cfg must be an object of fields, got a list"):
        pretrained.config_from_dict(config)

def test_a_dangling_symlink_and_shards_outside_the_folder_are_named(tmp_path):
    model = tiny(1)
    pretrained.save(model, tmp_path / "ckpt", safe_serialization=False)
    os.remove(tmp_path / "ckpt" / "pytorch_model.bin")
    os.symlink(tmp_path / "blobs" / "gone", tmp_path / "ckpt" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin is a symbolic link to .*gone, which does not exist"):
        pretrained.load(tmp_path / "ckpt", cls=mm.MambaLM)
    os.remove(tmp_path / "ckpt" / "pytorch_model.bin")
    torch.save(model.state_dict(), tmp_path / "outside.bin")
    for name in ("../outside.bin", str(tmp_path / "outside.bin")):
        (tmp_path / "ckpt" / "pytorch_model.bin.index.json").write_text(
            json.dumps({"weight_map": {k: name for k in model.state_dict()}}))
        with pytest.raises(ValueError, match="shards must be file names inside"):
            pretrained.load(tmp_path / "ckpt", cls=mm.MambaLM)


# ------------------------------------------------------------------------------------------------
# pretrained.py: generate and score with a tokenizer
# ------------------------------------------------------------------------------------------------

class CharTokenizer:
    """A stand-in for transformers' tokenizers: one id per letter a..z and space, eos 28."""
    eos_token_id = 28

    def __call__(self, text):
        return {"input_ids": [26 if c == " " else ord(c) - ord("a") for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(" " if i == 26 else "#" if i >= 27 else chr(ord("a") + i) for i in ids)


@pytest.fixture
def char_tokenizer(monkeypatch):
    names = []
    monkeypatch.setattr(pretrained, "load_tokenizer", lambda name: names.append(name) or CharTokenizer())
    return names


@pytest.mark.parametrize("generation", [1, 2, 3])
def test_generate_picks_the_generation_and_prints_the_greedy_continuation(tmp_path, capsys, char_tokenizer,
                                                                          generation):
    model = tiny(generation)
    pretrained.save(model, tmp_path)
    pretrained.main(["generate", str(tmp_path), "--prompt", "the cat", "--max-new-tokens", "12",
                     "--temperature", "0"])
    out = capsys.readouterr().out
    prompt = torch.tensor([CharTokenizer()("the cat")["input_ids"]])
    new = model.generate(prompt, 12, top_k=1)[0, 7:].tolist()
    if CharTokenizer.eos_token_id in new:
        new = new[:new.index(CharTokenizer.eos_token_id)]
    assert out == "the cat" + CharTokenizer().decode(new) + "\n"
    assert char_tokenizer == [pretrained.TOKENIZERS[generation]]


def test_score_is_the_mean_loss_of_the_text_whatever_the_window(tmp_path, capsys, char_tokenizer):
    model = tiny(2).double()
    pretrained.save(model, tmp_path)
    text = "a stitch in time saves nine and a rolling stone gathers no moss"
    (tmp_path / "text.txt").write_text(text)
    token_ids = torch.tensor([CharTokenizer()(text)["input_ids"]])
    # the oracle: one pass over the whole text, log-softmax in float64, each token from those before it
    logits = model(token_ids)[0, :-1, :VOCAB].double()
    expected = -logits.log_softmax(-1).gather(-1, token_ids[0, 1:, None]).mean().item()
    for window in ("1", "5", "8", "1000"):
        pretrained.main(["score", str(tmp_path), "--text", str(tmp_path / "text.txt"), "--window", window,
                         "--dtype", "fp32"])
        out = capsys.readouterr().out
        assert f"{token_ids.shape[1]} tokens, mean loss {expected:.4f} nats/token" in out, (window, out)


@pytest.mark.parametrize("flags, message", [
    (["--device", "foo"], "--device foo is not a device name"),
    (["--device", "cuda:99"], "--device cuda:99: torch finds"),
    (["--device", "cuda"], "--device cuda: torch finds 0 cuda device(s)"),  # the usual mistake: no GPU at all
    (["--threads", "-1"], "--threads must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),  # 0 is falsy: it would be skipped silently
    (["--text", "missing.txt"], "error: cannot read --text missing.txt"),
    (["--text", "."], "error: cannot read --text .: "),  # a folder
    (["--text", "latin1.txt"], "error: cannot read --text latin1.txt: 'utf-8' codec can't decode"),
])
def test_bad_flags_end_with_a_message_that_names_them(tmp_path, capsys, char_tokenizer, monkeypatch, flags, message):
    pretrained.save(tiny(1), tmp_path)
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))  # not UTF-8
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # the same answer on a machine with a GPU
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        pretrained.main(["score", str(tmp_path), "--text", "text.txt"] + flags)
    assert message in str(stop.value) + capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "-1"], "--max-new-tokens must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--top-k", "0"], "--top-k must be at least 1"),
    (["--top-p", "0"], r"--top-p must lie in \(0, 1\]"),
    (["--top-p", "1.5"], r"--top-p must lie in \(0, 1\]"),
])
def test_bad_sampling_flags_end_before_anything_is_printed(tmp_path, capsys, char_tokenizer, flags, message):
    pretrained.save(tiny(1), tmp_path)
    with pytest.raises(SystemExit):
        pretrained.main(["generate", str(tmp_path), "--prompt", "abc"] + flags)
    out, err = capsys.readouterr()
    assert out == "" and re.search(message, err), (out, err)


def test_score_of_a_mamba3_checkpoint_gives_the_loss_under_each_A(tmp_path, capsys, char_tokenizer):
    # a checkpoint trained with the March 2026 release's softplus A: the variant with the lower loss
    # on its own text says which A it needs (mamba3_minimal.A_variant_losses)
    model = tiny(3, A_activation="softplus").double()
    pretrained.save(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["ssm_cfg"]["A_activation"] == "softplus"
    text = "the quick brown fox jumps over the lazy dog"
    (tmp_path / "text.txt").write_text(text)
    token_ids = torch.tensor([CharTokenizer()(text)["input_ids"]])
    expected = {}
    for variant in m3.A_ACTIVATIONS:  # the oracle: one forward per variant, log-softmax in float64
        variant_model = pretrained.load(tmp_path, cls=CLASSES[3], dtype=torch.float64, A_activation=variant)
        logits = variant_model(token_ids)[0, :-1, :VOCAB].double()  # the vocabulary, its padding left out
        expected[variant] = -logits.log_softmax(-1).gather(-1, token_ids[0, 1:, None]).mean().item()
    assert expected["heavy_tail"] != pytest.approx(expected["softplus"], abs=1e-4)
    pretrained.main(["score", str(tmp_path), "--text", str(tmp_path / "text.txt")])
    out = capsys.readouterr().out
    assert "(the config's: softplus): " + ", ".join(f"{v} {expected[v]:.4f}" for v in m3.A_ACTIVATIONS) in out
    assert f"mean loss {expected['softplus']:.4f} nats/token" in out  # the config's A: the line above's loss


def test_a_folder_with_its_own_tokenizer_uses_it_and_the_flag_overrides(tmp_path, char_tokenizer):
    pretrained.save(tiny(1), tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    pretrained.main(["generate", str(tmp_path), "--prompt", "a", "--max-new-tokens", "1"])
    pretrained.main(["generate", str(tmp_path), "--prompt", "a", "--max-new-tokens", "1", "--tokenizer", "x/y"])
    assert char_tokenizer == [str(tmp_path), "x/y"]


def test_generation_of_reads_every_layout():
    assert pretrained.generation_of({"d_model": 8, "ssm_cfg": {}}) == 1
    assert pretrained.generation_of({"d_model": 8, "ssm_cfg": {"layer": "Mamba2"}}) == 2
    assert pretrained.generation_of({"d_model": 8, "ssm_cfg": {"layer": "Mamba3"}}) == 3
    assert pretrained.generation_of({"hidden_size": 8, "model_type": "mamba"}) == 1
    assert pretrained.generation_of({"hidden_size": 8, "model_type": "mamba2"}) == 2
    for config in ({"hidden_size": 8, "model_type": "falcon_mamba"}, {"ssm_cfg": {"layer": "Mamba4"}}):
        with pytest.raises(ValueError):
            pretrained.generation_of(config)


def test_without_transformers_the_tokenizer_message_says_what_to_install(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_transformers(name, *args, **kw):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(SystemExit, match="needs the transformers package: pip install transformers"):
        pretrained.load_tokenizer("EleutherAI/gpt-neox-20b")


@pytest.mark.parametrize("wrong_id", [1000, VOCAB])  # VOCAB: the first id past it, which has a padded row
def test_a_tokenizer_of_another_vocabulary_is_refused(tmp_path, monkeypatch, capsys, wrong_id):
    class Wide(CharTokenizer):
        def __call__(self, text):
            return {"input_ids": [wrong_id]}

    monkeypatch.setattr(pretrained, "load_tokenizer", lambda name: Wide())
    pretrained.save(tiny(1), tmp_path)
    with pytest.raises(SystemExit, match=f"gives id {wrong_id}, and the model has {VOCAB} tokens"):
        pretrained.main(["generate", str(tmp_path), "--prompt", "a"])


def test_a_real_transformers_tokenizer_saved_with_the_checkpoint_runs_end_to_end(tmp_path, capsys):
    # transformers' AutoTokenizer reads the folder's own tokenizer (as a -hf checkpoint ships it)
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    model = tiny(3)
    pretrained.save(model, tmp_path)
    fast.save_pretrained(tmp_path)
    pretrained.main(["generate", str(tmp_path), "--prompt", "w3 w4 w5", "--max-new-tokens", "6", "--temperature", "0"])
    out = capsys.readouterr().out
    new = model.generate(torch.tensor([[5, 6, 7]]), 6, top_k=1)[0, 3:].tolist()
    new = new[:new.index(0)] if 0 in new else new
    assert out.split() == ["w3", "w4", "w5"] + [words[i] for i in new if i > 1]  # <unk> is special: not shown
    (tmp_path / "text.txt").write_text("w1 w2 w3 w9 w9 w2")
    pretrained.main(["score", str(tmp_path), "--text", str(tmp_path / "text.txt")])
    assert capsys.readouterr().out.startswith("6 tokens, mean loss ")
