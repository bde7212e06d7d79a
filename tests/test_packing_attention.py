"""Packed examples are isolated: same logits as alone, no influence, zero cross gradients."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from helpers import ARCHS, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from leansft.core.batching.collate import collate_packed, collate_padded, collate_rows
from leansft.core.batching.packing import bfd, micro_batches
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.data.masking import IGNORE_INDEX
from leansft.core.errors import ModelError
from leansft.core.model.attention import FLEX, VARLEN, packed_forward, sdpa_varlen_attention, use_packed_attention
from leansft.core.model.loss import chunked_loss


def dataset(seqs: list[list[int]], prompt: int = 2) -> TokenizedDataset:
    ids = np.concatenate([np.asarray(s, np.int32) for s in seqs])
    labels = ids.copy()
    off = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([len(s) for s in seqs], out=off[1:])
    for a in off[:-1]:
        labels[a : a + prompt] = IGNORE_INDEX  # a short "prompt" without loss
    return TokenizedDataset.from_arrays(ids, labels, off)


def run(model, data, examples):
    ex = np.asarray(examples)
    batch = collate_packed(data, ex, np.zeros_like(ex), data.lengths[ex])
    return batch, packed_forward(model, batch)


def logits_of(model, hidden):
    return hidden @ model.get_output_embeddings().weight.t()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", [VARLEN, FLEX])
def test_packed_example_equals_alone_and_sees_nothing_else(arch, backend):
    model = tiny_model(arch)
    use_packed_attention(model, backend)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 512, (11,), generator=g).tolist(), torch.randint(0, 512, (9,), generator=g).tolist()
    a2 = torch.randint(0, 512, (11,), generator=g).tolist()
    data = dataset([a, b, a2])
    with torch.no_grad():
        _, h_pack = run(model, data, [0, 1])
        _, h_alone = run(model, data, [1])
        _, h_other = run(model, data, [2, 1])
    lb_pack, lb_alone = logits_of(model, h_pack)[0, 11:], logits_of(model, h_alone)[0]
    assert (lb_pack - lb_alone).abs().max() < 1e-4
    assert torch.equal(h_pack[0, 11:], h_other[0, 11:])  # A's tokens change nothing in B


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_of_b_wrt_a_embeddings_is_zero(arch):
    model = tiny_model(arch)
    use_packed_attention(model, VARLEN)
    data = dataset([list(range(5, 17)), list(range(40, 50))])
    captured = {}

    def keep(_m, _i, out):
        out.retain_grad()
        captured["emb"] = out

    model.get_input_embeddings().register_forward_hook(keep)
    batch, hidden = run(model, data, [0, 1])
    loss_b, n = chunked_loss(hidden[:, 12:], model.get_output_embeddings().weight, batch.labels[:, 12:])
    assert n > 0
    loss_b.backward()
    grad = captured["emb"].grad[0]
    assert torch.count_nonzero(grad[:12]) == 0
    assert torch.count_nonzero(grad[12:]) > 0


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_packed_gradients_equal_the_sum_over_examples_alone(arch):
    """The parameter gradients of a packed row's loss equal those of each example run alone through the
    plain model (its own attention, its own loss), summed: segment boundaries cost nothing in backward."""
    from leansft.core.model.attention import plain_attention
    from leansft.core.model.forward import loss_of

    model = tiny_model(arch).train()
    use_packed_attention(model, VARLEN)
    data = dataset([list(range(5, 17)), list(range(40, 50)), list(range(100, 121))])
    batch, hidden = run(model, data, [0, 1, 2])
    loss_of(model, batch, hidden, 16)[0].backward()  # the output layer as the model applies it (soft-capping)
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with plain_attention(model):
        for i in range(3):
            ids, labels = (torch.as_tensor(x, dtype=torch.long)[None] for x in data.example(i))
            out = model(input_ids=ids, labels=labels, use_cache=False)
            (out.loss * int((labels[0, 1:] != IGNORE_INDEX).sum())).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_short_segments_attend_in_fp32_under_cpu_bf16_autocast():
    """The CPU's bf16 flash kernel is slower than its fp32 one on short segments: those run in fp32 (exact
    fp32 attention, returned in bf16 as autocast's would be); longer ones stay bf16 as autocast makes them."""
    from leansft.core.model.attention import _segment_attention, cpu_half_segment_max

    g = torch.Generator().manual_seed(0)
    for length, fp32 in ((12, True), (cpu_half_segment_max(), True), (cpu_half_segment_max() + 1, False)):
        q, k, v = (torch.randn(1, h, length, 16, generator=g) for h in (4, 2, 2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _segment_attention(q, k, v, None, 0.0, None, None)
            bf16 = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, exact.bfloat16() if fp32 else bf16)


def test_the_fp32_attention_limit_follows_the_cpus_bf16_units(monkeypatch):
    """With AMX the bf16 kernel overtakes fp32 from ~384 tokens; with AVX512-BF16 alone only from ~768."""
    from leansft.core.model import attention

    for amx, limit in ((True, 256), (False, 512)):
        attention.cpu_half_segment_max.cache_clear()
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert attention.cpu_half_segment_max() == limit
    attention.cpu_half_segment_max.cache_clear()


def test_positions_restart_per_example():
    data = dataset([[1] * 4, [2] * 3, [3] * 5])
    batch = collate_packed(data, np.array([0, 1, 2]), np.zeros(3, np.int64), data.lengths)
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]
    assert batch.cu_seqlens.tolist() == [0, 4, 7, 12] and batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == 5
    # the first token of every example carries no label: no target crosses an example boundary
    assert (batch.labels[0, batch.cu_seqlens[:-1].long()] == IGNORE_INDEX).all()


