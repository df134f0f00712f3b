"""The dense MLP: column-parallel fc1, GeLU, SwiGLU or squared ReLU, row-parallel fc2 (also
the MoE layer's shared experts, with their own hidden size; the routed experts share
:func:`activate`)."""
import torch
import torch.nn.functional as F

from megatron_cp import tensor_parallel as tpar


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of h = [gate | up] (halves of the last dim).

    Backward writes d gate and d up straight into the two halves of one gradient buffer (no
    ``torch.cat``), and only h is saved: autograd's own graph would also keep silu(gate), one
    more [s, b, ffn/tp] tensor per layer.
    """

    @staticmethod
    def forward(ctx, h):
        gate, up = h.chunk(2, dim=-1)  # views, [s, b, ffn/tp] each
        ctx.save_for_backward(h)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        if torch.compiler.is_compiling():  # no out= into a strided view; inductor fuses the cat
            return torch.cat((torch.ops.aten.silu_backward(grad * up, gate), F.silu(gate) * grad),
                             dim=-1)
        grad_h = torch.empty_like(h)  # [s, b, 2 ffn/tp]
        grad_gate, grad_up = grad_h.chunk(2, dim=-1)
        torch.mul(F.silu(gate), grad, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_h


def swiglu(h):
    """SwiGLU of h [..., 2 f] stacked as [gate | up] -> [..., f]."""
    return _SwiGLU.apply(h)


def activate(h, activation):
    """The MLP's non-linearity of fc1's output ``h`` [..., f] (SwiGLU: [..., 2 f]): ``gelu``
    (exact, erf), ``gelu_tanh`` (tanh approximation), ``swiglu`` or ``squared_relu`` (relu(h)^2, Megatron-LM's ``--squared-relu``,
    which it allows only without a gated unit)."""
    if activation == "swiglu":
        return swiglu(h)
    if activation == "squared_relu":
        return F.relu(h).square()
    if activation == "gelu_tanh":  # Megatron-LM's bias-GELU fusion (its default with biases)
        return F.gelu(h, approximate="tanh")
    return F.gelu(h)


class MLP(torch.nn.Module):
    """[s, b, h] -> [s, b, h]; ffn split over TP. SwiGLU's fc1 stacks [gate; up] (stride 2)."""

    def __init__(self, config, prefix, tp_group, device=None, ffn_hidden_size=None):
        super().__init__()
        self.activation = config.activation
        self.swiglu = config.activation == "swiglu"
        ffn, std = ffn_hidden_size or config.ffn_hidden_size, config.hidden_init_std
        common = dict(tp_group=tp_group, bias=config.add_bias_linear,
                      sequence_parallel=config.sequence_parallel,
                      tp_comm_overlap=tpar.overlap_from_config(config),
                      params_dtype=config.params_dtype, device=device)
        self.linear_fc1 = tpar.ColumnParallelLinear(
            config.hidden_size, ffn * (2 if self.swiglu else 1), init_method=tpar.normal_init(std),
            seed=tpar.init_seed(config.seed, prefix + ".linear_fc1"), stride=2 if self.swiglu else 1,
            **common)
        self.linear_fc2 = tpar.RowParallelLinear(
            ffn, config.hidden_size,
            init_method=tpar.normal_init(tpar.scaled_init_std(std, config.num_layers)),
            seed=tpar.init_seed(config.seed, prefix + ".linear_fc2"), **common)

    def forward(self, x):
        h = self.linear_fc1(x)  # [s, b, ffn/tp (x2 for swiglu)]
        h = activate(h, self.activation)  # [s, b, ffn/tp]
        return self.linear_fc2(h)


def chunked_mlp(mlp, x, num_chunks, rng_tracker):
    """``mlp`` over ``x`` [s(/tp), b, h] in min(num_chunks, s) sequence chunks, each one
    recomputed in backward (--mlp-chunks-for-training): the MLP is per token, so the result is
    the whole-sequence one, while only one chunk's [c, b, ffn/tp] intermediates are alive at
    a time. Under SP every TP rank chunks its own s/tp tokens alike, so each chunk's gather
    and reduce-scatter over TP pair up."""
    pieces = x.chunk(min(num_chunks, x.shape[0]), dim=0)  # [c, b, h] each
    return torch.cat([tpar.checkpoint(mlp, rng_tracker, piece) for piece in pieces], dim=0)
