"""
bench/load.py: the memory a bf16 checkpoint takes to load.

    python -m bench load  # peak memory of loading mamba-1.4b's shape in bf16, the meta-device way and the plain way

pretrained.load(folder, dtype=torch.bfloat16) builds the model on the meta device (shapes, no
storage) and assigns the checkpoint's tensors to it, so memory holds the weights once, in bf16. The
plain way, an fp32 model built and initialized, then the weights loaded and cast, peaks at the fp32
model plus the file's tensors. Both at mamba-1.4b's shape (48 layers of width 2048, vocabulary
50,277) with random weights saved in bf16, each load in a subprocess of its own (peak RSS, with
every weight read once: safetensors maps the file, and a mapped page is resident once read).
"""

import json
import tempfile

import torch

import mamba_minimal as mm
import pretrained
from bench.common import memory_in_subprocess, peak_extra_bytes, table

LOAD_SHAPE = dict(d_model=2048, n_layer=48, vocab_size=50277)  # state-spaces/mamba-1.4b's config.json
LOADS = ("pretrained.load", "fp32 model, load, cast")


def load_case(spec):
    """One load of spec's folder, the way spec["how"] names (LOADS), in this (sub)process; prints
    its peak memory as JSON."""
    torch.set_num_threads(1)
    folder, shape = spec["folder"], spec["shape"]

    def run():
        if spec["how"] == LOADS[0]:
            model = pretrained.load(folder, dtype=torch.bfloat16)
        else:  # the plain way
            model = mm.MambaLM(mm.MambaConfig(**shape))
            model.load_state_dict(pretrained._load_state_dict_file(folder), strict=False)  # tied head: one key
            model.to(torch.bfloat16)
        for p in model.parameters():  # read every page: a memory-mapped file counts once it is read
            p.detach().view(-1)[::1024].sum()
    print(json.dumps({"gib": peak_extra_bytes(run) / 2**30}))


def bench_load(args, device):
    """Peak memory of loading a 1.4B-parameter Mamba in bf16, the meta-device way and the plain way."""
    shape = dict(d_model=128, n_layer=2, vocab_size=1000) if args.quick else LOAD_SHAPE
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)  # the checkpoint in bf16, as the hub's are stored
        try:
            model = mm.MambaLM(mm.MambaConfig(**shape))
        finally:
            torch.set_default_dtype(torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        pretrained.save(model, folder)
        del model
        weights = n_params * 2 / 2**30
        rows = []
        for how in LOADS:
            gib = memory_in_subprocess({"kind": "load", "folder": folder, "how": how, "shape": shape})["gib"]
            rows.append([how, f"{gib:.2f}", f"{gib / weights:.2f}"])
    table(f"peak memory of a bf16 load, GiB above the process's start: {n_params / 1e9:.2f}B parameters "
          f"({'a toy' if args.quick else 'mamba-1.4b'}'s shape), {weights:.2f} GiB of bf16 weights",
          ["load", "peak GiB", "/ the bf16 weights"], rows)
