"""
pscan.py: every way to run the first-order linear recurrence

    h_t = a_t * h_{t-1} + b_t          (t = 0 .. L-1, h_{-1} = h0, zero by default)

which is the heart of a selective state space model: in Mamba (Gu & Dao 2023, arXiv 2312.00752,
§3.2 and Algorithm 2), a_t = exp(Δ_t·A) and b_t = Δ_t·B_t·x_t, elementwise over every (channel, state) pair.
Read this file top to bottom:

    1. The sequential loop               scan_sequential: the oracle and the baseline
    2. The convolution view              why S4 needed no scan, and why Mamba does
    3. The combine rule                  why a recurrence can be computed in parallel
    4. Counting work and depth           count_combines: what each scan costs, counted by the code
    5. The Blelloch scan                 up-sweep and down-sweep on strided views, any L
    6. The Hillis-Steele scan            fewer levels, more work
    7. The chunked scan                  a scan inside every chunk, a carry across chunks
    8. The backward pass                 a gradient that is itself a reverse scan
    9. torch's associative_scan          scan_associative, with the same lean backward
   10. One entry point                   scan(..., backend="auto") and the rule it uses
       Appendix: checking the inputs     what every backend accepts

Shapes: a and b are (batch, L, *rest) with the same shape; the scan runs over dim 1 and every
other position is an independent recurrence. h0 is (batch, *rest). The result h is
(batch, L, *rest) with h[:, -1] the final state. fp16/bf16 inputs are accumulated in fp32 and the
result is returned in the input dtype. Inputs are never modified.

`python bench.py scan` times the backends against each other, `python bench.py depth` prints
their work and depth; test_scan.py checks each one against a float64 loop.
"""

import contextlib

import torch

__all__ = ["scan_sequential", "scan_time_invariant", "count_combines", "pscan", "scan_hillis_steele",
           "scan_chunked", "scan_associative", "choose_backend", "scan", "BACKENDS"]

BACKENDS = ("auto", "sequential", "pscan", "hillis_steele", "chunked", "associative")


# ------------------------------------------------------------------------------------------------
# 1. The sequential loop
# ------------------------------------------------------------------------------------------------
# L dependent steps, each one elementwise multiply-add over the batch * prod(rest) values of a
# step. On a CPU it holds its own forward, since it reads every input once (within 1.5x of pscan
# either way from width 4096 on, README "h = scan(a, b)"). On a GPU every step is a kernel launch
# of a few microseconds, so L = 4096 costs tens of milliseconds of launches
# alone, whatever the width. That is why the parallel scans below exist.
#
# Half precision loses the state: with a_t close to 1 the state is a long running sum, and once
# it is large, a small b_t is less than half the spacing of the representable numbers around it
# (fp16 has 11 significant bits, bf16 8) and is rounded away. So every backend accumulates
# fp16/bf16 inputs in fp32 and returns the input's dtype.
#
# We iterate with unbind, not a[:, t]: autograd's backward of `x[:, t]` allocates a zero tensor
# of the full (batch, L, ...) shape for every step, which makes the backward quadratic in L.

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
    for a_t, b_t in zip(a.to(dtype).unbind(1), b.to(dtype).unbind(1)):
        h = torch.addcmul(b_t, a_t, h)  # (batch, *rest)
        _level(h)
        hs.append(h)
    return torch.stack(hs, dim=1).to(a.dtype)  # (batch, L, *rest)


# ------------------------------------------------------------------------------------------------
# 2. The convolution view
# ------------------------------------------------------------------------------------------------
# Unroll the loop: h_t = b_t + a_t·b_{t-1} + a_t·a_{t-1}·b_{t-2} + ... Every b_s reaches h_t
# through the product of the a's in between. If a does not depend on t (a linear time-invariant
# system, S4's case: Δ, A, B, C fixed), that product is just a^(t-s), and
#
#     h_t = Σ_{k=0..t} a^k · b_{t-k}                a causal convolution with kernel K_k = a^k
#
# For the SSM's output y_t = C·h_t the kernel becomes C·exp(ΔA)^k·ΔB, computed once for the whole
# sequence; an FFT then applies it in O(L log L), all positions at once. This is how S4 trains
# without any scan.
#
# Mamba's selection (Gu & Dao 2023, §3.1-3.2) makes Δ, B and C functions of the input, so
# a_t = exp(Δ_t·A) changes with every token and the product between s and t is a different number
# for every pair (s, t): there is no single kernel to precompute. The recurrence has to be
# scanned, which is the rest of this file.

