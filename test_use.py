"""Specification of using a model for real, for every generation: continuing from a cache with many
tokens at once, packed sequences (seq_idx), and left-padded batches (attention_mask). Each property
is checked against an independent oracle in float64: the whole sequence in one pass without a
cache, each document run alone, each row run alone, a conv written as a loop here, and
transformers' generate where it is installed."""

import copy

import pytest
import torch

import hybrid
import mamba2_minimal as m2
import mamba3_minimal as m3
import mamba_engine as me
import mamba_minimal as mm
import pretrained

VOCAB = 50
CHUNK = 8  # the chunk length of the chunked forms: pieces and documents longer than it are tested


def perturbed(model):
    """A float64 model off its init values (D = 1 and tiny Δ would hide mistakes)."""
    model = model.double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "A_log", "D", "conv1d.bias", "B_bias", "C_bias", "dt_proj.bias")):
                p.add_(torch.randn_like(p) * 0.5)
    return model


def mamba2_model(seed=0):
    torch.manual_seed(seed)
    return perturbed(m2.Mamba2LM(m2.Mamba2Config(d_model=32, n_layer=2, vocab_size=VOCAB, d_state=8, headdim=16,
                                                 ngroups=2, chunk_size=CHUNK)))


def mamba3_model(seed=0, is_mimo=False):
    torch.manual_seed(seed)
    return perturbed(m3.Mamba3LM(m3.Mamba3Config(d_model=16, n_layer=2, vocab_size=VOCAB, d_state=8, headdim=8,
                                                 ngroups=2, chunk_size=CHUNK, is_mimo=is_mimo, mimo_rank=2)))


def mamba1_model(seed=0, backend="sequential", recompute=True):
    """Mamba-1 as built ("reference") or accelerated by mamba_engine with `backend`."""
    torch.manual_seed(seed)
    model = mm.MambaLM(mm.MambaConfig(d_model=16, n_layer=2, vocab_size=VOCAB, d_state=4))
    if backend != "reference":
        me.accelerate(model, backend=backend, chunk_size=CHUNK, recompute=recompute)
    return perturbed(model)


# Mamba-1: the model as built (mamba_minimal.py's sections 2 and 3 under autograd), and accelerated:
# every eager backend (pscan.py's scans under mamba_engine.py's hand-written backward) and the fused
# path, with its recomputing backward and with plain autograd through each chunk
MAMBA1_BACKENDS = ("reference", "sequential", "pscan", "hillis_steele", "two_level", "associative", "fused")
MODELS = {
    **{f"mamba1_{backend}": (lambda seed=0, backend=backend: mamba1_model(seed, backend))
       for backend in MAMBA1_BACKENDS},
    "mamba1_fused_autograd": lambda seed=0: mamba1_model(seed, "fused", recompute=False),
    "mamba2": mamba2_model,
    "mamba3_siso": mamba3_model,
    "mamba3_mimo": lambda seed=0: mamba3_model(seed, is_mimo=True),
}


def max_difference(got, expected):
    """The largest absolute difference between two tensors or two (nested) caches."""
    if isinstance(got, torch.Tensor):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        return (got - expected).abs().max().item()
    assert len(got) == len(expected)
    return max(max_difference(g, e) for g, e in zip(got, expected))


def random_split(L, rng):
    """Piece lengths summing to L: ones, primes and pieces longer than a chunk, in a random order."""
    menu = [1, 1, 2, 3, 5, 7, 11, 13, CHUNK + 9]
    pieces = []
    while sum(pieces) < L:
        pieces.append(min(menu[int(torch.randint(len(menu), (1,), generator=rng))], L - sum(pieces)))
    return pieces


# ------------------------------------------------------------------------------------------------
# 1. Continuing from a cache: any split of a sequence gives the one-pass logits and final cache
# ------------------------------------------------------------------------------------------------

def split_difference(model):
    """The worst difference between the logits and final cache of pieces and those of one pass."""
    worst = 0.0
    ids = torch.randint(0, VOCAB, (2, 53))
    with torch.no_grad():
        expected, expected_cache = model(ids, want_cache=True)  # the oracle: one pass, no cache
    rng = torch.Generator().manual_seed(1)
    for split in ([1] * 5 + [48], [CHUNK, CHUNK, 37], *(random_split(53, rng) for _ in range(3))):
        logits, cache, start = [], None, 0
        for length in split:
            piece, cache_before = ids[:, start:start + length], cache
            frozen = None if cache is None else [tuple(t.clone() for t in c) for c in cache]
            out, cache = model.prefill(piece, cache=cache)
            if frozen is not None:  # the cache given is read, never written
                assert max_difference(cache_before, frozen) == 0
            logits.append(out)
            start += length
        worst = max(worst, max_difference(torch.cat(logits, dim=1), expected), max_difference(cache, expected_cache))
    return worst


