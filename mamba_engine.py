"""
mamba_engine.py: the same Mamba-1 as mamba_minimal.py, made fast. Opt-in, one call:

    import mamba_engine
    model = mamba_engine.accelerate(MambaLM(cfg))              # hand-written backwards
    model = mamba_engine.accelerate(MambaLM(cfg), compile=True) # the fused path, torch.compile'd
    mamba_engine.compile_decode(model)                          # generate's step as one graph

accelerate swaps two functions of every MambaMixer in the model, its selective scan (mixer.scan_fn)
and its causal conv (mixer.conv_fn), for this file's versions: the same numbers to rounding, tested
against mamba_minimal.selective_scan_reference and float64 loops (test_selective_scan.py). The
trainer and the benchmarks opt in; a model that has not been accelerated runs the lesson's code.

    1. One backward for the whole scan   _SelectiveScan (a CPU and a GPU form), _CausalConv
    2. The fused path                    chunk by chunk, recomputing backward, torch.compile
    3. Compiling without dying           CompiledOrEager: a failed compile runs eagerly, one warning
    4. The public entry points           selective_scan, accelerate, compile_decode
"""

import contextlib
import functools
import inspect
import warnings
import weakref

import torch
import torch.nn.functional as F

import pscan
from mamba_minimal import (MambaMixer, _at_least_fp32, _batched_by_vmap, _is_positive_int, discretize,
                           selective_scan_reference, shifted_sum, skip_and_gate)

CHUNK_SIZE = 16  # the fused path's chunk length T (see section 2)

# ------------------------------------------------------------------------------------------------
# 1. One backward for the whole scan
# ------------------------------------------------------------------------------------------------
# Every path of this file is tested against mamba_minimal.selective_scan_reference and a float64
# loop (test_selective_scan.py, test_model.py).
#
# One backward for the whole scan. Autograd through selective_scan_reference differentiates each
# broadcast on its own: exp(Δ·A), Δ·B·x and C·h each materialize and reduce (b, L, ED, N) tensors
# in the backward, about half of a CPU training step (`python -m bench profile`). The official
# selective_scan_fn has one backward for the whole operation, and so has _SelectiveScan below. Its
# formulas, shared with the fused path's chunk backward (_scan_chunk_backward), follow from
# h_t = dA_t·h_{t-1} + Δ_t·x_t·B_t with dA_t = exp(Δ_t·A), y_t = C_t·h_t, and
# out = (y + D·x)·SiLU(z); grad_X is dLoss/dX, and dA_t is the forward's decay, never a gradient.
#
#   The skip and the gate, with SiLU'(z) = σ(z)·(1 + z·(1 - σ(z))):
#       grad_y = grad_out·SiLU(z)        grad_z = grad_out·(y + D·x)·SiLU'(z)
#       grad_D = Σ_{b,t} grad_y·x        grad_x gets grad_y·D
#   The state. G_t = dLoss/dh_t in total, through y_t and through every later state, is pscan.py's
#   reverse recurrence (its section 8), driven by the read-out; grad_last is dLoss/d(final state):
#       G_t = grad_y_t·C_t + dA_{t+1}·G_{t+1},        G_{L-1} = grad_y_{L-1}·C_{L-1} + grad_last
#   Every input, summing over what it touches (G_t·B_t sums over the N states):
#       grad_C_t = Σ_ed grad_y_t·h_t      grad_B_t = Σ_ed G_t·Δ_t·x_t      grad_x_t = Δ_t·(G_t·B_t)
#       grad_Δ_t = x_t·(G_t·B_t) + Σ_n G_t·h_{t-1}·dA_t·A
#       grad_A = Σ_{b,t} G_t·h_{t-1}·dA_t·Δ_t                              grad_h0 = dA_0·G_0
#
# The eager forward has every state in memory anyway, so each Σ above is a pass over the whole
# sequence, and G is one reverse scan, run by the forward's own backend (in place for the
# "sequential" and "pscan" backends that "auto" picks). The forward keeps its inputs, the decays
# dA and the states h: recomputing dA would save memory, but exp is the dearest op of the forward
# (`python -m bench profile`).
#
# Two forms compute these formulas: one for a CPU and one for a GPU, since what a pass costs
# differs. The same numbers to rounding, tested against the same float64 loop; _SelectiveScan
# runs the CPU form on a CPU and the GPU form on any other device (_gpu_form).
#
# The CPU form. What the passes cost is memory traffic: G, dA and h, three (b, L, N, ED) tensors
# (2.0 MB each at the trainer's CPU shape), do not fit together in a core's L2 cache (1 MB on
# RESULTS.md's AMD VM, 2 MiB on its Intel one), so a pass over all of them goes out to the L3
# cache or to memory. The backward therefore works one state n at a time: several sums
# read each (b, L, ED) slice of G, dA and h (1.0 MB each) in turn while it is still in a cache,
# L2 or L3, instead of making a pass over each whole tensor.
#
# Layout: in the CPU form the states are (b, L, N, ED), ED last, not mamba_minimal.py's (b, L, ED, N).
# With N as small as 2 (the trainer's CPU default), a last dimension of N would make every
# broadcast and every sum over N run along 2 values, where one AVX-512 register holds 16 fp32
# values; with ED last they run along 320 contiguous values, and the read-out C·h is a batched
# (1, N) @ (N, ED) matmul.

def _scan_in_place(h, dA, backend, reverse=False):
    """The recurrence over dim 1, written over h: h_t += dA_t·h_{t-1} from the first step on, or
    with reverse=True, h_t += dA_{t+1}·h_{t+1} from the last step back (the backward's G). The
    caller has folded the start state into h's first step (the last one in reverse). dA, h:
    (b, L, *rest). Backends that cannot scan in place go through pscan.scan, which allocates."""
    if backend == "sequential":  # pscan.scan_sequential's loop, in place on views of each step
        h_steps, dA_steps = h.unbind(1), dA.unbind(1)  # (b, *rest) each
        if reverse:
            for t in range(h.shape[1] - 2, -1, -1):
                h_steps[t].addcmul_(dA_steps[t + 1], h_steps[t + 1])
        else:
            for t in range(1, h.shape[1]):
                h_steps[t].addcmul_(dA_steps[t], h_steps[t - 1])
        return h
    if backend == "pscan" or (backend == "associative" and reverse):  # the Brent-Kung tree in place:
        tree = pscan._brent_kung_reverse_ if reverse else pscan._brent_kung_  # pscan.py sections 5 and 8
        return tree(h, dA[:, 1:] if reverse else dA)
    if not reverse:
        return pscan.scan(dA, h, None, backend)
    # pscan.scan on the time-reversed sequence; the step after the last one is the identity
    dA_next = torch.cat([dA[:, 1:], torch.ones_like(dA[:, :1])], dim=1)  # (b, L, *rest)  dA_{t+1}
    return pscan.scan(dA_next.flip(1), h.flip(1), None, backend).flip(1)


def _autocast_off(device):
    """Autocast turned off on device; nothing to turn off where torch has no autocast (meta)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _in_compute_dtype(*tensors):
    """Cast to one dtype, at least fp32 (a state sums many small terms): fp64 if any is fp64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return [t.to(dtype) for t in tensors]


