"""
bench/roofline.py: a MODEL of one training step on four GPUs, made without a GPU.

    python -m bench roofline [--archs mamba,gpt] [--flags "--batch-size 16 --block-size 1024"]

It counts the kernels, bytes, FLOPs and peak memory of the trainer's real step and times them
by each GPU's datasheet peaks; `python -m bench gpu` measures on a real one.
"""

import contextlib
import shlex
import sys
import weakref

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import mamba_engine
import mamba_minimal as mm
import pscan as ps
from bench.common import table


# An eager training step on a GPU is a sequence of kernels, one per PyTorch op, and each takes at
# least the time to move its bytes through the GPU's memory (HBM) and to do its FLOPs: the
# roofline model (Williams, Waterman & Patterson 2009), with each GPU's datasheet peaks,
#
#     a kernel's time = max(bytes / bandwidth, FLOPs / FLOP rate) + KERNEL_US,
#
# a lower bound for the first term: real kernels reach less than the datasheet's peaks. The CPU
# issues the kernels one after another, LAUNCH_US each (Python, dispatch, autograd), and the GPU
# runs each once it is issued and the one before has finished; the step's modelled time is when
# the last one ends. So a step of many small kernels is bound by the CPU, one of few large ones
# by the GPU. The count runs the trainer's real step (forward under bf16 autocast, the loss,
# backward, gradient clipping, fused AdamW) on fake tensors (torch's FakeTensorMode: shapes and
# dtypes, no data, no arithmetic), on the CPU, with the choices the code makes on CUDA: the GPU
# form of the selective scan, no read of the token ids' range, foreach gradient clipping. CPU
# autocast's bf16 ops stand for CUDA's (both run matmuls in bf16). A kernel's bytes are the
# distinct elements it reads and writes: a broadcast input once, a view nothing, an in-place op
# its tensor twice. FLOPs are torch's FLOP counter's (torch.utils.flop_counter: matmuls and
# attention; elementwise ops are free against the bandwidth). Peak memory is the most live tensor
# storage at any point of the step, parameters and optimizer state included.
#
# Mamba-1 has a row per eager scan backend of the selective scan's GPU form, one for its CPU
# form (with pscan), to show what the GPU form saves, and the "ideal fused scan": the same step
# with the selective scan replaced by a stand-in that costs exactly one kernel reading its
# inputs and writing its output once in the forward, and one reading the inputs and the
# output's gradient and writing the inputs' gradients once in the backward: what a kernel that
# keeps the states on chip (the paper's §3.3, the official selective_scan_cuda) moves at best.