@pytest.mark.parametrize("name", list(MODELS))
def test_pieces_in_any_split_give_the_one_pass_logits_and_final_cache(name):
    assert split_difference(MODELS[name]()) < 1e-10


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_with_a_cache_carries_gradients_like_the_one_pass(name):
    """Truncated backprop through time without truncating: forward(want_cache=True, cache=...) keeps
    the cache in the graph, so the pieces' gradients add up to the one pass's."""
    model = MODELS[name]()
    ids = torch.randint(0, VOCAB, (2, 21))
    weights = torch.randn(2, 21, model.cfg.padded_vocab_size, dtype=torch.float64)
    (model(ids) * weights).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    first, cache = model(ids[:, :10], want_cache=True)
    second = model(ids[:, 10:], cache=cache)
    (torch.cat([first, second], dim=1) * weights).sum().backward()
    for n, p in model.named_parameters():
        assert max_difference(p.grad, expected[n]) < 1e-10, n


@pytest.mark.parametrize("name", list(MODELS))
def test_steps_after_a_continued_prefill_follow_the_one_pass(name):
    model = MODELS[name]()
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        expected = model(ids)
    _, cache = model.prefill(ids[:, :3])
    _, cache = model.prefill(ids[:, 3:20], cache=cache)
    for t in range(20, 30):
        assert max_difference(model.step(ids[:, t], cache), expected[:, t]) < 1e-10


# ------------------------------------------------------------------------------------------------
# 2. Packed sequences: each document as if it ran alone
# ------------------------------------------------------------------------------------------------

# documents of length 1, and boundaries at chunk edges (positions 8 and 16) and inside chunks
DOC_LENGTHS = [1, 7, 8, 1, 5, 10, 3]


def packed_row(lengths, batch=2):
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return torch.randint(0, VOCAB, (batch, sum(lengths))), seq_idx.expand(batch, -1).contiguous()


def embedding_gradients(model, ids, weights, seq_idx=None):
    """Parameter gradients and the gradient at the embedding's output (b, L, d_model) of
    sum(logits·weights)."""
    model.zero_grad()
    seen = {}

    def keep(module, inputs, output):
        output.retain_grad()
        seen["embedded"] = output

    hook = model.backbone.embedding.register_forward_hook(keep)
    try:
        logits = model(ids, seq_idx=seq_idx)
        (logits * weights).sum().backward()
    finally:
        hook.remove()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, seen["embedded"].grad


def packing_difference(model):
    """The worst difference between a packed row and its documents alone: logits, the gradients at
    the embedding's output and the parameters' gradients."""
    worst = 0.0
    ids, seq_idx = packed_row(DOC_LENGTHS)
    weights = torch.randn(*ids.shape, model.cfg.padded_vocab_size, dtype=torch.float64)
    logits, grads, grad_embedded = embedding_gradients(model, ids, weights, seq_idx)
    expected_grads = {n: torch.zeros_like(g) for n, g in grads.items()}
    start = 0
    for length in DOC_LENGTHS:  # the oracle: each document alone, from a zero state
        doc = slice(start, start + length)
        alone, alone_grads, alone_embedded = embedding_gradients(model, ids[:, doc], weights[:, doc])
        worst = max(worst, max_difference(logits[:, doc], alone), max_difference(grad_embedded[:, doc], alone_embedded))
        for n, g in alone_grads.items():
            expected_grads[n] += g
        start += length
    return max(worst, max_difference(list(grads.values()), list(expected_grads.values())))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_row_equals_each_document_alone_outputs_and_gradients(name):
    assert packing_difference(MODELS[name]()) < 1e-10