def _without_autocast(fn):
    """fn run with autocast off on the device of its first tensor argument (positional or
    keyword), for the later generations' scans (mamba2_minimal.py, mamba3_minimal.py). They cast
    their inputs to fp32 at least (_in_compute_dtype), but autocast would run every matmul in bf16
    or fp16 again: the state would then sum its terms with an 8-bit mantissa."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if device is None or not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)
    return run


def _cpu_forward(x, delta, A, B, C, h0, backend, reset):
    """The CPU form's states and read-out: y = C·h (b, L, ED), dA and h (b, L, N, ED)."""
    A_transposed = A.t().contiguous()  # (N, ED), contiguous so that the broadcast reads it in order
    dA = torch.mul(delta.unsqueeze(-2), A_transposed).exp_()  # (b, L, N, ED)  exp(Δ·A)
    if reset is not None:  # saved with its zeros: the backward's G_t and dLoss/d(Δ·A) stop there
        dA.masked_fill_(reset[:, :, None, None], 0)
    h = (delta * x).unsqueeze(-2) * B.unsqueeze(-1)  # (b, L, N, ED)  Δ·B·x, scanned into h
    if h0 is not None:  # h_0 = dA_0·h0 + dBx_0
        h[:, 0].addcmul_(dA[:, 0], h0.transpose(1, 2))
    h = _scan_in_place(h, dA, backend)  # (b, L, N, ED)
    y = (C.unsqueeze(-2) @ h).squeeze(-2)  # (b, L, ED)  C_t·h_t
    return y, dA, h


def _cpu_backward(grad_y, grad_last, x, delta, A, B, C, h0, dA, h, backend):
    """The CPU form's gradients of x, Δ, A, B, C, h0 (the skip and the gate aside); test_selective_scan.py's
    test_forward_and_every_gradient_match_the_float64_loop checks each against a float64 loop."""
    G = grad_y.unsqueeze(-2) * C.unsqueeze(-1)  # (b, L, N, ED)  the read-out's share of G_t
    if grad_last is not None:
        G[:, -1] += grad_last.transpose(1, 2)
    G = _scan_in_place(G, dA, backend, reverse=True)  # (b, L, N, ED)  G_t in total
    # The rest, one state n at a time: each step reads the n-th (b, L, ED) slices of G, dA and h
    # once and works on them while they are in the CPU's cache, instead of making several passes
    # over the whole (b, L, N, ED) tensors, which do not fit in it.
    delta_x = delta * x  # (b, L, ED)
    GB = torch.zeros_like(G[:, :, 0])  # (b, L, ED)  Σ_n G_t·B_t
    through_A = torch.zeros_like(GB)  # (b, L, ED)  Σ_n dLoss/d(Δ_t·A)·A
    grad_A, grad_B, grad_C = [], [], []  # one entry per state, stacked at the end
    h_start = None if h0 is None else h0.transpose(1, 2)  # (b, N, ED)
    for n in range(A.shape[1]):
        G_n, dA_n, h_n = G[:, :, n], dA[:, :, n], h[:, :, n]  # (b, L, ED) each
        grad_B.append(torch.linalg.vecdot(G_n, delta_x))  # (b, L)  Σ_ed G·Δ·x
        grad_C.append(torch.linalg.vecdot(h_n, grad_y))  # (b, L)  Σ_ed grad_y·h
        GB.addcmul_(G_n, B[..., n, None])
        through_dA = G_n * dA_n  # dLoss/d(Δ_t·A) = G_t·dA_t·h_{t-1}
        through_dA[:, 1:].mul_(h_n[:, :-1])
        if h_start is None:
            through_dA[:, 0].zero_()
        else:
            through_dA[:, 0].mul_(h_start[:, n])
        through_A.addcmul_(through_dA, A[:, n])
        grad_A.append(through_dA.mul_(delta).sum((0, 1)))  # (ED,)
    grad_x = delta * GB  # (b, L, ED)
    grad_delta = through_A.addcmul_(x, GB)  # (b, L, ED)
    grad_h0 = None if h0 is None else (dA[:, 0] * G[:, 0]).transpose(1, 2)  # (b, ED, N)
    return grad_x, grad_delta, torch.stack(grad_A, -1), torch.stack(grad_B, -1), torch.stack(grad_C, -1), grad_h0


# On a GPU: where the bytes go. A GPU does these formulas' arithmetic far faster than it can
# fetch their operands, so what an eager step costs is nearly the bytes it moves between the
# GPU's memory (HBM) and its cores, plus a few microseconds for each kernel (every eager op is
# one). `python -m bench roofline` counts both, op by op and without a GPU, for one training
# step at the trainer's CUDA default: batch 64, block 256, 6 layers of width 384, N = 16, bf16
# autocast. There a (b, L, ED, N) fp32 tensor is U = 64·256·768·16·4 B = 805 MB, 16 times any
# (b, L, ED) one, and every op that reads or writes one moves U. The rest of a layer (the
# projections, the conv, the norms, the casts) moves about 5 GB; the scan, in the GPU form below:
#
#   forward    dA = exp(Δ·A), written once                                          1 U
#              Δ·B·x, written into h                                                1 U
#              the recurrence in place, the loop: reads dA_t, h_t, h_{t-1}, writes h_t   4 U
#              the read-out C·h, a batched matmul reading h                          1 U
#   backward   grad_y·C written into G, the reverse recurrence in place             5 U
#              grad_B, G·B and grad_C, batched matmuls reading G, G and h            3 U
#              dLoss/d(Δ·A) (two passes, see _gpu_backward) and its sums over N and
#              over (b, L), two batched matmuls                                      7 U
#
# 22 U, 17.7 GB a layer, 106 GB in six layers; with the scan's smaller (b, L, ED) tensors, 116 GB
# of the step's 155 GB, counted. The CPU form would move 294 GB (the same command's row for it,
# with pscan.py's tree): its per-state loop makes about eight passes over every (b, L, ED) slice,
# which a CPU's cache absorbs and a GPU pays in full, and the tree moves 11 U per scan against the
# loop's 4. 22 U is about the least that states in memory allow: the forward writes dA and h and
# reads them back, the backward writes G and reads it, h and dA back. At an H100's 3.35 TB/s, 155
# GB take 46 ms; the step's matmuls, 0.6 TFLOP, under 1 ms. The loop's price is kernels: 255 a
# scan, 3,897 in the step, which the CPU issues while the GPU works through the large ones
# (pscan.py, appendix C).
#
# The paper's answer (§3.3) is not to keep the states in memory at all: its kernel reads x, Δ, A,
# B, C, D and z once, holds each channel's N states in on-chip memory (SRAM) while it walks the
# sequence, writes y once, and recomputes the states in the backward. The same step would then
# move 33 GB, the scan's share 3 GB, in 591 kernels (the command's "ideal fused scan" row): 11.8
# ms on an H100, 4.6-5.0x faster than the GPU form, by the model. The fused path below is that
# idea in PyTorch: compiled, Inductor fuses a chunk of T steps into one kernel that keeps its
# states in registers and cache.
#
# The GPU form: the states in mamba_minimal.py's layout (b, L, ED, N), so that every contraction of the
# backward is a batched matmul (cuBLAS reads its operand once) instead of a product and a sum
# (which write the product and read it again); and the fewest passes over U, noted on each line.

