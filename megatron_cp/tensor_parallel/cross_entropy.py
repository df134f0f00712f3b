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
        vocab_local = logits.shape[-1]
        rank = dist.get_rank(group) if group is not None else 0
        start = rank * vocab_local
        logits_max = logits.max(dim=-1).values  # [s, b]
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)
        shifted = logits - logits_max.unsqueeze(-1)  # [s, b, v/tp]
        local_target = target - start
        outside = (local_target < 0) | (local_target >= vocab_local)
        local_target = local_target.masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [s, b]
        predicted = predicted.masked_fill(outside, 0.0)
        _all_reduce(predicted, dist.ReduceOp.SUM, group)
        exp = shifted.exp_()  # [s, b, v/tp], reused as softmax numerator
        sum_exp = exp.sum(dim=-1)  # [s, b]
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        loss = sum_exp.log() - predicted
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # reuse the buffer: [s, b, v/tp]
        onehot = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(logits, target, tp_group):
    """Per-token cross entropy [s, b] of vocab-parallel ``logits`` [s, b, v/tp] and ``target`` [s, b]."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)
