"""
pscan.py: the recurrence at the heart of Mamba, and every way to run it

    h_t = a_t * h_{t-1} + b_t          t = 0 .. L-1, from h_{-1} = h0 (zero by default)

In Mamba (Gu & Dao 2023, arXiv 2312.00752, §3.2 and Algorithm 2) the state h(t) of a continuous
SSM, h'(t) = A·h(t) + B·x(t), with x the SSM's input, is sampled with a step Δ_t > 0 computed
from the token: Ā_t = exp(Δ_t·A) and B̄_t ≈ Δ_t·B_t (to first order, as the official code does;
mamba_minimal.py's section 1 derives both). With A < 0, a_t = Ā_t is a decay in (0, 1) (exactly 1 where
padding sets Δ = 0) and b_t = B̄_t·x_t, elementwise over every (channel, state) pair.
Sections: 1 the loop, 2 the convolution view (why S4 needed no scan), 3 the combine rule, 4 work
and depth, 5 Blelloch's work-efficient scan (pscan), 6 Hillis-Steele and 7 the two-level scan, 8
the backward, 9 scan(), the entry point, 10 segment sums (Mamba-2's). The model needs 1 and 9;
then come 3-5 and 8, the parallel scan; 2, 6, 7 and 10 can wait. The appendix is past the lesson: A
second derivatives, jvp, vmap; B torch's associative_scan; C how "auto" chooses; D counting
combines; E input checks.

Shapes: a, b and h are (batch, L, *rest), scanned over dim 1, h[:, -1] the final state; h0 is
(batch, *rest). fp16/bf16 are accumulated in fp32, returned in the input dtype. Inputs are never
modified.
"""

import contextlib
import warnings

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["scan_sequential", "scan_time_invariant", "pscan", "scan_hillis_steele", "scan_two_level",
           "scan_chunked", "scan", "BACKENDS", "scan_associative", "choose_backend", "backend_for",
           "count_combines", "tree_levels", "print_tree", "segsum"]


# ------------------------------------------------------------------------------------------------
# 1. The loop
# ------------------------------------------------------------------------------------------------
# L dependent steps, each an elementwise multiply-add: the yardstick of every other backend
# (test_scan.py checks them all against a float64 loop of its own). Its weakness is depth: step t
# waits for step t-1.

def scan_sequential(a, b, h0=None):
    """The loop. Differentiable through plain autograd (backward linear in L).

    Args:
        a, b: (batch, L, *rest)
        h0:   (batch, *rest) or None for zeros
    Returns:
        h:    (batch, L, *rest), h[:, t] = a[:, t] * h[:, t-1] + b[:, t]
    """
    dtype = _check_inputs(a, b, h0)
    h = torch.zeros_like(b[:, 0], dtype=dtype) if h0 is None else h0.to(dtype)  # (batch, *rest)
    hs = []
    # unbind, not a[:, t]: indexing's backward allocates full-size zeros per step, quadratic in L
    for a_t, b_t in zip(a.to(dtype).unbind(1), b.to(dtype).unbind(1)):
        h = torch.addcmul(b_t, a_t, h)  # (batch, *rest)  h_t = a_t * h_{t-1} + b_t
        hs.append(h)
    return torch.stack(hs, dim=1).to(a.dtype)  # (batch, L, *rest)

# Why fp32 for half inputs: with a_t close to 1 the state is a long running sum, and a small b_t
# below half the state's spacing (fp16 keeps 11 significant bits, bf16 8) is rounded away.


# ------------------------------------------------------------------------------------------------
# 2. The convolution view
# ------------------------------------------------------------------------------------------------
# Unroll the loop: h_t = b_t + a_t·b_{t-1} + a_t·a_{t-1}·b_{t-2} + ... If a does not depend on t
# (a linear time-invariant system), the product of the a's over the last k steps is a^k, and
#
#     h_t = Σ_{k=0..t} a^k · b_{t-k}                a causal convolution with kernel K_k = a^k
#
# S4 (Gu, Goel & Ré 2021, arXiv 2111.00396) is such a system: its output is the input convolved
# with the fixed kernel C·Ā^k·B̄, by FFT in O(L log L). Mamba's selection (§3.1-3.2) makes Δ, B
# and C functions of the input, so a_t = exp(Δ_t·A) changes with every token: no kernel, a scan.

def scan_time_invariant(a, b, h0=None):
    """The recurrence with a constant a, as a causal convolution (FFT), for the LTI case only.

    Args:
        a:  (batch, *rest)     the same multiplier at every step
        b:  (batch, L, *rest)
        h0: (batch, *rest) or None
    Returns:
        h:  (batch, L, *rest), scan_sequential's result to within 100 eps·max|h| in float64 at
            L = 4096 for a up to 1 (test_scan.py, ten random draws); the error grows with L
    """
    dtype = _check_time_invariant_inputs(a, b, h0)
    L = b.shape[1]
    k = torch.arange(L, device=b.device, dtype=dtype).view((1, L) + (1,) * (b.dim() - 2))
    kernel = a.to(dtype).unsqueeze(1) ** k  # (batch, L, *rest)  K_k = a^k
    n = 2 * L  # zero padding to 2L turns the FFT's circular convolution into a causal one
    h = torch.fft.irfft(torch.fft.rfft(kernel, n=n, dim=1) * torch.fft.rfft(b.to(dtype), n=n, dim=1),
                        n=n, dim=1)[:, :L]  # (batch, L, *rest)
    if h0 is not None:
        h = h + kernel * a.to(dtype).unsqueeze(1) * h0.to(dtype).unsqueeze(1)  # a^(t+1)·h0
    return h.to(b.dtype)


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
# Note the order: s1∘s2 means "s1, then s2", as time runs (the mathematician's f∘g is "g first").