def _gpu_forward(x, delta, A, B, C, h0, backend, reset):
    """The GPU form's states and read-out: y = C·h (b, L, ED), dA and h (b, L, ED, N)."""
    # exp(Δ·A) = (e^(A/s))^(Δ·s): one pass writing U from two small tensors, where exp of the
    # product would write U, then read and write it again. s per channel keeps e^(A/s) at least
    # e^-80, a normal fp32 number (e^A itself underflows below A = -104). The price is precision:
    # a relative error of about |Δ·A| + Δ·s ulps against exp's |Δ·A| + 1, the same where |A| < 80,
    # and 4e-6 on the outputs with rates down to A = -1000 and steps up to Δ = 20
    # (test_selective_scan.py); bf16 autocast rounds the projections around the scan at 4e-3
    s = (A.abs().amax(-1) / 80).clamp(min=torch.finfo(A.dtype).tiny)  # (ED,)
    dA = torch.pow(torch.exp(A / s[:, None]), (delta * s).unsqueeze(-1))  # (b, L, ED, N)  1 U
    if reset is not None:
        dA.masked_fill_(reset[:, :, None, None], 0)
    h = (delta * x).unsqueeze(-1) * B.unsqueeze(-2)  # (b, L, ED, N)  Δ·B·x  1 U
    if h0 is not None:
        h[:, 0].addcmul_(dA[:, 0], h0)
    h = _scan_in_place(h, dA, backend)  # (b, L, ED, N)  4 U with the loop
    y = (h @ C.unsqueeze(-1)).squeeze(-1)  # (b, L, ED)  C_t·h_t  1 U
    return y, dA, h


def _gpu_backward(grad_y, grad_last, x, delta, A, B, C, h0, dA, h, backend):
    """The GPU form's gradients of x, Δ, A, B, C, h0 (the skip and the gate aside)."""
    G = grad_y.unsqueeze(-1) * C.unsqueeze(-2)  # (b, L, ED, N)  the read-out's share of G_t  1 U
    if grad_last is not None:
        G[:, -1] += grad_last
    G = _scan_in_place(G, dA, backend, reverse=True)  # (b, L, ED, N)  G_t in total  4 U
    grad_h0 = None if h0 is None else dA[:, 0] * G[:, 0]  # (b, ED, N)
    delta_x = delta * x  # (b, L, ED)
    grad_B = (delta_x.unsqueeze(-2) @ G).squeeze(-2)  # (b, L, N)  Σ_ed G·Δ·x  1 U
    GB = (G @ B.unsqueeze(-1)).squeeze(-1)  # (b, L, ED)  Σ_n G·B  1 U
    grad_C = (grad_y.unsqueeze(-2) @ h).squeeze(-2)  # (b, L, N)  Σ_ed grad_y·h  1 U
    # dLoss/d(Δ_t·A) = G_t·dA_t·h_{t-1}, without reading dA: one step of G's recurrence says
    # dA_t·G_t = G_{t-1} - grad_y_{t-1}·C_{t-1}. So G becomes, in place, at each t < L-1 the
    # value for step t+1: (G_t - grad_y_t·C_t)·h_t. At L-1 it belongs to no step: Δ_{t+1} = 0
    # and the shift below leave it out
    through_dA = G.addcmul_(grad_y.unsqueeze(-1), C.unsqueeze(-2), value=-1).mul_(h)  # 2 U + 3 U
    b, L, ed, n = G.shape
    per_channel = through_dA.view(b * L, ed, n).transpose(0, 1)  # (ED, b·L, N), a view
    # Σ_n A·dLoss/d(Δ·A) per token and Σ_{b,t} Δ·dLoss/d(Δ·A) per (ed, n): batched over the channels
    through_A = torch.bmm(per_channel, A.unsqueeze(-1)).squeeze(-1).t().view(b, L, ed)  # 1 U
    delta_next = F.pad(delta[:, 1:], (0, 0, 0, 1))  # (b, L, ED)  Δ_{t+1}, and 0 for the last t
    grad_A = torch.bmm(delta_next.view(b * L, ed).t().unsqueeze(1), per_channel).squeeze(1)  # (ED, N)  1 U
    grad_x = delta * GB  # (b, L, ED)
    grad_delta = x * GB  # (b, L, ED)
    grad_delta[:, 1:] += through_A[:, :-1]
    if h0 is not None:  # step 0's dLoss/d(Δ_0·A) = G_0·dA_0·h0
        first = grad_h0 * h0  # (b, ED, N)
        grad_delta[:, 0] += (first * A).sum(-1)
        grad_A += (first * delta[:, 0, :, None]).sum(0)
    return grad_x, grad_delta, grad_A, grad_B, grad_C, grad_h0


class _SelectiveScan(torch.autograd.Function):
    """selective_scan_reference's forward; the backward above, in the CPU or the GPU form. Takes
    fp32 or fp64 tensors, and computes in their dtype whatever autocast says: under bf16 autocast
    the read-out C·h, a matmul, would be rounded to bf16.

    Forward-mode AD (torch.func.jvp) has no rule here: eager_selective_scan runs the reference
    instead (_forward_mode). torch.func.grad and vmap work through it. The forward's intermediate
    tensors go to the backward as extra outputs, which the setup_context form asks for."""

    generate_vmap_rule = True  # torch.func.vmap runs forward and backward on batched tensors

    @staticmethod
    def forward(x, delta, A, B, C, D, z, h0, backend, reset, gpu_form):
        with _autocast_off(x.device):
            if gpu_form:
                y, dA, h = _gpu_forward(x, delta, A, B, C, h0, backend, reset)  # (b, L, ED), states (b, L, ED, N)
                h_last = h[:, -1].clone()  # (b, ED, N)
            else:
                y, dA, h = _cpu_forward(x, delta, A, B, C, h0, backend, reset)  # (b, L, ED), states (b, L, N, ED)
                h_last = h[:, -1].transpose(1, 2).contiguous()  # (b, ED, N)
            if D is not None:
                y.addcmul_(x, D)  # y + D·x, kept so that the backward need not add it again
            if z is None:
                return y, h_last, dA, h, None, None
            silu_z = F.silu(z)
            return y * silu_z, h_last, dA, h, y, silu_z  # (b, L, ED), (b, ED, N), then what the backward needs

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, delta, A, B, C, D, z, h0, backend, reset, gpu_form = inputs
        _, _, dA, h, y_skip, silu_z = output
        ctx.mark_non_differentiable(*(t for t in output[2:] if t is not None))
        ctx.set_materialize_grads(False)  # else autograd hands the backward a zero tensor per extra output
        ctx.save_for_backward(x, delta, A, B, C, D, z, h0, dA, h, y_skip, silu_z)
        ctx.backend, ctx.reset, ctx.gpu_form = backend, reset, gpu_form

    @staticmethod
    def backward(ctx, grad_out, grad_last, *_):
        x, delta, A, B, C, D, z, h0, dA, h, y_skip, silu_z = ctx.saved_tensors
        if grad_out is None:  # an output that reached no loss has no gradient (the final state, in training)
            grad_out = torch.zeros_like(x)  # (b, L, ED)
        if torch.is_grad_enabled():  # create_graph=True: a second derivative will follow
            if grad_last is None:
                grad_last = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])  # (b, ED, N)
            return (*_recorded_gradients(ctx, (x, delta, A, B, C, D, z, h0), grad_out, grad_last), None, None, None)
        with _autocast_off(x.device):
            grad_y, grad_z = grad_out, None  # (b, L, ED)
            if z is not None:
                grad_z = torch.ops.aten.silu_backward(grad_out * y_skip, z)  # grad_out·(y + D·x)·SiLU'(z)
                grad_y = grad_out * silu_z
            backward = _gpu_backward if ctx.gpu_form else _cpu_backward
            grad_x, grad_delta, grad_A, grad_B, grad_C, grad_h0 = backward(
                grad_y, grad_last, x, delta, A, B, C, h0, dA, h, ctx.backend)
            grad_D = None
            if D is not None:
                grad_D = (grad_y * x).sum((0, 1))  # (ED,)
                grad_x.addcmul_(grad_y, D)
        return grad_x, grad_delta, grad_A, grad_B, grad_C, grad_D, grad_z, grad_h0, None, None, None


