"""
pscan.py: every way to run the first-order linear recurrence

    h_t = a_t * h_{t-1} + b_t          (t = 0 .. L-1, h_{-1} = h0, zero by default)

which is the heart of a selective state space model: in Mamba, a_t = exp(Δ_t·A) and
b_t = Δ_t·B_t·x_t, elementwise over the (ED, N) state. Read this file top to bottom:

    1. Checking the inputs               what every backend accepts
    2. The sequential loop               scan_sequential: the oracle and the baseline
    3. The combine rule                  why a recurrence can be computed in parallel
    4. The Blelloch scan                 up-sweep and down-sweep on strided views, any L
    5. The backward pass                 a gradient that is itself a reverse scan
    6. torch's associative_scan          scan_associative, with the same lean backward
    7. One entry point                   scan(..., backend="auto") and the rule it uses

Shapes: a and b are (B, L, *rest) with the same shape; the scan runs over dim 1 and every
other position is an independent recurrence. h0 is (B, *rest). The result h is (B, L, *rest)
with h[:, -1] the final state. fp16/bf16 inputs are accumulated in fp32 and the result is
returned in the input dtype. Inputs are never modified.

`python bench.py` times the backends against each other; test_scan.py checks each one against
the float64 loop.
"""

import torch

__all__ = ["scan_sequential", "pscan", "scan_associative", "scan", "BACKENDS"]

BACKENDS = ("auto", "sequential", "pscan", "associative")


# ------------------------------------------------------------------------------------------------
# 1. Checking the inputs
# ------------------------------------------------------------------------------------------------

def _shape(t):
    return tuple(t.shape)


