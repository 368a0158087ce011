"""
pretrained.py: official Mamba checkpoints (Mamba-1, -2 and -3, and the hybrids) in and out, and a
command that runs one with its tokenizer.

    import pretrained
    model = pretrained.load("state-spaces/mamba-130m")   # or a folder; any generation, any layout
    pretrained.save(model, "my-folder")                  # config.json and the weights, official layout

    python pretrained.py generate state-spaces/mamba3-siso-187m --prompt "Hello" --dtype bf16
    python pretrained.py score state-spaces/mamba2-130m --text essay.txt   # mean loss per token

MODEL is a hub id (downloaded with huggingface_hub) or a folder with config.json and the weights in
the official or transformers' (-hf) layout; config.json's generation picks MambaLM (HybridMambaLM with
attention or MLP layers), Mamba2LM or Mamba3LM, and the model files know no layout. A folder is data,
never code: regular files (or links to them, as in the hub's cache), tensors only, sizes checked
against config.json before a model is built on the meta device. A folder's own tokenizer (a -hf
checkpoint's) is read from that folder and never runs code from it. The official checkpoints ship
none: Mamba-1 and -2 were trained with GPT-NeoX's (EleutherAI/gpt-neox-20b, as the official
benchmarks/benchmark_generation_mamba_simple.py loads it), Mamba-3 with Llama 3's (meta-llama/Llama-3.1-8B,
gated: accept its license on the hub and log in, or pass --tokenizer). The tokenizer needs transformers.

Sections:
  1. Reading a folder: hub ids, regular files, the weights files (whole or sharded)
  2. config.json -> a config, for each generation and the hybrids
  3. The weights into a model: sizes checked first, no memory for what they replace
  4. load and save, any generation
  5. Which A a Mamba-3 checkpoint needs
  6. The command: generate and score
"""

import argparse
import contextlib
import importlib.util
import json
import math
import os
import pickle
import re
import stat
import sys
import time
import warnings
from dataclasses import fields

import torch
import torch.nn.functional as F

import mamba3_minimal as m3
import mamba_engine as eng
import mamba_minimal as mm
from hybrid import HybridMambaConfig, HybridMambaLM
from mamba_minimal import MambaConfig, MambaLM
from mamba2_minimal import Mamba2Config, Mamba2LM
from mamba3_minimal import A_ACTIVATIONS, Mamba3Config, Mamba3LM


def _first_line(err):  # torch's and transformers' messages run to paragraphs; the user gets one line
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


# ------------------------------------------------------------------------------------------------
# 1. Reading a folder: hub ids, regular files, the weights files (whole or sharded)
# ------------------------------------------------------------------------------------------------
# Two layouts. Official (state-spaces/mamba-130m): the weights in pytorch_model.bin under the model's
# own key names. transformers (state-spaces/mamba-130m-hf): the same names but backbone.embeddings.*,
# often in model.safetensors without the tied lm_head.weight. Large checkpoints come in shards that an
# index.json lists. A file is opened only once it is known to be a regular file: a FIFO would wait
# forever, /dev/zero be read until memory runs out.

MAX_JSON_BYTES = 16 << 20  # config.json is a few KB; a large model's index.json a few hundred KB


def _regular_file(path, mode=None):
    """Refuse path (of the mode given, else os.stat's) unless it is a regular file or a symbolic link to one."""
    if mode is None:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            if os.path.islink(path):
                raise FileNotFoundError(f"{path} is a symbolic link to {os.readlink(path)}, which does not exist "
                                        f"(an interrupted download? download it again)") from None
            raise
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a plain file")
        raise ValueError(f"{path} is {kind}; a checkpoint's files must be regular files")