def _recorded_gradients(ctx, inputs, grad_out, grad_last):
    """The gradients as a graph that can be differentiated again (a Hessian, a gradient penalty):
    the vector-Jacobian product of selective_scan_reference, recomputed under autograd. Only
    then; a plain backward takes the lean path above. torch.func.vjp rather than
    torch.autograd.grad: it records at whatever level of torch.func's transforms (grad, vmap)
    the backward runs, as well as under plain autograd."""
    wanted = [i for i, t in enumerate(inputs) if t is not None and ctx.needs_input_grad[i]]

    def reference(*live):  # the wanted inputs as arguments, the others fixed
        full = list(inputs)
        for i, t in zip(wanted, live):
            full[i] = t
        return selective_scan_reference(*full, backend=ctx.backend, reset=ctx.reset)

    with torch.enable_grad():
        _, vjp = torch.func.vjp(reference, *(inputs[i] for i in wanted))
        found = vjp((grad_out, grad_last))
    grads = [None] * len(inputs)
    for i, g in zip(wanted, found):
        grads[i] = g
    return grads


def _forward_mode():
    """Whether forward-mode AD (torch.func.jvp, jacfwd, or torch.autograd.forward_ad) is differentiating
    this call. The Functions of this file have no forward-mode rule (torch.compile refuses a
    Function that has one), so under it each runs the code it replaces, which forward mode
    differentiates op by op: the same numbers. (torch.func.jvp opens a dual level too.)"""
    return torch.autograd.forward_ad._current_level >= 0


def _partly_mapped(per_token, others):
    """Whether torch.func.vmap maps some of these tensors but not every per-token one."""
    tokens = [_batched_by_vmap(t) for t in per_token if t is not None]
    return not all(tokens) and (any(tokens) or any(_batched_by_vmap(t) for t in others if t is not None))


def _gpu_form(device):
    """Whether _SelectiveScan runs its GPU form: on any device but a CPU. (The tests, and the
    model of `python -m bench roofline`, run it on a CPU by replacing this function.)"""
    return device.type != "cpu"


def eager_selective_scan(x, delta, A, B, C, D=None, z=None, h0=None, backend="auto", reset=None):
    """selective_scan_reference (same arguments, same numbers to rounding) through _SelectiveScan:
    the backward written above instead of autograd's. Returns y and the final state, in fp32 (fp64
    for fp64 inputs)."""
    x, delta, A, B, C = (_at_least_fp32(t) for t in (x, delta, A, B, C))
    D, z, h0 = (None if t is None else t.to(x.dtype) for t in (D, z, h0))
    # torch.func.vmap that leaves a per-token input unmapped (a model vmapped over A_log, say): the
    # in-place scans would write mapped tensors into unmapped ones, which vmap refuses (per-sample
    # gradients map them all); forward mode: no rule (_forward_mode). The reference serves both
    if not torch.compiler.is_compiling() and (_forward_mode() or _partly_mapped((x, delta, B, C, z),
                                                                                (A, D, h0, reset))):
        return selective_scan_reference(x, delta, A, B, C, D, z, h0, backend, reset)
    if backend == "auto":  # chosen for a scan without autograd, which is what both scans are
        backend = pscan.backend_for(x.device, x.shape[0] * x.shape[2] * A.shape[1], needs_grad=False)
    y, h_last, *_ = _SelectiveScan.apply(x, delta, A, B, C, D, z, h0, backend, reset, _gpu_form(x.device))
    return y, h_last


class _CausalConv(torch.autograd.Function):
    """mamba_minimal.shifted_sum (its section 3) with its backward written out. Autograd's would, for every tap, zero
    a tensor the size of x_pad, copy the tap's gradient into it (the backward of a slice) and add
    them up; this backward writes the taps' gradients into one buffer, and each weight's gradient is one dot
    product over the batch and the sequence. The backward is made of differentiable ops, so a
    second derivative (create_graph=True) and torch.func.grad work through it, and torch.func.vmap
    runs both passes on batched tensors (generate_vmap_rule). Under forward mode, shifted_sum itself
    (_forward_mode)."""
    generate_vmap_rule = True

    @classmethod
    def apply(cls, x_pad, w, bias, keep):
        if not torch.compiler.is_compiling() and _forward_mode():
            return shifted_sum(x_pad, w, bias, keep)
        return super().apply(x_pad, w, bias, keep)

    @staticmethod
    def forward(x_pad, w, bias, keep):
        return shifted_sum(x_pad, w, bias, keep)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_pad, w, bias, keep = inputs
        ctx.save_for_backward(x_pad, w, keep)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad_out):
        x_pad, w, keep = ctx.saved_tensors
        width, L = w.shape[1], grad_out.shape[1]
        grad_w = []
        for k in range(width):  # out_t = Σ_k w_k·x_pad_{t+k}: tap k read x_pad[:, k:k+L]
            grad_k = grad_out if keep is None else grad_out * keep[:, :, k, None]  # (b, L, ED)
            if k == 0:  # the buffer starts as tap 0's share, padded: batched under vmap wherever grad_out or w is
                grad_x_pad = F.pad(grad_k * w[:, 0], (0, 0, 0, width - 1))  # (b, d_conv-1+L, ED)
            else:
                grad_x_pad[:, k:k + L].addcmul_(grad_k, w[:, k])
            grad_w.append((grad_k * x_pad[:, k:k + L]).sum((0, 1)))  # (ED,)
        grad_bias = grad_out.sum((0, 1)) if ctx.has_bias else None
        return grad_x_pad.to(x_pad.dtype), torch.stack(grad_w, dim=1).to(w.dtype), grad_bias, None


