"""The dense MLP: column-parallel fc1, GeLU or SwiGLU, row-parallel fc2."""
import torch
import torch.nn.functional as F

from megatron_cp import tensor_parallel as tpar


class MLP(torch.nn.Module):
    """[s, b, h] -> [s, b, h]; ffn split over TP. SwiGLU's fc1 stacks [gate; up] (stride 2)."""

    def __init__(self, config, prefix, tp_group, device=None):
        super().__init__()
        self.swiglu = config.activation == "swiglu"
        ffn, std = config.ffn_hidden_size, config.init_method_std
        common = dict(tp_group=tp_group, bias=config.add_bias_linear,
                      sequence_parallel=config.sequence_parallel,
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
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)
