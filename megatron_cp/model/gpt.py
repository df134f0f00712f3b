"""The GPT model: embedding -> transformer layers -> final norm -> vocab-parallel output + loss.

Stage-aware from the start: ``pre_process`` builds the embedding, ``post_process`` the final
norm, output layer and loss, and ``layer_numbers`` the global layers this chunk owns. With
tied embeddings on a last stage that lacks the embedding, the output layer holds a copy
initialized identically and marked ``shared_embedding`` (its gradient is all-reduced with
the first stage's over the embedding group). With ``--mtp-num-layers`` the last stage also
holds the multi-token-prediction depths (multi_token_prediction.py), which share the word
embedding and the output layer; a last stage without the embedding embeds through its copy
(the tied output weight, or with untied embeddings ``mtp_word_embeddings``, a
``shared_embedding`` copy as Megatron-LM keeps one there). The word embedding and the
output layer weight (any copy) are marked ``is_embedding_or_output_parameter``, Megatron-LM's
mark: the optimizer gives them --decoupled-lr and keeps them from Muon. Every dropout
(embedding, layers, attention) draws its mask from each element's global coordinates
(``DropoutIds`` from the batch: hidden_dropout.py), so every layout equals one process.
"""
import functools

import torch
import torch.nn.functional as F

from megatron_cp import tensor_parallel as tpar
from megatron_cp.context_parallel.layout import SequenceLayout
from megatron_cp.fp8 import fp8_linear, rows as fp8_rows
from megatron_cp.distributed import device as device_mod
from megatron_cp.fp8.model import check_block_device, output_fp8
from megatron_cp.layers.norms import norm_for
from megatron_cp.layers.hidden_dropout import (SITE_EMBEDDING, DropoutIds, hidden_dropout,
                                               sequence_shard, site_key, token_coordinates)
from megatron_cp.model.multi_token_prediction import MultiTokenPrediction
from megatron_cp.model.transformer import TransformerBlock, mark_sequence_parallel

WORD_EMBEDDING_KEY = "embedding.word_embeddings"


def word_embedding(config, padded_vocab, tp_group, device=None):
    """The vocab-parallel word embedding (the same weights wherever it is built)."""
    return tpar.VocabParallelEmbedding(
        padded_vocab, config.hidden_size, tp_group=tp_group,
        init_method=tpar.real_rows_init(tpar.normal_init(config.init_method_std),
                                        config.vocab_size),
        seed=tpar.init_seed(config.seed, WORD_EMBEDDING_KEY),
        reduce_scatter_output=config.sequence_parallel, params_dtype=config.params_dtype,
        device=device)


class Embedding(torch.nn.Module):
    """tokens [b, s] (+ position ids) -> [s, b, h], or [s/tp, b, h] under SP."""

    def __init__(self, config, padded_vocab, tp_group, rng_tracker, device=None):
        super().__init__()
        self.config, self.rng_tracker = config, rng_tracker
        self.sequence_parallel = config.sequence_parallel and tp_group is not None and \
            torch.distributed.get_world_size(tp_group) > 1
        self.tp_group = tp_group
        std = config.init_method_std
        self.word_embeddings = word_embedding(config, padded_vocab, tp_group, device)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = tpar.drawn_weight(
                (config.max_position_embeddings, config.hidden_size), tpar.normal_init(std),
                tpar.init_seed(config.seed, "embedding.position_embeddings"),
                config.params_dtype, device)
            self.position_embeddings.sequence_parallel = self.sequence_parallel

    def forward(self, tokens, position_ids, dropout_ids=None, depth=0):
        """``dropout_ids``: a DropoutIds or None; ``depth``: 0 for the model's input, k for
        MTP depth k's lookup (each its own dropout site)."""
        h = self.word_embeddings(tokens)  # [s(/tp), b, h]
        if self.position_embeddings is not None:
            pos = F.embedding(position_ids, self.position_embeddings).transpose(0, 1)  # [s, b, h]
            if self.sequence_parallel:
                tp_size = torch.distributed.get_world_size(self.tp_group)
                tp_rank = torch.distributed.get_rank(self.tp_group)
                chunk = pos.shape[0] // tp_size
                pos = pos[tp_rank * chunk:(tp_rank + 1) * chunk]  # [s/tp, b, h]
            h = h + pos
        return finish_embedding(h, self.config, self.training, self.tp_group, dropout_ids, depth)


def finish_embedding(h, config, training, tp_group, dropout_ids, depth):
    """Embedded tokens [s(/tp), b, h] -> what the first layer gets: muP's input multiplier,
    then hidden dropout at embedding site ``depth`` (also for MTP's lookups on a last stage
    without the embedding)."""
    if config.use_mup and config.mup_embedding_mult != 1.0:
        h = h * config.mup_embedding_mult
    if not training or config.hidden_dropout == 0.0:
        return h
    shard = sequence_shard(tp_group, config.sequence_parallel)
    return hidden_dropout(h, config.hidden_dropout, training,
                          site_key(config.seed, SITE_EMBEDDING, depth),
                          token_coordinates(dropout_ids, h, shard))