# ------------------------------------------------------------------------------------------------
# 2. The fused path
# ------------------------------------------------------------------------------------------------
# Where the time goes: the reference writes dA, dBx and h to memory as
# (b, L, ED, N) tensors and reads them back several times: at the trainer's CPU shape
# (12, 64, 320, 2) that is 2.0 MB each (15.7 MB at the official N = 16), for a long sequence
# gigabytes, while the inputs x, Δ, B, C are N times smaller. The arithmetic is trivial; the cost
# is memory traffic.
#
# The paper's answer (§3.3, the hardware-aware algorithm) is kernel fusion plus recomputation:
# load x, Δ, A, B, C into fast memory, discretize and scan there, write only y, and recompute
# the states in the backward instead of storing them. The official CUDA kernel walks the
# sequence in chunks: inside a chunk its threads run a parallel scan over the steps (cub's
# BlockScan), and the running state is carried from one chunk to the next.
#
# The fused path does it in PyTorch: for a chunk of T steps, discretize, run the recurrence from the carried
# state, contract with C, add D·x, gate with SiLU(z), and pass the last state on. In a forward
# pass, and in training with recompute (below), only (b, T, ED, N) is ever alive. Eagerly this
# is still several passes over a small block; under torch.compile, Inductor fuses the chunk into
# one kernel (generated C++ on a CPU, Triton on a GPU, where this path has not been timed) that
# reads x, Δ, B, C, z once and writes y once, the states staying in registers and cache.
#
# Sequential in time, parallel across channels: this is what makes the fused path fast on a CPU.
# Each chunk runs its T steps one after another from the carried state, and every step is one
# vector operation over the b·ED·N independent recurrences, which fill the CPU's vector lanes, as
# each thread of the official kernel walks its few consecutive steps in order. The parallel scans
# of pscan.py are a lesson about depth (how few dependent steps the recurrence needs given enough
# processors), not what makes a CPU fast: a few cores cannot repay their extra work (where pscan
# beats the loop in training, it is by needing fewer autograd nodes than the loop's L steps, as
# pscan.py's appendix C says). Nor is this pscan.py's two-level scan (its section 7), which scans
# every chunk from a zero state and corrects each by its carried-in state: the fused path has no correction pass.
#
# The chunk length T (CHUNK_SIZE, 16 by default) trades the number of calls against
# the size of the compiled kernels: a longer chunk halves the calls but unrolls a longer loop, in
# the backward above all, which compiles for longer. 16 was measured on a CPU, where 32 trained
# slower. On a GPU each call costs more Python per kernel (launches, guards, wrappers), so a
# longer chunk may pay there; no figure for it yet.
#
# The loop over chunks. Each call of a compiled function has a fixed cost, paid in Python
# (guards, wrappers): tens of microseconds on a CPU, as much as the kernel of a small chunk.
# With compile="loop" a forward-only pass compiles the loop too (_chunk_loop, with torch's scan
# operator), so a whole sequence is one call. It is opt-in because torch cannot cache a graph
# that holds this operator: every new process compiles it again. Training calls the compiled
# chunk, and its backward, once per chunk.
#
# Static shapes: every chunk has length T. The last one is padded with identity steps, Δ = 0,
# which give dA = exp(0) = 1 and dBx = 0, so the state passes through unchanged and the padded
# outputs are dropped. A new sequence length therefore never triggers a recompile (the compiled
# loop of a forward pass takes the number of chunks as a dynamic size). Nor does a new batch
# size (an evaluation's smaller last batch): the batch is compiled as a dynamic size too, except
# a batch of 1, which torch always specializes. An evaluation runs the graph that training
# compiled: the chunk's forward runs without autograd in both, on detached inputs.
#
# A compiler that fails (none installed, an Inductor or Triton error, a shape it cannot handle,
# its recompile limit) fails at a call: the first training step, the first evaluation, a new
# shape. CompiledOrEager runs that call again eagerly and, if the eager call works, warns once
# and keeps the function eager from then on, so that a long run goes on, slower, never dies.
#
# Recompute (training, the paper's §3.3.2): plain autograd through a chunk keeps every step's
# (b, ED, N) tensors for the backward, so O(b·L·ED·N) is back, and the backward graph it records
# is a long chain of small ops that Inductor fuses poorly. With recompute=True each chunk is a
# custom autograd Function instead: the forward keeps only the chunk's inputs and its start
# state, and the backward (written out below, fused by torch.compile like the forward)
# recomputes the states from the start state and runs the reverse recurrence. Memory:
# O(b·L·ED) for the inputs plus one (b, ED, N) start state per chunk, plus O(b·T·ED·N) inside
# the chunk being worked on.

def _scan_chunk(x, delta, A, B, C, D, z, h, keep=None):
    """One chunk: selective_scan_reference on T steps, with the loop written out so that the
    compiler fuses it. x, delta, z: (b, T, ED); A: (ED, N); B, C: (b, T, N); D: (ED,);
    h: (b, ED, N) start state; D and z may be None; keep (b, T) or None: 0 where a packed
    sequence starts (dA = 0), 1 elsewhere. Returns y (b, T, ED) and the end state
    (b, ED, N). The skip D·x and the gate SiLU(z) are applied here, as the official kernel does:
    inside the fused chunk they ride in the same pass, outside they are three more passes over
    (b, L, ED)."""
    dA, dBx = discretize(x, delta, A, B)  # (b, T, ED, N), one chunk only
    if keep is not None:
        dA = dA * keep[:, :, None, None]
    ys = []
    for dA_t, dBx_t, C_t in zip(dA.unbind(1), dBx.unbind(1), C.unbind(1)):
        h = torch.addcmul(dBx_t, dA_t, h)  # (b, ED, N)
        ys.append((h * C_t.unsqueeze(1)).sum(-1))  # (b, ED)
    return skip_and_gate(torch.stack(ys, dim=1), x, D, z), h  # (b, T, ED), (b, ED, N)


def _scan_chunk_backward(x, delta, A, B, C, D, z, h0, keep, grad_out, grad_h):
    """Gradients of _scan_chunk from its inputs and the output gradients, recomputing the states:
    the formulas of "One backward for the whole scan" at the top of section 1, on a chunk of T
    steps (grad_h is the gradient of the chunk's end state). Every reduction is taken inside the
    reverse loop, step by step. Batching them after the loop
    looks more vectorized but needs G and h as (b, T, ED, N) tensors. In Inductor's generated C++
    the per-step reductions over N fuse into the reverse pass and those over ED and the batch
    become small loops per step; the batched form was 1.8x slower.
    """
    dA, dBx = discretize(x, delta, A, B)  # (b, T, ED, N)
    if keep is not None:  # as the forward: G_t and dLoss/d(Δ·A) stop where a sequence starts
        dA = dA * keep[:, :, None, None]
    hs = [h0]
    for dA_t, dBx_t in zip(dA.unbind(1), dBx.unbind(1)):
        hs.append(torch.addcmul(dBx_t, dA_t, hs[-1]))  # h_t (b, ED, N)
    grad_y, grad_z = grad_out, None  # (b, T, ED)
    if z is not None:
        y = torch.stack([(h_t * C_t.unsqueeze(1)).sum(-1) for h_t, C_t in zip(hs[1:], C.unbind(1))], dim=1)
        sig = torch.sigmoid(z)
        grad_z = grad_out * skip_and_gate(y, x, D, None) * sig * (1 + z * (1 - sig))
        grad_y = grad_out * z * sig  # grad_out·SiLU(z)
    g, grad_A = grad_h, torch.zeros_like(A)  # g: G_t as the loop walks back
    grads = []  # (grad_x_t, grad_Δ_t, grad_B_t, grad_C_t), last step first
    steps = zip(x.unbind(1), delta.unbind(1), B.unbind(1), C.unbind(1), grad_y.unbind(1),
                dA.unbind(1), hs[:-1], hs[1:])
    for x_t, delta_t, B_t, C_t, grad_y_t, dA_t, h_prev, h_t in reversed(list(steps)):
        g = torch.addcmul(g, grad_y_t.unsqueeze(-1), C_t.unsqueeze(1))  # G_t (b, ED, N)
        GB = (g * B_t.unsqueeze(1)).sum(-1)  # (b, ED)  G_t·B_t
        through_dA = g * h_prev * dA_t  # (b, ED, N)  dLoss/d(Δ_t·A)
        grad_A = grad_A + (through_dA * delta_t.unsqueeze(-1)).sum(0)  # (ED, N)
        grads.append((delta_t * GB,  # grad_x_t (b, ED)
                      x_t * GB + (through_dA * A).sum(-1),  # grad_Δ_t (b, ED)
                      (g * (delta_t * x_t).unsqueeze(-1)).sum(1),  # grad_B_t (b, N)
                      (grad_y_t.unsqueeze(-1) * h_t).sum(1)))  # grad_C_t (b, N)
        g = g * dA_t  # G_t's share for h_{t-1}
    grad_x, grad_delta, grad_B, grad_C = (torch.stack(per_step[::-1], dim=1) for per_step in zip(*grads))
    grad_D = None
    if D is not None:
        grad_D = (grad_y * x).sum((0, 1))  # (ED,)
        grad_x = grad_x + grad_y * D
    return grad_x, grad_delta, grad_A, grad_B, grad_C, grad_D, grad_z, g  # the last g is grad_h0


# ------------------------------------------------------------------------------------------------
# 3. Compiling without dying
# ------------------------------------------------------------------------------------------------

class CompileFallbackWarning(UserWarning):
    """torch.compile failed for a function that then ran eagerly, as it will from then on."""