def _combine(first, then):
    """The combine rule on pairs of tensors: the step `first`, then the step `then`."""
    (a1, b1), (a2, b2) = first, then
    return a2 * a1, torch.addcmul(b2, a2, b1)  # (a2*a1, a2*b1 + b2)

# Function composition is associative, hence so is this rule: (s1∘s2)∘s3 = s1∘(s2∘s3), both
# (a3*a2*a1, a3*a2*b1 + a3*b2 + b3). That is all a parallel scan needs. Write i:j for the steps
# i, ..., j-1 combined into one (half-open, as a Python slice). The prefix 0:t+1 maps h_{-1} to
# h_t, and may be bracketed as a balanced tree whose levels run in parallel (sections 5 to 7).
# Its b-part is h_t when h_{-1} = 0, so the scans fold h0 into the first step,
# b_0 <- a_0*h0 + b_0, and scan from zero.
#
# Two steps are special. The identity (1, 0) changes nothing: padding is made of it (in Mamba,
# Δ = 0 gives a = 1, b = 0). A reset (0, b) forgets everything before it, (a1, b1)∘(0, b2) =
# (0, b2): a_t = 0 at the first token of a packed document starts it from a zero state.
#
# Floating point is not exactly associative: the scans agree with the loop to rounding only.


# ------------------------------------------------------------------------------------------------
# 4. Work and depth
# ------------------------------------------------------------------------------------------------
# Work: how many combines in all. Depth: how many levels run one after another, a level being
# one vectorized op over all its combines. Counted by count_combines (appendix D), one combine
# per update of a b-part:
#
#   scan                    work           depth        counted at L = 1024 (`python -m bench depth`)
#   loop (section 1)        L              L            1024 combines in 1024 levels
#   pscan (section 5)       O(L)           O(log L)     2036 combines in 19 levels: up, then down
#   Hillis-Steele (sec. 6)  O(L log L)     O(log L)     9217 combines in 10 levels: L - 2^k at level k


# ------------------------------------------------------------------------------------------------
# 5. Blelloch's work-efficient scan: the up-sweep and the down-sweep (inclusive: Brent & Kung's tree)
# ------------------------------------------------------------------------------------------------
# Up-sweep: combine neighbours in pairs, then pairs of pairs, ... Each level is one multiply-add
# over strided views, half the size of the level before. After it, the right element of every
# pair holds the whole block it closes. Down-sweep: walk back down; the left element of every
# pair but the first, and an odd last one, receives the finished prefix that ends just before it.
# For L = 8, with x_t = (a_t, b_t):
#
#   t:        0      1      2      3      4      5      6      7
#             x0     x1     x2     x3     x4     x5     x6     x7
#   up 0      └──────┤      └──────┤      └──────┤      └──────┤
#                   0:2           2:4           4:6           6:8
#   up 1             └─────────────┤             └─────────────┤
#                                 0:4                         4:8
#   up 2                           └───────────────────────────┤
#                                                             0:8
#   down 1                         └─────────────┐
#                                               0:6
#   down 0           └──────┐      └──────┐      └──────┐
#                          0:3           0:5           0:7
#
# Every element t ends holding 0:t+1, its inclusive prefix; print_tree(n) prints each level
# (appendix D). (Precisely: Blelloch's 1990 down-sweep computes the exclusive scan, the "prescan",
# each element ending with 0:t: it clears the last element, then at each level hands every left
# element its parent's prefix and every right one that prefix combined with the old left value.
# The inclusive down-sweep drawn above, updating only left elements, is Brent & Kung's 1982 tree,
# hence the function's name.) Depth: log2(L) levels up and log2(L) - 1 down.
# Work: about 2L combines (2L - 2 - log2(L) for a power of two), more than the loop's L: the
# price of the short depth.
#
# Each level recurses on the right elements of its pairs (a view with twice the stride), so L
# need not be a power of two: an odd last element sits out the level's up-sweep (n = 7 below).
#
# The code keeps the b-parts in x and the a-parts beside them in w, w[:, t] = a_t with x[:, t]:
# each slice of w below is the slice of x it updates. Element 0 receives nothing (h0 is folded
# into its b-part, section 3), so w[:, 0] never reaches the result.

def _brent_kung_(x, w):
    """The up-sweep and the down-sweep: scan x in place along dim 1 and return it.
    x, w: (batch, n, *rest), any strides; w[:, t] = a_t."""
    n = x.shape[1]
    if n < 2:
        return x
    # For n = 7 (p = 3): pairs (0, 1), (2, 3), (4, 5), and element 6 sits out; the recursion on
    # elements 1, 3, 5; the down-sweep 2 <- 1, 4 <- 3, 6 <- 5
    p = n // 2  # pairs at this level
    left, right = x[:, 0 : 2 * p : 2], x[:, 1 : 2 * p : 2]  # (batch, p, *rest) elements 0, 2, ... and 1, 3, ...
    w_left, w_right = w[:, 0 : 2 * p : 2], w[:, 1 : 2 * p : 2]  # (batch, p, *rest) their a_t
    right.addcmul_(w_right, left)  # up-sweep: right = w_right * left + right, the combine's b-part
    _brent_kung_(right, w_right * w_left)  # the same on the pairs (its a-part a_{2k+1}·a_{2k}): right gets its prefix
    # down-sweep: elements 2, 4, ... combine the finished prefix of the element before them
    x[:, 2:n:2].addcmul_(w[:, 2:n:2], x[:, 1 : n - 1 : 2])
    return x