@pytest.mark.parametrize("name", list(MODELS))
def test_no_gradient_crosses_a_document_boundary(name):
    model = MODELS[name]()
    ids, seq_idx = packed_row(DOC_LENGTHS, batch=1)
    last = sum(DOC_LENGTHS[:-1])  # the last document's first position
    weights = torch.zeros(*ids.shape, model.cfg.padded_vocab_size, dtype=torch.float64)
    weights[:, last:] = torch.randn_like(weights[:, last:])  # a loss on the last document only
    _, _, grad_embedded = embedding_gradients(model, ids, weights, seq_idx)
    assert grad_embedded[:, last:].abs().max() > 1e-3
    assert grad_embedded[:, :last].abs().max() < 1e-14  # Mamba-3's angles: a cancellation, not a 0


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap loops over addcmul_
@pytest.mark.parametrize("name", ["mamba1_sequential", "mamba1_fused", "mamba2", "mamba3_siso", "mamba3_mimo"])
def test_torch_func_vmap_over_the_lm_equals_the_loop_over_its_samples(name):
    # vmap has no single value to read: forward checks only shapes under a torch.func transform
    model = MODELS[name]()
    ids = torch.randint(0, VOCAB, (3, 2, 12))  # 3 samples of a (2, 12) batch
    seq_idx = torch.stack([torch.tensor([[0] * 5 + [1] * 7, [0] * 12]), torch.tensor([[0] * 12, [2] * 9 + [4] * 3]),
                           torch.tensor([[0] + [1] * 11, [3] * 12])])  # (3, 2, 12)

    def forward(i, s):
        logits, cache = model(i, want_cache=True, seq_idx=s)
        return logits, [list(c) for c in cache]

    for in_ids in (0, None):  # each sample its own ids, or one batch of ids packed three ways
        got = torch.func.vmap(forward, in_dims=(in_ids, 0))(ids if in_ids == 0 else ids[0], seq_idx)
        for k in range(3):
            expected = forward(ids[k if in_ids == 0 else 0], seq_idx[k])
            assert max_difference(got[0][k], expected[0]) < 1e-12
            assert max_difference([t[k] for c in got[1] for t in c], [t for c in expected[1] for t in c]) < 1e-12

    # per-sample gradients, vmap(grad), where grad wraps vmap's batched ids
    def loss(params, i, s):
        return torch.func.functional_call(model, params, (i,), dict(seq_idx=s)).logsumexp(-1).mean()

    params = {name: p.detach() for name, p in model.named_parameters()}
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, ids, seq_idx)
    for k in range(3):
        model.zero_grad()
        loss(dict(model.named_parameters()), ids[k], seq_idx[k]).backward()
        assert max_difference([per_sample[n][k] for n in params], [p.grad for p in model.parameters()]) < 1e-12


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap loops over addcmul_
@pytest.mark.parametrize("name", ["mamba1_pscan", "mamba1_reference", "mamba1_fused", "mamba2", "mamba3_mimo"])
def test_torch_func_vmap_over_one_parameter_equals_the_loop_over_its_values(name):
    # vmap mapping one parameter and nothing else (A_log, a conv's weight, ...): every tensor the
    # others make is then unmapped, and the scans must not write a mapped tensor into one of them
    model = MODELS[name]()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))

    def loss(value, param):
        return torch.func.functional_call(model, {param: value}, (ids,)).logsumexp(-1).mean()

    for param, p in model.named_parameters():
        values = torch.stack([p.detach(), p.detach() + 0.1 * torch.randn_like(p)])  # two values of the parameter
        got = torch.func.vmap(lambda v: loss(v, param))(values)
        grads = torch.func.vmap(torch.func.grad(lambda v: loss(v, param)))(values)
        for k in range(2):
            assert abs(got[k].item() - loss(values[k], param).item()) < 1e-12, param
            v = values[k].clone().requires_grad_()
            loss(v, param).backward()
            assert max_difference(grads[k], v.grad) < 1e-12, param


