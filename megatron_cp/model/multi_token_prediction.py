"""Multi-token prediction (DeepSeek-V3, Megatron-LM's ``--mtp-num-layers``).

Depth k (1..D) predicts the token k+1 positions ahead. It takes depth k-1's hidden states
``h`` (depth 0: the decoder's output after its final norm) and the embedding of the token k
positions ahead, and runs::

    h_k = final_norm_k(layer_k(eh_proj_k([enorm_k(embed(tokens_k)), hnorm_k(h_{k-1})])))
    loss_k = sum(mask_k * CE(output_layer(h_k), labels_k)) / N_k

with the model's own word embedding and output layer (shared, not copies), ``eh_proj`` a
column-parallel [2h -> h] projection whose output is gathered over TP (Megatron-LM's), and
``layer_k`` one transformer layer of the last decoder layer's kind (its attention and dense
MLP or MoE), rotated with the decoder's position ids. ``tokens_k``, ``labels_k`` and
``mask_k`` are the batch's tokens, labels and loss mask moved k positions left inside each
document (data/batch.py: :func:`~megatron_cp.data.batch.add_mtp_targets`), so the shift is
made once, in global order, before padding and the CP split: it is exact under every CP
type and never crosses a document.

The training objective adds each depth's loss weighted as Megatron-LM weights it: in one
microbatch on its own, ``mtp_loss_scaling_factor / D * sum_k loss_k`` with ``loss_k`` the
depth's mean over its ``N_k`` loss-masked tokens; in training, the weight of each
microbatch's masked sum comes with the batch (Megatron-LM's default or
``--calculate-per-token-loss``, with counts over the whole microbatch:
:mod:`megatron_cp.pipeline_parallel.loss_weighting`), so it does not change with TP, CP, DP,
PP or EP. The MTP loss reaches backward through
:class:`~megatron_cp.moe.balancing.AttachLoss` on the model's output (Megatron-LM's
MTPLossAutoScaler), so the forward value (the LM loss) is unchanged.
"""
import torch

from megatron_cp import tensor_parallel as tpar
from megatron_cp.fp8 import attach_fp8
from megatron_cp.layers.norms import norm_for
from megatron_cp.model.transformer import TransformerLayer, mark_sequence_parallel
from megatron_cp.moe.balancing import AttachLoss


class MultiTokenPredictionLayer(torch.nn.Module):
    """One MTP depth: [s(/tp), b, h] hidden states and token embeddings -> [s(/tp), b, h]."""

    def __init__(self, config, depth, tp_group, cp_group, rng_tracker, device=None, state=None):
        super().__init__()
        prefix = f"mtp.layers.{depth}"
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and tp_group is not None and \
            torch.distributed.get_world_size(tp_group) > 1
        self.enorm = norm_for(config, config.hidden_size, device)
        self.hnorm = norm_for(config, config.hidden_size, device)
        self.eh_proj = tpar.ColumnParallelLinear(
            2 * config.hidden_size, config.hidden_size, tp_group=tp_group,
            init_method=tpar.normal_init(config.init_method_std),
            seed=tpar.init_seed(config.seed, prefix + ".eh_proj"), bias=False,
            sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
            device=device)
        # numbered after the decoder's layers: its own attention-dropout stream and MoE stats
        self.mtp_model_layer = TransformerLayer(
            config, config.num_layers + depth, tp_group, cp_group, rng_tracker, device,
            state=state, prefix=prefix + ".mtp_model_layer", kind_of=config.num_layers - 1)
        self.final_layernorm = norm_for(config, config.hidden_size, device)
        for norm in (self.enorm, self.hnorm, self.final_layernorm):
            mark_sequence_parallel(norm, config.sequence_parallel)
        if config.fp8:  # Megatron-LM runs MTP under its global FP8 context, whatever the layer
            attach_fp8(self, config, tp_group, cp_group)

    def forward(self, h, embedded, position_ids, token_index, document_ids, loss_mask,
                dropout_ids, site_number=None, layout=None):
        x = torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)  # [s(/tp), b, 2h]
        x = self.eh_proj(x)  # [s, b, h/tp]
        x = tpar.gather_from_tensor_model_parallel_region(x, self.tp_group)  # [s, b, h]
        if self.sequence_parallel:
            x = tpar.scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
        x = self.mtp_model_layer(x, position_ids, token_index, document_ids, loss_mask,
                                 dropout_ids, site_number, layout=layout)
        return self.final_layernorm(x)


