"""The output layer and the vocab-parallel cross entropy in one pass over sequence chunks.

Untiled, a training step holds the [s, b, v/tp] logits (and their fp32 softmax, kept for
backward) at once: at s = 8192 and a 32000 vocabulary that is 1 GiB per copy, more than the
rest of a small model's step. Here the loss is computed ``chunk_size`` sequence positions at
a time: each chunk's logits are formed, reduced to a per-token loss with the same three TP
all-reduces as :mod:`cross_entropy`, and dropped. Backward recomputes each chunk's logits
from the saved hidden states (one extra output-layer matmul per step) and turns them into
that chunk's share of the hidden-state gradient and of the output weight's gradient. What
is kept between forward and backward is the hidden states [s, b, h] and two numbers per
token (the logits' max and the sum of their exponentials), never a [.., v/tp] tensor.

The same function under every layout: the caller hands it the hidden states as every TP
rank's output matmul sees them (gathered over SP, or copied into the TP region, by the usual
mappings, whose backward reduces the hidden-state gradient), CP needs nothing (the loss is
per token), and padded vocabulary entries are -inf, as in the untiled path.
"""
import torch
import torch.nn.functional as F

from megatron_cp.tensor_parallel.cross_entropy import local_targets, logits_grad_, loss_and_exp
from megatron_cp.tensor_parallel.layers import mask_padded_vocab


class _TiledVocabParallelCrossEntropy(torch.autograd.Function):
    """forward: per-token loss [s, b] of logits h W^T, chunk by chunk over s.
    backward: per chunk, recompute the logits and form (softmax - onehot) * grad, then
    grad_h = g W and grad_W += g^T h; no [s, b, v/tp] tensor in either direction."""

    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_size, group, chunk_size):
        # hidden [s, b, h]; weight [v/tp, h]; target [s, b]
        seq = hidden.shape[0]
        loss = hidden.new_empty(target.shape, dtype=torch.float32)  # [s, b]
        logits_max = torch.empty_like(loss)
        sum_exp = torch.empty_like(loss)
        local_target, outside = local_targets(target, weight.shape[0], group)
        for start in range(0, seq, chunk_size):
            piece = slice(start, min(start + chunk_size, seq))
            logits = _chunk_logits(hidden[piece], weight, vocab_size, group)  # [c, b, v/tp]
            loss[piece], _, logits_max[piece], sum_exp[piece] = loss_and_exp(
                logits, local_target[piece], outside[piece], group, in_place=True)
        ctx.save_for_backward(hidden, weight, local_target, outside, logits_max, sum_exp)
        ctx.vocab_size, ctx.group, ctx.chunk_size = vocab_size, group, chunk_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local_target, outside, logits_max, sum_exp = ctx.saved_tensors
        seq, hidden_size = hidden.shape[0], hidden.shape[-1]
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) \
            if ctx.needs_input_grad[0] else None  # [s, b, h]
        # the weight's gradient sums over every chunk: in fp32 whatever the weight's dtype
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, seq, ctx.chunk_size):
            piece = slice(start, min(start + ctx.chunk_size, seq))
            logits = _chunk_logits(hidden[piece], weight, ctx.vocab_size, ctx.group)
            softmax = logits.sub_(logits_max[piece].unsqueeze(-1)).exp_().div_(
                sum_exp[piece].unsqueeze(-1))  # [c, b, v/tp], as the untiled forward forms it
            grad = logits_grad_(softmax, local_target[piece], outside[piece], grad_loss[piece])
            grad = grad.to(hidden.dtype).flatten(0, 1)  # [c*b, v/tp]
            h = hidden[piece].flatten(0, 1)  # [c*b, h]
            if grad_hidden is not None:
                torch.mm(grad, weight, out=grad_hidden[piece].view(-1, hidden_size))
            if grad_weight is not None:
                if grad.dtype == torch.float32:
                    grad_weight.addmm_(grad.t(), h)
                else:
                    grad_weight += (grad.t() @ h).float()  # [v/tp, h]
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _chunk_logits(hidden, weight, vocab_size, group):
    """fp32 logits [c, b, v/tp] of one chunk, padded vocabulary entries -inf."""
    logits = F.linear(hidden, weight).float()  # [c, b, v/tp]
    return mask_padded_vocab(logits, vocab_size, group)


def tiled_vocab_parallel_cross_entropy(hidden, weight, target, vocab_size, tp_group, chunk_size):
    """Per-token cross entropy [s, b] of the logits ``hidden`` [s, b, h] @ ``weight``^T
    ([v/tp, h], this rank's vocabulary slice) against ``target`` [s, b], ``chunk_size``
    sequence positions at a time; entries at and past ``vocab_size`` are padding."""
    return _TiledVocabParallelCrossEntropy.apply(hidden, weight, target, vocab_size, tp_group,
                                                 chunk_size)