def scan_time_invariant(a, b, h0=None):
    """The recurrence with a constant a, as a causal convolution (FFT), for the LTI case only.

    Args:
        a:  (batch, *rest)     the same multiplier at every step
        b:  (batch, L, *rest)
        h0: (batch, *rest) or None
    Returns:
        h:  (batch, L, *rest), equal to scan_sequential(a expanded over L, b, h0) to within about
            eps·max|h| (the FFT's rounding is absolute: a state far below the largest one, such as
            a^30 for a = 0.1, keeps only that absolute accuracy, not a relative one)
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
# Note the order: s1∘s2 here means "s1, then s2", read left to right as time runs, which is the
# opposite of the mathematician's f∘g ("g first"). Function composition is associative, hence so
# is this rule: (s1∘s2)∘s3 = s1∘(s2∘s3), and both sides expand to (a3*a2*a1, a3*a2*b1 + a3*b2 + b3).
#
# Associativity is all a parallel scan needs. The prefix s_0∘s_1∘...∘s_t is one step
# (a_{0:t+1}, b_{0:t+1}) that maps h0 to h_t, so h_t = a_{0:t+1}*h0 + b_{0:t+1}: its b-part alone
# is h_t only when h0 = 0. A nonzero h0 is one more step (0, h0) in front of s_0 (it maps anything to h0); the scans
# below fold it into the first step instead, b_0 <- a_0*h0 + b_0, and then scan from zero. And we
# may bracket the product however we like, for instance as a balanced tree whose levels run in
# parallel (sections 5 to 7).
#
# Floating point is not exactly associative, so every bracketing rounds differently: the scans
# agree with the loop to rounding, not bit for bit, and a model trained with one and sampled with
# another sees these tiny differences.


# ------------------------------------------------------------------------------------------------
# 4. Counting work and depth
# ------------------------------------------------------------------------------------------------
# Two numbers describe a parallel algorithm: its work (how many combines in all) and its depth
# (how many of them must happen one after another; every level of a tree is one vectorized op,
# and on a GPU one or two kernel launches). Every scan below reports each dependent level it runs
# to an optional counter, so the figures in bench.py and the README are counted by the code
# itself, not by a second copy of the schedule. A combine is one update of a b-part; the products
# of a-parts that ride along in the same level are not counted separately.

_levels = None  # a list while count_combines() is active


@contextlib.contextmanager
def count_combines():
    """Record every dependent level a scan runs, as the number of values it updates.

    Run it on inputs of shape (1, L), one recurrence, to read the counts as combines:

        with count_combines() as levels:
            pscan(a, b)
        work, depth = sum(levels), len(levels)
    """
    global _levels
    outer, _levels = _levels, []
    try:
        yield _levels
    finally:
        _levels = outer


def _level(updated):
    """Called once per dependent level with the tensor it updated."""
    if _levels is not None and updated.numel() > 0:
        _levels.append(updated.numel())


# ------------------------------------------------------------------------------------------------
# 5. The Blelloch scan
# ------------------------------------------------------------------------------------------------
# Up-sweep: combine neighbours in pairs, then pairs of pairs, ... Each level is one vectorized
# multiply-add over strided views, on half as many elements as the level before. After it, the
# right element of every pair holds the whole block it closes. Down-sweep: walk back down; the
# left element of every pair except the first now receives the finished prefix that ends just
# before it. For L = 8, with x_t = (a_t, b_t) and i:j the combined steps i, i+1, ..., j-1 (a
# half-open range, as a Python slice):
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
# Every element t ends holding 0:t+1, its inclusive prefix. The levels run one after another:
# log2(L) up and log2(L) - 1 down, about 2·log2(L) dependent levels in all, not log2(L). The work
# is about 2L combines (exactly 2L - 2 - log2(L) for a power of two): more than the loop's L, which
# is the price of the short depth.
#
# This is the work-efficient *inclusive* scan in its odd/even form (the Brent-Kung scan, Brent &
# Kung 1982, as the literature names it), not the textbook Blelloch
# scan (Blelloch 1990), which is *exclusive*: after the same up-sweep, the textbook puts the
# identity step (1, 0) at the root and walks down swapping, so that every element t ends with
# 0:t, the prefix *before* it (element 0 gets the identity, which is where h0 would go). One turns
# into the other with one combine per element, or a shift: inclusive_t = exclusive_t ∘ x_t, and
# exclusive_t = inclusive_{t-1}. Our down-sweep skips the identity and the swaps: it only
# finishes the left elements, since the right ones are already finished by the recursion.
#
# Each level recurses on the right elements of its pairs (a view with twice the stride), so
# the tree never needs L to be a power of two: with an odd count, the last element sits out
# the up-sweep of that level and is finished by the down-sweep like any other left element.
# (Padding to a power of two would double the work at L = 2^k + 1.)
#
# Memory: b is copied once into the output h, which is then scanned in place. The a-part of
# the combined steps needs a new tensor per level, but each level is half the one below, so
# all of them together are one more tensor of the input's size. The input a is only read.
#
# The same tree runs backwards in time for the backward pass (section 8). Written for both
# directions, the multipliers `w` are a[:, 1:] in both cases: w holds the multiplier of every
# element except the first one in scan order.
#   forward:  h_t = a_t * h_{t-1} + b_t,   element t takes w[t-1] = a_t   (element 0 takes none)
#   reverse:  g_t = a_{t+1} * g_{t+1} + c_t, element t takes w[t] = a_{t+1} (element L-1 takes none)

def _blelloch_(x, w, reverse=False):
    """Scan x in place along dim 1 and return it. x: (batch, n, *rest) (any strides); w: (batch, n-1, *rest)."""
    n = x.shape[1]
    if n < 2:
        return x
    p = n // 2  # number of pairs at this level
    if not reverse:
        # pairs (0,1), (2,3), ...; the right element receives, an odd last element sits out
        give, recv = x[:, 0 : 2 * p : 2], x[:, 1 : 2 * p : 2]  # (batch, p, *rest)
        w_recv = w[:, 0 : 2 * p : 2]  # (batch, p, *rest)   multipliers of elements 1, 3, 5, ...
        w_give = w[:, 1 : 2 * p - 1 : 2]  # (batch, p-1, *rest) of elements 2, 4, ... (0 has none)
        recv.addcmul_(w_recv, give)  # up-sweep: right = w_right * left + right
        _level(recv)
        w_up = w_recv[:, 1:] * w_give  # (batch, p-1, *rest) a-part of pairs 1.. (pair 0 leads)
        _blelloch_(recv, w_up, reverse)  # the pairs' right elements now hold full prefixes
        # down-sweep: elements 2, 4, ... take the finished prefix of the element before them
        down = x[:, 2:n:2]
        down.addcmul_(w[:, 1 : n - 1 : 2], x[:, 1 : n - 1 : 2])
        _level(down)
    else:
        # the mirror image: pairs are aligned at the end, the left element receives, and an
        # odd element 0 sits out
        off = n - 2 * p
        recv, give = x[:, off:n:2], x[:, off + 1 : n : 2]  # (batch, p, *rest)
        w_recv = w[:, off : n - 1 : 2]  # (batch, p, *rest)
        w_give = w[:, off + 1 : n - 1 : 2]  # (batch, p-1, *rest) (element n-1 has none)
        recv.addcmul_(w_recv, give)
        _level(recv)
        w_up = w_recv[:, :-1] * w_give  # (batch, p-1, *rest) (the last pair leads)
        _blelloch_(recv, w_up, reverse)
        down = x[:, 1 - off : n - 1 : 2]
        down.addcmul_(w[:, 1 - off : n - 1 : 2], x[:, 2 - off : n : 2])
        _level(down)
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
# The trade-off, as seed 000 §2.3 puts it, with the counts of this file at L = 1024 (section 4,
# `python bench.py depth`):
#
#   scan            work           depth        counted at L = 1024
#   Hillis-Steele   O(L log L)     O(log L)     9217 combines in 10 levels: L - d at level d
#   Blelloch        O(L)           O(log L)     2036 combines in 19 levels: up, then down
#   loop            L              L            1024 combines in 1024 levels
#
# Hillis-Steele does about log2(L)/2 times Blelloch's work in half its levels. With thousands of
# idle lanes (a GPU, a short sequence) the extra work is free and each level saved is a launch or
# a barrier saved; once the work fills the machine (long sequences, wide states, any CPU) the extra
# work is paid in full, and Blelloch wins. A Hillis-Steele level cannot update x in place: element
# t must read its partner's value from before the level, so every level writes a new tensor.

def _hillis_steele(x, w, reverse=False):
    """Scan x along dim 1; return a new tensor. x: (batch, n, *rest); w: (batch, n-1, *rest)."""
    if reverse:  # the same scan on the time-reversed sequence (section 8)
        return _hillis_steele(x.flip(1), w.flip(1)).flip(1)
    n = x.shape[1]
    m, d = w, 1  # m[:, j]: a-part of the d steps that end at element j + d
    while d < n:
        done = x[:, :d]  # (batch, d, *rest) these prefixes are complete
        x = torch.cat([done, torch.addcmul(x[:, d:], m, x[:, : n - d])], dim=1)  # (batch, n, *rest)
        _level(x[:, d:])
        if 2 * d < n:  # the a-parts for the next level, only where someone still needs one
            m = m[:, d:] * m[:, : n - 2 * d]  # (batch, n - 2d, *rest)
        d *= 2
    return x


# ------------------------------------------------------------------------------------------------
# 7. The chunked scan
# ------------------------------------------------------------------------------------------------
# The classic two-level scan of GPU programming (the seed's §2.4 and §4.2 chunk the sequence the
# same way), and the shape of Mamba-2's chunked SSD (mamba2_minimal.py): cut the sequence into
# chunks of T steps, small enough that a chunk's states fit in fast on-chip memory.
#
#   1. Inside every chunk, a parallel scan from a zero state: all chunks at once, as one batch.
#   2. Each chunk is now one step (P_c, E_c): P_c the product of its a's, E_c its end state.
#      Carry the state across chunks with the loop, H_c = P_c * H_{c-1} + E_c: only L/T - 1 steps.
#   3. Correct every chunk by the state carried in: h_t += (a-product from the chunk's start
#      up to t) * H_{c-1}.
#
#   chunks:     [ 0 .. T-1 ][ T .. 2T-1 ][ 2T .. 3T-1 ]
#   1. scan:     └──────┤     └──────┤     └──────┤        from zero, all chunks at once
#   2. carry:          H_0 ────────> H_1 ────────> H_2     L/T dependent steps
#   3. correct:               += cumprod·H_0  += cumprod·H_1
#
# Depth is that of one chunk's scan, plus L/T - 1 carry steps, plus one correction. The official
# Mamba-1 kernel is the sequential variant of this scheme: one thread block walks the chunks in
# order and seeds each chunk's parallel scan with the carried state, so steps 1 and 3 merge, and
# the L/T carry steps are a loop inside one kernel, which is why a long sequence costs it little.
#
# Why T is bounded. Step 3 needs the cumulative product of a inside a chunk. With
# a_t = exp(Δ_t·A), that product is exp(-Σ Δ_t·|A|), which shrinks geometrically with T. In fp32
# it leaves the normal range below about 1e-38, i.e. once Σ Δ·|A| > 87, and is 0 past 103. Here
# that is harmless: the product only multiplies the carried state, and a contribution below 1e-38
# of it is rounded away anyway (nothing here divides by it). It is fatal in the formulations that
# divide by it, such as h_t = P_t · Σ_{s<=t} b_s / P_s (one cumsum instead of a scan): 1/P_s
# overflows to inf and inf·0 gives NaN. fp16 reaches that much sooner: its smallest normal is
# 6e-5, so the product leaves the normal range once Σ Δ·|A| > 9.7 (about ten steps of Δ·|A| = 1)
# and 1/P passes fp16's largest number, 65504, soon after (Σ Δ·|A| > 11). bf16 has fp32's range but
# 8 significant bits: a_t = 0.999 rounds to 1.0, so a long product of rounded factors drifts by
# about T·2^-9. Hence small chunks, products kept in fp32 (this file accumulates half inputs in
# fp32; but a_t must be computed in fp32 too, as mamba_minimal.py does: a 0.999 already rounded
# to 1.0 in bf16 stays 1.0 however it is accumulated), and Mamba-2's ssd_minimal works with sums of logs (`segsum`) and exponentiates only
# differences, which never divides.

# chunk_size = 64 by default: a chunk of a typical GPU kernel's size, whose a-products stay in fp32's
# normal range for Δ·|A| up to about 1.3 per step. The depth, about 2·log2(T) + L/T, is smallest
# for chunks of a third of L; the work grows with the number of chunks (test_scan.py counts both).

def _chunked(x, w, reverse=False, chunk_size=64):
    """Scan x along dim 1; return a new tensor. x: (batch, n, *rest); w: (batch, n-1, *rest)."""
    if reverse:
        return _chunked(x.flip(1), w.flip(1), False, chunk_size).flip(1)
    batch, n, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    T = min(chunk_size, n)  # a short sequence is one chunk of its own length
    K = -(-n // T)  # number of chunks
    pad = K * T - n  # identity steps (a = 1, b = 0) at the end change nothing
    one = (batch, 1) + rest
    m = torch.cat([x.new_zeros(one), w, x.new_ones((batch, pad) + rest)], dim=1)  # (batch, K·T, *rest)
    x = torch.cat([x, x.new_zeros((batch, pad) + rest)], dim=1) if pad else x.contiguous()
    xs, ms = x.view((batch * K, T) + rest), m.view((batch * K, T) + rest)  # every chunk a row
    _blelloch_(xs, ms[:, 1:])  # 1. (batch*K, T, *rest) every chunk scanned from zero
    prod = torch.cumprod(ms, dim=1).view((batch, K, T) + rest)  # a-products from each chunk's start
    xs = xs.view((batch, K, T) + rest)
    carried = [xs[:, 0, -1]]  # 2. (batch, *rest) the state leaving chunk 0
    for k in range(1, K):
        carried.append(torch.addcmul(xs[:, k, -1], prod[:, k, -1], carried[-1]))
        _level(carried[-1])
    if K > 1:  # 3. chunks 1.. take the state carried in from the chunk before
        into = torch.stack(carried[:-1], dim=1).unsqueeze(2)  # (batch, K-1, 1, *rest)
        xs[:, 1:].addcmul_(prod[:, 1:], into)
        _level(xs[:, 1:])
    return x[:, :n]


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
# So the backward needs only a and h (no per-level intermediates) and runs the same scan
# backwards. Peak memory during it: h, the incoming gradient, g and the scan's scratch, which is
# freed before dLoss/da is written.
#
# A second derivative (a Hessian, or a gradient penalty) differentiates this backward. The
# formulas above are built from a, h and grad only, so we simply run them through differentiable
# ops when autograd records (create_graph=True): the reverse scan as a forward scan of the
# time-reversed sequence through this same autograd Function, and h as the Function's saved
# output, whose own gradient comes back here. The recorded path is used only then; a plain
# backward keeps the lean in-place one.
#
# Forward-mode (torch.func.jvp) is a scan too: tangents (ȧ, ḃ, ḣ0) of the inputs move the states by
#     ḣ_t = a_t * ḣ_{t-1} + (ȧ_t * h_{t-1} + ḃ_t),    ḣ_{-1} = ḣ0,
# the same recurrence with the forcing term ȧ_t * h_{t-1} + ḃ_t.

def _previous_states(h, h0):
    """(batch, L, *rest): h_{t-1} for every t, with h0 (or zeros) before the first step."""
    first = torch.zeros_like(h[:, :1]) if h0 is None else h0.to(h.dtype).unsqueeze(1)
    return torch.cat([first, h[:, :-1]], dim=1)


def _backward_lean(fn, ctx, a, h, h0, grad_h):
    dtype = h.dtype
    g = grad_h.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)  # (batch, L, *rest)
    g = fn._scan(g, a[:, 1:].to(dtype), True, *ctx.extra)  # g_t = grad_t + a_{t+1} * g_{t+1}
    grad_a = grad_h0 = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.empty_like(g)  # (batch, L, *rest)
        torch.mul(g[:, 1:], h[:, :-1], out=grad_a[:, 1:])
        if h0 is None:
            grad_a[:, 0].zero_()
        else:
            torch.mul(g[:, 0], h0.to(dtype), out=grad_a[:, 0])
        grad_a = grad_a.to(a.dtype)
    if h0 is not None and ctx.needs_input_grad[2]:
        grad_h0 = (g[:, 0] * a[:, 0].to(dtype)).to(h0.dtype)  # (batch, *rest)
    grad_b = g.to(a.dtype) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, grad_h0


def _backward_recorded(fn, ctx, a, h, h0, grad_h):
    dtype = h.dtype
    a_next = torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], dim=1).to(dtype)  # a_{t+1}, 0 at the end
    # time-reversed, g_t = a_{t+1}*g_{t+1} + grad_t is a forward recurrence from zero
    g = fn.apply(a_next.flip(1), grad_h.to(dtype).flip(1), None, dtype, *ctx.extra).flip(1)
    grad_a = (g * _previous_states(h, h0)).to(a.dtype)
    grad_h0 = None if h0 is None else (g[:, 0] * a[:, 0].to(dtype)).to(h0.dtype)
    return grad_a, g.to(a.dtype), grad_h0


class _ScanFunction(torch.autograd.Function):
    """Base: a subclass sets `_scan(x, w, reverse, *extra)`; forward, backward and jvp are shared.

    It returns h in the accumulation dtype and saves (a, h, h0); the public functions cast h to
    the input dtype outside, so that h stays an output that autograd can differentiate again.
    """

    generate_vmap_rule = True  # torch.func.vmap runs forward/backward on batched tensors

    @classmethod
    def forward(cls, a, b, h0, dtype, *extra):
        h = b.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)  # (batch, L, *rest)
        if h0 is not None:
            h[:, 0].addcmul_(a[:, 0].to(dtype), h0.to(dtype))  # fold h0 into the first step
            _level(h[:, 0])
        return cls._scan(h, a[:, 1:].to(dtype), False, *extra)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, _, h0, _, *extra = inputs
        ctx.extra = tuple(extra)
        ctx.save_for_backward(a, output, h0)
        ctx.save_for_forward(a, output, h0)

    @classmethod
    def backward(cls, ctx, grad_h):
        a, h, h0 = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a second derivative will follow
            grads = _backward_recorded(cls, ctx, a, h, h0, grad_h)
        else:
            grads = _backward_lean(cls, ctx, a, h, h0, grad_h)
        return (*grads, None) + (None,) * len(ctx.extra)

    @classmethod
    def jvp(cls, ctx, tan_a, tan_b, tan_h0, *_):
        a, h, h0 = ctx.saved_tensors
        dtype = h.dtype
        forcing = torch.zeros_like(h) if tan_b is None else tan_b.to(dtype)  # (batch, L, *rest)
        if tan_a is not None:
            forcing = forcing + tan_a.to(dtype) * _previous_states(h, h0)
        return cls.apply(a, forcing, None if tan_h0 is None else tan_h0.to(dtype), dtype, *ctx.extra)


class _PScan(_ScanFunction):
    _scan = staticmethod(_blelloch_)


class _HillisSteele(_ScanFunction):
    _scan = staticmethod(_hillis_steele)


class _Chunked(_ScanFunction):
    _scan = staticmethod(_chunked)


def pscan(a, b, h0=None):
    """Blelloch scan with a reverse-scan backward. Same arguments and result as scan_sequential."""
    dtype = _check_inputs(a, b, h0)
    return _PScan.apply(a, b, h0, dtype).to(a.dtype)


def scan_hillis_steele(a, b, h0=None):
    """Hillis-Steele scan (log2(L) levels, ~L·log2(L) combines). Same contract as scan_sequential."""
    dtype = _check_inputs(a, b, h0)
    return _HillisSteele.apply(a, b, h0, dtype).to(a.dtype)


def scan_chunked(a, b, h0=None, chunk_size=64):
    """Blelloch inside chunks of `chunk_size` steps, a loop across them. Same contract as scan_sequential."""
    dtype = _check_inputs(a, b, h0)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return _Chunked.apply(a, b, h0, dtype, chunk_size).to(a.dtype)


# ------------------------------------------------------------------------------------------------
# 9. torch's associative_scan
# ------------------------------------------------------------------------------------------------
# torch ships a generic parallel scan, torch._higher_order_ops.associative_scan (a prototype,
# private API), which takes the combine rule as a Python function. Its combine_mode argument
# (pytorch/pytorch#133012, first released in torch 2.5.0: the 2.5.0 wheel's associative_scan has
# it, the 2.4.0 one's does not) selects "pointwise", which compiles the scan into one Triton
# kernel and needs a CUDA or XPU device, or "generic", which runs anywhere. This project asks
# for torch >= 2.6 (requirements.txt) and is tested on 2.13. We run it without
# autograd (its own backward saves far more than a and h) and reuse the reverse-scan backward of
# section 8, with the Blelloch tree running the reverse scan.

def _combine(left, right):
    (a1, b1), (a2, b2) = left, right
    return a2 * a1, torch.addcmul(b2, a2, b1)  # (a2*a1, a2*b1 + b2)


def _associative(x, w, reverse=False):
    if reverse:
        return _blelloch_(x, w, True)
    try:
        from torch._higher_order_ops import associative_scan
    except ImportError as err:
        raise RuntimeError(
            f"backend 'associative' needs torch._higher_order_ops.associative_scan with its "
            f"combine_mode argument (see requirements.txt); this is torch {torch.__version__}"
        ) from err
    if x.numel() == 0:  # associative_scan cannot stack empty slices; there is nothing to scan
        return x
    m = torch.cat([torch.ones_like(x[:, :1]), w], dim=1)  # element 0's multiplier is never used
    mode = "pointwise" if x.device.type in ("cuda", "xpu") else "generic"
    with torch.no_grad():
        try:
            _, h = associative_scan(_combine, (m, x), dim=1, combine_mode=mode)
        except TypeError as err:  # a torch from before combine_mode
            raise RuntimeError(f"backend 'associative' needs associative_scan's combine_mode argument "
                               f"(torch >= 2.6, see requirements.txt); this is torch {torch.__version__}") from err
    return h.contiguous()


class _AssociativeScan(_ScanFunction):
    _scan = staticmethod(_associative)


def scan_associative(a, b, h0=None):
    """torch's associative_scan with a reverse-scan backward. Same contract as scan_sequential."""
    dtype = _check_inputs(a, b, h0)
    return _AssociativeScan.apply(a, b, h0, dtype).to(a.dtype)