class MultiTokenPrediction(torch.nn.Module):
    """The D MTP depths of a model's last pipeline stage (one layer for all of them with
    ``--mtp-use-repeated-layer``), and what each step of training reads of them."""

    def __init__(self, config, tp_group, cp_group, rng_tracker, device=None, state=None):
        super().__init__()
        self.num_depths = config.mtp_num_layers
        self.first_layer_number = config.num_layers  # depth d's layer: num_layers + d
        self.weight = config.mtp_loss_scaling_factor / self.num_depths
        built = 1 if config.mtp_use_repeated_layer else self.num_depths
        self.layers = torch.nn.ModuleList(
            MultiTokenPredictionLayer(config, d, tp_group, cp_group, rng_tracker, device, state)
            for d in range(built))
        self.loss_sums = None  # [D] masked CE sums of the microbatches run since the last step

    def prepare_layout(self, layout, length, device):
        """What the MTP layers' attention will look up, worked out in the microbatch's
        SequenceLayout before any layer runs (see TransformerBlock.prepare_layout)."""
        for layer in self.layers:
            layer.mtp_model_layer.prepare_layout(layout, length, device)

    def forward(self, output, h, embed, loss_fn, targets, position_ids, token_index=None,
                document_ids=None, loss_mask=None, dropout_ids=None, layout=None):
        """``output``: the model's per-token LM loss [b, s], returned with every depth's loss
        attached for backward. ``h`` [s(/tp), b, h]: the decoder's normed output. ``embed``:
        (tokens [b, s], depth 1..D) -> [s(/tp), b, h] through the shared word embedding (each
        depth its own dropout site); ``loss_fn``:
        (hidden, labels) -> per-token loss [b, s] through the shared output layer.
        ``targets``: one (tokens, labels, loss mask [b, s], weight) per depth: the weight
        multiplies the depth's masked loss sum in backward (None: Megatron-LM's objective of
        this microbatch alone, the factor / D times the mean over its loss tokens)."""
        if len(targets) != self.num_depths:
            raise ValueError(f"the batch holds MTP targets for {len(targets)} depths but "
                             f"mtp_num_layers is {self.num_depths}; build the batch with "
                             f"add_mtp_targets(batch, {self.num_depths})")
        sums = []
        for depth, (tokens, labels, mask, weight) in enumerate(targets):
            layer = self.layers[depth % len(self.layers)]
            # a repeated layer draws each depth's dropout apart: numbered as that depth's own
            number = self.first_layer_number + depth
            h = layer(h, embed(tokens, depth + 1), position_ids, token_index, document_ids,
                      loss_mask, dropout_ids, number, layout=layout)
            loss_sum = (loss_fn(h, labels) * mask).sum()
            if weight is None:
                output = AttachLoss.apply(output, loss_sum / mask.sum().clamp(min=1.0),
                                          self.weight)
            else:
                output = AttachLoss.apply(output, loss_sum, weight)
            sums.append(loss_sum.detach())
        sums = torch.stack(sums).float()  # [D]
        self.loss_sums = sums if self.loss_sums is None else self.loss_sums + sums
        return output


def mtp_blocks(model_chunks):
    """The MTP modules of this rank's model chunks (one on a last stage, else none)."""
    return [m for chunk in model_chunks for m in chunk.modules()
            if isinstance(m, MultiTokenPrediction)]


def reset_loss_sums(model_chunks):
    """Before a step's microbatches: the loss sums the step will report start from zero."""
    for block in mtp_blocks(model_chunks):
        block.loss_sums = None


def local_loss_sums(model_chunks, num_depths, device):
    """[D] this rank's masked MTP cross-entropy sums since :func:`reset_loss_sums` (zeros on a
    rank without MTP layers), to be summed over DP x CP and PP."""
    sums = torch.zeros(num_depths, dtype=torch.float32, device=device)
    for block in mtp_blocks(model_chunks):
        if block.loss_sums is not None:
            sums += block.loss_sums
    return sums