def assert_jvp_equals_central_differences(model, ids, seed):
    """torch.func.jvp of the logits along a random direction in every parameter at once, against
    float64 central differences (their own error, from eps² and rounding, is about 1e-8 of the scale)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(seed)
    direction = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}
    logits = lambda p: torch.func.functional_call(model, p, (ids,))
    _, got = torch.func.jvp(logits, (params,), (direction,))
    eps = 1e-6
    step = lambda sign: logits({n: p + sign * eps * direction[n] for n, p in params.items()})
    want = (step(1) - step(-1)) / (2 * eps)
    assert (got - want).abs().max() < 1e-6 * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_mode_ad_over_the_lm_equals_central_differences(name):
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    assert_jvp_equals_central_differences(MODELS[name](), ids, seed=3)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # jacrev's vmap loops over addcmul_
@pytest.mark.parametrize("name", list(MODELS))
def test_a_hessian_by_torch_func_equals_central_differences_of_the_gradient(name):
    # jacrev of jacrev (a grad of a grad) with respect to D: the Hessian times a direction against
    # central differences of torch.func.grad along it
    model = MODELS[name]()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    param = next(n for n, _ in model.named_parameters() if n.endswith("mixer.D"))
    value = dict(model.named_parameters())[param].detach()
    loss = lambda v: torch.func.functional_call(model, {param: v}, (ids,)).logsumexp(-1).mean()
    direction = torch.randn(value.shape, generator=torch.Generator().manual_seed(7), dtype=value.dtype)
    got = torch.func.jacrev(torch.func.jacrev(loss))(value).flatten(0, value.dim() - 1).reshape(value.numel(), -1)
    got = (got @ direction.flatten()).reshape(value.shape)
    eps = 1e-5
    want = (torch.func.grad(loss)(value + eps * direction) - torch.func.grad(loss)(value - eps * direction)) / (2 * eps)
    assert (got - want).abs().max() < 1e-6 * want.abs().max(), (got - want).abs().max()


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap loops over addcmul_
def test_per_sample_gradients_keep_the_hand_written_backward(monkeypatch):
    # vmap(grad) over the data maps every per-token input of the scan: the engine runs, not the reference
    model = MODELS["mamba1_pscan"]()
    calls = []
    forward = me._cpu_forward
    monkeypatch.setattr(me, "_cpu_forward", lambda *a: calls.append(1) or forward(*a))
    ids = torch.randint(0, VOCAB, (3, 2, 12), generator=torch.Generator().manual_seed(8))
    params = {n: p.detach() for n, p in model.named_parameters()}
    loss = lambda p, i: torch.func.functional_call(model, p, (i,)).logsumexp(-1).mean()
    torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, ids)
    assert calls  # each layer ran _SelectiveScan


def test_under_torch_func_grad_the_ids_are_still_checked():
    # only vmap's batched tensors go unread: grad alone reads them as a plain forward does
    model = MODELS["mamba2"]()
    params = {name: p.detach() for name, p in model.named_parameters()}
    for bad in (VOCAB, -1):  # VOCAB: a padded slot of the embedding, which a forward would read silently
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {VOCAB}\)"):
            torch.func.grad(lambda p: torch.func.functional_call(model, p, (torch.tensor([[1, bad]]),)).sum())(params)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_row_continues_from_a_cache_in_pieces(name):
    """The first document of a piece continues the cache; the final cache is the last document's
    alone (its conv buffer holds none of the earlier documents' inputs)."""
    model = MODELS[name]()
    ids, seq_idx = packed_row(DOC_LENGTHS)
    with torch.no_grad():
        expected = model(ids, seq_idx=seq_idx)
        _, last_alone = model.prefill(ids[:, -DOC_LENGTHS[-1]:])
        logits, cache, start = [], None, 0
        for length in (3, 6, 14, 12):
            out, cache = model(ids[:, start:start + length], want_cache=True, cache=cache,
                               seq_idx=seq_idx[:, start:start + length])
            logits.append(out)
            start += length
    assert max_difference(torch.cat(logits, dim=1), expected) < 1e-10
    assert max_difference(cache, last_alone) < 1e-10


@pytest.mark.parametrize("name", list(MODELS))
def test_pieces_shorter_than_the_conv_keep_the_cache_inputs_of_their_document(name):
    """Pieces of 2 and 1 tokens inside one document: after each, the conv buffer still holds inputs
    that came from the cache, and they belong to the same document, so the next piece reads them."""
    model = MODELS[name]()
    ids, seq_idx = packed_row(DOC_LENGTHS)  # documents at 0, 1-7, 8-15, 16, 17-21, 22-31, 32-34
    with torch.no_grad():
        expected = model(ids, seq_idx=seq_idx)
        logits, cache, start = [], None, 0
        for length in (3, 2, 1, 3, 11, 15):  # every split falls inside a document
            out, cache = model(ids[:, start:start + length], want_cache=True, cache=cache,
                               seq_idx=seq_idx[:, start:start + length])
            logits.append(out)
            start += length
    assert max_difference(torch.cat(logits, dim=1), expected) < 1e-10


def split_at_every_position_difference(model, ids, seq_idx):
    """Cut a packed row at every k, continue from the first piece's cache with seq_idx[:, k - 1:]
    (the document of the cache's last token first): the largest difference from one pass, over all
    k, boundaries included."""
    with torch.no_grad():
        expected = model(ids, seq_idx=seq_idx)
        worst = 0.0
        for k in range(1, ids.shape[1]):
            first, cache = model(ids[:, :k], want_cache=True, seq_idx=seq_idx[:, :k])
            second = model(ids[:, k:], cache=cache, seq_idx=seq_idx[:, k - 1:])
            worst = max(worst, max_difference(torch.cat([first, second], dim=1), expected))
    return worst


@pytest.mark.parametrize("name", list(MODELS))
def test_a_split_at_any_position_continues_or_restarts_as_the_documents_say(name):
    """fuzz N2: a new document that starts exactly at the split must not continue the cache."""
    model = MODELS[name]()
    ids, seq_idx = packed_row([3, 1, 4, 2])  # boundaries at 3, 4 and 8, among the splits 1 .. 9
    seq_idx = seq_idx.clone()
    seq_idx[1] = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, 2])  # the rows differ: one may restart, one not
    assert split_at_every_position_difference(model, ids, seq_idx) < 1e-10