class CompiledOrEager:
    """torch.compile(fn, **options) that falls back to fn. A call that raises is made again
    eagerly: if that works too, the compiler was what failed, so warn once (CompileFallbackWarning)
    and call fn from then on; an error that fn raises as well is the caller's, and is raised.

    compile_backward_now: compile a training graph's backward when its forward compiles (torch
    defers it to the first backward, outside this call and its fallback; torch before 2.10 has no
    switch for it and keeps that order). batch_args: the names of
    fn's arguments whose dim 0 is the batch, compiled as a dynamic size. fallback=False: raise
    instead, for a caller with a better plan."""

    def __init__(self, fn, what, compile_backward_now=False, batch_args=(), fallback=True, **options):
        self.fn, self.what, self.batch_args, self.fallback = fn, what, batch_args, fallback
        self.compiled = torch.compile(fn, **options)
        self.compile_backward_now = compile_backward_now and hasattr(torch._functorch.config,
                                                                      "force_non_lazy_backward_lowering")
        self.failed = False
        self.arg_names = list(inspect.signature(fn).parameters)

    def compiled_call(self, *args):
        for name, t in zip(self.arg_names, args):
            if name in self.batch_args and t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        if self.compile_backward_now:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                return self.compiled(*args)
        return self.compiled(*args)

    def __call__(self, *args):
        # fn itself inside a model being compiled (that compile traces fn) and under torch.func's
        # grad or vmap (whose wrapped tensors a compiled graph does not take: not a failure)
        if self.failed or torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None:
            return self.fn(*args)
        try:
            return self.compiled_call(*args)
        except Exception as err:
            if not self.fallback:
                raise
            out = self.fn(*args)
            self.failed = True
            while getattr(err, "inner_exception", None) or err.__cause__:  # the compiler's own error,
                err = getattr(err, "inner_exception", None) or err.__cause__  # under torch's wrappers
            message = (str(err).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"torch.compile failed for {self.what} ({type(err).__name__}: {message}); it runs "
                          f"eagerly from now on", CompileFallbackWarning, stacklevel=2)
            return out


_compiled = {}  # (fn, device type) -> CompiledOrEager


def _compile_options(device):
    # On a CPU, Inductor's C++ wrapper instead of its Python one: the code around the kernels
    # (output allocation, views, the compiled loop of _chunk_loop) then runs in C++, which trims
    # the fixed cost of every call.
    return {"cpp_wrapper": True} if device.type == "cpu" else None


def _maybe_compiled(fn, compile, device):
    """fn itself, or its torch.compile'd version (made once per device type; static shapes but the
    batch). After a compiler failure on a device the fused path runs eagerly there, the chunk's
    backward too: one warning, and no time spent on compiles that would fail alike. Inside a
    model that torch.compile compiles whole, fn itself: that compile traces it."""
    if not compile or torch.compiler.is_compiling() or any(c.failed for (_, on), c in _compiled.items()
                                                           if on == device.type):
        return fn
    key = (fn, device.type)
    if key not in _compiled:
        _compiled[key] = CompiledOrEager(fn, f"the fused selective scan ({fn.__name__} on {device.type})",
                                         batch_args=("x", "delta", "B", "C", "z", "h", "h0", "keep", "grad_out",
                                                     "grad_h"),
                                         fallback=fn is not _chunk_loop,  # _forward_in_one_call has its own
                                         dynamic=False, fullgraph=True, options=_compile_options(device))
    return _compiled[key]


