"""Gradient clipping: the total norm exact on large gradients (torch's CPU kernel drifts), the clip applied."""

import torch

from leansft.core.model.grad_clip import ROW, clip_gradients


def _params(*shapes: tuple[int, ...]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g) * 1e-3 + 1e-4
        params.append(p)
    return params


def _fp64_norm(params) -> float:
    return float(torch.cat([p.grad.double().reshape(-1) for p in params]).norm())


def test_total_norm_is_exact_on_an_embedding_sized_gradient():
    # SmolLM2's embedding (28M elements) plus a tail that is no multiple of ROW and a few small tensors:
    # torch.nn.utils.clip_grad_norm_ is 1.5e-3 off here on the CPU (torch 2.13).
    params = _params((49152, 576), (3 * ROW + 5,), (576,), (7, 3))
    ref = _fp64_norm(params)
    norm = clip_gradients(params, None)
    assert norm.dtype == torch.float32
    assert abs(float(norm) - ref) / ref < 1e-6
    assert abs(_fp64_norm(params) - ref) < 1e-12  # max_norm None: nothing scaled


def test_clipping_scales_to_max_norm_and_leaves_small_gradients_alone():
    params = _params((300, 100), (ROW + 1,), (10,))
    before = [p.grad.clone() for p in params]
    ref = _fp64_norm(params)
    norm = clip_gradients(params, ref / 4)
    assert abs(float(norm) - ref) / ref < 1e-6
    assert abs(_fp64_norm(params) - ref / 4) / (ref / 4) < 1e-5
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b / 4, rtol=1e-5, atol=0)
    unclipped = [p.grad.clone() for p in params]
    clip_gradients(params, ref)  # already under: unchanged up to the 1e-6 guard of the clip factor
    for p, b in zip(params, unclipped):
        torch.testing.assert_close(p.grad, b, rtol=1e-5, atol=0)


def test_a_non_finite_gradient_is_clipped_as_torch_clips_it():
    ours, theirs = _params((ROW * 2,), (5,)), _params((ROW * 2,), (5,))
    for params in (ours, theirs):
        params[0].grad[3] = float("inf")
    norm = clip_gradients(ours, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert torch.isinf(norm) and torch.isinf(ref)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, equal_nan=True)
