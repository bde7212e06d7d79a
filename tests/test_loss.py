"""Chunked loss: exact against full logits, bounded memory, token-weighted accumulation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_model

from leansft.core.cpu.bf16_head import bf16_head, onednn_bf16_mode_engages
from leansft.core.data.masking import IGNORE_INDEX
from leansft.core.metrics.memtrack import TensorMemoryTracker
from leansft.core.model.attention import VARLEN, packed_forward, use_packed_attention
from leansft.core.model.loss import chunked_loss, full_logits_loss, normalise


def setup(T=37, H=16, V=101, tied=False, ignore=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(V, H, generator=g, dtype=torch.float64).float().requires_grad_()
    ids = torch.randint(0, V, (1, T), generator=g)
    proj = torch.randn(H, H, generator=g) / H**0.5
    labels = ids.clone()
    if ignore:
        labels[0, ::3] = IGNORE_INDEX
    weight = emb if tied else torch.randn(V, H, generator=g).requires_grad_()
    return emb, ids, proj, labels, weight


def grads(loss_fn, chunk, tied, ignore, softcap=None):
    emb, ids, proj, labels, weight = setup(tied=tied, ignore=ignore)
    hidden = (emb[ids] @ proj).detach().requires_grad_()
    kw = {"softcap": softcap}
    loss, n = loss_fn(hidden, weight, labels, chunk, **kw) if chunk else loss_fn(hidden, weight, labels, **kw)
    loss.backward()
    return loss.detach(), n, hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 5, 8, 24, 1000])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("ignore", [False, True])
def test_exact_against_full_logits(chunk, tied, ignore):
    ref = grads(full_logits_loss, None, tied, ignore)
    got = grads(chunked_loss, chunk, tied, ignore)
    assert got[1] == ref[1]
    for a, b in zip((got[0], got[2], got[3]), (ref[0], ref[2], ref[3])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_softcap_and_bf16():
    ref = grads(full_logits_loss, None, False, True, softcap=5.0)
    got = grads(chunked_loss, 7, False, True, softcap=5.0)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)
    emb, ids, proj, labels, weight = setup()
    h = (emb[ids] @ proj).detach().bfloat16().requires_grad_()
    w = weight.detach().bfloat16().requires_grad_()
    loss, _ = chunked_loss(h, w, labels, 8)
    loss.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    ref_loss, _ = full_logits_loss(h.detach().float(), w.detach().float(), labels)
    assert float(loss.detach()) == pytest.approx(float(ref_loss), rel=1e-2)


def test_plain_head_under_cpu_bf16_autocast_is_the_fp32_loss():
    """By default (no ``cpu.bf16_head``) the head of an fp32 model under CPU bf16 autocast multiplies in fp32."""
    emb, ids, proj, labels, weight = setup(T=64, H=32, V=301)
    hidden, weight = (emb[ids] @ proj).detach(), weight.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = chunked_loss(hidden, weight, labels, 16)
    assert float(loss) == pytest.approx(float(full_logits_loss(hidden, weight, labels)[0]), rel=1e-6)


def test_cpu_bf16_head_takes_bf16_inputs_with_fp32_accumulation():
    """With ``cpu.bf16_head`` (core/cpu/bf16_head.py) under CPU bf16 autocast the head's matmuls run as autocast
    runs a linear layer (bf16 inputs) where oneDNN's bf16 mode engages, but accumulate and return fp32: the loss
    equals the exact loss of the bf16-rounded inputs there and the fp32 loss elsewhere, never a loss of bf16-rounded
    logits. Where the mode does not engage on a CPU with bf16 units, the two gradient products alone are bf16
    (``grad_dtype``): bf16-level gradients."""
    emb, ids, proj, labels, weight = setup(T=64, H=32, V=301)
    hidden = (emb[ids] @ proj).detach().requires_grad_()
    before = torch.backends.mkldnn.matmul.fp32_precision
    precision = bf16_head(torch.device("cpu"), torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, n = chunked_loss(hidden, weight, labels, 16, precision=precision)
    assert torch.backends.mkldnn.matmul.fp32_precision == before  # the switch is the loss's alone
    loss.backward()
    assert loss.dtype == torch.float32 and n == int((labels[0, 1:] != IGNORE_INDEX).sum())
    h32, w32 = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    fp32_loss = full_logits_loss(h32, w32, labels)[0]
    fp32_loss.backward()
    if not onednn_bf16_mode_engages():  # fp32 logits and loss; gradients as grad_dtype says
        assert float(loss) == pytest.approx(float(fp32_loss), rel=1e-5)
        low = precision.grad_dtype
        for got, ref in ((hidden.grad, h32.grad), (weight.grad, w32.grad)):
            error = float((got - ref).norm() / ref.norm())
            assert error < 1e-5 if low is None else 1e-4 < error < 1e-2  # bf16 products: bf16-level, not fp32
        return
    rounded, _ = full_logits_loss(hidden.detach().bfloat16().double(), weight.detach().bfloat16().double(), labels)
    assert float(loss) == pytest.approx(float(rounded), rel=1e-5)
    for got, ref in ((hidden.grad, h32.grad), (weight.grad, w32.grad)):  # bf16-level gradients
        assert float((got - ref).norm() / ref.norm()) < 1e-2
    # the hidden-state gradient too is bf16 inputs, fp32 accumulated, not rounded after
    h64, w64 = hidden.detach().bfloat16().double(), weight.detach().bfloat16().double()
    keep = labels[0, 1:] != IGNORE_INDEX
    probs = torch.softmax(h64[0, :-1][keep] @ w64.t(), -1)
    probs[torch.arange(int(keep.sum())), labels[0, 1:][keep]] -= 1.0
    exact = torch.zeros_like(h64[0])
    exact[:-1][keep] = probs.float().bfloat16().double() @ w64
    assert float((hidden.grad[0].double() - exact).norm() / exact.norm()) < 1e-4


def test_frozen_weight_gets_no_gradient():
    emb, ids, proj, labels, weight = setup()
    hidden = (emb[ids] @ proj).detach().requires_grad_()
    loss, _ = chunked_loss(hidden, weight.detach(), labels, 8)
    loss.backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    full_logits_loss(ref_hidden, weight.detach(), labels)[0].backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad)


@pytest.mark.slow
def test_peak_memory_bounded_by_chunk():
    T, V, H, chunk = 4096, 32_000, 32, 256
    torch.manual_seed(0)
    hidden = torch.randn(1, T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (1, T))
    bound = 4 * chunk * V * 4 + 4 * (T * H + V * H) * 4  # a few chunks of fp32 logits + grads of inputs
    full_logits = T * V * 4
    with TensorMemoryTracker() as tr:
        loss, _ = chunked_loss(hidden, weight, labels, chunk)
        loss.backward()
    assert tr.peak < bound < full_logits
    hidden.grad = weight.grad = None
    with TensorMemoryTracker() as tr_ref:
        loss, _ = full_logits_loss(hidden, weight, labels)
        loss.backward()
    assert tr_ref.peak > bound
    assert tr_ref.peak > 5 * tr.peak


def test_accumulation_1_vs_8_same_update_and_logged_loss():
    """One step over 8 packed micro-batches of unequal target counts, accumulated 1 vs 8 ways."""
    from test_packing_attention import dataset

    from leansft.core.batching.collate import collate_packed

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (5, 17, 9, 30, 4, 12, 21, 8)]
    data = dataset(seqs, prompt=2)

    def step(groups):
        model = tiny_model("llama")
        model.train()
        use_packed_attention(model, VARLEN)
        w = model.get_output_embeddings().weight
        batches = [collate_packed(data, np.asarray(gr), np.zeros(len(gr), np.int64), data.lengths[np.asarray(gr)])
                   for gr in groups]
        total = sum(b.target_tokens for b in batches)
        logged = 0.0
        for b in batches:
            loss_sum, _ = chunked_loss(packed_forward(model, b), w, b.labels, chunk_size=16)
            normalise(loss_sum, total).backward()
            logged += float(loss_sum.detach()) / total
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # AdamW divides by tiny second moments: ill-conditioned to compare
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        return logged, [p.detach() - b for p, b in zip(model.parameters(), before)]

    loss1, upd1 = step([list(range(8))])
    loss8, upd8 = step([[i] for i in range(8)])
    assert loss1 == pytest.approx(loss8, rel=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(upd1, upd8)) < 1e-6


def test_liger_backend_missing_is_a_clear_error():
    import importlib.util

    from leansft.core.errors import ConfigError
    from leansft.core.model.loss import liger_loss

    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel installed")
    with pytest.raises(ConfigError, match="liger-kernel"):
        liger_loss(torch.zeros(1, 3, 4), torch.zeros(5, 4), torch.zeros(1, 3, dtype=torch.long))


def test_no_gradient_buffers_under_no_grad(monkeypatch):
    """Evaluation (FSDP included) computes no weight gradient even when the weight requires grad: the loss
    function is handed inputs that need no gradient, so it allocates no gradient buffers."""
    from leansft.core.model import loss as loss_mod

    seen = []
    real = loss_mod._ChunkedLinearCE.apply
    monkeypatch.setattr(loss_mod._ChunkedLinearCE, "apply",
                        lambda h, w, *rest: seen.append((h.requires_grad, w.requires_grad)) or real(h, w, *rest))
    hidden = torch.randn(1, 16, 8, requires_grad=True)
    weight = torch.randn(100, 8, requires_grad=True)
    labels = torch.randint(0, 100, (1, 16))
    with torch.no_grad():
        loss, n = chunked_loss(hidden, weight, labels, chunk_size=4)
    assert n == 15 and loss.grad_fn is None and seen == [(False, False)]
    chunked_loss(hidden, weight, labels, chunk_size=4)  # training: gradients wanted
    assert seen[-1] == (True, True)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_output_bias_and_logit_scale_are_exact(softcap):
    """Phi's lm_head bias, Cohere's logit_scale / Granite's 1/logits_scaling: loss and every gradient
    (hidden states, weight, bias) equal the full-logits reference."""
    emb, ids, proj, labels, weight = setup()
    bias = torch.randn(weight.shape[0], requires_grad=True)
    out = {}
    for name, fn in (("chunked", lambda h, w, b: chunked_loss(h, w, labels, 8, softcap, b, 0.0625)[0]),
                     ("full", lambda h, w, b: full_logits_loss(h, w, labels, softcap, b, 0.0625)[0])):
        h = (emb[ids] @ proj).detach().requires_grad_()
        w, b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
        loss = fn(h, w, b)
        loss.backward()
        out[name] = (loss.detach(), h.grad, w.grad, b.grad)
    for a, b in zip(out["chunked"], out["full"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_output_head_is_read_from_the_model():
    """The scale is measured from the model's own forward (Cohere multiplies, Granite divides)."""
    import transformers as tf

    from leansft.core.model.head import read_output_head

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=64)
    cohere = tf.CohereForCausalLM(tf.CohereConfig(**small, logit_scale=0.125))
    granite = tf.GraniteForCausalLM(tf.GraniteConfig(**small, logits_scaling=4.0))
    assert read_output_head(cohere).scale == pytest.approx(0.125, rel=1e-4)
    assert read_output_head(granite).scale == pytest.approx(0.25, rel=1e-4)
    assert read_output_head(tiny_model("llama")).scale == 1.0
    assert read_output_head(tiny_model("gemma2")).softcap == 30.0


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_token_weights_are_exact_against_full_logits(chunk):
    """Per-token loss weights (a message's fractional ``weight``) scale loss and gradient alike."""
    emb, ids, proj, labels, weight = setup()
    token_weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))
    out = []
    for fn, kw in ((full_logits_loss, {}), (chunked_loss, {"chunk_size": chunk})):
        w = weight.detach().clone().requires_grad_()
        hidden = (emb[ids] @ proj).detach().requires_grad_()
        loss, n = fn(hidden, w, labels, token_weights=token_weights, **kw)
        loss.backward()
        out.append((loss.detach(), n, hidden.grad, w.grad))
    (l0, n0, h0, w0), (l1, n1, h1, w1) = out
    assert n0 == n1
    for a, b in ((l1, l0), (h1, h0), (w1, w0)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    unweighted, _ = full_logits_loss((emb[ids] @ proj).detach(), weight.detach(), labels)
    assert not torch.isclose(l0, unweighted)


def test_weighted_accumulation_1_vs_4_same_update():
    """The step's normaliser is the sum of the targets' weights: accumulation does not change the update."""
    from test_packing_attention import dataset

    from leansft.core.batching.collate import collate_packed
    from leansft.core.data.dataset import TokenizedDataset

    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (9, 17, 6, 25)]
    plain = dataset(seqs, prompt=2)
    ids, labels = plain.flat()
    data = TokenizedDataset.from_arrays(ids, labels, np.r_[0, np.cumsum(plain.lengths)])
    codes = data.store.mask[0]
    codes[(codes == 1) & (np.arange(len(codes)) % 3 == 0)] = 2  # every third target weighs 0.25
    data.store.weights[0] = np.array([0.0, 1.0, 0.25], dtype=np.float32)

    def step(groups):
        model = tiny_model("llama")
        use_packed_attention(model, VARLEN)
        w = model.get_output_embeddings().weight
        batches = [collate_packed(data, np.asarray(gr), np.zeros(len(gr), np.int64), data.lengths[np.asarray(gr)])
                   for gr in groups]
        assert all(b.weights is not None for b in batches)
        total = sum(b.target_weight for b in batches)
        for b in batches:
            loss_sum, _ = chunked_loss(packed_forward(model, b), w, b.labels, chunk_size=16, token_weights=b.weights)
            normalise(loss_sum, total).backward()
        return total, [p.grad.detach().clone() for p in model.parameters()]

    t1, g1 = step([[0, 1, 2, 3]])
    t4, g4 = step([[0], [1], [2], [3]])
    n_targets = sum(int(np.count_nonzero(data.example(i)[1][1:] != IGNORE_INDEX)) for i in range(4))
    assert t1 == pytest.approx(t4) and t1 < n_targets
    assert max(float((a - b).abs().max()) for a, b in zip(g1, g4)) < 1e-6