class _RecomputedChunk(torch.autograd.Function):
    """One chunk with the recomputing backward: saves the inputs only. Its forward runs the
    compiled _scan_chunk without autograd, on detached inputs, as an evaluation does (one graph
    for both); torch.func.vmap runs both passes on batched tensors (generate_vmap_rule)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, delta, A, B, C, D, z, h, compile, keep):
        return _maybe_compiled(_scan_chunk, compile, x.device)(*_detached(x, delta, A, B, C, D, z, h, keep))

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, ctx.compile, keep = inputs
        ctx.save_for_backward(*tensors, keep)  # the inputs only, no states

    @staticmethod
    def backward(ctx, grad_y, grad_h):
        if torch.is_grad_enabled():  # create_graph=True or torch.func.grad: a graph to differentiate again
            return (*_chunk_gradients_recorded(ctx, grad_y, grad_h), None, None)
        # contiguous, as in the forward: grad_y arrives as a slice of the whole sequence's gradient
        backward = _maybe_compiled(_scan_chunk_backward, ctx.compile, grad_y.device)
        grads = backward(*_detached(*ctx.saved_tensors), grad_y.contiguous(), grad_h.contiguous())
        return (*grads, None, None)


def _chunk_gradients_recorded(ctx, grad_y, grad_h):
    """The chunk's gradients as a graph that can be differentiated again (a Hessian, torch.func.grad):
    _scan_chunk recomputed eagerly under autograd and differentiated with create_graph. Only then;
    a plain backward takes the recomputing backward."""
    *inputs, keep = ctx.saved_tensors
    wanted = [i for i, t in enumerate(inputs) if t is not None and ctx.needs_input_grad[i]]
    with torch.enable_grad():
        # through aliases: autograd.grad with respect to A itself would also follow A's path
        # through h into the chunks before, which their own backward counts
        inputs = [None if t is None else t.view_as(t) for t in inputs]
        y, h = _scan_chunk(*inputs, keep)
        # with respect to D (or z) alone the state h needs no gradient and has none
        outputs = [(out, grad) for out, grad in ((y, grad_y), (h, grad_h)) if out.requires_grad]
        found = torch.autograd.grad([out for out, _ in outputs], [inputs[i] for i in wanted],
                                    [grad for _, grad in outputs], create_graph=True)
    grads = [None] * len(inputs)
    for i, g in zip(wanted, found):
        grads[i] = g
    return grads


def _detached(*tensors):
    # The first chunk's start state is a plain zero tensor, the later ones come out of autograd
    # and require grad; D is a Parameter. The compiled code guards on requires_grad and on the
    # type, so without this the first chunk, the others and a no-grad pass would each compile
    # their own copy of the same graph.
    return [None if t is None else t.detach() for t in tensors]


try:  # torch's scan operator, a prototype in torch; only compile="loop" uses it
    from torch._higher_order_ops.scan import scan as _scan_op
except ImportError:
    _scan_op = None


def _chunk_loop(x, delta, A, B, C, D, z, h):
    """Every chunk of a forward-only pass in one call: x, delta, z (b, K, T, ED), B, C (b, K, T, N),
    K chunks of T steps; h: the start state (b, ED, N). Returns y (b, K, T, ED) and the end state.
    torch's scan operator, carry, ys = scan(f, init, xs), calls f(carry, chunk k) for k = 0..K-1
    and stacks the ys; compiled, Inductor turns it into a loop around the fused chunk kernel, so
    the per-call cost of "The loop over chunks" above is paid once per sequence instead of per chunk."""
    def one_chunk(h, chunk):
        x_c, delta_c, B_c, C_c, *z_c = chunk  # (b, T, ·); z_c: [] when there is no gate
        y, h = _scan_chunk(x_c, delta_c, A, B_c, C_c, D, z_c[0] if z_c else None, h)
        return h, y

    # chunks first, scanned over dim 0: torch 2.6, 2.8 and 2.12 stack the ys along dim 0 whatever dim is
    chunks = [t.movedim(1, 0) for t in (x, delta, B, C, z) if t is not None]  # (K, b, T, ·)
    h, ys = _scan_op(one_chunk, h, chunks)
    return ys.movedim(0, 1), h


_compiled_loop_works = _scan_op is not None  # until a compile of it fails


def _forward_in_one_call(x, delta, A, B, C, D, z, h, T):
    """Forward only, compiled: every chunk in one call of the compiled _chunk_loop. The inputs
    are padded to K·T steps. Returns y (b, K·T, ED) and the end state, or None (with a warning,
    once) where this torch cannot compile the scan operator."""
    global _compiled_loop_works
    k = x.shape[1] // T
    # contiguous: a padded input is, an unpadded slice (B, C and z in the model) is not, and a
    # change of layout would be a recompile
    parts = [None if t is None else t.contiguous().unflatten(1, (k, T)) for t in (x, delta, B, C, z)]
    for t in parts:
        if t is not None:  # K changes with the length: a dynamic size, so no recompile
            torch._dynamo.maybe_mark_dynamic(t, 1)
    x_k, delta_k, B_k, C_k, z_k = parts  # (b, K, T, ED|N)
    try:  # where it fails, one compiled call per chunk beats the scan operator run eagerly
        y, h = _maybe_compiled(_chunk_loop, True, x.device)(x_k, delta_k, A, B_k, C_k, D, z_k, h)
    except Exception as e:
        _compiled_loop_works = False
        warnings.warn(f"compiling the loop over chunks failed ({type(e).__name__}: {e}); compiled "
                      f"forward passes now call the compiled chunk once per chunk instead", CompileFallbackWarning)
        return None
    return y.flatten(1, 2), h  # (b, K·T, ED), (b, ED, N)


def fused_selective_scan(x, delta, A, B, C, D=None, z=None, h0=None, chunk_size=CHUNK_SIZE,
                         recompute=True, compile=False, reset=None):
    """The scan chunk by chunk, computed in fp32 at least (as selective_scan_reference). Returns y (b, L, ED) and
    the final state (b, ED, N)."""
    x, delta, A, B, C = (_at_least_fp32(t) for t in (x, delta, A, B, C))
    D, z = (None if t is None else t.to(x.dtype) for t in (D, z))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, delta, A, B, C, D, z, h0))
    # forward mode, or torch.func's grad of a grad (jacrev of jacrev): plain, eager ops, which every
    # level differentiates (the recomputing backward would lose a level)
    if not torch.compiler.is_compiling() and (_forward_mode() or pscan._transform_levels("Grad") > 1):
        needs_grad, recompute, compile = True, False, False
    if not _is_positive_int(chunk_size):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    b, l, ed = x.shape
    T = chunk_size
    pad = (-l) % T
    if pad:  # identity steps: Δ = 0 gives dA = 1, dBx = 0 (their outputs are dropped)
        x, delta, B, C, z = (None if t is None else F.pad(t, (0, 0, 0, pad)) for t in (x, delta, B, C, z))
    keep = None if reset is None else (~F.pad(reset, (0, pad))).to(x.dtype)  # (b, L + pad)
    h = x.new_zeros(b, ed, A.shape[1]) if h0 is None else h0.to(x.dtype)  # (b, ED, N)
    recompute = recompute and needs_grad
    if compile == "loop" and not needs_grad and _compiled_loop_works and keep is None:
        out = _forward_in_one_call(*_detached(x, delta, A, B, C, D, z, h), T)
        if out is not None:
            return out[0][:, :l], out[1]  # (b, L, ED), (b, ED, N)
    step = _maybe_compiled(_scan_chunk, compile, x.device)

    def chunks(t):
        # split, not t[:, s:s+T]: autograd's backward of a slice writes a zero tensor of the whole
        # sequence per chunk (quadratic in L), a split's backward is one cat. Contiguous chunks:
        # their strides then do not depend on L, so neither does the compile.
        if t is None:
            return [None] * ((l + pad) // T)
        return [c.contiguous() for c in t.split(T, dim=1)]  # (b, T, ED|N) each

    ys = []
    for x_c, delta_c, B_c, C_c, z_c, keep_c in zip(*map(chunks, (x, delta, B, C, z, keep))):
        if recompute:
            y, h = _RecomputedChunk.apply(x_c, delta_c, A, B_c, C_c, D, z_c, h, compile, keep_c)
        elif needs_grad:  # plain autograd through each chunk
            y, h = step(x_c, delta_c, A, B_c, C_c, D, z_c, h, keep_c)
        else:  # forward only: the graph that training's _RecomputedChunk compiled
            y, h = step(*_detached(x_c, delta_c, A, B_c, C_c, D, z_c, h, keep_c))
        ys.append(y)
    return torch.cat(ys, dim=1)[:, :l], h  # (b, L, ED), (b, ED, N)


chunked_selective_scan = fused_selective_scan  # deprecated alias: "chunked" names Mamba-2's SSD form


# ------------------------------------------------------------------------------------------------
# 4. The public entry points
# ------------------------------------------------------------------------------------------------
# selective_scan takes the arguments of the official selective_scan_fn, except that Δ
# arrives already through softplus (no delta_bias, delta_softplus) and the layout is (b, L, ED),
# not (b, ED, L). It sends each call to eager_selective_scan (the lesson's selective_scan_reference
# with section 1's backward), to section 2's fused path, or with "reference" to
# selective_scan_reference itself.
#
# The eager backends name the pscan.py scan that runs the recurrence; "fused" is section 2's
# chunk-by-chunk path, which runs its own loop. "chunked" is accepted for "fused" with a
# DeprecationWarning: the word belongs to Mamba-2's chunked SSD (mamba2_minimal.py).
SCAN_BACKENDS = ("auto", "reference", "sequential", "pscan", "hillis_steele", "two_level", "associative", "fused",
                 "chunked")
FUSED_BACKENDS = ("fused", "chunked")
COMPILE_MODES = (False, True, "loop")


def selective_scan(x, delta, A, B, C, D=None, z=None, h0=None, backend="auto", compile=False,
                   return_last_state=False, chunk_size=CHUNK_SIZE, recompute=True, reset=None):
    """The selective scan y = SSM(Δ, A, B, C)(x) + D·x, gated by SiLU(z): selective_scan_reference
    or section 2's fused path, with the same numbers to rounding.

    Args:
        x, delta, A, B, C, D, z, h0: as in mamba_minimal.selective_scan_reference
        backend: "sequential", "pscan", "hillis_steele", "two_level", "associative" (the pscan.py
                 scan that eager_selective_scan runs over materialized tensors), "auto" (pscan.scan's
                 choice), "fused" (the fused path of section 2; "chunked": deprecated, "fused"),
                 or "reference" (selective_scan_reference itself, plain autograd)
        compile: False; True to run the fused path through torch.compile (implies
                 backend="fused"), chunk by chunk; "loop" to compile, for forward-only passes,
                 the loop over chunks as well (faster on long sequences, but every new process
                 compiles it again)
        chunk_size, recompute: the fused path's T and its recomputing backward (see above)
        reset: (b, L) bool or None, True where a packed sequence starts (dA = 0 there)
    Returns:
        y: (b, L, ED) in x's dtype, and with return_last_state the final state (b, ED, N) in fp32
        (fp64 for fp64 inputs)
    """
    _check_selective_scan_inputs(x, delta, A, B, C, D, z, h0, backend, compile, reset)
    if backend == "chunked":
        warnings.warn('selective_scan: backend="chunked" is deprecated, it is the fused path: use "fused"',
                      DeprecationWarning, stacklevel=2)
    out_dtype = x.dtype
    if backend == "reference":
        y, h_last = selective_scan_reference(x, delta, A, B, C, D, z, h0, reset=reset)
    elif compile or backend in FUSED_BACKENDS:
        y, h_last = fused_selective_scan(x, delta, A, B, C, D, z, h0, chunk_size, recompute, compile, reset)
    else:
        y, h_last = eager_selective_scan(x, delta, A, B, C, D, z, h0, backend, reset)
    y = y.to(out_dtype)
    return (y, h_last) if return_last_state else y


# The decode step, captured. A token of a small model is little arithmetic and many small ops:
# each layer's step is some 30 to 140 of them (projections, conv buffer, discretization, gate,
# norm), each paying the framework's dispatch, so that at d_model 128 the step costs far more
# than its maths. The official generate captures the whole step in a CUDA graph (cg=True) and
# replays it; decode_step(model, compile=True) does the same with torch.compile: one graph of
# every layer's step (fullgraph, so either all of it compiles or nothing runs), the cache tensors
# its inputs, written in place as the eager step writes them. Each new batch size or dtype
# compiles again (tens of seconds on a CPU), so it pays off over long generations; it is opt-in
# (compile_decode(model)). `python -m bench decode` measures both.

_compiled_steps = weakref.WeakKeyDictionary()  # model -> its compiled step, or its eager one after a failure


def decode_step(model, compile=False):
    """The function generate calls once per token, (token_ids (b,), cache) -> logits (b, V):
    model._step, or with compile the same step compiled (made once per model). If compiling
    fails (no C++ compiler, an op the compiler lacks), one warning, then the eager step."""
    if not compile:
        return model._step
    eager = type(model)._step.__get__(model)  # the class's step, whatever compile_decode set
    if getattr(model.cfg, "attn_layer_idx", None) and model not in _compiled_steps:
        # an attention layer's KV cache grows by a token per step: a new shape, a new graph, each token
        warnings.warn("compile_decode covers models without attention layers; decoding eagerly", stacklevel=3)
        _compiled_steps[model] = eager
    if model not in _compiled_steps:
        compiled = torch.compile(eager, fullgraph=True, dynamic=False)

        def step(token_ids, cache):
            if _compiled_steps[model] is not step:  # compiling failed before
                return eager(token_ids, cache)
            try:
                return compiled(token_ids, cache)
            except Exception as err:  # fullgraph: nothing ran, the cache is untouched
                warnings.warn(f"compiling the decode step failed, decoding eagerly instead "
                              f"({type(err).__name__}: {str(err)[:500]})", stacklevel=2)
                _compiled_steps[model] = eager
                return eager(token_ids, cache)

        _compiled_steps[model] = step
    return _compiled_steps[model]


def _check_backend(backend, what):
    # an eager backend is a pscan.py scan: pscan.BACKENDS decides which names it knows
    known = tuple(b for b in SCAN_BACKENDS if b in FUSED_BACKENDS or b in pscan.BACKENDS or b == "reference")
    if backend not in known:
        raise ValueError(f"{what} must be one of {known}, got {backend!r}")


def _check_selective_scan_inputs(x, delta, A, B, C, D, z, h0, backend, compile, reset=None):
    _check_backend(backend, "backend")
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    if backend == "reference" and compile:
        raise ValueError("backend='reference' runs the lesson's code, compile runs the fused path: choose one")
    for name, t in (("x", x), ("delta", delta), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("h0", h0)):
        if (t is not None or name in "x delta A B C") and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got a {type(t).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape (b, L, ED) (batch, length, channels), got {tuple(x.shape)}")
    b, l, ed = x.shape
    if l == 0:
        raise ValueError("the sequence length must be at least 1, got x of shape (batch, 0, ED)")
    if A.dim() != 2 or A.shape[0] != ed:
        raise ValueError(f"A must have shape (ED, N) = ({ed}, N), got {tuple(A.shape)}")
    given = {name: t for name, t in (("x", x), ("delta", delta), ("A", A), ("B", B), ("C", C), ("D", D),
                                     ("z", z), ("h0", h0)) if t is not None}
    for name, t in given.items():
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    elsewhere = [f"{name} on {t.device}" for name, t in given.items() if t.device != x.device]
    if elsewhere:
        raise ValueError(f"selective_scan's inputs must all be on x's device, {x.device}; got {', '.join(elsewhere)}")
    computed_in = {name: _at_least_fp32(t).dtype for name, t in given.items()}
    if len(set(computed_in.values())) > 1:  # fp16/bf16 count as fp32: they are computed in fp32
        raise ValueError(f"selective_scan's inputs must be all float64 or all at most float32 (fp16/bf16 "
                         f"are computed in fp32), got {', '.join(f'{k} {t.dtype}' for k, t in given.items())}")
    n = A.shape[1]
    expected = {"delta": (b, l, ed), "B": (b, l, n), "C": (b, l, n), "D": (ed,), "z": (b, l, ed),
                "h0": (b, ed, n)}
    for name, shape in expected.items():
        if name in given and tuple(given[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(given[name].shape)}")
    if reset is not None and (not isinstance(reset, torch.Tensor) or reset.dtype != torch.bool
                              or tuple(reset.shape) != (b, l)):
        raise ValueError(f"reset must be a bool tensor of shape (b, L) = ({b}, {l}), got "
                         f"{reset.dtype if isinstance(reset, torch.Tensor) else type(reset).__name__}")



def _mixer_scan(x, delta, A, B, C, D, z, h0, reset, **options):
    return selective_scan(x, delta, A, B, C, D, z, h0, return_last_state=True, reset=reset, **options)


def accelerate(model, backend="auto", compile=False, chunk_size=CHUNK_SIZE, recompute=True):
    """Run every MambaMixer of `model` (a MambaLM, a Mamba backbone, any module holding them) with
    this file's selective scan and conv: the same numbers to rounding, a CPU training step 1.3-1.4
    times as fast (RESULTS.md). Returns the model.

    backend: the pscan.py scan under the hand-written backward ("auto", "sequential", "pscan",
             "hillis_steele", "two_level", "associative"), "fused" for section 2's path, or
             "reference" to go back to the lesson's code
    compile: False, True (the fused path through torch.compile) or "loop" (section 2)
    chunk_size, recompute: the fused path's T and its recomputing backward"""
    _check_backend(backend, "backend")
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    if backend == "reference" and compile:
        raise ValueError("backend='reference' runs the lesson's code, compile runs the fused path: choose one")
    if not _is_positive_int(chunk_size):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if not isinstance(recompute, bool):
        raise ValueError(f"recompute must be True or False, got {recompute!r}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"accelerate takes a built model (an nn.Module), got {type(model).__name__}")
    mixers = [m for m in model.modules() if isinstance(m, MambaMixer)]
    if not mixers:
        raise ValueError(f"accelerate runs Mamba-1's mixers (MambaMixer); {type(model).__name__} has none")
    for mixer in mixers:
        if backend == "reference":  # the class's own functions again
            mixer.__dict__.pop("scan_fn", None)
            mixer.__dict__.pop("conv_fn", None)
            continue
        mixer.scan_fn = functools.partial(_mixer_scan, backend=backend, compile=compile, chunk_size=chunk_size,
                                          recompute=recompute)
        mixer.conv_fn = _CausalConv.apply
    return model


def compile_decode(model):
    """generate's per-token step of `model` (any generation) as one torch.compile graph, made on the
    first token (decode_step above). Returns the model."""
    if not isinstance(model, torch.nn.Module) or not callable(getattr(type(model), "_step", None)):
        raise ValueError(f"compile_decode takes a built language model (MambaLM, Mamba2LM, Mamba3LM), got "
                         f"{type(model).__name__}")
    model._step = decode_step(model, compile=True)
    return model