# ------------------------------------------------------------------------------------------------
# 10. One entry point
# ------------------------------------------------------------------------------------------------
# Which backend is fastest depends on the device, the width of one step (batch * prod(rest)) and
# on whether a backward pass follows. On a GPU the loop pays a kernel launch per step, so the
# tree wins. On a CPU with a backward pass the tree wins too, 1.7x to 12x in the README's table
# ("h = scan(a, b)"), because the loop's autograd graph records L small steps. Forward only, the
# loop reads each input once and catches up as a step gets wider, on one thread only.
# `python bench.py crossover` (L = 1024, forward only, the README's machine, quiet) found, with
# one thread, the two level at width 4096 and the loop ahead from 8192 on (1.28x, 1.37x at 16384,
# 1.39x at 24576), hence the threshold below; with two threads pscan was ahead at every width
# (its time over the loop's 0.27 at width 1024 to 0.85 at 16384), so the loop is chosen only
# where torch runs one thread. Hillis-Steele and the chunked scan are here to teach and to
# count; on a CPU they are slower than pscan (README, "h = scan(a, b)").

CPU_LOOP_MIN_WIDTH = 8192

_FUNCTIONS = {"sequential": scan_sequential, "pscan": pscan, "hillis_steele": scan_hillis_steele,
              "chunked": scan_chunked, "associative": scan_associative}


