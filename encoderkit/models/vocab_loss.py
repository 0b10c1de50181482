"""Cross-entropy over a vocabulary's logits, a slice of rows at a time.

A masked-LM step's (M, V) logits are its largest tensor: upcasting all of them, log-softmaxing, differentiating
and scanning them again for the accuracy is a large share of the step. Here each slice is upcast into one reused
fp32 buffer, and its loss, accuracy and gradient ``(softmax - one_hot) / M`` (in the logits' dtype) come from one
pass. The loss is ``F.cross_entropy(logits.float(), targets)``'s, to float rounding.
"""

from __future__ import annotations

import torch

SLICE = 1 << 21  # fp32 values per slice (8 MB; 68 rows of a 30,522-word vocabulary): the fastest size timed


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, want_grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        m = logits.shape[0]
        total = torch.zeros((), dtype=torch.float64)
        correct = torch.zeros((), dtype=torch.long)
        grad = torch.empty_like(logits) if want_grad else None
        # one fp32 slice, filled again for every slice: a fresh large tensor costs its page faults
        step = max(1, SLICE // logits.shape[1])
        work = torch.empty((min(step, m), logits.shape[1]), dtype=torch.float32)
        for start in range(0, m, step):
            rows = logits[start:start + step]
            x = work[:rows.shape[0]]
            x.copy_(rows)
            t = targets[start:start + step, None]
            top = x.amax(dim=-1, keepdim=True)
            target = x.gather(1, t)
            correct += (target >= top).sum()  # a tie counts as right
            p = x.sub_(top).exp_()  # one exp: softmax numerators, shifted for range
            sums = p.sum(dim=-1, keepdim=True)
            total += (sums.log() + top - target).sum(dtype=torch.float64)
            if grad is not None:
                p.div_(sums * m)
                p.scatter_add_(1, t, torch.full(t.shape, -1.0 / m, dtype=p.dtype))
                grad[start:start + step] = p
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return (total / m).to(torch.float32), correct

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if grad_loss.numel() == 1 and float(grad_loss) == 1.0:  # the usual case: no (M, V) product to write
            return grad, None, None
        return grad * grad_loss.to(grad.dtype), None, None


def vocab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, correct)`` of ``logits`` (M, V) against ``targets`` (M,): the fp32 mean cross-entropy and how
    many rows have their target's logit the largest (ties count as right). No row is ignored: pass only
    the labelled rows. ``M = 0`` gives a NaN loss (0 / 0), as ``F.cross_entropy`` does."""
    want_grad = torch.is_grad_enabled() and logits.requires_grad
    return _VocabCrossEntropy.apply(logits, targets, want_grad)