def _read_json(path, what):
    """A JSON file of at most MAX_JSON_BYTES, as Python values. Opened without blocking and checked
    through the open file, so that no FIFO or device can take its place in between."""
    _regular_file(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        _regular_file(path, os.fstat(f.fileno()).st_mode)
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MB: not a checkpoint's {what}")
    try:
        return json.loads(data.decode("utf-8-sig"))  # -sig: a byte-order mark, as some editors write
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {data[err.start]:#04x} at {err.start})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:
        raise ValueError(f"{path} nests its JSON too deeply to be a checkpoint's {what}") from None


def read_config_json(folder):
    """The folder's config.json as a dict."""
    path = os.path.join(folder, "config.json")
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no config.json in {folder}")
    d = _read_json(path, "config.json")
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object of config fields, got a {type(d).__name__}")
    return d


def _resolve_folder(path_or_id):
    """A folder, or a hub id downloaded (or found in the hub's cache) -> the folder to read."""
    if not isinstance(path_or_id, (str, os.PathLike)) or not isinstance(os.fspath(path_or_id), str) \
            or "\0" in os.fspath(path_or_id):
        got = repr(path_or_id) if isinstance(path_or_id, (str, os.PathLike)) else type(path_or_id).__name__
        raise ValueError(f"load needs a folder or a hub id such as state-spaces/mamba-130m, got {got}")
    path_or_id = os.fspath(path_or_id)
    if os.path.isdir(path_or_id):
        return path_or_id
    if os.path.lexists(path_or_id):
        raise ValueError(f"{path_or_id} is a file; pass the folder holding config.json and the weights")
    if not re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", path_or_id) or ".." in path_or_id:  # a hub id: owner/name
        raise FileNotFoundError(f"the folder {path_or_id} does not exist (pass a folder holding config.json "
                                f"and the weights, or a hub id such as state-spaces/mamba-130m)")
    try:
        from huggingface_hub import list_repo_files, snapshot_download
    except ImportError:
        raise FileNotFoundError(f"{path_or_id!r} is not a folder, and huggingface_hub is not installed to "
                                f"download it (pip install huggingface_hub, or fetch https://huggingface.co/"
                                f"{path_or_id})") from None
    try:
        files = list_repo_files(path_or_id)
    except Exception:  # offline or unreachable: snapshot_download answers from the cache, or says why not
        files = None
    try:
        return snapshot_download(path_or_id, allow_patterns=_download_patterns(files))
    except Exception as err:  # not on the hub, gated, offline and not in the cache
        raise FileNotFoundError(f"{path_or_id} is not a folder, and the hub gives no checkpoint under that id "
                                f"({_first_line(err)})") from None


def _safetensors_installed():
    return importlib.util.find_spec("safetensors") is not None


def _download_patterns(files):
    """What to download of a repository with these files: config.json and one format of weights with
    its index, .safetensors where the repository has it and the package is installed. files None (the
    list is unknown, offline): both formats, as the cache holds them."""
    safetensors = ["*.safetensors", "model.safetensors.index.json"]
    pickles = ["*.bin", "pytorch_model.bin.index.json"]
    if files is None:
        return ["config.json"] + safetensors + pickles
    has_bin = any(f.endswith(".bin") for f in files)
    use_safetensors = any(f.endswith(".safetensors") for f in files) and (_safetensors_installed() or not has_bin)
    return ["config.json"] + (safetensors if use_safetensors else pickles)


def _weights_files(folder):
    """The folder's weights files in the order they are tried: safetensors first (as transformers
    does), whole or sharded, unless the package is missing; then the .bin."""
    safetensors = ["model.safetensors", "model.safetensors.index.json"]
    pickles = ["pytorch_model.bin", "pytorch_model.bin.index.json"]
    order = safetensors + pickles if _safetensors_installed() else pickles + safetensors
    return [os.path.join(folder, name) for name in order]


def _load_state_dict_file(folder):
    """The folder's weights as one dict: model.safetensors, pytorch_model.bin, or the shards their
    index.json lists. A tensor in two shards is refused: the order of reading would pick the copy."""
    for path in _weights_files(folder):
        if not os.path.lexists(path):
            continue
        if not path.endswith(".index.json"):
            return _read_weights(path)
        index = _read_json(path, "index.json")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path} must be JSON with a weight_map of tensor names to shard files")
        for shard in weight_map.values():  # a name such as ../../x would open a file outside the checkpoint
            if not isinstance(shard, str) or not shard or os.path.isabs(shard) or \
                    ".." in shard.replace("\\", "/").split("/"):
                raise ValueError(f"{path} lists the shard {shard!r}: shards must be file names inside {folder}")
        state_dict, shard_of = {}, {}
        for shard in sorted(set(weight_map.values())):
            part = _read_weights(os.path.join(folder, shard))
            twice = sorted(part.keys() & state_dict.keys())
            if twice:
                raise ValueError(f"checkpoint tensor {twice[0]} is in both {shard_of[twice[0]]} and {shard}: a "
                                 f"tensor must be given once")
            state_dict.update(part)
            shard_of.update(dict.fromkeys(part, shard))
        return state_dict
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (nor a sharded index.json) in {folder}")


def _read_weights(path):
    """One weights file (.bin or .safetensors) as a dict of tensor name -> tensor, memory-mapped: the
    tensors are the file's pages, so loading holds no second copy (safetensors' are aligned to their
    element size, not torch's 64: a CPU kernel may round a last bit otherwise, 1e-16 in fp64). A .bin
    is read with weights_only=True: a pickle that would build anything but tensors is refused."""
    _regular_file(path)
    safetensors = path.endswith(".safetensors")
    if safetensors:
        try:
            from safetensors.torch import load_file
        except ImportError as err:
            raise ImportError(f"{path} needs the safetensors package: pip install safetensors") from err
    try:
        if safetensors:
            state_dict = load_file(path)
        else:
            try:
                state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:  # the legacy (not zip) format cannot be memory-mapped
                if "mmap" not in str(err):
                    raise
                state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated download, a pickle of more than tensors, not a checkpoint
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if isinstance(err, pickle.UnpicklingError) and refused:
            raise ValueError(f"{path} could not be read: a pickle of more than tensors (it would call "
                             f"{refused.group(1)}) is refused; a checkpoint from someone else must never be "
                             f"loaded with weights_only=False") from None
        why = re.search(r"WeightsUnpickler error: *\n*(.+)", str(err))  # torch's paragraphs: the line that says
        raise ValueError(f"{path} could not be read as a PyTorch state dict (truncated or not a checkpoint?): "
                         f"{why.group(1).strip() if why else _first_line(err)}") from None
    if not isinstance(state_dict, dict):
        raise ValueError(f"{path} must hold a dict of tensor name -> tensor (a state dict), got a "
                         f"{type(state_dict).__name__}")
    if not all(isinstance(k, str) for k in state_dict):
        raise ValueError(f"{path} must name its tensors with strings, got the keys {list(state_dict)[:4]}")
    wrong = sorted(k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    if wrong:
        raise ValueError(f"{path} must hold only tensors; not tensors: {wrong[:4]}{' ...' if len(wrong) > 4 else ''}")
    odd = [k for k, t in state_dict.items() if t.device.type == "meta" or t.layout != torch.strided]
    if odd:  # shapes without values, or a sparse tensor
        raise ValueError(f"checkpoint tensor {odd[0]} in {path} is a {state_dict[odd[0]].layout} tensor on "
                         f"{state_dict[odd[0]].device.type}; a checkpoint holds dense tensors with their values")
    return state_dict


# ------------------------------------------------------------------------------------------------
# 2. config.json -> a config, for each generation and the hybrids
# ------------------------------------------------------------------------------------------------
# The official config.json is MambaLMHeadModel's config (mamba_ssm/models/config_mamba.py): the model's
# fields at the top, the hybrid fields (hybrid.py's) among them, and the mixer's in ssm_cfg, whose
# "layer" names the generation. transformers writes its own names (hidden_size, num_hidden_layers,
# state_size ...) for Mamba-1 and -2, and never pads the vocabulary: its embedding has vocab_size rows.

def _is_transformers(d):
    return "hidden_size" in d or "num_hidden_layers" in d


def generation_of(config):
    """config.json's dict -> 1, 2 or 3: the Mamba generation it describes."""
    if _is_transformers(config):
        model_type = config.get("model_type")
        if model_type is None:  # transformers writes it; a hand-made config.json may not: its fields say
            architectures = config.get("architectures")
            two = "head_dim" in config or "num_heads" in config or (
                isinstance(architectures, list) and "Mamba2ForCausalLM" in architectures)
            model_type = "mamba2" if two else "mamba"
        if model_type not in ("mamba", "mamba2"):
            raise ValueError(f"config.json describes a transformers {model_type!r} model; "
                             f"this file loads model_type 'mamba' and 'mamba2'")
        return 1 if model_type == "mamba" else 2
    layer = _ssm_cfg(config).get("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2", "Mamba3"):
        raise ValueError(f"config.json's ssm_cfg.layer must be Mamba1, Mamba2 or Mamba3, got {layer!r}")
    return int(layer[-1])


def _ssm_cfg(d):
    ssm_cfg = {} if d.get("ssm_cfg") is None else d["ssm_cfg"]  # null: the official default
    if not isinstance(ssm_cfg, dict):
        raise ValueError(f"config.json's ssm_cfg must be an object of fields, got a {type(ssm_cfg).__name__}")
    return dict(ssm_cfg)


def _require(d, names):
    missing = [k for k in names if k not in d]
    if missing:
        raise ValueError(f"config.json is missing the fields {missing} (found {sorted(d)})")


def official_lm_fields(d, ours):
    """The fields of an official config.json that a config class has (ours: its field names), null
    attn_layer_idx and attn_cfg read as the official defaults (as create_block does)."""
    return {k: v for k, v in d.items() if k in ours and not (k in ("attn_layer_idx", "attn_cfg") and v is None)}


# Mamba-1. transformers' MambaConfig name -> MambaConfig's
_HF_FIELDS = {
    "hidden_size": "d_model", "num_hidden_layers": "n_layer", "vocab_size": "vocab_size", "state_size": "d_state",
    "expand": "expand", "conv_kernel": "d_conv", "time_step_rank": "dt_rank", "use_conv_bias": "conv_bias",
    "use_bias": "bias", "time_step_min": "dt_min", "time_step_max": "dt_max", "time_step_floor": "dt_init_floor",
    "time_step_scale": "dt_scale", "layer_norm_epsilon": "norm_epsilon", "tie_word_embeddings": "tie_embeddings",
    "residual_in_fp32": "residual_in_fp32", "time_step_init_scheme": "dt_init"}
_OFFICIAL_SSM_FIELDS = {"d_state", "d_conv", "expand", "dt_rank", "dt_min", "dt_max", "dt_init_floor",
                        "dt_scale", "conv_bias", "bias", "dt_init"}
_HYBRID_FIELDS = ("d_intermediate", "attn_layer_idx", "attn_cfg", "rms_norm")


def config_from_dict(d, **overrides):
    """A MambaConfig (HybridMambaConfig where the hybrid fields are set) from an official or a
    transformers config.json dict."""
    to_mamba2 = "; load it with pretrained.load (Mamba2LM)"
    if _is_transformers(d):
        if d.get("model_type") == "mamba2" or "head_dim" in d or "num_heads" in d:
            raise ValueError("config.json describes a Mamba-2 model (transformers' Mamba2ForCausalLM)" + to_mamba2)
        _require(d, ["hidden_size", "num_hidden_layers", "vocab_size"])
        if d.get("hidden_act", "silu") not in ("silu", "swish"):  # after the conv and on the gate
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported, only silu")
        kwargs = {_HF_FIELDS[k]: v for k, v in d.items() if k in _HF_FIELDS}
        kwargs["pad_vocab_size_multiple"] = 1  # even where a converted config.json still carries one
    else:
        ssm_cfg = _ssm_cfg(d)
        layer = ssm_cfg.pop("layer", "Mamba1")
        if layer != "Mamba1":
            raise ValueError(f"MambaLM covers Mamba-1 only; config.json asks for {layer}"
                             + (to_mamba2 if layer == "Mamba2" else ""))
        ssm_cfg.pop("use_fast_path", None)  # the choice of the official CUDA path: nothing to do here
        unknown = set(ssm_cfg) - _OFFICIAL_SSM_FIELDS
        if unknown:
            raise ValueError(f"unsupported ssm_cfg fields in config.json: {sorted(unknown)}")
        _require(d, ["d_model", "n_layer", "vocab_size"])
        kwargs = official_lm_fields(d, {f.name for f in fields(HybridMambaConfig)})
        kwargs.update(ssm_cfg)
        if "tie_embeddings" not in d and "tie_word_embeddings" in d:
            kwargs["tie_embeddings"] = d["tie_word_embeddings"]
    if kwargs.get("dt_rank") is None:
        kwargs["dt_rank"] = "auto"
    kwargs.update(overrides)
    plain = (kwargs.get("d_intermediate", 0) == 0 and not kwargs.get("attn_layer_idx")
             and not kwargs.get("attn_cfg") and kwargs.get("rms_norm", True) is True)
    if plain:  # the hybrid fields at their defaults: the lesson's model
        return MambaConfig(**{k: v for k, v in kwargs.items() if k not in _HYBRID_FIELDS})
    return HybridMambaConfig(**kwargs)


# Mamba-2. Official (state-spaces/mamba2-130m; mamba2attn-2.7b is a hybrid): ssm_cfg = {"layer": "Mamba2",
# d_state, headdim, ngroups, chunk_size ...}. transformers' Mamba2ForCausalLM: num_heads, head_dim,
# n_groups ..., and tie_word_embeddings false unless it says otherwise.
_MAMBA2_HF_FIELDS = {
    "hidden_size": "d_model", "num_hidden_layers": "n_layer", "vocab_size": "vocab_size", "state_size": "d_state",
    "expand": "expand", "conv_kernel": "d_conv", "head_dim": "headdim", "n_groups": "ngroups",
    "chunk_size": "chunk_size", "time_step_min": "dt_min", "time_step_max": "dt_max", "time_step_limit": "dt_limit",
    "time_step_floor": "dt_init_floor", "use_bias": "bias", "use_conv_bias": "conv_bias", "residual_in_fp32":
    "residual_in_fp32", "layer_norm_epsilon": "norm_epsilon", "tie_word_embeddings": "tie_embeddings"}
_MAMBA2_SSM_FIELDS = {"d_state", "d_conv", "expand", "headdim", "d_ssm", "ngroups", "A_init_range",
                      "dt_min", "dt_max", "dt_init_floor", "dt_limit", "bias", "conv_bias", "chunk_size"}
# official Mamba2 options that only change how it runs or how it is initialized
_MAMBA2_IGNORED = {"use_mem_eff_path", "conv_init", "layer_idx", "process_group", "sequence_parallel"}
# official Mamba2 options supported only at their default value
_MAMBA2_FIXED = {"D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False}


def _number(name, v):
    """transformers 5 writes inf to config.json as {"__float__": "Infinity"} (json as Infinity)."""
    try:
        return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else v
    except (TypeError, ValueError):
        raise ValueError(f"config.json's {name} must hold numbers, got {v!r}") from None


def mamba2_config_from_dict(d, **overrides):
    """A Mamba2Config from an official or a transformers config.json dict."""
    if _is_transformers(d):
        if d.get("model_type", "mamba2") != "mamba2":
            raise ValueError(f"config.json describes a {d['model_type']!r} model, not Mamba-2 (pretrained.load "
                             f"reads any generation)")
        if "head_dim" not in d:
            raise ValueError(f"config.json is missing the field head_dim (found {sorted(d)})")
        _require(d, ["hidden_size", "num_hidden_layers", "vocab_size"])
        kwargs = {_MAMBA2_HF_FIELDS[k]: v for k, v in d.items() if k in _MAMBA2_HF_FIELDS}
        kwargs.setdefault("tie_embeddings", False)  # transformers' default
        kwargs["pad_vocab_size_multiple"] = 1
        if d.get("rms_norm") is False:
            raise ValueError("rms_norm: false (no gated norm in the mixer) is not supported")
        if d.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported, only silu")
    else:
        ssm_cfg = _ssm_cfg(d)
        layer = ssm_cfg.pop("layer", "Mamba1")
        if layer != "Mamba2":
            raise ValueError(f"config.json asks for ssm_cfg.layer = {layer!r}; Mamba2LM loads Mamba-2 "
                             f"only (pretrained.load reads any generation)")
        for name, value in _MAMBA2_FIXED.items():
            got = ssm_cfg.pop(name, value)
            if got is not value:
                raise ValueError(f"ssm_cfg.{name} = {got!r} is not supported (only {value})")
        unknown = set(ssm_cfg) - _MAMBA2_SSM_FIELDS - _MAMBA2_IGNORED
        if unknown:
            raise ValueError(f"unsupported ssm_cfg fields in config.json: {sorted(unknown)}")
        _require(d, ["d_model", "n_layer", "vocab_size"])
        kwargs = official_lm_fields(d, {f.name for f in fields(Mamba2Config)})  # with the hybrid fields
        kwargs.update({k: v for k, v in ssm_cfg.items() if k in _MAMBA2_SSM_FIELDS})
    for name in ("dt_limit", "A_init_range"):
        if isinstance(kwargs.get(name), (list, tuple)):  # anything else is Mamba2Config's to refuse by name
            kwargs[name] = tuple(_number(name, v) for v in kwargs[name])
    kwargs.update(overrides)
    cfg = Mamba2Config(**kwargs)  # which checks each field's type and range
    heads = d.get("num_heads") if _is_transformers(d) else None
    if heads is not None and (not mm._is_positive_int(heads) or heads * cfg.headdim != cfg.d_inner):
        raise ValueError(f"num_heads * head_dim = {heads!r} * {cfg.headdim} must equal expand * hidden_size = "
                         f"{cfg.d_inner}")
    return cfg


# Mamba-3. The official layout only (MambaLMHeadModel.save_pretrained, mixer_seq_simple.py):
# ssm_cfg = {"layer": "Mamba3", and any Mamba3 argument: d_state, headdim, rope_fraction, is_mimo,
# mimo_rank ...}. The published checkpoints (state-spaces/mamba3-*) come in it, with a GatedMLP after
# every mixer; which A they need is section 5's question.
_MAMBA3_SSM_FIELDS = {"d_state", "expand", "headdim", "ngroups", "rope_fraction", "dt_min", "dt_max",
                      "dt_init_floor", "A_floor", "is_outproj_norm", "is_mimo", "mimo_rank", "chunk_size"}
# official Mamba3 arguments (official main, e9594ce) that change only how it runs: fused MIMO norm and
# gate (the same arithmetic), unused dropout, the layer's place, where and in what parameters are made
_MAMBA3_IGNORED = {"fuse_pregate_headwise_norm", "dropout", "layer_idx", "n_layer", "device", "dtype"}
# not an official argument: mamba3_minimal.py's choice of A (Mamba3Config.A_activation)
_MAMBA3_OWN_FIELDS = {"A_activation"}


def mamba3_config_from_dict(d, **overrides):
    """A Mamba3Config from an official config.json dict (ssm_cfg.layer = "Mamba3"); ssm_cfg fields the
    official Mamba3 does not take are dropped with a warning, as its **kwargs drops them (e9594ce)."""
    ssm_cfg = _ssm_cfg(d)
    layer = ssm_cfg.pop("layer", "Mamba1")
    if layer != "Mamba3":
        raise ValueError(f"config.json asks for ssm_cfg.layer = {layer!r}; Mamba3LM loads Mamba3 only "
                         f"(pretrained.load reads any generation)")
    unknown = set(ssm_cfg) - _MAMBA3_SSM_FIELDS - _MAMBA3_IGNORED - _MAMBA3_OWN_FIELDS
    if unknown:  # the official Mamba3 takes **kwargs and drops them: the same model, said out loud
        warnings.warn(f"config.json's ssm_cfg fields {sorted(unknown)} are not Mamba3 arguments; ignored, as the "
                      f"official Mamba3 module ignores them")
    _require(d, ["d_model", "n_layer", "vocab_size"])
    kwargs = official_lm_fields(d, {f.name for f in fields(Mamba3Config)})  # with the hybrid fields
    kwargs.update({k: v for k, v in ssm_cfg.items() if k in _MAMBA3_SSM_FIELDS | _MAMBA3_OWN_FIELDS})
    kwargs.update(overrides)
    return Mamba3Config(**kwargs)


# ------------------------------------------------------------------------------------------------
# 3. The weights into a model: sizes checked first, no memory for what they replace
# ------------------------------------------------------------------------------------------------
# In order: the sizes the checkpoint fixes (layers, vocabulary, width) against the config's, so that
# 10**6 layers are refused before anything is built; the model built on the meta device (shapes, no
# memory, inits that do nothing); keys and shapes checked against it; and the checkpoint's tensors
# handed to it (assign=True), each converted on the way: a bf16 checkpoint in bf16 is held once.

_LAYER_KEY = re.compile(r"backbone\.layers\.(\d+)\.")


def _our_names(state_dict):
    """The checkpoint's keys under the model's names: transformers' backbone.embeddings.* is
    backbone.embedding.*. A tensor under both names is refused: either copy could be the one meant."""
    sd = {}
    for k, v in state_dict.items():
        ours = "backbone.embedding." + k[len("backbone.embeddings."):] if k.startswith("backbone.embeddings.") else k
        if ours in sd:
            raise ValueError(f"checkpoint tensor {ours} is given twice (as backbone.embedding.* and "
                             f"backbone.embeddings.*): a tensor must be given once")
        sd[ours] = v
    return sd


def _check_sizes(cfg, sd):
    """The sizes a checkpoint fixes against the config's, before anything is built: the number of
    layers (the keys backbone.layers.N.), and the vocabulary and the width (the embedding's shape)."""
    layers = {int(m.group(1)) for m in map(_LAYER_KEY.match, sd) if m}
    if len(layers) != cfg.n_layer or (layers and max(layers) != cfg.n_layer - 1):
        shown = sorted(layers)[:4] + (["..."] if len(layers) > 4 else [])
        raise ValueError(f"config.json's n_layer = {cfg.n_layer}, but the checkpoint holds {len(layers)} layers "
                         f"(backbone.layers.N. with N in {shown})")
    emb = sd.get("backbone.embedding.weight")  # missing or not 2-d: the key and shape checks name it
    if emb is not None and emb.dim() == 2 and tuple(emb.shape) != (cfg.padded_vocab_size, cfg.d_model):
        raise ValueError(f"checkpoint tensor backbone.embedding.weight has shape {tuple(emb.shape)}, and "
                         f"config.json's vocab_size = {cfg.vocab_size} (padded to {cfg.padded_vocab_size}) and "
                         f"d_model = {cfg.d_model} need ({cfg.padded_vocab_size}, {cfg.d_model})")


def convert_state_dict(state_dict, model):
    """Map either layout onto the model's key names, re-tie the head, and check keys and shapes strictly."""
    sd = _our_names(state_dict)
    if model.cfg.tie_embeddings and "backbone.embedding.weight" in sd:
        head = sd.setdefault("lm_head.weight", sd["backbone.embedding.weight"])
        if head is not sd["backbone.embedding.weight"] and not torch.equal(head, sd["backbone.embedding.weight"]):
            raise ValueError("the config ties the embeddings, but the checkpoint's lm_head.weight differs "
                             "from backbone.embedding.weight; set tie_embeddings (tie_word_embeddings) to "
                             "false to load an untied head")
        sd["lm_head.weight"] = sd["backbone.embedding.weight"]  # one tensor, as in the model
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint keys do not match the model: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    for k, v in model.state_dict().items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ValueError(f"checkpoint tensor {k} has shape {tuple(sd[k].shape)}, the config "
                             f"expects {tuple(v.shape)} (vocab padded to {model.cfg.padded_vocab_size})")
    return sd


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter a module registers moved to meta, buffers real (as accelerate's init_empty_weights
    does); each is made for real first, so load_weights uses it only once the checkpoint fixed the shapes."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param if param is None else torch.nn.Parameter(param.to("meta"), param.requires_grad))

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _build(cls, cfg, where):
    """cls(cfg) built in `where` (a device, or _parameters_on_meta()); sizes too large for even a
    shape (2**70, or products past 2**63) are refused by name."""
    try:
        with where:
            return cls(cfg)
    except (RuntimeError, TypeError, OverflowError, MemoryError) as err:
        huge = [f"{f.name} = {getattr(cfg, f.name)}" for f in fields(cfg)
                if isinstance(getattr(cfg, f.name), int) and getattr(cfg, f.name) >= 2 ** 31]
        huge += [f"attn_cfg.{k} = {v}" for k, v in (getattr(cfg, "attn_cfg", None) or {}).items()
                 if isinstance(v, int) and v >= 2 ** 31]
        raise ValueError(f"config.json's sizes make tensors too large to build "
                         f"({', '.join(huge) or _first_line(err)}); they must match the checkpoint's") from None


def load_weights(cls, cfg, folder, device=None, dtype=None, keep_fp32=("mixer.A_log", "mixer.D")):
    """cls(cfg) with the folder's weights (strict keys, either layout), in `dtype` (None: as built, fp32)
    on `device`; under fp16/bf16 keep_fp32's stay fp32, as the official modules make them (A_log in
    bf16 would move every decay rate). Weights must be floating-point, and finite in their new dtype."""
    sd = _our_names(_load_state_dict_file(folder))
    _check_sizes(cfg, sd)
    model = _build(cls, cfg, torch.device("meta"))
    if next(model.buffers(), None) is not None:  # values computed at construction, in no checkpoint
        convert_state_dict(sd, model)  # every shape now fixed by the checkpoint: then build them for real
        model = _build(cls, cfg, _parameters_on_meta())
    sd = convert_state_dict(sd, model)
    built = model.state_dict()
    converted = {}  # id -> tensor: the tied head and embedding stay one tensor
    for name, t in sd.items():
        if not t.is_floating_point():  # an integer would be cast without a word, a complex lose half of it
            raise ValueError(f"checkpoint tensor {name} is {t.dtype}; the model's weights are floating-point")
        want = built[name].dtype if dtype is None else dtype
        if name.endswith(keep_fp32) and dtype in (torch.float16, torch.bfloat16):
            want = torch.float32
        if id(t) not in converted:
            converted[id(t)] = t.to(device=device, dtype=want)  # no copy when nothing changes
            if not bool(torch.isfinite(converted[id(t)]).all()):
                raise ValueError(f"checkpoint tensor {name} holds NaN or infinite values in {want} (a damaged "
                                 f"file, or values beyond the dtype's range)")
        sd[name] = converted[id(t)]
    model.load_state_dict(sd, strict=True, assign=True)
    if cfg.tie_embeddings:  # assign gave the head a Parameter of its own, over the same tensor
        model.lm_head.weight = model.backbone.embedding.weight
    return model.to(device=device).eval()  # the buffers


# ------------------------------------------------------------------------------------------------
# 4. load and save, any generation
# ------------------------------------------------------------------------------------------------

# generation -> its config.json reader, config class, and the parameters that stay fp32 under fp16/bf16
GENERATIONS = {1: (config_from_dict, MambaConfig, ("mixer.A_log", "mixer.D")),
               2: (mamba2_config_from_dict, Mamba2Config, ("mixer.A_log", "mixer.D")),
               3: (mamba3_config_from_dict, Mamba3Config, m3._FP32_PARAMETERS)}
GENERATION_OF_CLASS = {MambaLM: 1, HybridMambaLM: 1, Mamba2LM: 2, Mamba3LM: 3}


def checked_device(device):
    """device (None, a name or a torch.device) as a torch.device that torch has, or a ValueError."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device} is not a device name; expected cpu, cuda, cuda:N or mps") from None
    available = {"cpu": 1, "cuda": torch.cuda.device_count(), "mps": int(torch.backends.mps.is_available())}
    if device.type != "cpu" and (device.index or 0) >= available.get(device.type, 0):
        raise ValueError(f"device {device}: torch finds {available.get(device.type, 0)} {device.type} device(s)")
    return device


def load(path_or_id, device=None, dtype=None, cls=None, **overrides):
    """A checkpoint folder or hub id, of any generation and layout, as a model in eval mode.

    Args:
        path_or_id: a folder with config.json and the weights, or a hub id (state-spaces/mamba-130m)
        device, dtype: where and in what the weights go (None: cpu, the dtypes the model is built
                       with); under fp16/bf16 A_log, D and the like stay fp32, as in the official code
        cls: None (config.json's generation decides), or MambaLM, Mamba2LM, Mamba3LM to insist on one
        overrides: config fields to change (e.g. Mamba3Config's A_activation)
    """
    if cls is not None and not any(cls is known for known in GENERATION_OF_CLASS):
        raise ValueError(f"cls must be None, MambaLM, Mamba2LM or Mamba3LM, got {cls!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype such as torch.float32 or torch.bfloat16, "
                         f"got {dtype!r}")
    device = checked_device(device)
    folder = _resolve_folder(path_or_id)
    d = read_config_json(folder)
    generation = generation_of(d)
    if cls is not None and GENERATION_OF_CLASS[cls] != generation:
        raise ValueError(f"config.json describes a Mamba-{generation} model; {cls.__name__} "
                         f"loads Mamba-{GENERATION_OF_CLASS[cls]} (cls=None loads any generation)")
    from_dict, cfg_cls, keep_fp32 = GENERATIONS[generation]
    known = [f.name for f in fields(cfg_cls)]
    known += [name for name in _HYBRID_FIELDS if name not in known]
    if set(overrides) - set(known):
        raise ValueError(f"unknown {cfg_cls.__name__} fields {sorted(set(overrides) - set(known))}; the fields are "
                         f"{known}")
    cfg = from_dict(d, **overrides)
    model_cls = {1: HybridMambaLM if isinstance(cfg, HybridMambaConfig) else MambaLM, 2: Mamba2LM, 3: Mamba3LM}
    return load_weights(model_cls[generation], cfg, folder, device, dtype, keep_fp32)


# Saving: config.json in the official layout (section 2), the weights under the official names as
# model.safetensors (the tied head stored once, as transformers does) or pytorch_model.bin (both keys,
# one storage, as the official save_pretrained writes). Each file is written beside its name, then
# renamed over it: an interrupted save leaves the old file or the new one, never half of one.
# config.json is written first and takes its name last; weights in the other format are set aside
# once the new ones are whole, put back if the new file cannot take its name, removed at the end.

# fields of the official MambaConfig (config_mamba.py); the rest of a config's are the mixer's or how to run
_OFFICIAL_TOP_FIELDS = ("d_model", "d_intermediate", "n_layer", "vocab_size", "attn_layer_idx", "attn_cfg",
                        "rms_norm", "residual_in_fp32", "pad_vocab_size_multiple", "tie_embeddings")
_RUNTIME_FIELDS = {"scan_backend", "compile_mixer"}  # how Mamba-2 and -3 run, not what they are


def config_to_dict(cfg, layer="Mamba1", ssm_fields=_OFFICIAL_SSM_FIELDS, own_ssm_fields=()):
    """A config as the official config.json writes it: the official top-level fields, the mixer's
    (ssm_fields) in ssm_cfg with `layer`, and only where they differ from their defaults (the official
    code would refuse them) own_ssm_fields in ssm_cfg and other fields at the top. How to run is not saved."""
    d = {"d_model": cfg.d_model, "d_intermediate": 0, "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size,
         "ssm_cfg": {"layer": layer}, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
         "residual_in_fp32": cfg.residual_in_fp32, "fused_add_norm": True,
         "pad_vocab_size_multiple": cfg.pad_vocab_size_multiple, "tie_embeddings": cfg.tie_embeddings}
    for f in fields(cfg):
        value = _as_json(getattr(cfg, f.name))
        if f.name in _OFFICIAL_TOP_FIELDS:
            d[f.name] = value
        elif f.name in ssm_fields:
            if value == _as_json(f.default) and not math.isfinite(sum(value) if isinstance(value, list) else 0):
                continue  # JSON has no inf (Mamba-2's dt_limit): the default, left out, loads as itself
            d["ssm_cfg"][f.name] = value
        elif f.name not in _RUNTIME_FIELDS and value != f.default:
            (d["ssm_cfg"] if f.name in own_ssm_fields else d)[f.name] = value
    return d


def _as_json(value):
    return list(value) if isinstance(value, tuple) else value  # JSON has lists


def save(model, folder, safe_serialization=None):
    """config.json and the weights of a MambaLM, Mamba2LM or Mamba3LM, in the official layout, into
    folder (created if needed); safe_serialization: model.safetensors (True), pytorch_model.bin
    (False), or None: safetensors where the package is installed. Returns the folder."""
    if isinstance(model, Mamba3LM):
        d = config_to_dict(model.cfg, "Mamba3", _MAMBA3_SSM_FIELDS, _MAMBA3_OWN_FIELDS)
    elif isinstance(model, Mamba2LM):
        d = config_to_dict(model.cfg, "Mamba2", _MAMBA2_SSM_FIELDS)
    elif isinstance(model, MambaLM):
        d = config_to_dict(model.cfg)
    else:
        raise ValueError(f"save writes a MambaLM, Mamba2LM or Mamba3LM, got a {type(model).__name__}")
    return save_pretrained(model, folder, d, safe_serialization)


def save_pretrained(model, folder, config_dict, safe_serialization=None):
    """config_dict as config.json and the model's weights into folder, as `save` and the comment
    above describe: a save that fails (a full disk, an interrupt, a rename Windows refuses while a
    scanner holds the file) leaves the checkpoint that was there."""
    if not isinstance(folder, (str, os.PathLike)):
        raise ValueError(f"folder must be a path, got {type(folder).__name__}")
    if safe_serialization not in (None, True, False):
        raise ValueError(f"safe_serialization must be True, False or None, got {safe_serialization!r}")
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{os.fspath(folder)} exists and is not a folder; save writes a folder")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("the model's parameters are on the meta device (shapes without values): nothing to save")
    if safe_serialization is None:
        safe_serialization = _safetensors_installed()
    if safe_serialization:  # before anything in the folder changes
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise ImportError("safe_serialization=True needs the safetensors package: pip install safetensors "
                              "(or save(model, folder, safe_serialization=False) for pytorch_model.bin)") from err
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, "model.safetensors" if safe_serialization else "pytorch_model.bin")
    stale = [path for path in _weights_files(folder) if path != target and os.path.lexists(path)]
    aside = f".old{os.getpid()}"  # renamed, not removed: if the new file cannot take its name, they go back
    state_dict = model.state_dict()
    if safe_serialization and model.cfg.tie_embeddings:
        del state_dict["lm_head.weight"]  # one storage under two names: safetensors stores it once

    def write(tmp):
        if safe_serialization:
            save_file({k: v.contiguous() for k, v in state_dict.items()}, tmp, metadata={"format": "pt"})
        else:
            torch.save(state_dict, tmp)

    config_tmp = os.path.join(folder, f"config.json.tmp{os.getpid()}")
    try:
        _write_json(config_tmp, config_dict)  # first: a full disk stops the save before anything changes
        try:
            _write_atomically(target, write, lambda: [os.replace(path, path + aside) for path in stale])
        except BaseException:  # a full disk, a refused rename, an interrupt: the folder as it was
            for path in (path for path in stale if os.path.lexists(path + aside)):
                try:
                    os.replace(path + aside, path)
                except OSError as err:
                    warnings.warn(f"save could not put {path} back ({err}): the old weights are in {path + aside}")
            raise
        os.replace(config_tmp, os.path.join(folder, "config.json"))
    finally:
        if os.path.exists(config_tmp):
            os.remove(config_tmp)
    for path in stale:  # the new checkpoint is whole: a file that will not go is harmless, and said
        try:
            os.remove(path + aside)
        except OSError as err:
            warnings.warn(f"save could not remove {path + aside} ({err}); the new checkpoint is complete "
                          f"and the loader never reads that file: delete it by hand")
    return folder


def _write_json(path, d):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(d, f, indent=2)
        f.write("\n")


def _write_atomically(path, write, before_rename=None):
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ------------------------------------------------------------------------------------------------
# 5. Which A a Mamba-3 checkpoint needs
# ------------------------------------------------------------------------------------------------
# Official main computes A with the heavy-tail activation, the March 2026 release with softplus, and
# config.json does not say which trained the weights. Run both ways on real text, the wrong A (every
# decay rate moved, and with them every logit) has the clearly higher loss.

@torch.no_grad()
def A_variant_losses(path_or_model, input_ids, **load_kwargs):
    """The mean next-token loss (nats per token) of a checkpoint with each A_activation.

    Args:
        path_or_model: a folder or hub id, as load takes it (with load_kwargs), or a loaded Mamba3LM
        input_ids:     (b, L) token ids of some text, L ≥ 2, from the checkpoint's own tokenizer
    Returns:
        {"heavy_tail": loss, "softplus": loss}: the cross-entropy of each token given the ones before
        it over the vocabulary (padding entries left out), averaged over the b·(L − 1) predictions.
        A model passed in keeps the A_activation it had.
    """
    tensor = isinstance(input_ids, torch.Tensor)
    if not tensor or input_ids.dtype not in (torch.int32, torch.int64) or input_ids.dim() != 2 \
            or input_ids.shape[0] < 1 or input_ids.shape[1] < 2:
        got = f"{input_ids.dtype} of shape {tuple(input_ids.shape)}" if tensor else type(input_ids).__name__
        raise ValueError(f"input_ids must be an integer tensor of shape (b, L) with b >= 1 and L >= 2, got {got}")
    if isinstance(path_or_model, Mamba3LM):
        if load_kwargs:
            raise ValueError(f"load_kwargs apply to a path only, got {sorted(load_kwargs)} with a loaded model")
        model = path_or_model
    else:
        model = load(path_or_model, cls=Mamba3LM, **load_kwargs)
    cfg = model.cfg
    if not 0 <= input_ids.min() <= input_ids.max() < cfg.vocab_size:
        raise ValueError(f"input_ids must lie in [0, vocab_size = {cfg.vocab_size}), got "
                         f"[{input_ids.min().item()}, {input_ids.max().item()}]")
    ids = input_ids.to(model.lm_head.weight.device)
    kept = cfg.A_activation
    losses = {}
    try:
        for variant in A_ACTIVATIONS:
            cfg.A_activation = variant  # every mixer reads the model's one config
            total = 0.0
            for row in ids:  # one row at a time: a (L, vocab) logits tensor is the largest one held
                logits = mm._at_least_fp32(model(row[None])[0, :-1, :cfg.vocab_size])  # (L - 1, vocab)
                total += F.cross_entropy(logits, row[1:], reduction="sum").item()
            losses[variant] = total / (ids.shape[0] * (ids.shape[1] - 1))
    finally:
        cfg.A_activation = kept
    return losses



# ------------------------------------------------------------------------------------------------
# 6. The command: generate and score
# ------------------------------------------------------------------------------------------------

# The tokenizer each generation's official checkpoints were trained with (see the top of the file).
TOKENIZERS = {1: "EleutherAI/gpt-neox-20b", 2: "EleutherAI/gpt-neox-20b", 3: "meta-llama/Llama-3.1-8B"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_tokenizer(name):
    """transformers' AutoTokenizer for the repository or folder `name`, never running code of its own
    (a tokenizer_config.json's auto_map): trust_remote_code=False refuses it without asking."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SystemExit(f"error: the tokenizer ({name}) needs the transformers package: pip install "
                         f"transformers (the model itself needs only torch)") from None
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except Exception as err:  # gated, offline, not a tokenizer, code of its own
        if "custom code" in str(err):
            raise SystemExit(f"error: the tokenizer in {name} asks to run Python files of its own (auto_map), "
                             f"which is refused; pass --tokenizer with another tokenizer") from None
        raise SystemExit(f"error: cannot load the tokenizer {name}: {_first_line(err)} (pass --tokenizer with a "
                         f"folder or a hub id of the tokenizer to use; meta-llama repositories are gated: "
                         f"accept the license on the hub and log in)") from None


def tokenizer_name(args, generation, folder):
    """--tokenizer, else the folder's own tokenizer, else the one its generation was trained with."""
    if args.tokenizer:
        return args.tokenizer
    present = [os.path.join(folder, f) for f in TOKENIZER_FILES if os.path.lexists(os.path.join(folder, f))]
    for path in present:  # as the weights are: transformers would open a FIFO and wait
        _regular_file(path)
    return folder if present else TOKENIZERS[generation]


def encode(tokenizer, text, model, device):
    ids = tokenizer(text)["input_ids"]
    if not ids:
        raise SystemExit("error: the text gives no tokens")
    if max(ids) >= model.cfg.vocab_size:
        raise SystemExit(f"error: the tokenizer gives id {max(ids)}, and the model has {model.cfg.vocab_size} "
                         f"tokens: a tokenizer of another model? (--tokenizer)")
    return torch.tensor([ids], device=device)


def generate(args, model, tokenizer, device):
    ids = encode(tokenizer, args.prompt, model, device)
    torch.manual_seed(args.seed)
    eos = tokenizer.eos_token_id
    prompt = ids[0].tolist()
    # decoded with the prompt, then cut: a tokenizer may join a word to the one before it
    prefix = tokenizer.decode(prompt, skip_special_tokens=True)
    new, shown, times = [], "", [time.perf_counter()]
    print(args.prompt, end="", flush=True)
    if args.compile:
        eng.compile_decode(model)
    for token in model.generate_stream(ids, args.max_new_tokens, temperature=args.temperature,
                                       top_k=args.top_k, top_p=args.top_p):
        times.append(time.perf_counter())
        if token.item() == eos:
            break
        new.append(token.item())
        text = tokenizer.decode(prompt + new, skip_special_tokens=True)[len(prefix):]
        if not text.endswith("\ufffd"):  # a character whose bytes are not all out yet
            print(text[len(shown):], end="", flush=True)
            shown = text
    print(tokenizer.decode(prompt + new, skip_special_tokens=True)[len(prefix) + len(shown):])
    line = f"prompt of {ids.shape[1]} tokens and the first new token in {times[1] - times[0]:.2f} s"
    if args.compile and len(times) > 2:  # the second token's step compiles the graph
        line, times = line + f"; the second (compiling the step) in {times[2] - times[1]:.2f} s", times[1:]
    if len(times) > 2:
        line += f"; {len(times) - 2} more in {times[-1] - times[1]:.2f} s " \
                f"({(times[-1] - times[1]) / (len(times) - 2) * 1e3:.1f} ms/token)"
    print(f"[{line}]", file=sys.stderr)


def mean_loss(model, ids, window):
    """The mean cross-entropy (nats/token) of ids (1, L), each token predicted from all before it:
    prefill over windows of `window` tokens, each continuing the last one's cache (bounded memory)."""
    total, count, cache, last = 0.0, 0, None, None  # last: the logits before the window's first token
    for start in range(0, ids.shape[1], window):
        piece = ids[:, start:start + window]  # (1, T)
        logits, cache = model.prefill(piece, cache=cache)  # (1, T, V)
        logits = logits[..., :model.cfg.vocab_size].float()
        if last is None:  # the text's first token has nothing before it to be predicted from
            predicted, targets = logits[:, :-1], piece[:, 1:]
        else:
            predicted, targets = torch.cat([last, logits[:, :-1]], dim=1), piece
        total += F.cross_entropy(predicted.flatten(0, 1), targets.flatten(), reduction="sum").item()
        count += targets.numel()
        last = logits[:, -1:]
    return total / count


def score(args, model, tokenizer, device, generation):
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:  # a typo in the path, a folder, a file that is not UTF-8
        raise SystemExit(f"error: cannot read --text {args.text}: {err}") from None
    ids = encode(tokenizer, text, model, device)
    if ids.shape[1] < 2:
        raise SystemExit("error: the text must have at least 2 tokens")
    loss = mean_loss(model, ids, args.window)
    print(f"{ids.shape[1]} tokens, mean loss {loss:.4f} nats/token (perplexity {math.exp(loss):.2f})")
    if generation == 3:  # which A the checkpoint was trained with: the wrong one scores clearly worse
        losses = A_variant_losses(model, ids)
        print("mean loss with each A_activation (the config's: " + model.cfg.A_activation + "): "
              + ", ".join(f"{variant} {value:.4f}" for variant, value in losses.items()))


def check_flags(p, args):
    """Every flag's range, before the download and before anything is printed."""
    if args.command == "generate" and args.prompt is None:
        p.error("generate needs --prompt TEXT")
    if args.command == "score" and args.text is None:
        p.error("score needs --text FILE")
    if args.window < 1:
        p.error("--window must be at least 1")
    if args.command == "generate":
        if args.max_new_tokens < 1:
            p.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        if not 0 <= args.temperature < math.inf:
            p.error(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
        if args.top_k is not None and args.top_k < 1:
            p.error(f"--top-k must be at least 1, got {args.top_k}")
        if not 0 < args.top_p <= 1:
            p.error(f"--top-p must lie in (0, 1] (1: no cut), got {args.top_p}")
        # below float32's smallest normal number, 0 in the logits' arithmetic; greedy is their limit
        tiny = torch.finfo(torch.float32).tiny
        if args.temperature < tiny or args.top_p < tiny:
            args.temperature, args.top_k = 0.0, 1
    if not 0 <= args.seed < 2 ** 64:
        p.error(f"--seed must lie in [0, 2**64), got {args.seed}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    cores = os.cpu_count() or 1
    if args.threads is not None and args.threads > 4 * cores:  # torch crashes far above the cores
        p.error(f"--threads {args.threads} is more than 4 x the {cores} cores os.cpu_count() finds")
    try:
        return checked_device(args.device)
    except ValueError as err:
        p.error(f"--{err}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("generate", "score"))
    p.add_argument("model", help="a hub id (state-spaces/mamba-130m) or a checkpoint folder")
    p.add_argument("--prompt", help="generate: the text to continue")
    p.add_argument("--text", help="score: a UTF-8 text file")
    p.add_argument("--tokenizer", help="a hub id or folder of the tokenizer (default: see above)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=1024, help="score: tokens per forward pass")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the weights' dtype (A_log, D stay fp32)")
    p.add_argument("--compile", action="store_true", help="generate: compile the decode step (tens of s first)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    device = check_flags(p, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        folder = _resolve_folder(args.model)
        model = load(folder, device=device, dtype=DTYPES[args.dtype])
        generation = GENERATION_OF_CLASS[type(model)]
        tokenizer = load_tokenizer(tokenizer_name(args, generation, folder))
        if args.command == "generate":
            generate(args, model, tokenizer, device)
        else:
            score(args, model, tokenizer, device, generation)
    except (ValueError, FileNotFoundError, ImportError) as err:  # the checkpoint, or a value the model refuses
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