def choose_backend(a, b, h0=None):
    """The backend that scan(a, b, h0, backend="auto") runs: "sequential" or "pscan"."""
    _check_inputs(a, b, h0)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, h0))
    wide = a[:, 0].numel() >= CPU_LOOP_MIN_WIDTH
    one_thread = torch.get_num_threads() == 1
    return "sequential" if a.device.type == "cpu" and wide and one_thread and not needs_grad else "pscan"


def scan(a, b, h0=None, backend="auto"):
    """Run the recurrence with the chosen backend; "auto" picks by device, width, threads and autograd."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = choose_backend(a, b, h0)
    return _FUNCTIONS[backend](a, b, h0)


# ------------------------------------------------------------------------------------------------
# Appendix: checking the inputs
# ------------------------------------------------------------------------------------------------
# What every backend accepts, checked before anything runs; kept here, out of the story's way.

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
    # half precision is accumulated in fp32: see section 1
    return torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype


def _check_time_invariant_inputs(a, b, h0):
    """scan_time_invariant's a is (batch, *rest), one multiplier for every step; then the checks
    of _check_inputs. Returns the dtype to accumulate in."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or b.dim() < 2 \
            or tuple(a.shape) != (b.shape[0],) + tuple(b.shape[2:]):
        raise ValueError(f"a must have shape (batch, *rest) of b (batch, L, *rest), got {_shape(a)} "
                         f"and {_shape(b)}")
    return _check_inputs(a.unsqueeze(1).expand_as(b), b, h0)