def test_without_the_caches_column_the_first_document_continues_the_cache():
    # seq_idx as long as the ids: the first document of the call continues the cache, whatever its
    # index; the longer seq_idx says where the cache's document ends
    model = MODELS["mamba1_sequential"]()
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        whole = model(ids)
        _, cache = model.prefill(ids[:, :5])
        continued = model(ids[:, 5:], cache=cache, seq_idx=torch.tensor([[7, 7, 7]]))
        restarted = model(ids[:, 5:], cache=cache, seq_idx=torch.tensor([[6, 7, 7, 7]]))
        alone = model(ids[:, 5:])
    assert max_difference(continued, whole[:, 5:]) < 1e-12
    assert max_difference(restarted, alone) < 1e-12
    with pytest.raises(ValueError, match=r"seq_idx must be an integer tensor of shape \(1, 3\) like input_ids, "
                                         r"or \(1, 4\) with the document of the cache's last token first"):
        model(ids[:, 5:], cache=cache, seq_idx=torch.tensor([[6, 7, 7, 7, 7]]))
    with pytest.raises(ValueError, match=r"shape \(1, 3\) like input_ids, on"):  # no cache: no longer seq_idx
        model(ids[:, 5:], seq_idx=torch.tensor([[6, 7, 7, 7]]))


def loop_conv(x, weight, bias, seq_idx, buffer=None):
    """The oracle: out_t = bias + Σ_k w_k·x_{t-d+1+k} over the inputs of t's own sequence only,
    position by position; before the first token, the buffer's inputs (zeros without one)."""
    b, L, ED = x.shape
    d = weight.shape[-1]
    out = torch.zeros_like(x)
    for i in range(b):
        for t in range(L):
            total = bias.clone()
            for k in range(d):
                s = t - d + 1 + k
                if s >= 0 and seq_idx[i, s] == seq_idx[i, t]:
                    total += weight[:, k] * x[i, s]
                elif s < 0 and buffer is not None and seq_idx[i, 0] == seq_idx[i, t]:
                    total += weight[:, k] * buffer[i, :, d + s]
            out[i, t] = total
    return out


def test_the_conv_never_reads_across_a_boundary():
    mixer = mamba2_model().backbone.layers[0].mixer
    _, seq_idx = packed_row([1, 2, 5, 1, 4], batch=2)
    seq_idx[1] = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3, 3])  # another packing in row 2
    x = torch.randn(2, 13, mixer.cfg.conv_dim, dtype=torch.float64)
    w, bias = mixer.conv1d.weight[:, 0].detach(), mixer.conv1d.bias.detach()
    buffer = torch.randn(2, mixer.cfg.conv_dim, mixer.cfg.d_conv, dtype=torch.float64)
    with torch.no_grad():
        assert max_difference(mixer.causal_conv(x, seq_idx=seq_idx), loop_conv(x, w, bias, seq_idx)) < 1e-12
        assert max_difference(mixer.causal_conv(x, buffer, seq_idx), loop_conv(x, w, bias, seq_idx, buffer)) < 1e-12


def test_seq_idx_from_cu_seqlens():
    got = mm.seq_idx_from_cu_seqlens(torch.tensor([0, 1, 4, 9]))
    assert torch.equal(got, torch.tensor([[0, 1, 1, 1, 2, 2, 2, 2, 2]]))
    for bad in (torch.tensor([1, 4]), torch.tensor([0, 4, 4]), torch.tensor([0.0, 2.0]), torch.tensor([0]),
                torch.tensor([False, True])):  # fuzz-2 N13: bool reached repeat_interleave's own error
        with pytest.raises(ValueError, match="cu_seqlens must be"):
            mm.seq_idx_from_cu_seqlens(bad)


# ------------------------------------------------------------------------------------------------
# 3. Left padding: each row as if it ran alone
# ------------------------------------------------------------------------------------------------

PROMPT_LENGTHS = [5, 12, 1, 9]


def left_padded(prompts, pad_id):
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):], mask[i, L - len(p):] = p, 1
    return ids, mask


def padding_difference(model):
    """The worst difference between each row of a left-padded batch and the row alone (logits at the
    real positions, the cache); the greedy tokens of generate and generate_stream must be equal."""
    worst = 0.0
    prompts = [torch.randint(0, VOCAB, (n,)) for n in PROMPT_LENGTHS]
    for pad_id in (0, 17):  # whatever the padding token is
        ids, mask = left_padded(prompts, pad_id)
        L = ids.shape[1]
        with torch.no_grad():
            logits, cache = model.prefill(ids, attention_mask=mask)
        generated = model.generate(ids, 7, top_k=1, attention_mask=mask)
        streamed = torch.stack(list(model.generate_stream(ids, 7, top_k=1, attention_mask=mask)), dim=1)
        assert torch.equal(streamed, generated[:, L:])
        for i, p in enumerate(prompts):  # the oracle: the row alone, no padding
            n = len(p)
            with torch.no_grad():
                alone, alone_cache = model.prefill(p[None])
            worst = max(worst, max_difference(logits[i:i + 1, L - n:], alone),
                        max_difference([tuple(t[i:i + 1] for t in c) for c in cache], alone_cache))
            assert torch.equal(generated[i, L:], model.generate(p[None], 7, top_k=1)[0, n:])
    return worst


@pytest.mark.parametrize("name", list(MODELS))
def test_each_row_of_a_left_padded_batch_equals_the_row_alone(name):
    assert padding_difference(MODELS[name]()) < 1e-10