class GPTModel(torch.nn.Module):
    """A GPT model chunk over the TP and CP groups of ``state`` (None: one process).

    forward(tokens [b, s], position_ids [b, s], labels [b, s] or None, token_index, document_ids,
    loss_mask [b, s] or None (the tokens MoE balancing losses count; None: all), sample_ids
    [b] and unpadded_index [b, s] (where the tokens sit in the run, which attention dropout's
    mask follows: see attention.DropoutIds; the batch gives both)):
    - post_process with labels -> per-token loss [b, s] (fp32); with ``mtp_targets`` (one
      (tokens, labels, loss mask) [b, s] per MTP depth) the MTP losses ride on it to backward
    - post_process without labels -> vocab-parallel logits [s, b, v/tp]
    - otherwise -> hidden states [s(/tp), b, h] for the next pipeline stage.
    A non-first stage takes its input from :meth:`set_input_tensor`.
    """

    def __init__(self, config, state=None, rng_tracker=None, pre_process=True, post_process=True,
                 layer_numbers=None, device=None):
        super().__init__()
        tp_group = state.group("tp") if state is not None else None
        cp_group = state.group("cp") if state is not None else None
        tp_size = state.size("tp") if state is not None else 1
        device = device if device is not None else (state.device if state is not None else None)
        config.validate_parallel(tp_size)
        if config.fp8 and device is not None:  # a block recipe needs its GPU kernels
            check_block_device(config.fp8_recipe, device_mod.compute_capability(device),
                               device_mod.device_name(device))
        if rng_tracker is None:
            rng_tracker = tpar.model_parallel_seed(config.seed, state.rank("tp") if state else 0,
                                                   device or torch.device("cpu"))
        self.config, self.rng_tracker = config, rng_tracker
        self.pre_process, self.post_process = pre_process, post_process
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and tp_size > 1
        self.padded_vocab_size = config.padded_vocab_size(tp_size)
        self.input_tensor = None
        tied = not config.untie_embeddings_and_output_weights
        if pre_process:
            self.embedding = Embedding(config, self.padded_vocab_size, tp_group, rng_tracker, device)
            # a last stage without it holds a copy: the tied output layer, or MTP's table
            self.embedding.word_embeddings.weight.shared_embedding = \
                (tied or bool(config.mtp_num_layers)) and not post_process
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
            for param in self.embedding.parameters():  # muP: base lr and eps (not hidden)
                param.is_embedding_parameter = True
        layer_numbers = range(config.num_layers) if layer_numbers is None else layer_numbers
        self.decoder = TransformerBlock(config, layer_numbers, tp_group, cp_group, rng_tracker,
                                        device, state=state)
        if post_process:
            self.final_layernorm = norm_for(config, config.hidden_size, device)
            mark_sequence_parallel(self.final_layernorm, config.sequence_parallel)
            self.output_layer = None
            if not (tied and pre_process):
                key = WORD_EMBEDDING_KEY if tied else "output_layer"
                self.output_layer = tpar.ColumnParallelLinear(
                    config.hidden_size, self.padded_vocab_size, tp_group=tp_group,
                    init_method=tpar.real_rows_init(tpar.normal_init(config.init_method_std),
                                                    config.vocab_size),
                    seed=tpar.init_seed(config.seed, key), bias=False,
                    sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
                    device=device)
                self.output_layer.weight.shared_embedding = tied
                self.output_layer.weight.is_embedding_or_output_parameter = True
                self.output_layer.weight.is_embedding_parameter = True
        # --fp8-output-proj: the output layer's GEMMs in FP8 (MXFP8), tied or not
        self.output_fp8 = output_fp8(config, self.padded_vocab_size, tp_group,
                                     cp_group) if post_process else None
        self.mtp, self.mtp_word_embeddings = None, None
        if post_process and config.mtp_num_layers:
            if not (pre_process or tied):  # MTP embeds here: a copy of the first stage's table
                self.mtp_word_embeddings = word_embedding(config, self.padded_vocab_size,
                                                          tp_group, device)
                self.mtp_word_embeddings.weight.shared_embedding = True
                self.mtp_word_embeddings.weight.is_embedding_or_output_parameter = True
                self.mtp_word_embeddings.weight.is_embedding_parameter = True
            self.mtp = MultiTokenPrediction(config, tp_group, cp_group, rng_tracker, device,
                                            state)

    def set_input_tensor(self, tensor):
        """The activation received from the previous pipeline stage."""
        self.input_tensor = tensor

    def output_weight(self):
        """The [v/tp, h] weight of the output layer (the word embedding when tied here)."""
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def _output_input(self, h):
        """[s(/tp), b, h] -> [s, b, h], the output layer's input on every TP rank (gathered
        under SP; backward reduces the gradient over TP)."""
        if self.sequence_parallel:
            return tpar.gather_from_sequence_parallel_region(h, self.tp_group)  # [s, b, h]
        return tpar.copy_to_tensor_model_parallel_region(h, self.tp_group)

    def _logits(self, h):
        """[s, b, v/tp] logits; padded vocabulary entries are -inf (out of every softmax)."""
        if self.output_fp8 is not None:  # [s, b, v/tp]
            logits = fp8_linear(self._output_input(h), self.output_weight(), None,
                                self.output_fp8)
        elif self.output_layer is not None:
            logits = self.output_layer(h)
        else:
            weight = self.embedding.word_embeddings.weight  # [v/tp, h]
            logits = F.linear(self._output_input(h), weight)  # [s, b, v/tp]
        if self.config.use_mup and self.config.mup_output_mult != 1.0:
            logits = logits * self.config.mup_output_mult  # muP's output multiplier
        return tpar.mask_padded_vocab(logits, self.config.vocab_size, self.tp_group)

    def _loss(self, h, labels):
        """Per-token loss [b, s] (fp32) of normed hidden states [s(/tp), b, h]: the output
        layer and vocab-parallel cross entropy, for the LM head and every MTP depth. With
        --tiled-logits-chunk-size they run that many positions at a time, so the [s, b, v/tp]
        logits never exist."""
        if self.config.tiled_logits_chunk_size:
            loss = tpar.tiled_vocab_parallel_cross_entropy(
                self._output_input(h), self.output_weight(), labels.t(), self.config.vocab_size,
                self.tp_group, self.config.tiled_logits_chunk_size)  # [s, b]
        else:
            logits = self._logits(h)  # [s, b, v/tp]
            loss = tpar.vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group)  # [s, b]
        return loss.t().contiguous()  # [b, s]

    def _embed(self, tokens, depth, dropout_ids=None):
        """tokens [b, s] -> [s(/tp), b, h] through the word embedding for MTP depth ``depth``
        (1..D: its own dropout site); a last stage without the embedding looks them up in its
        copy of the table: the tied output weight, or with untied embeddings
        ``mtp_word_embeddings``."""
        if self.pre_process:
            return self.embedding(tokens, None, dropout_ids, depth)
        table = self.output_layer.weight if self.mtp_word_embeddings is None \
            else self.mtp_word_embeddings.weight
        h = tpar.vocab_parallel_embedding(tokens, table, self.tp_group, self.sequence_parallel)
        return finish_embedding(h, self.config, self.training, self.tp_group, dropout_ids, depth)

    def sequence_layout(self, token_index, document_ids, length, device):
        """The microbatch's SequenceLayout (context_parallel/layout.py) with every plan this
        chunk's attention layers (and MTP layers) will look up worked out now: the one place
        a microbatch's token metadata is read on the host and gathered over the CP group."""
        layout = SequenceLayout(token_index, document_ids)
        self.decoder.prepare_layout(layout, length, device)
        if self.mtp is not None:
            self.mtp.prepare_layout(layout, length, device)
        return layout

    def forward(self, tokens, position_ids, labels=None, token_index=None, document_ids=None,
                loss_mask=None, sample_ids=None, unpadded_index=None, mtp_targets=None,
                layout=None, real_token=None):
        """``real_token`` [b, s_local] bool: False on the pad tokens context parallelism
        adds (megatron_cp/data/microbatch.py), which FP8's input amaxes skip; None: none.
        With ``unpadded_index`` they give FP8's token blocks their one-process rows."""
        with fp8_rows.real_rows(fp8_rows.rows_of(real_token, unpadded_index)):
            return self._forward(tokens, position_ids, labels, token_index, document_ids,
                                 loss_mask, sample_ids, unpadded_index, mtp_targets, layout)

    def _forward(self, tokens, position_ids, labels, token_index, document_ids, loss_mask,
                 sample_ids, unpadded_index, mtp_targets, layout):
        dropout_ids = DropoutIds(sample_ids, unpadded_index)
        if layout is None:  # before the layers: none of them reads the metadata on the host
            layout = self.sequence_layout(token_index, document_ids, position_ids.shape[1],
                                          position_ids.device)
        if self.pre_process:
            h = self.embedding(tokens, position_ids, dropout_ids)  # [s(/tp), b, h]
        else:
            h = self.input_tensor
        h = self.decoder(h, position_ids, token_index, document_ids, loss_mask, dropout_ids,
                         layout)
        if not self.post_process:
            # An empty stage (a layout's "||") passes its input on as a view: the schedule
            # frees and differentiates its own output, not the received tensor.
            return h.view_as(h) if h is self.input_tensor else h
        h = self.final_layernorm(h)
        if labels is None:
            return self._logits(h)  # [s, b, v/tp]
        loss = self._loss(h, labels)  # [b, s]
        if self.mtp is not None and mtp_targets is not None:
            embed = functools.partial(self._embed, dropout_ids=dropout_ids)
            loss = self.mtp(loss, h, embed, self._loss, mtp_targets, position_ids,
                            token_index, document_ids, loss_mask, dropout_ids, layout)
        return loss