# ------------------------------------------------------------------------------------------------
# 6. The Hillis-Steele scan
# ------------------------------------------------------------------------------------------------
# The other classic (Hillis & Steele 1986). At level k every element t >= d = 2^k combines with
# the element d before it, all at once. Each row is the state after its level:
#
#   t:          0      1      2      3      4      5      6      7
#   start       x0     x1     x2     x3     x4     x5     x6     x7
#   d = 1       0:1    0:2    1:3    2:4    3:5    4:6    5:7    6:8     t takes t-1
#   d = 2       0:1    0:2    0:3    0:4    1:5    2:6    3:7    4:8     t takes t-2
#   d = 4       0:1    0:2    0:3    0:4    0:5    0:6    0:7    0:8     t takes t-4
#
# (at d = 2, element 5 holding 4:6 takes element 3 holding 2:4: 2:4 ∘ 4:6 = 2:6).
#
# Half the tree's levels, for about (log2(L) - 1)/2 times its work (4.5x at L = 1024, section 4).

def _hillis_steele(x, w):
    """Scan x along dim 1; return a new tensor. x, w: (batch, n, *rest), w[:, t] = a_t (section 5)."""
    n = x.shape[1]
    m, d = w[:, 1:], 1  # m[:, j]: a-part of the d steps that end at element j + d
    while d < n:  # a new tensor per level: element t reads its partner from before the level
        done = x[:, :d]  # (batch, d, *rest) these prefixes are complete
        x = torch.cat([done, torch.addcmul(x[:, d:], m, x[:, : n - d])], dim=1)  # (batch, n, *rest)
        if 2 * d < n:  # the a-parts for the next level, only where someone still needs one
            m = m[:, d:] * m[:, : n - 2 * d]  # (batch, n - 2d, *rest)
        d *= 2
    return x


def scan_hillis_steele(a, b, h0=None):
    """Hillis-Steele scan (log2(L) levels, ~L·log2(L) combines), with section 8's backward (_run).
    Same contract as scan_sequential."""
    dtype = _check_inputs(a, b, h0)
    return _run(_hillis_steele, a, b, h0, dtype).to(a.dtype)


# ------------------------------------------------------------------------------------------------
# 7. The two-level scan
# ------------------------------------------------------------------------------------------------
# The classic two-level scan of GPU programming, and the shape of Mamba-2's chunked SSD
# (mamba2_minimal.py section 3): cut the sequence into K chunks of T steps, small enough for a
# chunk's states to fit in fast on-chip memory.
#
#   1. Inside every chunk, a tree from a zero state: all chunks at once, as one batch.
#   2. Chunk k is now one step (prod_k, end_k), the product of its a's and its end state. The
#      loop carries the state: carried_k = prod_k * carried_{k-1} + end_k, from carried_0 = end_0.
#   3. Chunk k >= 1 adds carried_{k-1} times the a-product from its start up to t.
#
#   chunks:     [ 0 .. T-1 ][ T .. 2T-1 ][ 2T .. 3T-1 ]
#   1. scan:     └──────┤     └──────┤     └──────┤          from zero, all chunks at once
#   2. carry:      carried_0 ──> carried_1 ──> carried_2     K - 1 dependent steps
#   3. correct:              chunk 1 += cumprod·carried_0, chunk 2 += cumprod·carried_1
#
# Depth: one chunk's tree (about 2·log2(T) levels), K - 1 carry steps, one correction: at best
# 18 levels at L = 1024 (T = 342 to 383: three chunks), one fewer than one tree. Work: step 3 adds
# about L - T combines; at L = 1024 the count (step 3's cumprod left out) is 2895 at T = 64, 2045
# at T = 2, above pscan's 2036 at every T < L: chunking buys locality, hardly depth, not work.
#
# Any T works: a chunk's a-product may underflow to 0, but it only scales a carried state
# whose true contribution is then as small. (Dividing by it, h_t = p_t·Σ_{s<=t} b_s/p_s, would
# give inf·0 = NaN.)
#
# Hillis-Steele and the two-level scan are here to teach and to count: on the CPUs of RESULTS.md
# both are slower than pscan (`python -m bench scan`).