@pytest.mark.parametrize("generation", [1, 2])
def test_left_padded_generate_equals_transformers_generate_with_the_same_mask(tmp_path, generation):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    tokens = dict(vocab_size=VOCAB, tie_word_embeddings=False, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    if generation == 1:
        hf = transformers.MambaForCausalLM(transformers.MambaConfig(hidden_size=16, state_size=4, num_hidden_layers=2,
                                                                    expand=2, **tokens))
    else:
        hf = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
            num_heads=4, head_dim=16, hidden_size=32, state_size=8, num_hidden_layers=2, n_groups=2,
            chunk_size=CHUNK, expand=2, **tokens))
    hf = hf.double().eval()
    with torch.no_grad():  # off the init values
        for name, p in hf.named_parameters():
            if name.endswith(("dt_bias", "A_log", ".D", "norm.weight", "dt_proj.bias", "conv1d.bias")):
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path)
    model = pretrained.load(str(tmp_path), dtype=torch.float64, cls=mm.MambaLM if generation == 1 else m2.Mamba2LM)
    prompts = [torch.randint(1, VOCAB, (n,)) for n in PROMPT_LENGTHS]
    ids, mask = left_padded(prompts, pad_id=0)
    ours = model.generate(ids, 6, top_k=1, attention_mask=mask)
    real = mask.bool()
    with torch.no_grad():  # the logits at the real positions, then the greedy tokens
        torch.testing.assert_close(model(ids, attention_mask=mask)[real][:, :VOCAB],
                                   hf(ids, attention_mask=mask).logits[real].double(), atol=1e-6, rtol=1e-5)
        theirs = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             min_new_tokens=6)
    assert torch.equal(ours, theirs)


# ------------------------------------------------------------------------------------------------
# 4. Bad input gets an error that names what was expected
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_bad_masks_seq_idx_and_caches_raise_errors_that_name_the_expectation(name):
    model = MODELS[name]()
    ids = torch.randint(0, VOCAB, (2, 6))
    ones = torch.ones(2, 6, dtype=torch.long)
    bad_masks = {
        "right padding": torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6]),
        "a hole": torch.tensor([[0, 1, 0, 1, 1, 1], [1] * 6]),
        "not 0/1": torch.tensor([[0, 2, 2, 2, 2, 2], [1] * 6]),
        "no token": torch.tensor([[0] * 6, [1] * 6]),
    }
    for what, mask in bad_masks.items():
        with pytest.raises(ValueError, match="attention_mask must be left padding"):
            model(ids, attention_mask=mask)
    for mask in (ones[:, :5], ones.double(), ones[0]):
        with pytest.raises(ValueError, match=r"attention_mask must be a bool or integer tensor of shape \(2, 6\)"):
            model.generate(ids, 2, attention_mask=mask)
        with pytest.raises(ValueError, match=r"attention_mask must be a bool or integer tensor of shape \(2, 6\)"):
            model.generate(ids, 0, attention_mask=mask)  # no prefill to check it: generate checks it
    with pytest.raises(ValueError, match="seq_idx must be non-decreasing"):
        model(ids, seq_idx=torch.tensor([[0, 0, 1, 1, 0, 2], [0] * 6]))
    for seq_idx in (ones[:, :5], ones.double(), ones[None]):
        with pytest.raises(ValueError, match=r"seq_idx must be an integer tensor of shape \(2, 6\)"):
            model(ids, seq_idx=seq_idx)
    _, cache = model.prefill(ids)
    with pytest.raises(ValueError, match="attention_mask with a cache must be all ones"):
        model.prefill(ids, cache=cache, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6]))
    with pytest.raises(ValueError, match="must have shape"):  # a cache for another batch
        model.prefill(ids[:1], cache=cache)
    with pytest.raises(ValueError, match="cache must be a list of 2"):
        model.prefill(ids, cache=cache[:1])
    with pytest.raises(ValueError, match="must be torch.float64"):
        model.prefill(ids, cache=[tuple(t.float() for t in c) for c in cache])
    other = mamba3_model() if name == "mamba2" else mamba2_model()
    _, foreign = other.prefill(ids)  # a cache from another generation
    with pytest.raises(ValueError, match="cache"):
        model.prefill(ids, cache=foreign)
    with torch.no_grad():  # nothing above changed the model's answer
        assert max_difference(model.prefill(ids)[0], model(ids)) == 0