def test_split_pieces_and_micro_batches_by_token_budget():
    lengths = [30, 10, 25, 7, 50]
    data = dataset([list(range(1, n + 1)) for n in lengths])
    plan = bfd(data.lengths, 40)
    groups = micro_batches(plan, 64)
    assert all(plan.row_tokens[g].sum() <= 64 for g in groups)
    assert sorted(np.concatenate(groups).tolist()) == list(range(plan.num_rows))
    batch = collate_rows(data, plan, groups[0])
    assert batch.real_tokens == plan.row_tokens[groups[0]].sum()
    piece = collate_packed(data, np.array([4]), np.array([20]), np.array([10]))  # a bfd_split piece
    assert piece.input_ids[0].tolist() == list(range(21, 31)) and piece.position_ids[0, 0] == 0


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_loss_parity_with_padded_eager_forward(arch):
    model = tiny_model(arch)
    seqs = [list(range(3, 3 + n)) for n in (13, 6, 20)]
    data = dataset(seqs, prompt=3)
    use_packed_attention(model, VARLEN)
    with torch.no_grad():
        batch, hidden = run(model, data, [0, 1, 2])
    w = model.get_output_embeddings().weight
    cu = batch.cu_seqlens.tolist()
    packed = [float(chunked_loss(hidden[:, s:e], w, batch.labels[:, s:e], chunk_size=4)[0]) for s, e in zip(cu, cu[1:])]
    model.config._attn_implementation = "eager"
    pb = collate_padded(data, np.arange(3), pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=pb.input_ids, attention_mask=pb.attention_mask).logits
    ref = []
    for i in range(3):
        lg, lab = logits[i, :-1], pb.labels[i, 1:]
        ref.append(float(torch.nn.functional.cross_entropy(lg, lab, ignore_index=IGNORE_INDEX, reduction="sum")))
    np.testing.assert_allclose(packed, ref, rtol=1e-4)


def test_mixing_backends_are_refused():
    model = tiny_model("llama")
    data = dataset([[1, 2, 3], [4, 5, 6]])
    batch = collate_packed(data, np.array([0, 1]), np.zeros(2, np.int64), data.lengths)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ModelError, match="attend to each other"):
        packed_forward(model, batch)
    use_packed_attention(model, VARLEN)
    with pytest.raises(ModelError, match="use_cache"):
        packed_forward(model, batch, use_cache=True)
    q = torch.zeros(1, 4, 6, 16)
    with pytest.raises(ModelError, match="cu_seq_lens"):
        sdpa_varlen_attention(model.model.layers[0].self_attn, q, q, q, None)