def _two_level(x, w, chunk_size=64):
    """Scan x along dim 1; return a new tensor. x, w: (batch, n, *rest), w[:, t] = a_t (section 5)."""
    batch, n, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    T = min(chunk_size, n)  # a short sequence is one chunk of its own length
    K = -(-n // T)  # number of chunks
    pad = K * T - n  # identity steps (a = 1, b = 0) at the end change nothing
    m = torch.cat([w, x.new_ones((batch, pad) + rest)], dim=1) if pad else w.contiguous()  # (batch, K·T, *rest)
    x = torch.cat([x, x.new_zeros((batch, pad) + rest)], dim=1) if pad else x.contiguous()
    xs, ms = x.view((batch * K, T) + rest), m.view((batch * K, T) + rest)  # every chunk a row
    _brent_kung_(xs, ms)  # 1. (batch*K, T, *rest) every chunk scanned from zero
    prod = torch.cumprod(ms, dim=1).view((batch, K, T) + rest)  # a-products from each chunk's start
    xs = xs.view((batch, K, T) + rest)
    carried = [xs[:, 0, -1]]  # 2. (batch, *rest) carried_0 = end_0
    for k in range(1, K):  # carried_k = prod_k * carried_{k-1} + end_k
        carried.append(torch.addcmul(xs[:, k, -1], prod[:, k, -1], carried[-1]))
    if K > 1:  # 3. chunks 1.. take the state carried in from the chunk before
        into = torch.stack(carried[:-1], dim=1).unsqueeze(2)  # (batch, K-1, 1, *rest)
        xs[:, 1:].addcmul_(prod[:, 1:], into)
    return x[:, :n]


def scan_two_level(a, b, h0=None, chunk_size=64):
    """The tree inside chunks of `chunk_size` steps, a loop across them, with section 8's backward
    (_run). Same contract as scan_sequential."""
    dtype = _check_inputs(a, b, h0)
    _check_chunk_size(chunk_size)
    return _run(_two_level, a, b, h0, dtype, (chunk_size,)).to(a.dtype)


# ------------------------------------------------------------------------------------------------
# 8. The backward pass
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
# So the backward needs only a and h. Read backwards in time, the recurrence for g is a forward
# one: element j of the flipped sequence is step L-1-j, whose multiplier a_{L-j} is element j of
# a_next = (a_1, ..., a_{L-1}, 0) flipped. So the forward's own scan runs it, on flipped copies.
#
# Section 5's tree runs it in place, without the copies, seen in a mirror: time runs from the last
# element to the first, so the pairs are aligned at the end, the left element receives, and when n
# is odd element 0 sits out (off = 1). Element t receives from t+1, times w[:, t] = a_{t+1}; the
# last element receives nothing, so w is a[:, 1:]. For L = 8:
#
#   t:        0      1      2      3      4      5      6      7
#   up 0      ├──────┘      ├──────┘      ├──────┘      ├──────┘       0 <- 1, 2 <- 3, 4 <- 5, 6 <- 7
#            0:2           2:4           4:6           6:8
#   up 1      ├─────────────┘             ├─────────────┘              the same on 0, 2, 4, 6
#            0:4                         4:8
#   up 2      ├───────────────────────────┘                            and on 0, 4
#            0:8
#   down 1                  ├─────────────┘                            2 <- 4
#                          2:8
#   down 0           ├──────┘      ├──────┘      ├──────┘              1 <- 2, 3 <- 4, 5 <- 6
#                   1:8           3:8           5:8
#
# Element t ends with t:8 (steps t to 7, combined backwards): g_t (print_tree(8, reverse=True)).
#
# For n = 7 (off = 1, p = 3): left 1, 3, 5 receive from right 2, 4, 6 (w_left = a_2, a_4, a_6;
# w_right = a_3, a_5); the recursion on 1, 3, 5; down 0 <- 1, 2 <- 3, 4 <- 5.

def _brent_kung_reverse_(x, w):
    """x_t += w[:, t]·x_{t+1} from the last element back, in place along dim 1; returns x.
    x: (batch, n, *rest), any strides; w: (batch, n-1, *rest), w[:, t] = a_{t+1}."""
    n = x.shape[1]
    if n < 2:
        return x
    p = n // 2
    off = n - 2 * p  # 1 if n is odd: element 0 sits out
    left, right = x[:, off:n:2], x[:, off + 1 : n : 2]  # (batch, p, *rest)
    w_left = w[:, off : n - 1 : 2]  # (batch, p, *rest)   multipliers of the receiving left elements
    w_right = w[:, off + 1 : n - 1 : 2]  # (batch, p-1, *rest) (element n-1 has none)
    left.addcmul_(w_left, right)  # up-sweep
    _brent_kung_reverse_(left, w_left[:, :-1] * w_right)  # the pairs; the last receives from none
    x[:, 1 - off : n - 1 : 2].addcmul_(w[:, 1 - off : n - 1 : 2], x[:, 2 - off : n : 2])  # down-sweep
    return x


def _next_multipliers(a):
    """a_next (batch, L, *rest)"""
    return torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], dim=1)


def _backward(ctx, a, h, h0, grad_h):
    """The three formulas above. -> grad_a, grad_b, grad_h0"""
    dtype = h.dtype
    # g_t = grad_t + a_{t+1} * g_{t+1}: (batch, L, *rest)
    if ctx.reverse is not None:  # in place, no flipped copies
        g = ctx.reverse(grad_h.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True),
                        a[:, 1:].to(dtype), *ctx.extra)
    else:
        g = ctx.scan(grad_h.to(dtype).flip(1), _next_multipliers(a).to(dtype).flip(1), *ctx.extra).flip(1)
    grad_a = grad_h0 = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.empty_like(g)  # (batch, L, *rest)
        # written in place, no temporary the size of the sequence (torch.compile refuses mul's out= on a slice)
        grad_a[:, 1:].copy_(g[:, 1:]).mul_(h[:, :-1])
        grad_a[:, 0] = 0 if h0 is None else g[:, 0] * h0.to(dtype)
        grad_a = grad_a.to(a.dtype)
    if h0 is not None and ctx.needs_input_grad[2]:
        grad_h0 = (g[:, 0] * a[:, 0].to(dtype)).to(h0.dtype)  # (batch, *rest)
    grad_b = g.to(a.dtype) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, grad_h0


class _ScanFunction(torch.autograd.Function):
    """A scan with the backward above: scan(x, w, *extra) is one of the scans above (extra: section 7's
    chunk size, else empty), reverse(x, w, *extra) its reverse-time form or None; h comes back in the
    accumulation dtype. forward takes no ctx and setup_context saves what backward reads: the form
    torch.func's transforms (vmap, grad, jvp) require. Appendix A: the create_graph branch (second
    derivatives) and forward mode."""

    @staticmethod
    def forward(a, b, h0, dtype, scan, extra, reverse):
        h = b.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)  # (batch, L, *rest)
        if h0 is not None:
            h[:, 0].addcmul_(a[:, 0].to(dtype), h0.to(dtype))  # fold h0 into the first step
        return scan(h, a.to(dtype), *extra)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, _, h0, _, ctx.scan, ctx.extra, ctx.reverse = inputs
        ctx.save_for_backward(a, output, h0)

    @staticmethod
    def backward(ctx, grad_h):
        a, h, h0 = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a second derivative follows (appendix A)
            return (*_backward_recorded(ctx, a, h, h0, grad_h), None, None, None, None)
        return (*_backward(ctx, a, h, h0, grad_h), None, None, None, None)