def _check_inputs(a, b, h0):
    """Raise ValueError naming what was expected; return the dtype to accumulate in."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError(f"a and b must be tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {_shape(a)} and {_shape(b)}")
    if a.dim() < 2:
        raise ValueError(f"a and b must have shape (B, L, ...) with at least 2 dims, got {_shape(a)}")
    if a.shape[1] == 0:
        raise ValueError(f"the sequence length (dim 1) must be at least 1, got shape {_shape(a)}")
    if not a.is_floating_point() or a.dtype != b.dtype:
        raise ValueError(f"a and b must share one floating dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device, got {a.device} and {b.device}")
    if h0 is not None:
        expected = (a.shape[0],) + tuple(a.shape[2:])
        if not isinstance(h0, torch.Tensor) or tuple(h0.shape) != expected:
            got = _shape(h0) if isinstance(h0, torch.Tensor) else type(h0).__name__
            raise ValueError(f"h0 must have shape (B, *rest) = {expected}, got {got}")
        if h0.device != a.device:
            raise ValueError(f"h0 must be on {a.device}, got {h0.device}")
    # Half precision loses the state after a few hundred steps of a_t close to 1: keep fp32.
    return torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype


# ------------------------------------------------------------------------------------------------
# 2. The sequential loop
# ------------------------------------------------------------------------------------------------
# L dependent steps, each one elementwise multiply-add over the B * prod(rest) values of a step.
# On a CPU this is hard to beat once a step holds a few thousand values: it reads every input
# once. On a GPU every step is a kernel launch of a few microseconds, so L = 4096 costs tens of
# milliseconds of launches alone, whatever the width. That is why the parallel scan exists.
#
# We iterate with unbind, not a[:, t]: autograd's backward of `x[:, t]` allocates a zero tensor
# of the full (B, L, ...) shape for every step, which makes the backward quadratic in L.

def scan_sequential(a, b, h0=None):
    """The loop. Differentiable through plain autograd (backward linear in L).

    Args:
        a, b: (B, L, *rest)
        h0:   (B, *rest) or None for zeros
    Returns:
        h:    (B, L, *rest), h[:, t] = a[:, t] * h[:, t-1] + b[:, t]
    """
    dtype = _check_inputs(a, b, h0)
    h = torch.zeros_like(b[:, 0], dtype=dtype) if h0 is None else h0.to(dtype)  # (B, *rest)
    hs = []
    for a_t, b_t in zip(a.to(dtype).unbind(1), b.to(dtype).unbind(1)):
        h = torch.addcmul(b_t, a_t, h)  # (B, *rest)
        hs.append(h)
    return torch.stack(hs, dim=1).to(a.dtype)  # (B, L, *rest)


# ------------------------------------------------------------------------------------------------
# 3. The combine rule
# ------------------------------------------------------------------------------------------------
# Write one step as the pair (a, b), meaning "h -> a*h + b". Doing step 1 then step 2 is
#
#     h -> a2*(a1*h + b1) + b2 = (a2*a1)*h + (a2*b1 + b2)
#
# so two steps compose into one step of the same form:
#
#     (a1, b1) ∘ (a2, b2) = (a2*a1, a2*b1 + b2)                               (combine rule)
#
# Composition of functions is associative, hence so is this rule: ((s1∘s2)∘s3 = s1∘(s2∘s3)),
# and both sides expand to (a3*a2*a1, a3*a2*b1 + a3*b2 + b3). Associativity is all a parallel
# scan needs: h_t is the b-part of s_0∘s_1∘...∘s_t, and we may bracket that product however
# we like, for instance as a balanced tree of depth log2(L) whose levels run in parallel.


# ------------------------------------------------------------------------------------------------
# 4. The Blelloch scan
# ------------------------------------------------------------------------------------------------
# Up-sweep: combine neighbours in pairs, then pairs of pairs, ... Each level is one vectorized
# multiply-add over strided views, on half as many elements as the level before. After it, the
# right element of every pair holds the whole block it closes (written i:j below).
# Down-sweep: walk back down; the left element of every pair except the first now receives the
# finished prefix that ends just before it. For L = 8, with x_t = (a_t, b_t):
#
#   t:        0      1      2      3      4      5      6      7
#             x0     x1     x2     x3     x4     x5     x6     x7
#   up 0      └──────┤      └──────┤      └──────┤      └──────┤
#                   0:1           2:3           4:5           6:7
#   up 1             └─────────────┤             └─────────────┤
#                                 0:3                         4:7
#   up 2                           └───────────────────────────┤
#                                                             0:7
#   down 1                         └─────────────┐
#                                               0:5
#   down 0           └──────┐      └──────┐      └──────┐
#                          0:2           0:4           0:6
#
# Each level recurses on the right elements of its pairs (a view with twice the stride), so
# the tree never needs L to be a power of two: with an odd count, the last element sits out
# the up-sweep of that level and is finished by the down-sweep like any other left element.
# The work is about 2L combines for every L (a power-of-two padding would double it at 2^k + 1).
#
# Memory: b is copied once into the output h, which is then scanned in place. The a-part of
# the combined steps needs a new tensor per level, but each level is half the one below, so
# all of them together are one more tensor of the input's size. The input a is only read.
#
# The same tree runs backwards in time for the backward pass (section 5). Written for both
# directions, the coefficients `w` are a[:, 1:] in both cases: w holds the multiplier of every
# element except the first one in scan order.
#   forward:  h_t = a_t * h_{t-1} + b_t,   element t takes w[t-1] = a_t   (element 0 takes none)
#   reverse:  g_t = a_{t+1} * g_{t+1} + c_t, element t takes w[t] = a_{t+1} (element L-1 takes none)

def _blelloch_(x, w, reverse=False):
    """Scan x in place along dim 1. x: (B, n, *rest) (any strides); w: (B, n-1, *rest)."""
    n = x.shape[1]
    if n < 2:
        return
    p = n // 2  # number of pairs at this level
    if not reverse:
        # pairs (0,1), (2,3), ...; the right element receives, an odd last element sits out
        give, recv = x[:, 0 : 2 * p : 2], x[:, 1 : 2 * p : 2]  # (B, p, *rest)
        w_recv = w[:, 0 : 2 * p : 2]  # (B, p, *rest)   multipliers of elements 1, 3, 5, ...
        w_give = w[:, 1 : 2 * p - 1 : 2]  # (B, p-1, *rest) of elements 2, 4, ... (0 has none)
        recv.addcmul_(w_recv, give)  # up-sweep: right = w_right * left + right
        w_up = w_recv[:, 1:] * w_give  # (B, p-1, *rest) a-part of pairs 1.. (pair 0 leads)
        _blelloch_(recv, w_up, reverse)  # the pairs' right elements now hold full prefixes
        # down-sweep: elements 2, 4, ... take the finished prefix of the element before them
        x[:, 2:n:2].addcmul_(w[:, 1 : n - 1 : 2], x[:, 1 : n - 1 : 2])
    else:
        # the mirror image: pairs are aligned at the end, the left element receives, and an
        # odd element 0 sits out
        off = n - 2 * p
        recv, give = x[:, off:n:2], x[:, off + 1 : n : 2]  # (B, p, *rest)
        w_recv = w[:, off : n - 1 : 2]  # (B, p, *rest)
        w_give = w[:, off + 1 : n - 1 : 2]  # (B, p-1, *rest) (element n-1 has none)
        recv.addcmul_(w_recv, give)
        w_up = w_recv[:, :-1] * w_give  # (B, p-1, *rest) (the last pair leads)
        _blelloch_(recv, w_up, reverse)
        x[:, 1 - off : n - 1 : 2].addcmul_(w[:, 1 - off : n - 1 : 2], x[:, 2 - off : n : 2])


def _forward_states(a, b, h0, dtype):
    """h for the forward recurrence, in `dtype`, as a new contiguous tensor."""
    h = b.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)  # (B, L, *rest)
    if h0 is not None:
        h[:, 0].addcmul_(a[:, 0].to(dtype), h0.to(dtype))  # fold h0 into the first step
    _blelloch_(h, a[:, 1:].to(dtype))
    return h


# ------------------------------------------------------------------------------------------------
# 5. The backward pass
# ------------------------------------------------------------------------------------------------
# Let grad_t = dLoss/dh_t coming from outside, and g_t the total gradient reaching h_t, which
# also flows through every later state: h_{t+1} = a_{t+1}*h_t + b_{t+1} gives
#
#     g_t = grad_t + a_{t+1} * g_{t+1},     g_{L-1} = grad_{L-1}
#
# the same linear recurrence, run backwards in time with the multipliers shifted by one. Then
#
#     dLoss/db_t = g_t,     dLoss/da_t = g_t * h_{t-1},     dLoss/dh0 = a_0 * g_0
#
# So the backward needs only a and h (no per-level intermediates) and runs the same tree.
# Peak memory during it: h, the incoming gradient, g and the per-level products (one tensor),
# and the last is freed before dLoss/da is written.

def _backward_from_states(ctx, grad_h):
    a, h, h0 = ctx.saved_tensors
    dtype = h.dtype
    g = grad_h.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)  # (B, L, *rest)
    _blelloch_(g, a[:, 1:].to(dtype), reverse=True)
    grad_a = grad_h0 = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.empty_like(g)  # (B, L, *rest)
        torch.mul(g[:, 1:], h[:, :-1], out=grad_a[:, 1:])
        if h0 is None:
            grad_a[:, 0].zero_()
        else:
            torch.mul(g[:, 0], h0.to(dtype), out=grad_a[:, 0])
        grad_a = grad_a.to(a.dtype)
    if ctx.has_h0 and ctx.needs_input_grad[2]:
        grad_h0 = (g[:, 0] * a[:, 0].to(dtype)).to(ctx.h0_dtype)  # (B, *rest)
    grad_b = g.to(a.dtype) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, grad_h0


class _ScanFunction(torch.autograd.Function):
    """Base: subclasses provide `_states(a, b, h0, dtype)`; the backward is shared."""

    @classmethod
    def forward(cls, ctx, a, b, h0, dtype):
        h = cls._states(a, b, h0, dtype)
        ctx.has_h0 = h0 is not None
        ctx.h0_dtype = h0.dtype if h0 is not None else None
        ctx.save_for_backward(a, h, h0)
        return h.to(a.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_h):
        return (*_backward_from_states(ctx, grad_h), None)


class _PScan(_ScanFunction):
    _states = staticmethod(_forward_states)


def pscan(a, b, h0=None):
    """Blelloch scan with a reverse-scan backward. Same arguments and result as scan_sequential."""
    dtype = _check_inputs(a, b, h0)
    return _PScan.apply(a, b, h0, dtype)


# ------------------------------------------------------------------------------------------------
# 6. torch's associative_scan
# ------------------------------------------------------------------------------------------------
# torch ships a generic parallel scan, torch._higher_order_ops.associative_scan, which takes the
# combine rule as a Python function. "pointwise" mode compiles it into one Triton kernel and
# needs a CUDA or XPU device; "generic" mode runs anywhere. Its own autograd support saves much
# more than a and h (its backward materializes L x L intermediates), so we run it without
# autograd and reuse the reverse-scan backward of section 5.

def _combine(left, right):
    (a1, b1), (a2, b2) = left, right
    return a2 * a1, torch.addcmul(b2, a2, b1)  # (a2*a1, a2*b1 + b2)


def _associative_states(a, b, h0, dtype):
    try:
        from torch._higher_order_ops import associative_scan
    except ImportError as err:
        raise RuntimeError(
            f"backend 'associative' needs torch._higher_order_ops.associative_scan, which arrived "
            f"in torch 2.5 (eager generic mode in 2.6); this is torch {torch.__version__}"
        ) from err
    a_, b_ = a.to(dtype), b.to(dtype)
    if h0 is not None:
        b_ = b_.clone()
        b_[:, 0].addcmul_(a_[:, 0], h0.to(dtype))
    mode = "pointwise" if a.device.type in ("cuda", "xpu") else "generic"
    with torch.no_grad():
        _, h = associative_scan(_combine, (a_, b_), dim=1, combine_mode=mode)
    return h.contiguous()


class _AssociativeScan(_ScanFunction):
    _states = staticmethod(_associative_states)


def scan_associative(a, b, h0=None):
    """torch's associative_scan with a reverse-scan backward. Same contract as scan_sequential."""
    dtype = _check_inputs(a, b, h0)
    return _AssociativeScan.apply(a, b, h0, dtype)


# ------------------------------------------------------------------------------------------------
# 7. One entry point
# ------------------------------------------------------------------------------------------------
# Which backend is fastest depends on the device, the width of one step (B * prod(rest)) and on
# whether a backward pass follows. On a GPU the loop pays a kernel launch per step, so the tree
# wins. On a CPU (bench.py, one thread, L = 256..4096) the tree wins every forward+backward,
# by 2x to 3x, because the loop's autograd graph records L small steps; forward-only, the loop
# reads each input once and catches up as a step gets wider: even at 4096 values per step, ahead
# from 8192 on (1.3x at 24576, L = 4096).

CPU_LOOP_MIN_WIDTH = 8192


def scan(a, b, h0=None, backend="auto"):
    """Run the recurrence with the chosen backend; "auto" picks by device, width and autograd."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        _check_inputs(a, b, h0)
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (a, b, h0))
        wide = a[:, 0].numel() >= CPU_LOOP_MIN_WIDTH
        use_loop = a.device.type == "cpu" and wide and not needs_grad
        backend = "sequential" if use_loop else "pscan"
    fn = {"sequential": scan_sequential, "pscan": pscan, "associative": scan_associative}[backend]
    return fn(a, b, h0)