KERNEL_US = 3.0  # an eager kernel's fixed cost on the GPU (launch latency, ramp-up and tail): an assumption
LAUNCH_US = 8.0  # what issuing one eager op costs the CPU (Python, dispatch, autograd): an assumption
ROOFLINE_GPUS = {  # datasheet peaks: HBM bytes/s; dense FLOP/s of bf16 (fp16 on the T4) and fp32
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 3.35 TB/s, BF16 989 TFLOPS (1,979 with
    # sparsity), FP32 67 TFLOPS, 80 GB
    "H100 SXM": dict(bandwidth=3.35e12, half=989e12, fp32=67e12),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 4.8 TB/s, the H100's compute, 141 GB
    "H200": dict(bandwidth=4.8e12, half=989e12, fp32=67e12),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: 2,039 GB/s, BF16 312 TFLOPS, FP32 19.5
    "A100 80GB": dict(bandwidth=2.039e12, half=312e12, fp32=19.5e12),
    # NVIDIA T4 Tensor Core GPU datasheet: 320 GB/s, mixed-precision FP16 65 TFLOPS, FP32 8.1 TFLOPS,
    # 16 GB; no bf16 (the trainer takes --dtype fp16 there: the same bytes)
    "T4": dict(bandwidth=320e9, half=65e12, fp32=8.1e12),
}
# the eager scans; "associative" asks torch for a compiled scan on CUDA, which no count of eager ops sees
ROOFLINE_BACKENDS = ("sequential", "pscan", "hillis_steele", "two_level")
ROOFLINE_ARCHS = ("mamba", "mamba2", "mamba3", "gpt")


def _unique_bytes(t):
    """The bytes of the distinct elements of t: a broadcast (stride-0) dimension counts once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


class StepCounter(TorchDispatchMode):
    """Counts every kernel that runs under it: (op, phase, bytes, FLOPs, half precision or not,
    shape of the first tensor argument) in self.kernels, and the live tensor bytes (self.live,
    with its highest value in self.peak)."""

    NO_KERNEL = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
                 "lift_fresh", "_local_scalar_dense", "set_", "resize_", "_to_copy_noop")
    WRITE_ONLY = ("zero_", "fill_", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
                  "new_zeros", "new_ones", "new_full", "scalar_tensor", "arange")

    def __init__(self):
        super().__init__()
        self.kernels, self.phase = [], "setup"
        self.live, self.peak, self._storages = 0, 0, {}

    def record(self, op, nbytes, flops=0, half=False, shape=()):
        self.kernels.append(dict(op=op, phase=self.phase, bytes=nbytes, flops=flops, half=half, shape=shape))

    def _track(self, t):
        storage = t.untyped_storage()
        if id(storage) in self._storages:
            return
        self._storages[id(storage)] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)

        def free(key=id(storage), nbytes=storage.nbytes()):
            self.live -= nbytes
            self._storages.pop(key, None)
        weakref.finalize(storage, free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outputs:
            self._track(t)
        name = func._schema.name.split("::")[-1]
        written = [a for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        views = not written and all(t.untyped_storage()._cdata in inputs for t in outputs)  # _unsafe_view too
        if name in self.NO_KERNEL or (outputs and views) or not (outputs or written):
            return out
        by_name = dict(zip([a.name for a in func._schema.arguments], args), **kwargs)
        out_args = {a.name for a in written if a.kwarg_only}  # out=: written, never read
        reads = [t for key, value in by_name.items() if key not in out_args and name not in self.WRITE_ONLY
                 and not (name == "copy_" and key == "self")
                 for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        fresh = [t for t, r in zip(outputs, func._schema.returns) if r.alias_info is None]
        writes = fresh + [t for a in written for t in tree_flatten(by_name.get(a.name))[0]
                          if isinstance(t, torch.Tensor)]
        flops, packet = 0, func._overloadpacket
        if packet in flop_counter.flop_registry:
            flops = flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
        elif "scaled_dot_product" in name:  # the CPU's attention kernels: the registry's formulas
            q, k, v = args[:3] if "backward" not in name else args[1:4]
            flops = (flop_counter.sdpa_backward_flop_count(args[0].shape, q.shape, k.shape, v.shape)
                     if "backward" in name else flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape))
        half = bool(flops) and reads[0].dtype in (torch.bfloat16, torch.float16)
        first = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
        self.record(name, sum(map(_unique_bytes, reads + writes)), flops, half,
                    tuple(first.shape) if first is not None else ())
        return out


class _IdealScan(torch.autograd.Function):
    """The selective scan as one ideal kernel each way: reads its inputs once and writes y once;
    the backward reads the inputs and grad_y once and writes each gradient once. No arithmetic:
    it stands in for the scan inside StepCounter."""
    counter = None

    @staticmethod
    def forward(ctx, *inputs):
        x, B = inputs[0], inputs[3]
        ctx.save_for_backward(*inputs)
        _IdealScan.counter.record("ideal selective scan", sum(_unique_bytes(t) for t in inputs if t is not None)
                                  + _unique_bytes(x))
        h_last = x.new_empty(x.shape[0], x.shape[2], B.shape[2], dtype=torch.float32)
        return torch.empty_like(x), h_last  # (b, L, ED), (b, ED, N)

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        inputs = ctx.saved_tensors
        live = [t for t in inputs if t is not None]
        _IdealScan.counter.record("ideal selective scan, backward",
                                  2 * sum(map(_unique_bytes, live)) + _unique_bytes(grad_y))
        return tuple(None if t is None else torch.empty_like(t) for t in inputs)


def _ideal_selective_scan(x, delta, A, B, C, D=None, z=None, h0=None, return_last_state=False, **_):
    y, h_last = _IdealScan.apply(x, delta, A, B, C, D, z, h0)
    return (y, h_last) if return_last_state else y


def trainer_settings(arch, flags=(), scan=None):
    """train_shakespeare.py's settings for arch at its CUDA defaults under bf16, flags (its command
    line's) overriding them, and scan its --scan-backend (a Mamba-1 backend; None or "ideal": the
    default's). The trainer's checks refuse a flag or a value it does not take."""
    import train_shakespeare as ts
    args = ts.parse_args(["--arch", arch, "--dtype", "bf16", *flags]
                         + (["--scan-backend", scan] if scan not in (None, "ideal") else []))
    ts.fill_defaults(args, torch.device("cuda"))
    return args


def roofline_step(arch, flags=(), scan=None, gpu_form=True):
    """One training step of the trainer's model for arch at its CUDA defaults (flags override
    them, as on the trainer's command line), counted by a StepCounter. scan: a backend for
    Mamba-1, or "ideal" for the ideal fused scan; gpu_form=False runs the selective scan's CPU
    form instead. Returns (counter, the filled-in arguments, parameter count)."""
    from unittest import mock
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    import train_shakespeare as ts
    vocab = 65  # Tiny Shakespeare's characters
    args = trainer_settings(arch, flags, scan)
    counter = StepCounter()
    _IdealScan.counter = counter
    check_ids = mm._check_ids
    as_on_cuda = [mock.patch.object(mamba_engine, "_gpu_form", lambda device: gpu_form),  # the scan's GPU form
                  mock.patch.object(mm, "_check_ids", lambda ids, rank, vocab, read_values:  # reads no values
                                    check_ids(ids, rank, vocab, False))]
    if scan == "ideal":
        as_on_cuda.append(mock.patch.object(mamba_engine, "selective_scan", _ideal_selective_scan))
    with contextlib.ExitStack() as stack:
        for patch in as_on_cuda:
            stack.enter_context(patch)
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(counter)  # from the start: the parameters count as live memory
        model = ts.build_model(arch, ts.model_kwargs(args, vocab), ts.run_options(args))
        optimizer = torch.optim.AdamW(model.optim_groups(args.weight_decay), lr=args.lr, fused=True)
        ids = torch.randint(0, vocab, (args.batch_size, args.block_size + 1))
        x, y = ids[:, :-1], ids[:, 1:]
        for _ in range(2):  # the second step is counted: AdamW's state exists by then
            counter.kernels.clear()
            counter.peak = counter.live
            counter.phase = "forward"
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits[..., :vocab].float().flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            counter.phase = "backward"
            loss.backward()
            counter.phase = "optimizer"
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip, foreach=True)  # as on CUDA
            optimizer.step()
            del logits, loss
    return counter, args, sum(p.numel() for p in model.parameters())


def roofline_ms(kernels, gpu):
    """The step's modelled time on gpu (a ROOFLINE_GPUS entry), in ms: the CPU issues a kernel
    every LAUNCH_US, the GPU runs each once issued and once the previous one is done."""
    spec = ROOFLINE_GPUS[gpu]
    issued = done = 0.0
    for k in kernels:
        issued += LAUNCH_US * 1e-6
        work = max(k["bytes"] / spec["bandwidth"], k["flops"] / spec["half" if k["half"] else "fp32"])
        done = max(done, issued) + work + KERNEL_US * 1e-6
    return done * 1e3


def bench_roofline(args, device):
    """The modelled step per architecture (and per scan backend for Mamba-1) at the trainer's
    CUDA defaults, or at the shape --flags gives."""
    flags = shlex.split(args.flags or "")
    cases = []
    for arch in (args.archs.split(",") if args.archs else ROOFLINE_ARCHS):
        if arch != "mamba":
            cases.append((arch, None, True))
            continue
        # the CPU form beside the GPU form, and the ideal fused scan
        cases += [(arch, backend, True) for backend in ROOFLINE_BACKENDS]
        cases += [(arch, "pscan", False), (arch, "ideal", True)]
    rows, described = [], None
    for arch, scan, gpu_form in cases:
        try:
            counter, filled, n_params = roofline_step(arch, flags, scan, gpu_form)
        except (RuntimeError, MemoryError) as err:  # a size past what a tensor can hold, say
            first = (str(err).strip().splitlines() or [""])[0]
            raise SystemExit(f"error: roofline cannot count {arch}'s step with --flags {args.flags!r}: "
                             f"{type(err).__name__}: {first}")
        kernels = counter.kernels
        if described is None:
            described = (f"batch {filled.batch_size}, block {filled.block_size}, {filled.n_layer} layers of "
                         f"width {filled.d_model}, bf16 autocast")
        label = arch
        if arch == "mamba":
            state = filled.d_state
            width = filled.batch_size * filled.d_model * 2 * state  # one step of the scan: b·ED·N
            chosen = ps.backend_for(torch.device("cuda"), width, needs_grad=False)
            label = (f"mamba (N {state}), ideal fused scan" if scan == "ideal"
                     else f"mamba (N {state}), {scan}, the scan's CPU form" if not gpu_form
                     else f"mamba (N {state}), {scan}{' = auto' if scan == chosen else ''}")
        elif arch in ("mamba2", "mamba3"):
            mimo = f", MIMO rank {filled.mimo_rank}" if getattr(filled, "mimo_rank", None) else ""
            label = f"{arch} (N {filled.d_state}{mimo})"
        gb = sum(k["bytes"] for k in kernels) / 1e9
        tflop = sum(k["flops"] for k in kernels) / 1e12
        rows.append([label, f"{n_params / 1e6:.2f}M", f"{len(kernels):,}", f"{gb:.1f}", f"{tflop:.2f}",
                     f"{counter.peak / 1e9:.1f}"]
                    + [f"{roofline_ms(kernels, gpu):.1f}" for gpu in ROOFLINE_GPUS])
        print(f"  {label}: done", file=sys.stderr, flush=True)
    table(f"MODELLED, not measured: one training step ({described}), forward + backward + clip + "
          f"fused AdamW.\nms: each kernel max(bytes / bandwidth, FLOPs / rate) at the datasheet peaks + "
          f"{KERNEL_US:.0f} µs, issued by the CPU every {LAUNCH_US:.0f} µs; peak: live tensors, GB",
          ["model", "params", "kernels", "GB moved", "matmul TFLOP", "peak GB"]
          + [f"{gpu} ms" for gpu in ROOFLINE_GPUS], rows)