def _run(scan, a, b, h0, dtype, extra=(), reverse=None):
    """h through the Function above: scan, and reverse in place for its backward (None: scan on
    flipped copies). Eager code runs appendix A's subclass _ScanWithJvp, which adds only forward mode
    (jvp) and vmap, neither of which a training step uses; torch.compile cannot trace a Function with
    a jvp, so compiled code runs _ScanFunction itself."""
    function = _ScanFunction if torch.compiler.is_compiling() else _ScanWithJvp
    return function.apply(a, b, h0, dtype, scan, extra, reverse)


def pscan(a, b, h0=None):
    """Blelloch's work-efficient scan, up-sweep and down-sweep (section 5; inclusive, as Brent-Kung's
    tree), with section 8's backward. Same contract as scan_sequential."""
    dtype = _check_inputs(a, b, h0)
    return _run(_brent_kung_, a, b, h0, dtype, reverse=_brent_kung_reverse_).to(a.dtype)


# ------------------------------------------------------------------------------------------------
# 9. One entry point
# ------------------------------------------------------------------------------------------------
# The backends of sections 1 and 5-7, and torch's own (appendix B). mamba_minimal.py asks for
# "sequential", section 1's loop. "auto" picks by the machine (appendix C): on one CPU thread or a GPU
# it runs pscan, except for forward-only passes over wide steps, where the loop is faster.

BACKENDS = ("auto", "sequential", "pscan", "hillis_steele", "two_level", "associative")


def scan(a, b, h0=None, backend="auto"):
    """Run the recurrence with the chosen backend; "auto" picks by device, width, threads and autograd."""
    backend = _check_backend(backend)  # appendix E
    if backend == "auto":
        backend = choose_backend(a, b, h0)
    functions = {"sequential": scan_sequential, "pscan": pscan, "hillis_steele": scan_hillis_steele,
                 "two_level": scan_two_level, "associative": scan_associative}
    return functions[backend](a, b, h0)


# ------------------------------------------------------------------------------------------------
# 10. Segment sums: the scan as one matrix (for Mamba-2 and Mamba-3)
# ------------------------------------------------------------------------------------------------
# Unrolled from a zero state, h_t = Σ_{s≤t} (a_{s+1}···a_t)·b_s: h is a lower-triangular matrix
# times the b's, entry (t, s) the a-part of the steps s+1:t+1 (section 3's notation). Mamba-2 and
# Mamba-3 run short chunks in this form, as matmuls (mamba2_minimal.py section 2). Their decays
# are a_t = exp(Δ_t·A), so they keep the logs, log a_t = Δ_t·A ≤ 0 (their adt), and each entry is
# exp of a sum, log a_{s+1} + ... + log a_t. segsum builds those sums, each from zero: the
# shortcut, a difference of two running sums, loses the short sums of a long sequence to rounding
# (mamba2_minimal.py section 2 measures it).

def segsum(log_a):
    """log_a (..., T), the log-decays -> (..., T, T) with [t, s] = log_a_{s+1} + ... + log_a_t for
    s ≤ t (0 on the diagonal) and -inf above it, so that exp() of it is the decay mask (the official
    ssd_minimal.py's segsum)."""
    _check_log_decays(log_a)  # appendix E
    T = log_a.shape[-1]
    below = torch.ones(T, T, dtype=torch.bool, device=log_a.device).tril(-1)  # s < t
    # entry (k, s) = log_a_k if s < k, else 0
    terms = torch.where(below, log_a.unsqueeze(-1), 0)  # (..., T, T)
    sums = terms.cumsum(-2)  # (..., T, T): entry (t, s) = Σ_{s<k≤t} log_a_k, down each column from zero
    causal = torch.ones(T, T, dtype=torch.bool, device=log_a.device).tril()  # s ≤ t
    return sums.masked_fill(~causal, -torch.inf)


# ================================================================================================
# Appendix: past the lesson. The lesson ends above; what follows makes the same scans work with
# torch.func and second derivatives, wraps torch's own scan, picks a backend, counts combines
# and checks inputs.
# ================================================================================================

# ------------------------------------------------------------------------------------------------
# A. Double backward, jvp, vmap
# ------------------------------------------------------------------------------------------------
# A second derivative (a Hessian, a gradient penalty) differentiates the backward itself. Section
# 8's formulas are built from a, h and grad only, so when autograd records (create_graph=True)
# the backward runs them through differentiable ops: the reverse scan as a forward scan of the
# time-reversed sequence through this same autograd Function, and h as the Function's saved
# output, whose own gradient comes back to it (section 8's backward branches here when grad mode
# is on). A plain backward keeps the lean in-place one.
# That is why _ScanFunction returns h in the accumulation dtype and the public functions cast it
# outside: h stays an output that autograd can differentiate again.
#
# Forward mode (torch.func.jvp) is a scan too: tangents (ȧ, ḃ, ḣ0) of the inputs move the states by
#     ḣ_t = a_t * ḣ_{t-1} + (ȧ_t * h_{t-1} + ḃ_t),    ḣ_{-1} = ḣ0,
# the same recurrence with the forcing term ȧ_t * h_{t-1} + ḃ_t. Forward mode over forward mode
# (a jvp of a jvp, jacfwd of jacfwd) is the exception: through this rule torch's result misses
# terms of the second derivative, so there _ScanWithJvp runs the loop, whose plain ops every level
# differentiates (test_scan.py checks the Hessian both ways).
#
# torch.func.vmap gets a rule of its own: every batch row is scanned alike, so vmap's dimension
# joins the batch dimension, and an input that vmap does not map is repeated. (torch's generated
# rule would run the in-place levels on the per-sample tensors, and vmap refuses to write a mapped
# a or h0 into an unmapped b's copy.) The rule serves torch.func.hessian too, a vmap over a jvp.
#
# torch.compile (torch 2.13) refuses to trace an autograd Function that defines a jvp: the scan
# would be cut out of the compiled graph and run eagerly between two graphs. So the jvp lives in a
# subclass, _ScanWithJvp, which eager code runs, while code being compiled keeps section 8's
# _ScanFunction: section 8's _run chooses. (Neither forward mode nor a second derivative goes through
# compiled code in torch anyway.)

