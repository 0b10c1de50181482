"""The sliced vocabulary cross-entropy gives F.cross_entropy's loss and gradient and the max-logit accuracy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from encoderkit.models import vocab_loss
from encoderkit.models.vocab_loss import vocab_cross_entropy


def reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    x = logits.float()
    correct = int((x.gather(1, targets[:, None]).squeeze(1) >= x.max(-1).values).sum())
    return F.cross_entropy(x, targets), correct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slice_values", [1 << 21, 50, 7])  # one slice; several with a short last one; a row each
def test_loss_gradient_and_accuracy_match_cross_entropy(dtype, slice_values, monkeypatch) -> None:
    monkeypatch.setattr(vocab_loss, "SLICE", slice_values)
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(13, 11, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 11, (13,), generator=g)
    targets[:4] = base[:4].float().argmax(-1)  # some rows right, so the count is not trivially 0
    ours_in, ref_in = base.clone().requires_grad_(), base.clone().requires_grad_()
    loss, correct = vocab_cross_entropy(ours_in, targets)
    ref_loss, ref_correct = reference(ref_in, targets)
    assert loss.dtype == torch.float32 and float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    assert int(correct) == ref_correct >= 4
    (loss * 3).backward()  # a gradient other than 1 flows in
    (ref_loss * 3).backward()
    assert ours_in.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours_in.grad.float(), ref_in.grad.float(), atol=tol, rtol=tol)
    assert torch.equal(ours_in.detach(), base)  # the caller's logits are untouched


def test_a_tie_counts_as_right_and_no_rows_give_nan() -> None:
    logits = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]])
    _, correct = vocab_cross_entropy(logits, torch.tensor([1, 0]))
    assert int(correct) == 1
    loss, correct = vocab_cross_entropy(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    assert torch.isnan(loss) and int(correct) == 0


def test_without_gradient_no_gradient_buffer_is_made() -> None:
    logits = torch.randn(5, 7, requires_grad=True)
    with torch.no_grad():
        loss, _ = vocab_cross_entropy(logits, torch.zeros(5, dtype=torch.long))
    assert not loss.requires_grad
    assert float(loss) == pytest.approx(float(F.cross_entropy(logits.detach(), torch.zeros(5, dtype=torch.long))),
                                        rel=1e-6)
