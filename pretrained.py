"""
pretrained.py: run an official Mamba checkpoint (Mamba-1, -2 or -3) with its tokenizer.

    python pretrained.py generate state-spaces/mamba-130m --prompt "The meaning of life is"
    python pretrained.py generate state-spaces/mamba3-siso-187m --prompt "Hello" --dtype bf16
    python pretrained.py score state-spaces/mamba2-130m --text essay.txt   # mean loss per token

MODEL is a hub id (downloaded with huggingface_hub) or a folder holding config.json and the
weights, in the official layout or in transformers' (-hf). config.json says which generation it
is (ssm_cfg.layer, or transformers' model_type), and so which of MambaLM, Mamba2LM and Mamba3LM
loads it. The official checkpoints ship no tokenizer: Mamba-1 and Mamba-2 were trained on the Pile
with GPT-NeoX's (EleutherAI/gpt-neox-20b, as the official benchmarks/benchmark_generation_mamba_simple.py
loads it), the Mamba-3 checkpoints with Llama 3's (meta-llama/Llama-3.1-8B, a gated repository: accept
its license on the hub and log in, or pass --tokenizer with a folder or another copy of it). A folder
that holds a tokenizer (a transformers -hf checkpoint) uses its own. The tokenizer needs the
transformers package; the model itself needs only torch.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

import mamba_minimal as mm

# The tokenizer each generation's official checkpoints were trained with (see the docstring).
TOKENIZERS = {1: "EleutherAI/gpt-neox-20b", 2: "EleutherAI/gpt-neox-20b", 3: "meta-llama/Llama-3.1-8B"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def generation_of(config):
    """config.json's dict -> 1, 2 or 3: the Mamba generation it describes."""
    if "hidden_size" in config or "num_hidden_layers" in config:  # transformers' layout
        kinds = {"mamba": 1, "mamba2": 2}
        if config.get("model_type") not in kinds:
            raise ValueError(f"config.json describes a transformers {config.get('model_type')!r} model; "
                             f"this script runs model_type 'mamba' and 'mamba2'")
        return kinds[config["model_type"]]
    ssm_cfg = config.get("ssm_cfg") or {}
    layer = ssm_cfg.get("layer", "Mamba1") if isinstance(ssm_cfg, dict) else None
    if layer not in ("Mamba1", "Mamba2", "Mamba3"):
        raise ValueError(f"config.json's ssm_cfg.layer must be Mamba1, Mamba2 or Mamba3, got {layer!r}")
    return int(layer[-1])


def model_class(generation):
    if generation == 1:
        return mm.MambaLM
    if generation == 2:
        import mamba2_minimal
        return mamba2_minimal.Mamba2LM
    import mamba3_minimal
    return mamba3_minimal.Mamba3LM


def load_model(name, dtype, device):
    """The folder or hub id `name` -> (model, generation, folder)."""
    folder = mm._resolve_folder(name)
    generation = generation_of(mm.read_config_json(folder))
    model = model_class(generation).from_pretrained(folder, device=device, dtype=dtype)
    return model, generation, folder


def load_tokenizer(name):
    """transformers' AutoTokenizer for the repository or folder `name`."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SystemExit(f"error: the tokenizer ({name}) needs the transformers package: pip install "
                         f"transformers (the model itself needs only torch)") from None
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as err:  # gated, offline, not a tokenizer
        raise SystemExit(f"error: cannot load the tokenizer {name}: {type(err).__name__}: {err}\n"
                         f"(pass --tokenizer with a folder or a hub id of the tokenizer to use; "
                         f"meta-llama repositories are gated: accept the license on the hub and log in)")


def tokenizer_name(args, generation, folder):
    if args.tokenizer:
        return args.tokenizer
    if any(os.path.exists(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        return folder
    return TOKENIZERS[generation]


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
    new, shown, t0, t_first = [], "", time.perf_counter(), None
    print(args.prompt, end="", flush=True)
    for token in model.generate_stream(ids, args.max_new_tokens, temperature=args.temperature,
                                       top_k=args.top_k, top_p=args.top_p, compile=args.compile):
        t_first = t_first or time.perf_counter()
        if token.item() == eos:
            break
        new.append(token.item())
        text = tokenizer.decode(prompt + new, skip_special_tokens=True)[len(prefix):]
        if not text.endswith("\ufffd"):  # a character whose bytes are not all out yet
            print(text[len(shown):], end="", flush=True)
            shown = text
    print(tokenizer.decode(prompt + new, skip_special_tokens=True)[len(prefix) + len(shown):])
    t_end = time.perf_counter()
    steps = f"; {len(new) - 1} more in {t_end - t_first:.2f} s ({(t_end - t_first) / (len(new) - 1) * 1e3:.1f} " \
            f"ms/token)" if len(new) > 1 else ""
    print(f"[prompt of {ids.shape[1]} tokens and the first new token in {t_first - t0:.2f} s{steps}]",
          file=sys.stderr)


def mean_loss(model, ids, window):
    """The mean cross-entropy (nats/token) of ids (1, L) under the model, each token predicted from
    all the tokens before it: the text runs through prefill in windows of `window` tokens, each
    continuing the previous one's cache, so memory stays bounded however long the text is."""
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
        import mamba3_minimal
        losses = mamba3_minimal.A_variant_losses(model, ids)
        print("mean loss with each A_activation (the config's: " + model.cfg.A_activation + "): "
              + ", ".join(f"{variant} {value:.4f}" for variant, value in losses.items()))


def checked_device(p, name):
    """--device as a torch.device, or a usage error that names it, before the checkpoint is read."""
    try:
        device = torch.device(name)
    except RuntimeError:
        p.error(f"--device {name} is not a device name; expected cpu, cuda, cuda:N or mps")
    available = {"cpu": 1, "cuda": torch.cuda.device_count(),
                 "mps": int(getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available())}
    if (device.index or 0) >= available.get(device.type, 0):
        p.error(f"--device {name}: torch finds {available.get(device.type, 0)} {device.type} device(s)")
    return device


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
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="the weights' dtype (bf16 halves the memory; A_log, D and the like stay fp32)")
    p.add_argument("--compile", action="store_true",
                   help="generate: compile the decode step (tens of seconds first, then faster per token)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.command == "generate" and args.prompt is None:
        p.error("generate needs --prompt TEXT")
    if args.command == "score" and args.text is None:
        p.error("score needs --text FILE")
    if args.window < 1:
        p.error("--window must be at least 1")
    if args.command == "generate":  # before the download, and before the prompt is printed
        if args.max_new_tokens < 1:
            p.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        if not 0 <= args.temperature < math.inf:
            p.error(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
        if args.top_k is not None and args.top_k < 1:
            p.error(f"--top-k must be at least 1, got {args.top_k}")
        if not 0 < args.top_p <= 1:
            p.error(f"--top-p must lie in (0, 1] (1: no cut), got {args.top_p}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = checked_device(p, args.device)
    try:
        model, generation, folder = load_model(args.model, DTYPES[args.dtype], device)
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise SystemExit(f"error: {err}") from None
    tokenizer = load_tokenizer(tokenizer_name(args, generation, folder))
    try:
        if args.command == "generate":
            generate(args, model, tokenizer, device)
        else:
            score(args, model, tokenizer, device, generation)
    except ValueError as err:  # a bad --temperature, --top-k, --top-p, --max-new-tokens
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