def _previous_states(h, h0):
    """(batch, L, *rest): h_{t-1} for every t, with h0 (or zeros) before the first step."""
    first = torch.zeros_like(h[:, :1]) if h0 is None else h0.to(h.dtype).unsqueeze(1)
    return torch.cat([first, h[:, :-1]], dim=1)


def _backward_recorded(ctx, a, h, h0, grad_h):
    dtype = h.dtype
    # time-reversed, g_t = a_{t+1}*g_{t+1} + grad_t is a forward recurrence from zero (section 8)
    a_next = _next_multipliers(a).to(dtype)  # (batch, L, *rest)
    g = _run(ctx.scan, a_next.flip(1), grad_h.to(dtype).flip(1), None, dtype, ctx.extra, ctx.reverse).flip(1)
    grad_a = (g * _previous_states(h, h0)).to(a.dtype)
    grad_h0 = None if h0 is None else (g[:, 0] * a[:, 0].to(dtype)).to(h0.dtype)
    return grad_a, g.to(a.dtype), grad_h0


def _transform_levels(kind):
    """How many of torch.func's transforms of one kind ("Jvp", "Grad", "Vmap") surround the call."""
    kind = getattr(torch._C._functorch.TransformType, kind)
    return sum(i.key() == kind for i in torch._C._functorch.get_interpreter_stack() or ())


class _ScanWithJvp(_ScanFunction):
    """Section 8's Function with forward mode and vmap."""

    @classmethod
    def apply(cls, a, b, h0, dtype, *how):
        # forward mode over forward mode (jvp of jvp, jacfwd of jacfwd): the loop (see above)
        if _transform_levels("Jvp") > 1:
            return scan_sequential(a.to(dtype), b.to(dtype), None if h0 is None else h0.to(dtype))
        return super().apply(a, b, h0, dtype, *how)

    @staticmethod
    def vmap(info, in_dims, a, b, h0, dtype, scan, extra, reverse):
        # every batch row is scanned alike, so vmap's dimension joins the batch: (size, batch, ...) as
        # (size·batch, ...), an input that vmap does not map repeated size times
        size = info.batch_size

        def join(t, dim):
            if t is None:
                return None
            t = t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)
            return t.reshape(size * t.shape[1], *t.shape[2:])

        h = _ScanWithJvp.apply(join(a, in_dims[0]), join(b, in_dims[1]), join(h0, in_dims[2]), dtype, scan, extra,
                               reverse)
        return h.view(size, -1, *h.shape[1:]), 0

    @staticmethod
    def setup_context(ctx, inputs, output):
        _ScanFunction.setup_context(ctx, inputs, output)
        a, _, h0, *_ = inputs
        ctx.save_for_forward(a, output, h0)  # what jvp reads as ctx.saved_tensors

    @staticmethod
    def jvp(ctx, tan_a, tan_b, tan_h0, *_):
        a, h, h0 = ctx.saved_tensors
        dtype = h.dtype
        forcing = torch.zeros_like(h) if tan_b is None else tan_b.to(dtype)  # (batch, L, *rest)
        if tan_a is not None:
            forcing = forcing + tan_a.to(dtype) * _previous_states(h, h0)
        return _ScanWithJvp.apply(a, forcing, None if tan_h0 is None else tan_h0.to(dtype), dtype, ctx.scan,
                                  ctx.extra, ctx.reverse)



# ------------------------------------------------------------------------------------------------
# B. torch's associative_scan
# ------------------------------------------------------------------------------------------------
# torch ships a generic parallel scan, torch._higher_order_ops.associative_scan (a prototype,
# private API), which takes the combine rule as a Python function (_combine, as it is). Its
# combine_mode argument (pytorch/pytorch#133012) selects "pointwise", for a combine made of
# pointwise ops on CUDA or XPU tensors, or "generic", which runs anywhere. Inside a function
# that torch.compile compiles, Inductor lowers a "pointwise" scan into one Triton kernel; called
# eagerly, as below, both modes run torch's generic algorithm, a tree of batched combines
# (torch 2.13 routes "pointwise" through Dynamo with its eager backend, which compiles nothing).
# torch 2.6 and 2.7 trace every eager call with Dynamo, once per new shape (2.6 compiles it with
# Inductor too, 12-22 s a shape: RESULTS.md): requirements.txt asks for torch >= 2.8. The scan
# runs without autograd, and section 8's backward, which needs only a and h, serves it.

def _associative(x, w):
    try:  # the module's own name: in torch 2.6 the package exports the module, not the function
        from torch._higher_order_ops.associative_scan import associative_scan
    except ImportError as err:
        raise RuntimeError(
            f"backend 'associative' needs torch._higher_order_ops.associative_scan with its "
            f"combine_mode argument (requirements.txt: torch >= 2.8); "
            f"this is torch {torch.__version__}"
        ) from err
    if x.numel() == 0:  # associative_scan cannot stack empty slices; there is nothing to scan
        return x
    mode = "pointwise" if x.device.type in ("cuda", "xpu") else "generic"
    with torch.no_grad():
        try:
            _, h = associative_scan(_combine, (w, x), dim=1, combine_mode=mode)
        except TypeError as err:  # a torch from before combine_mode
            raise RuntimeError(f"backend 'associative' needs associative_scan's combine_mode argument "
                               f"(requirements.txt: torch >= 2.8); this is torch {torch.__version__}"
                               ) from err
    return h.contiguous()