def test_target_positions_from_the_host_equal_the_boolean_mask_bitwise():
    """The loss's targets gathered by positions found on the host (``batch.to``) give bitwise the loss and
    gradients of the boolean-mask selection, with token weights."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 50, (2, 30), generator=g)
    labels[0, :7] = IGNORE_INDEX
    labels[1, 12:20] = IGNORE_INDEX
    weights = torch.rand(2, 30, generator=g)
    index = torch.nonzero(labels[:, 1:].reshape(-1) != IGNORE_INDEX).squeeze(1)
    results = []
    for idx in (None, index):
        hidden = torch.randn(2, 30, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        weight = torch.randn(50, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
        loss, n = chunked_loss(hidden, weight, labels, 8, token_weights=weights, target_index=idx)
        loss.backward()
        results.append((loss.detach(), n, hidden.grad, weight.grad))
    (l0, n0, h0, w0), (l1, n1, h1, w1) = results
    assert n0 == n1 == len(index) and torch.equal(l0, l1) and torch.equal(h0, h1) and torch.equal(w0, w1)


def test_the_tensor_core_head_is_the_exact_loss_of_bf16_rounded_inputs():
    """``TENSOR_CORES`` (CUDA's default under bf16 autocast): the three products take bf16 inputs and give fp32
    results accumulated in fp32. Its loss is the fp64 loss of the bf16-rounded inputs (to fp32 rounding: no logit
    is rounded to bf16), and its gradients, made from the logits' gradient rounded to bf16, are within bf16
    tolerance of the fp64 ones; both within bf16 tolerance of the fp64 loss and gradients of the fp32 inputs. On the
    CPU the products are the same values, made from the rounded inputs upcast."""
    from leansft.core.model.loss import PLAIN, TENSOR_CORES, head_precision_for

    assert head_precision_for(torch.device("cpu"), torch.bfloat16) is PLAIN  # the CPU keeps its products
    assert head_precision_for(torch.device("cuda"), torch.bfloat16) is TENSOR_CORES
    assert head_precision_for(torch.device("cuda"), None) is PLAIN  # an fp32 run stays fp32
    emb, ids, proj, labels, weight = setup(T=96, H=32, V=503)
    hidden = (emb[ids] @ proj).detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as a run computes it: inside autocast
        loss, _ = chunked_loss(hidden, weight, labels, 40, softcap=30.0, precision=TENSOR_CORES)
    loss.backward()
    assert loss.dtype == hidden.grad.dtype == weight.grad.dtype == torch.float32
    rounded = [x.detach().bfloat16().double().requires_grad_() for x in (hidden, weight)]
    ref, _ = full_logits_loss(*rounded, labels, softcap=30.0)
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), rel=1e-6)
    for got, want in ((hidden.grad, rounded[0].grad), (weight.grad, rounded[1].grad)):
        assert float((got.double() - want).norm() / want.norm()) < 5e-3
    exact = [x.detach().double().requires_grad_() for x in (hidden, weight)]
    fp64, _ = full_logits_loss(*exact, labels, softcap=30.0)
    fp64.backward()
    assert float(loss) == pytest.approx(float(fp64), rel=1e-2)  # bf16 inputs: within bf16 tolerance
    for got, want in ((hidden.grad, exact[0].grad), (weight.grad, exact[1].grad)):
        assert float((got.double() - want).norm() / want.norm()) < 2e-2
