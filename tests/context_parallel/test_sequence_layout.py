"""The document layout of a microbatch is worked out once, before the layers: no layer reads
the token metadata on the host (a sync on a GPU) nor gathers it over the CP group.

The count is :class:`sync_counter.SyncCounter`'s (every torch entry point that would wait for
a GPU or copy host data to it, counted on the CPU), over the decoder's forward AND backward
with packed documents, for the no-CP path and every CP comm type (ring, Ulysses, hybrid,
all-gather), with GQA, with Megatron-LM's default dropouts and without them:

- given the microbatch's SequenceLayout, built before (``GPTModel.sequence_layout``), the
  layers make no sync at all;
- without it (each attention planning for itself, the old way) the same window counts syncs
  in every layer: the counter has teeth;
- ``GPTModel.forward``, which builds the layout itself, makes as many syncs with 4 layers as
  with 2: the layout is built once per microbatch, whatever the depth;
- the outputs and gradients are the same with and without the prebuilt layout.
"""
import pytest
import torch

from dist_harness import run_workers
from megatron_cp.data.batch import get_ltor_batch
from megatron_cp.data.microbatch import prepare_microbatch
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.model import GPTModel
from megatron_cp.layers.hidden_dropout import DropoutIds
from model_utils import tiny_config
from sync_counter import SyncCounter

EOD, SEQ, BATCH = 0, 32, 2


def _text():
    """[BATCH, SEQ + 1] tokens with EODs at different places per sample (packed documents)."""
    gen = torch.Generator().manual_seed(5)
    text = torch.randint(1, 100, (BATCH, SEQ + 1), generator=gen)
    text[0, [5, 13, 14, 27]] = EOD
    text[1, [9, 20]] = EOD
    return text


def _microbatch(state):
    batch = get_ltor_batch(_text(), EOD, reset_position_ids=True, reset_attention_mask=True,
                           eod_mask_loss=True)
    mb = prepare_microbatch(batch, state.rank("cp"), state.size("cp"))
    mb["sample_ids"] = torch.arange(BATCH)
    return mb


def _decoder_window(rank, world, comm_type, hierarchical, prebuilt, config_extra):
    """(syncs inside the decoder's forward + backward, where they were, output, input grad)."""
    state = initialize_model_parallel(
        context_parallel_size=world,
        hierarchical_context_parallel_sizes=hierarchical)
    config = tiny_config(cp_comm_type=comm_type, hierarchical_context_parallel_sizes=hierarchical,
                         num_query_groups=2, **config_extra)
    model = GPTModel(config, state).train()
    mb = _microbatch(state)
    ids = DropoutIds(mb["sample_ids"], mb["unpadded_index"])
    length, device = mb["position_ids"].shape[1], mb["position_ids"].device
    h = model.embedding(mb["tokens"], mb["position_ids"], ids).detach().requires_grad_()
    layout = model.sequence_layout(mb["token_index"], mb["document_ids"], length, device) \
        if prebuilt else None
    with SyncCounter() as syncs:
        out = model.decoder(h, mb["position_ids"], mb["token_index"], mb["document_ids"],
                            mb["loss_mask"], ids, layout)
        out.backward(torch.ones_like(out))
    return syncs.count, syncs.sites[:6], out.detach(), h.grad


def _forward_syncs(rank, world, num_layers):
    """Syncs of a whole GPTModel.forward + backward (it builds the layout itself)."""
    state = initialize_model_parallel(context_parallel_size=world)
    model = GPTModel(tiny_config(num_layers=num_layers, cp_comm_type="p2p"), state).train()
    mb = _microbatch(state)
    with SyncCounter() as syncs:
        loss = model(mb["tokens"], mb["position_ids"], labels=mb["labels"],
                     token_index=mb["token_index"], document_ids=mb["document_ids"],
                     loss_mask=mb["loss_mask"], sample_ids=mb["sample_ids"],
                     unpadded_index=mb["unpadded_index"])
        loss.sum().backward()
    return syncs.count


CASES = [  # (world, comm type, hierarchical CP sizes)
    (1, "p2p", None), (2, "p2p", None), (2, "a2a", None), (2, "all_gather", None),
    (4, "a2a+p2p", (2, 2)),
]
IDS = ["no-cp", "cp2-p2p", "cp2-a2a", "cp2-allgather", "cp4-hybrid"]
DEFAULTS = dict(hidden_dropout=0.1, attention_dropout=0.1)  # Megatron-LM's: masks drawn per layer
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             add_bias_linear=False)


@pytest.mark.parametrize("world,comm_type,hierarchical", CASES, ids=IDS)
def test_no_layer_reads_the_metadata_on_the_host(world, comm_type, hierarchical):
    config = LLAMA if comm_type in ("a2a", "p2p") else DEFAULTS
    planned = run_workers(_decoder_window, world, comm_type, hierarchical, True, config)
    unplanned = run_workers(_decoder_window, world, comm_type, hierarchical, False, config)
    for rank, ((syncs, sites, out, grad), (old, old_sites, old_out, old_grad)) in enumerate(
            zip(planned, unplanned)):
        assert syncs == 0, f"rank {rank}: {syncs} host syncs inside the layers: {sites}"
        assert old >= 2, (f"rank {rank}: the layers planning for themselves should read the "
                          f"metadata in each of the 2 layers; counted {old}: {old_sites}")
        torch.testing.assert_close(out, old_out, rtol=0, atol=0)
        torch.testing.assert_close(grad, old_grad, rtol=0, atol=0)


GDN = dict(experimental_attention_variant="gdn", num_layers=4, linear_attention_freq="2",
           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=8, **LLAMA)  # Gated DeltaNet, attention, GDN, attention


@pytest.mark.parametrize("world,comm_type,hierarchical", CASES, ids=IDS)
def test_no_gated_deltanet_layer_reads_the_metadata_on_the_host(world, comm_type, hierarchical):
    """Qwen3-Next's hybrid: the Gated DeltaNet layers' document chunks (state passing), the
    gathered sequence (all-to-all) and FLA's packed rows come from the layout too."""
    planned = run_workers(_decoder_window, world, comm_type, hierarchical, True, GDN)
    unplanned = run_workers(_decoder_window, world, comm_type, hierarchical, False, GDN)
    for rank, ((syncs, sites, out, grad), (old, old_sites, old_out, old_grad)) in enumerate(
            zip(planned, unplanned)):
        assert syncs == 0, f"rank {rank}: {syncs} host syncs inside the layers: {sites}"
        assert old >= 2, f"rank {rank}: counted {old} without a layout: {old_sites}"
        torch.testing.assert_close(out, old_out, rtol=0, atol=0)
        torch.testing.assert_close(grad, old_grad, rtol=0, atol=0)


def test_the_layout_is_built_once_whatever_the_depth():
    shallow = run_workers(_forward_syncs, 2, 2)
    deep = run_workers(_forward_syncs, 2, 4)
    assert shallow == deep, f"syncs per microbatch with 2 layers {shallow}, with 4 {deep}"