def scan_associative(a, b, h0=None):
    """torch's associative_scan with section 8's backward. Same contract as scan_sequential."""
    dtype = _check_inputs(a, b, h0)
    return _run(_associative, a, b, h0, dtype).to(a.dtype)


# ------------------------------------------------------------------------------------------------
# C. How "auto" chooses
# ------------------------------------------------------------------------------------------------
# The rule (backend_for): with a backward pass, pscan; forward only, the loop where a step is wide
# (CPU_LOOP_MIN_WIDTH values on one CPU thread, GPU_LOOP_MIN_WIDTH on a GPU), else pscan. Every
# backend gives the same h to rounding; only the time differs. Why these thresholds:
#
# Which backend is fastest depends on the device, the width of one step (batch·prod(rest)) and
# whether a backward pass follows. With a backward pass the tree wins on a CPU (1.6x to 14x in
# `python -m bench scan` on a 2-core Intel Xeon with AVX-512), because the loop's autograd graph
# records L small steps. Forward only, the loop reads each input once and catches up as a step
# gets wider, on one thread only: `python -m bench crossover` (L = 1024) on that CPU found, with
# one thread, the loop and pscan level at width 4096 and the loop ahead from 8192 on (1.28x, 1.37x
# at 16384, 1.39x at 24576), hence the threshold below; with two threads pscan was ahead at every
# width, so the loop is chosen only where torch runs one thread.
#
# On a GPU every one of the loop's L - 1 steps is a kernel of its own, with a fixed cost of a few
# microseconds on the GPU and more on the CPU that issues it, while the tree runs about 3·log2(L)
# kernels but moves about 11 values per element against the loop's 4 (section 5: each level reads
# and writes its pairs and multiplies the multipliers of the level above). The loop wins once a
# step is wide enough for its bytes to outweigh those fixed costs. By `python -m bench roofline`,
# a model of a training step, not a measurement (RESULTS.md), for Mamba-1 at the trainer's CUDA
# defaults with the batch varied (RESULTS.md, "The loop against the tree on a GPU"): the loop
# overtakes the tree between 393 and 492 thousand values per step on the H100 and at about 590
# thousand on the H200, hence the threshold below, and lower on the A100 and the T4, which have
# less bandwidth; at the default, 786,432 values (64 x 768 x 16), the loop's step is 1.1x (H200)
# to 1.4x (T4) faster. Again forward only: with a backward, the loop's autograd graph would record
# L steps.

CPU_LOOP_MIN_WIDTH = 8192
GPU_LOOP_MIN_WIDTH = 2 ** 19


@torch.compiler.assume_constant_result
def _one_thread():
    # torch.compile cannot put a call that returns a number into its graph (it would break the
    # graph there); marked so, the call is made while tracing and its answer kept
    return torch.get_num_threads() == 1


def choose_backend(a, b, h0=None):
    """The backend that scan(a, b, h0, backend="auto") runs: "sequential" or "pscan"."""
    _check_inputs(a, b, h0)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, h0))
    return backend_for(a.device, a[:, 0].numel(), needs_grad)


def backend_for(device, width, needs_grad):
    """choose_backend's rule, from the device, the width of one step and whether autograd records."""
    if needs_grad:
        return "pscan"
    if device.type == "cpu":
        wide, one_thread = width >= CPU_LOOP_MIN_WIDTH, _one_thread()
        return "sequential" if wide and one_thread else "pscan"
    return "sequential" if width >= GPU_LOOP_MIN_WIDTH else "pscan"


# ------------------------------------------------------------------------------------------------
# D. Counting combines, and the trees printed
# ------------------------------------------------------------------------------------------------
# Every combine in the scans above is one addcmul (b <- a*b_before + b), and every dependent level
# is one call, so a torch function mode that notes the size of each addcmul's result counts work
# and depth without a line of bookkeeping inside the scans: the figures of sections 5 to 7 and of
# `python -m bench depth` are the scans' own. torch's associative_scan follows its own schedule,
# so its counts say little. Only the b-parts' updates count: the tree also multiplies a-parts for
# the level above (1023 products at L = 1024), which the loop never needs.

class _AfterEachLevel(TorchFunctionMode):
    """Calls after_level(out) after every addcmul that updates at least one value: a dependent level."""

    def __init__(self, after_level):
        super().__init__()
        self.after_level = after_level

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", None) in ("addcmul", "addcmul_") and out.numel() > 0:
            self.after_level(out)
        return out


@contextlib.contextmanager
def count_combines():
    """Record every dependent level a scan runs, as the number of values it updates.

    Run it on inputs of shape (1, L), one recurrence, to read the counts as combines:

        with count_combines() as levels:
            pscan(a, b)
        work, depth = sum(levels), len(levels)
    """
    levels = []
    with _AfterEachLevel(lambda out: levels.append(out.numel())):
        yield levels


# The drawings of sections 5 and 8, computed. With every a_t = 1 a combine adds. Each element
# carries two numbers: b_t = 2^t, whose sums' binary digits name the steps held, and 1, whose sums
# count them (exact in fp64 up to 53 steps). The function mode above, looking at the whole sequence
# after every level, reads off each element's i:j. A broken tree shows: a sum that is not one run of
# distinct steps prints as its runs joined by "+", with a "?" when a step is held twice.