def test_the_scans_refuse_a_reset_that_is_not_a_bool_mask_of_shape_b_l():
    x, dt = torch.randn(2, 5, 4, 3), torch.rand(2, 5, 4)
    A, B = -torch.rand(4), torch.randn(2, 5, 1, 6)
    for reset in (torch.zeros(2, 5), torch.zeros(2, 4, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"reset must be a bool tensor of shape \(b, L\) = \(2, 5\)"):
            m2.ssd(x, dt, A, B, B, 4, reset=reset)
        with pytest.raises(ValueError, match=r"reset must be a bool tensor of shape \(b, L\) = \(2, 5\)"):
            m3.mamba3_chunked(B.unsqueeze(2).expand(2, 5, 1, 1, 6), B.unsqueeze(2).expand(2, 5, 1, 1, 6), x, dt,
                              -dt, dt, torch.rand(2, 5, 4, 1), reset=reset)


@pytest.mark.compile
def test_compiled_mamba2_mixer_takes_packed_rows_and_left_padding():
    torch.manual_seed(0)
    model = m2.Mamba2LM(m2.Mamba2Config(d_model=32, n_layer=1, vocab_size=VOCAB, d_state=8, headdim=16, ngroups=2,
                                        chunk_size=CHUNK, compile_mixer=True)).eval()
    ids, seq_idx = packed_row([5, 11])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    # with autograd on: the compiled mixer serves training (a forward without autograd runs eagerly)
    packed, padded = (out.detach() for out in (model(ids, seq_idx=seq_idx), model(ids, attention_mask=mask)))
    with torch.no_grad():
        model.cfg.compile_mixer = False  # the oracle: each document and each row alone, eagerly
        for doc in (slice(0, 5), slice(5, 16)):
            torch.testing.assert_close(packed[:, doc], model(ids[:, doc]), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(padded[0, 3:], model(ids[:1, 3:])[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(padded[1], model(ids[1:])[0], atol=1e-5, rtol=1e-4)


def loop_selective_scan(x, delta, A, B, C, D, z, h0, reset):
    """The oracle: h_t = exp(Δ_t·A)·h_{t-1} + Δ_t·B_t·x_t with h_{t-1} replaced by 0 where reset_t,
    y_t = (C_t·h_t + D·x_t)·SiLU(z_t), one step at a time in float64."""
    h, ys = h0, []
    for t in range(x.shape[1]):
        decay = torch.exp(delta[:, t, :, None] * A)  # (b, ED, N)
        h = torch.where(reset[:, t, None, None], 0, decay * h) + (delta[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        y = (h * C[:, t, None, :]).sum(-1) + D * x[:, t]
        ys.append(y * z[:, t] * torch.sigmoid(z[:, t]))
    return torch.stack(ys, dim=1), h


@pytest.mark.parametrize("backend", MAMBA1_BACKENDS)
def test_mamba1_selective_scan_restarts_where_reset_forward_and_every_gradient(backend):
    """reset reaches the hand-written backwards (the eager Function's and the fused chunk's): the
    gradients of every input equal those of the loop above; and a second derivative too where the
    backend offers one."""
    torch.manual_seed(0)
    b, L, ED, N = 2, 21, 3, 4
    x, delta, z = torch.randn(b, L, ED), torch.rand(b, L, ED) + 0.1, torch.randn(b, L, ED)
    A, B, C, D, h0 = -torch.rand(ED, N) - 0.2, torch.randn(b, L, N), torch.randn(b, L, N), torch.randn(ED), torch.randn(b, ED, N)
    inputs = [t.double().requires_grad_() for t in (x, delta, A, B, C, D, z, h0)]
    reset = torch.zeros(b, L, dtype=torch.bool)
    reset[0, [1, 8, 16]] = True  # at a chunk edge (8, 16) and inside one
    reset[1, [5, 6, 20]] = True  # two starts in a row: a sequence of length 1
    weights = [torch.randn(b, L, ED, dtype=torch.float64), torch.randn(b, ED, N, dtype=torch.float64)]

    def grads(fn, create_graph=False):
        y, h = fn(*inputs)
        loss = (y * weights[0]).sum() + (h * weights[1]).sum()
        return (y, h), torch.autograd.grad(loss, inputs, create_graph=create_graph)

    expected, expected_grads = grads(lambda *t: loop_selective_scan(*t, reset))
    got, got_grads = grads(lambda *t: me.selective_scan(*t, backend=backend, return_last_state=True,
                                                       chunk_size=CHUNK, reset=reset))
    assert max_difference(got, expected) < 1e-10
    assert max_difference(got_grads, expected_grads) < 1e-10
    if backend != "fused":  # the recomputing fused backward refuses a second derivative, loudly
        _, first = grads(lambda *t: loop_selective_scan(*t, reset), create_graph=True)
        expected_second = torch.autograd.grad(sum((g * g).sum() for g in first), inputs)
        _, first = grads(lambda *t: me.selective_scan(*t, backend=backend, return_last_state=True, reset=reset),
                         create_graph=True)
        assert max_difference(torch.autograd.grad(sum((g * g).sum() for g in first), inputs), expected_second) < 1e-9


if __name__ == "__main__":  # python test_use.py: the worst float64 difference of each equality, per model
    torch.manual_seed(0)
    print(f"{'model':<24}{'split anywhere':>16}{'packed':>12}{'left-padded':>14}")
    for name, make in MODELS.items():
        print(f"{name:<24}{split_difference(make()):>16.1e}{packing_difference(make()):>12.1e}"
              f"{padding_difference(make()):>14.1e}")


@pytest.mark.compile
def test_compiled_mamba1_fused_scan_restarts_packed_rows_forward_and_backward():
    torch.manual_seed(0)
    cfg = mm.MambaConfig(d_model=16, n_layer=1, vocab_size=VOCAB, d_state=4)
    model = me.accelerate(mm.MambaLM(cfg), compile=True, chunk_size=CHUNK)
    ids, seq_idx = packed_row([5, 14])
    weights = torch.randn(*ids.shape, cfg.padded_vocab_size)
    model.zero_grad()
    packed = model(ids, seq_idx=seq_idx)
    (packed * weights).sum().backward()  # the compiled chunk and its compiled recomputing backward
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    me.accelerate(model, chunk_size=CHUNK)  # the oracle: each document alone, eagerly
    model.zero_grad()
    for doc in (slice(0, 5), slice(5, 19)):
        alone = model(ids[:, doc])
        torch.testing.assert_close(packed[:, doc].detach(), alone.detach(), atol=1e-5, rtol=1e-4)
        (alone * weights[:, doc]).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-4, rtol=1e-3)


# ------------------------------------------------------------------------------------------------
# 5. The captured decode step (mamba_engine.compile_decode, decode_step with compile=True)
# ------------------------------------------------------------------------------------------------

DECODE_MODELS = ["mamba1_sequential", "mamba2", "mamba3_siso", "mamba3_mimo"]


@pytest.mark.compile
@pytest.mark.filterwarnings("error:compiling the decode step failed")  # the fallback would pass as eager
@pytest.mark.parametrize("name", DECODE_MODELS)
def test_the_compiled_decode_step_equals_the_eager_step_and_the_forward(name):
    from torch._dynamo.utils import counters
    model = MODELS[name]()
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    _, cache = model.prefill(prompt)
    _, eager_cache = model.prefill(prompt)
    eager = copy.deepcopy(model)
    step = me.decode_step(model, compile=True)
    assert step is me.decode_step(model, compile=True) and step is not model._step  # compiled once per model
    graphs = counters["stats"]["unique_graphs"]
    for token in torch.randint(0, VOCAB, (4, 2), generator=torch.Generator().manual_seed(4)):
        with torch.no_grad():
            torch.testing.assert_close(step(token, cache), model._step(token, eager_cache), atol=1e-10, rtol=1e-10)
        assert max_difference(cache, eager_cache) < 1e-10  # the cache written in place, as the eager step does
    assert counters["stats"]["unique_graphs"] == graphs + 1  # the whole step, one graph
    # generate with it: the greedy tokens of one forward pass over the whole sequence
    out = me.compile_decode(model).generate(prompt, 6, top_k=1)
    with torch.no_grad():
        assert torch.equal(out[:, 5:], model(out[:, :-1])[:, 4:, :VOCAB].argmax(-1))
    assert torch.equal(out, eager.generate(prompt, 6, top_k=1))


def test_a_decode_step_that_fails_to_compile_runs_eagerly_after_one_warning(monkeypatch):
    def no_compiler(fn, **kw):
        def compiled(*args):
            raise RuntimeError("InductorError: no C++ compiler")
        return compiled

    monkeypatch.setattr(torch, "compile", no_compiler)
    model, eager = mamba2_model(), mamba2_model()
    me.compile_decode(model)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning, match="compiling the decode step failed.*no C\\+\\+ compiler") as caught:
        out = model.generate(prompt, 5, top_k=1)
        again = model.generate(prompt, 5, top_k=1)
    assert len([w for w in caught if "decode step" in str(w.message)]) == 1
    assert torch.equal(out, eager.generate(prompt, 5, top_k=1)) and torch.equal(again, out)


def test_a_hybrid_model_decodes_eagerly_under_compile_with_one_warning(monkeypatch):
    # an attention layer's KV cache grows each token: a compiled step would compile again every token
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: pytest.fail("compiled a step with a growing KV cache"))
    torch.manual_seed(0)
    model = perturbed(hybrid.HybridMambaLM(hybrid.HybridMambaConfig(
        d_model=16, n_layer=2, vocab_size=VOCAB, d_state=4, d_intermediate=8, attn_layer_idx=[1],
        attn_cfg=dict(num_heads=2, causal=True))))
    eager = copy.deepcopy(model)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning, match="without attention layers; decoding eagerly") as caught:
        out = me.compile_decode(model).generate(prompt, 4, top_k=1)
        model.generate(prompt, 4, top_k=1)
    assert len(caught) == 1 and torch.equal(out, eager.generate(prompt, 4, top_k=1))
