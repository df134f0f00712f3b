"""Cross entropy over vocab-parallel logits, without gathering the full vocabulary.

Each TP rank holds logits for its vocab range [start, end). The loss per token is
log(sum_v exp(z_v)) - z_target, computed stably with the global max: three small
all-reduces over TP (max, target logit, sum of exponentials) of size [s, b].
"""
import torch
import torch.distributed as dist


def _all_reduce(x, op, group):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: per-token loss [s, b]; backward: (softmax - onehot(target)) * grad, locally."""

    @staticmethod
    def forward(ctx, logits, target, group):
        # logits [s, b, v/tp] (any float dtype; math in fp32); target [s, b]
        logits = logits.float()
        local_target, outside = local_targets(target, logits.shape[-1], group)
        loss, exp, logits_max, sum_exp = loss_and_exp(logits, local_target, outside, group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        return logits_grad_(softmax, local_target, outside, grad_loss), None, None


def local_targets(target, vocab_local, group):
    """(index into this rank's vocab slice [s, b], mask of the tokens whose target lies in
    another rank's slice [s, b]); outside tokens get index 0, which the mask then cancels."""
    rank = dist.get_rank(group) if group is not None else 0
    local_target = target - rank * vocab_local
    outside = (local_target < 0) | (local_target >= vocab_local)
    return local_target.masked_fill(outside, 0), outside


def loss_and_exp(logits, local_target, outside, group, in_place=False):
    """Per-token loss of fp32 vocab-parallel ``logits`` [s, b, v/tp] (overwritten when
    ``in_place``, else left as they are): returns (loss [s, b], exp(logits - max)
    [s, b, v/tp], max [s, b], sum of the exponentials over the whole vocabulary [s, b]).
    Three all-reduces over TP of [s, b]."""
    logits_max = logits.max(dim=-1).values  # [s, b]
    _all_reduce(logits_max, dist.ReduceOp.MAX, group)
    shifted = logits.sub_(logits_max.unsqueeze(-1)) if in_place else \
        logits - logits_max.unsqueeze(-1)  # [s, b, v/tp]
    predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [s, b]
    predicted = predicted.masked_fill(outside, 0.0)
    _all_reduce(predicted, dist.ReduceOp.SUM, group)
    exp = shifted.exp_()  # [s, b, v/tp], reused as softmax numerator
    sum_exp = exp.sum(dim=-1)  # [s, b]
    _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
    return sum_exp.log() - predicted, exp, logits_max, sum_exp


def logits_grad_(softmax, local_target, outside, grad_loss):
    """d loss / d logits = (softmax - onehot(target)) * grad_loss, formed in ``softmax``'s
    buffer [s, b, v/tp] (the target's one lives on the rank whose slice holds it)."""
    onehot = (~outside).to(softmax.dtype)
    softmax.scatter_add_(-1, local_target.unsqueeze(-1), -onehot.unsqueeze(-1))
    return softmax.mul_(grad_loss.unsqueeze(-1))


def vocab_parallel_cross_entropy(logits, target, tp_group):
    """Per-token cross entropy [s, b] of vocab-parallel ``logits`` [s, b, v/tp] and ``target`` [s, b]."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)