def _steps_held(v, count):
    """(the sum of 2^t over the steps held, how many were held) -> "i:j" for the steps i .. j-1, else
    the runs of steps joined by "+", and "?" if the count is not the number of steps they name."""
    v, runs = int(v), []  # runs: [first step, one past the last]
    for t in range(v.bit_length()):
        if v >> t & 1:
            if runs and runs[-1][1] == t:
                runs[-1][1] = t + 1  # step t continues the run
            else:
                runs.append([t, t + 1])
    label = "+".join(f"{i}:{j}" for i, j in runs)
    return label if int(count) == sum(j - i for i, j in runs) else label + "?"


def tree_levels(n=8, reverse=False):
    """Section 5's tree on n elements (reverse: section 8's mirror), level by level: a list with,
    after each dependent level, every element's i:j. print_tree prints it."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 53:
        raise ValueError(f"n must be an int from 1 to 53 (the steps fp64 can name exactly), got {n!r}")
    if not isinstance(reverse, bool):  # a string such as "no" would count as true
        raise ValueError(f"reverse must be True or False, got {reverse!r}")
    steps = 2.0 ** torch.arange(n, dtype=torch.float64)  # (n,) element t holds step t alone
    x = torch.stack([steps, torch.ones_like(steps)], dim=-1)[None]  # (1, n, 2)
    rows = []
    with _AfterEachLevel(lambda out: rows.append([_steps_held(v, count) for v, count in x[0].tolist()])):
        w = torch.ones(1, n - 1 if reverse else n, 2, dtype=torch.float64)  # every a_t = 1 (a[:, 1:] in reverse)
        (_brent_kung_reverse_ if reverse else _brent_kung_)(x, w)
    return rows


def _level_names(n):
    """The drawings' names of the tree's levels on n elements: up 0, up 1, ... as the recursion goes
    down (n, n//2, ... elements, while at least 2), then down ..., down 0 on the way back, where a
    level has an element to update (3 or more)."""
    sizes = []
    while n >= 2:
        sizes.append(n)
        n //= 2
    return [f"up {d}" for d in range(len(sizes))] + [f"down {d}" for d in reversed(range(len(sizes))) if sizes[d] >= 3]


def print_tree(n=8, reverse=False):
    """Print tree_levels(n, reverse), a row per level: `python -c "import pscan; pscan.print_tree(7)"`."""
    rows = tree_levels(n, reverse)
    print(f"{'t:':<9}" + "".join(f" {t:>5}" for t in range(n)))
    print(f"{'start':<9}" + "".join(f" {f'{t}:{t + 1}':>5}" for t in range(n)))
    for name, row in zip(_level_names(n), rows):
        print(f"{name:<9}" + "".join(f" {label:>5}" for label in row))  # a space between labels of any length


# ------------------------------------------------------------------------------------------------
# E. Checking the inputs, and old names
# ------------------------------------------------------------------------------------------------
# What every backend accepts, checked before anything runs. "chunked" (and scan_chunked) is
# accepted for the two-level scan with a DeprecationWarning: the word belongs to Mamba-2's chunked
# SSD (mamba2_minimal.py).

scan_chunked = scan_two_level  # deprecated alias


def _check_backend(backend):
    """The backend's name, "chunked" mapped to "two_level" with a warning; ValueError if unknown."""
    if backend == "chunked":
        warnings.warn('pscan.scan: backend="chunked" is deprecated, it is the two-level scan: use "two_level"',
                      DeprecationWarning, stacklevel=3)
        return "two_level"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _shape(t):
    """A tensor's shape, or the type's name for anything else: what an error message shows."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_inputs(a, b, h0):
    """Raise ValueError naming what was expected; return the dtype to accumulate in."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError(f"a and b must be tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {_shape(a)} and {_shape(b)}")
    if a.dim() < 2:
        raise ValueError(f"a and b must have shape (batch, L, ...) with at least 2 dims, got {_shape(a)}")
    if a.shape[1] == 0:
        raise ValueError(f"the sequence length (dim 1) must be at least 1, got shape {_shape(a)}")
    if not a.is_floating_point() or a.dtype != b.dtype:
        raise ValueError(f"a and b must share one floating dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device, got {a.device} and {b.device}")
    if h0 is not None:
        expected = (a.shape[0],) + tuple(a.shape[2:])
        if not isinstance(h0, torch.Tensor) or tuple(h0.shape) != expected:
            raise ValueError(f"h0 must have shape (batch, *rest) = {expected}, got {_shape(h0)}")
        if h0.device != a.device:
            raise ValueError(f"h0 must be on {a.device}, got {h0.device}")
    # half precision is accumulated in fp32 (section 1 says why)
    return torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype


def _check_time_invariant_inputs(a, b, h0):
    """scan_time_invariant's a is (batch, *rest), one multiplier for every step; then the checks
    of _check_inputs. Returns the dtype to accumulate in."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or b.dim() < 2 \
            or tuple(a.shape) != (b.shape[0],) + tuple(b.shape[2:]):
        raise ValueError(f"a must have shape (batch, *rest) of b (batch, L, *rest), got {_shape(a)} "
                         f"and {_shape(b)}")
    return _check_inputs(a.unsqueeze(1).expand_as(b), b, h0)


def _check_log_decays(log_a):
    if not isinstance(log_a, torch.Tensor) or log_a.dim() < 1 or not log_a.is_floating_point():
        got = f"a {log_a.dtype} tensor of shape {_shape(log_a)}" if isinstance(log_a, torch.Tensor) else _shape(log_a)
        raise ValueError(f"log_a must be a floating-point tensor of shape (..., T), got {got}")


def _check_chunk_size(chunk_size):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
