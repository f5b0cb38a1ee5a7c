"""The chunked LM-head cross-entropy (dstrain/models/chunked_loss.py) against the reference computation,
torch's `F.cross_entropy(F.linear(h, W, b).float(), labels, ignore_index=-100)`: the loss and the
gradients w.r.t. the hidden states, the weight and the bias.

Tolerances: fp32, relative 1e-5 (the sums run in another order); bf16, the loss to 1e-3 relative (both
reduce in fp32) and the gradients to 2e-2 relative of their largest element (one bf16 rounding of the
gradient of the logits, as in the reference, plus the weight gradient's sum over chunks, which here runs
in fp32 and there in bf16 matrix products)."""

import pytest
import torch
import torch.nn.functional as F

from dstrain.models.chunked_loss import LMHeadLoss, chunked_cross_entropy, reference_cross_entropy


def _case(rows=37, width=16, vocab=101, dtype=torch.float32, bias=False, ignore=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, width, generator=g) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (rows,), generator=g)
    for row in ignore:
        labels[row] = -100
    return hidden, weight, b, labels


def _loss_and_grads(fn, hidden, weight, bias, labels, **kwargs):
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    for t in inputs:
        t.grad = None
    loss = fn(hidden, weight, labels, bias=bias, **kwargs)
    loss.backward()
    return loss.detach(), [t.grad.clone() for t in inputs]


def _close(got, want, rel):
    scale = want.abs().max().clamp_min(1e-12)
    assert (got.float() - want.float()).abs().max() <= rel * scale, (got, want)


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_the_reference_for_any_chunk(chunk, bias):
    hidden, weight, b, labels = _case(bias=bias, ignore=(0, 3, 36))
    want, want_grads = _loss_and_grads(reference_cross_entropy, hidden, weight, b, labels)
    got, grads = _loss_and_grads(chunked_cross_entropy, hidden, weight, b, labels, chunk=chunk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for g, w in zip(grads, want_grads):
        _close(g, w, 1e-5)


def test_bf16_matches_the_reference_within_bf16_rounding():
    hidden, weight, b, labels = _case(rows=64, width=32, vocab=257, dtype=torch.bfloat16, ignore=(1, 2))
    want, want_grads = _loss_and_grads(reference_cross_entropy, hidden, weight, b, labels)
    got, grads = _loss_and_grads(chunked_cross_entropy, hidden, weight, b, labels, chunk=24)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
    for g, w in zip(grads, want_grads):
        assert g.dtype == torch.bfloat16
        _close(g, w, 2e-2)


def test_a_chunk_whose_labels_are_all_ignored_adds_nothing():
    hidden, weight, b, labels = _case(rows=30, ignore=range(10, 20))
    want, want_grads = _loss_and_grads(reference_cross_entropy, hidden, weight, b, labels)
    got, grads = _loss_and_grads(chunked_cross_entropy, hidden, weight, b, labels, chunk=10)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert grads[0][10:20].abs().max() == 0  # no gradient reaches the ignored rows' hidden states
    for g, w in zip(grads, want_grads):
        _close(g, w, 1e-5)


def test_vocabulary_not_a_multiple_of_anything_and_batched_inputs():
    """[batch, seq, width] hidden states with [batch, seq] labels: flattened as the reference does."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 7, 8, generator=g, requires_grad=True)
    weight = torch.randn(997, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 997, (3, 7), generator=g)
    want, want_grads = _loss_and_grads(reference_cross_entropy, hidden, weight, None, labels)
    got, grads = _loss_and_grads(chunked_cross_entropy, hidden, weight, None, labels, chunk=4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for g_, w in zip(grads, want_grads):
        _close(g_, w, 1e-5)


def test_the_incoming_gradient_scales_every_gradient():
    """DeepSpeed's backward divides the loss by the accumulation steps (and fp16 multiplies it by the loss
    scale): the stored gradients are scaled by the incoming one."""
    hidden, weight, b, labels = _case()
    ref = reference_cross_entropy(hidden, weight, labels) * 0.25
    ref.backward()
    want = [hidden.grad.clone(), weight.grad.clone()]
    hidden.grad = weight.grad = None
    (chunked_cross_entropy(hidden, weight, labels, chunk=8) * 0.25).backward()
    _close(hidden.grad, want[0], 1e-5)
    _close(weight.grad, want[1], 1e-5)


def test_a_frozen_weight_gets_no_gradient_and_no_grad_mode_computes_none():
    hidden, weight, _, labels = _case()
    weight.requires_grad_(False)
    loss = chunked_cross_entropy(hidden, weight, labels, chunk=8)
    loss.backward()
    assert weight.grad is None and hidden.grad is not None
    with torch.no_grad():
        again = chunked_cross_entropy(hidden, weight, labels, chunk=8)
    torch.testing.assert_close(again, loss.detach())


def test_every_label_ignored_gives_nan_as_the_reference():
    hidden, weight, b, labels = _case(rows=6, ignore=range(6))
    assert torch.isnan(reference_cross_entropy(hidden, weight, labels))
    assert torch.isnan(chunked_cross_entropy(hidden, weight, labels, chunk=4))


def test_a_second_backward_is_refused():
    hidden, weight, _, labels = _case()
    loss = chunked_cross_entropy(hidden, weight, labels, chunk=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once"):
        loss.backward()


def test_lm_head_loss_leaves_the_state_dict_unchanged():
    """The head is the model's own module, not a second copy: no new state_dict key."""
    head = torch.nn.Linear(8, 11, bias=False)
    model = torch.nn.Module()
    model.head = head
    model.loss = LMHeadLoss(head, chunk=3)
    assert list(model.state_dict()) == ["head.weight"]
    hidden = torch.randn(5, 8)
    labels = torch.randint(0, 11, (5,))
    torch.testing.assert_close(model.loss(hidden, labels), reference_cross_entropy(hidden, head.weight, labels),
                               rtol=1e-5, atol=0)


def test_autocast_over_fp32_weights_matches_the_reference_under_autocast():
    """mixed_precision autocast (and the suite's torch runner): fp32 weights and hidden states, products in
    bf16; the gradients come back in fp32, within bf16 rounding of the reference's."""
    hidden, weight, b, labels = _case(rows=48, width=32, vocab=211, bias=True, ignore=(4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = _loss_and_grads(reference_cross_entropy, hidden, weight, b, labels)
        got, grads = _loss_and_grads(chunked_cross_entropy, hidden, weight, b, labels, chunk=20)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
    for g, w in zip(grads, want_grads):
        assert g.dtype == torch.float32
        _close(g, w, 2e-2)


def test_the_sum_reduction_is_the_references_sum_and_zero_where_every_label_is_ignored():
    hidden, weight, b, labels = _case(rows=30, vocab=50, ignore=range(7))
    summed = lambda h, w, y, bias=None: torch.nn.functional.cross_entropy(  # noqa: E731
        F.linear(h, w, bias).float(), y, reduction="sum")
    want, want_grads = _loss_and_grads(summed, hidden, weight, b, labels)
    got, grads = _loss_and_grads(chunked_cross_entropy, hidden, weight, b, labels, chunk=8, reduction="sum")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for g, w in zip(grads, want_grads):
        _close(g, w, 1e-5)
    none = chunked_cross_entropy(hidden, weight, torch.full((30,), -100), chunk=8, reduction="sum")
    assert none.item() == 0.0