class _DataDependentOps(TorchDispatchMode):
    """Records ops whose result size or value the host must read from the tensor: on CUDA each is a host sync."""

    READS = {"aten.nonzero", "aten.masked_select", "aten._local_scalar_dense"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        boolean_index = name in ("aten.index", "aten.index_put") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if name in self.READS or boolean_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_a_packed_micro_batch_reads_nothing_back_from_the_device():
    """Forward, loss and backward of a packed micro-batch that went through ``to(device)``: no op whose size or
    value depends on the data (the targets' positions and the segments' lengths are found on the host by ``to``),
    so on CUDA the host never waits inside the step until the loss and gradient norm are read."""
    from leansft.core.model.forward import LossModule
    from leansft.core.model.head import read_output_head

    model = tiny_model("qwen2").train()
    use_packed_attention(model, VARLEN)
    read_output_head(model)  # measured once when the model is built
    data = dataset([list(range(1, 30)), list(range(40, 52)), list(range(60, 81))])
    batch = collate_packed(data, np.arange(3), np.zeros(3, np.int64), data.lengths).to("cpu")
    assert batch.host_segment_sizes() == [29, 12, 21] and len(batch.host_target_index()) == batch.target_tokens
    with _DataDependentOps() as ops:
        LossModule(model)(batch).backward()
    assert ops.seen == []


def test_segment_lengths_come_from_the_host_for_that_boundaries_tensor_only():
    from leansft.core.host_read import HostRead
    from leansft.core.model.attention import remember_segment_sizes, segment_sizes

    cu = torch.tensor([0, 5, 12], device="meta")  # a device the host cannot read: the lengths must be handed over
    remember_segment_sizes(HostRead.of([5, 7], cu))
    assert segment_sizes(cu) == [5, 7]
    other = torch.tensor([0, 3, 12])
    assert segment_sizes(other) == [3, 9]  # another tensor: read from it
    remember_segment_sizes(None)  # a batch built without ``to``
    assert segment_sizes(other) == [3, 9]


def test_what_to_read_on_the_host_holds_for_those_very_tensors_only():
    """Labels or boundaries put in place of the moved ones, or edited in place, are read again (a stale target
    index would train the wrong tokens)."""
    import dataclasses

    data = dataset([list(range(1, 30)), list(range(40, 52))])
    batch = collate_packed(data, np.arange(2), np.zeros(2, np.int64), data.lengths).to("cpu")
    assert batch.host_target_index() is not None and batch.host_segment_sizes() == [29, 12]
    other = dataclasses.replace(batch, labels=batch.labels.clone(), cu_seqlens=batch.cu_seqlens.clone())
    assert other.host_target_index() is None and other.host_segment_sizes() is None
    batch.labels[0, :5] = IGNORE_INDEX
    assert batch.host_target_index() is None and batch.to("cpu").host_target_index() is not None


def test_the_cuda_choice_of_backend_follows_what_torch_and_flash_attn_offer(monkeypatch):
    """The choice is logic only (no GPU needed): bf16 on CUDA takes flash-attn when installed, else torch's varlen
    kernel, else (an older torch, as the H200 image's 2.11 may be) per-segment SDPA; fp32 takes per-segment SDPA."""
    from leansft.core.errors import ConfigError
    from leansft.core.model import attention

    cuda = torch.device("cuda")
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: None)  # no flash-attn
    monkeypatch.setattr(attention, "_torch_varlen_options", lambda: frozenset())  # no varlen module
    assert attention.choose_backend(cuda) == VARLEN
    with pytest.raises(ConfigError, match="torch.nn.attention.varlen"):
        attention.choose_backend(cuda, "torch_varlen")
    # torch 2.10's varlen_attn (causal by a flag, no scale): its kernel is not used
    monkeypatch.setattr(attention, "_torch_varlen_options", lambda: frozenset({"is_causal", "return_aux"}))
    assert attention.choose_backend(cuda) == VARLEN
    monkeypatch.setattr(attention, "_has_torch_varlen", lambda: True)
    assert attention.choose_backend(cuda) == attention.TORCH_VARLEN
    assert attention.choose_backend(cuda, half=False) == VARLEN
    assert attention.choose_backend(torch.device("cpu")) == VARLEN


def _fake_varlen_attn(enable_gqa_param: bool):
    """A CPU stand-in for ``torch.nn.attention.varlen.varlen_attn`` with torch 2.11's keywords (no
    ``enable_gqa``: it insists on as many key/value heads as query heads) or 2.13's: per-segment SDPA in fp32."""
    import torch.nn.functional as F

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False):
        assert query.dtype == torch.bfloat16 and cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
        assert window_size[1] == 0 and max_q == max_k == int(torch.diff(cu_seq_q).max())
        assert enable_gqa or key.shape[1] == query.shape[1]
        outs = []
        for a, b in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), strict=True):
            q, k, v = (x[a:b].transpose(0, 1).float() for x in (query, key, value))
            i = torch.arange(b - a)
            allowed = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] <= window_size[0])
                                                   if window_size[0] >= 0 else True)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                                       enable_gqa=enable_gqa).transpose(0, 1))
        return torch.cat(outs).to(query.dtype)

    if enable_gqa_param:
        return kernel

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):
        return kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)

    return torch_2_11


@pytest.mark.parametrize("enable_gqa_param", [False, True], ids=["torch-2.11", "torch-2.13"])
@pytest.mark.parametrize("window", [None, 3])
def test_torch_varlen_call_fits_the_installed_torch(monkeypatch, enable_gqa_param, window):
    """What ``torch_varlen_attention`` hands PyTorch's varlen kernel (CUDA only, so a CPU stand-in here): grouped
    key/value heads repeated where the kernel has no ``enable_gqa`` (torch 2.11, the H200 image's), passed as
    they are where it has; causal, scaled and windowed as per-segment SDPA attends."""
    import torch.nn.attention.varlen as varlen

    from leansft.core.model import attention

    fake = _fake_varlen_attn(enable_gqa_param)
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    monkeypatch.setattr(attention, "_torch_varlen_options", lambda: frozenset(inspect.signature(fake).parameters))
    # decided as use_packed_attention decides it for this torch (an earlier test's model left the real torch's)
    monkeypatch.setitem(attention._GQA, "mode", attention.gqa_mode(torch.device("cpu")))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 20, 16, generator=g).bfloat16().float() for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 12, 20])
    kw = dict(cu_seq_lens_q=cu, max_length_q=8, sliding_window=window)
    module = torch.nn.Module().eval()
    got, _ = attention.torch_varlen_attention(module, q, k, v, None, scaling=0.3, **kw)
    want, _ = sdpa_varlen_attention(module, q, k, v, None, scaling=0.3, **kw)
    assert got.shape == want.shape == (1, 20, 4, 16) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-2, rtol=0)
