"""Cross-entropy over a vocabulary's logits, a slice of rows at a time.

A masked-LM step's (M, V) logits are the largest tensor of the step (4,096 tokens x 15 % x 30,522 words:
18.7 M values). Cast to fp32, log-softmaxed, differentiated, cast back to bf16 and scanned again for the
accuracy, they cost ~130 ms of a 880 ms pretraining step on 2 threads of an AMX Xeon (4 x 256 BERT, 32 x 128;
the profile: fp32 copies 50 ms, log-softmax 29 ms, its backward 33 ms, max 15 ms; a fresh 75 MB tensor pays
its page faults). :func:`vocab_cross_entropy` reads them a slice of rows at a time through one reused fp32
buffer: 614 x 30,522 bf16 logits, loss and gradient, 42-50 ms against 220-250 ms for ``F.cross_entropy(
logits.float(), targets)`` + its backward + the max. Each slice is upcast to fp32, its
log-sum-exp, target logit and largest logit are taken, and where a gradient is wanted it is formed in the
same pass, ``(softmax - one_hot) / M``, and kept in the logits' dtype (the dtype the gradient flows back
in anyway: a bf16 decoder matmul receives a bf16 gradient). The loss is the fp32 mean cross-entropy, as
``F.cross_entropy(logits.float(), targets)`` gives it, to float rounding.
"""

from __future__ import annotations

import torch

SLICE = 1 << 21  # fp32 values per slice (8 MB; 68 rows of a 30,522-word vocabulary): measured 49 ms for the
# loss above with 64 rows, 42-50 with 128, 48-66 with 256, 62 with 32, 114 with 8


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, want_grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        m = logits.shape[0]
        total = torch.zeros((), dtype=torch.float64)
        correct = torch.zeros((), dtype=torch.long)
        grad = torch.empty_like(logits) if want_grad else None
        # one fp32 slice, filled again for every slice: a fresh large tensor costs its page faults
        # (an upcast of all 614 x 30,522 logits: 42 ms, against 9 ms for the same copy into memory in use)
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
        if grad_loss.numel() == 1 and float(grad_loss) == 1.0:  # the usual case: no 37 MB product to write
            return grad, None, None
        return grad * grad_loss.to(grad.dtype), None, None


def vocab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, correct)`` of ``logits`` (M, V) against ``targets`` (M,): the fp32 mean cross-entropy and how
    many rows have their target's logit the largest (ties count as right). No row is ignored: pass only
    the labelled rows. ``M = 0`` gives a NaN loss (0 / 0), as ``F.cross_entropy`` does."""
    want_grad = torch.is_grad_enabled() and logits.requires_grad
    return _VocabCrossEntropy.apply(logits, targets, want_grad)
