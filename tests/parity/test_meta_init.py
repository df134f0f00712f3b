"""--init-model-with-meta-device (megatron_cp/distributed/meta_init.py): the model built on the
meta device and its weights drawn one at a time holds the default build's weights bit for bit
(every kind of drawn weight in one process; TP=2 with SP, PP=2 with virtual stages, FSDP2 at
DP=2 in fp32 and bf16, across ranks), so it trains to the same losses; under FSDP2 the build's
peak memory (observability/memory_peak.py) is the rank's shards (and gradient buffers) plus one
full weight, below the default build's, which holds the whole model first, by the predicted
amount."""
import pytest
import torch

from dist_harness import run_workers
from megatron_cp.cli.arguments import parse_args
from megatron_cp.distributed.meta_init import materialize, meta_parameters
from megatron_cp.distributed.shards import local_shard
from megatron_cp.model import GPTModel
from megatron_cp.observability.memory_peak import PeakMemory
from megatron_cp.training.trainer import build_models
from model_utils import tiny_config
from training_utils import TINY, run_and_state, train_losses

META = " --init-model-with-meta-device"
MODEL = (TINY.replace("--num-layers 2", "--num-layers 4") + " --train-iters 3 --swiglu "
         "--normalization RMSNorm --untie-embeddings-and-output-weights --qk-layernorm "
         "--group-query-attention --num-query-groups 2 --num-experts 4 --moe-router-topk 2 "
         "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate --mtp-num-layers 1")
LAYOUTS = {"tp2-sp": "--tensor-model-parallel-size 2 --sequence-parallel",
           "pp2-vp2": "--pipeline-model-parallel-size 2 "
                      "--num-layers-per-virtual-pipeline-stage 1",
           "fsdp2": "--use-torch-fsdp2",
           "fsdp2-bf16": "--use-torch-fsdp2 --bf16"}

CONFIGS = {  # every site that draws a weight: linears, embeddings (word, position), experts,
    # router, shared-expert gate, MLA's replicated projections, Gated DeltaNet's conv and decay
    "gpt": dict(position_embedding_type="learned_absolute", qk_layernorm=True,
                untie_embeddings_and_output_weights=True),
    "moe": dict(num_moe_experts=4, moe_router_topk=2, activation="swiglu", bias_gelu_fusion=False,
                moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                moe_shared_expert_gate=True, moe_router_enable_expert_bias=True,
                moe_router_score_function="sigmoid", mtp_num_layers=1),
    "mla": dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                qk_pos_emb_head_dim=8, v_head_dim=8),
    "gdn": dict(num_layers=4, activation="swiglu", add_bias_linear=False,
                normalization="RMSNorm", experimental_attention_variant="gated_delta_net",
                linear_attention_freq=4, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
}


def _same_parameters(default, built):
    """Every parameter and buffer equal bit for bit, with the same attributes (TP marks, SP,
    expert and embedding marks: what reductions and the optimizer read)."""
    a, b = dict(default.named_parameters()), dict(built.named_parameters())
    assert a.keys() == b.keys()
    for name, p in a.items():
        assert not b[name].is_meta and b[name].dtype == p.dtype, name
        assert torch.equal(local_shard(b[name])[0], local_shard(p)[0]), name
        assert vars(b[name]).keys() == vars(p).keys(), name
    for (name, x), (_, y) in zip(default.named_buffers(), built.named_buffers()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("name", CONFIGS)
def test_meta_build_draws_every_weight_of_the_default_build(name):
    config = tiny_config(**CONFIGS[name])
    default = GPTModel(config, device=torch.device("cpu"))
    with torch.device("meta"):
        built = GPTModel(config, device=torch.device("cpu"))
    drawn = meta_parameters(built)
    # the drawn weights wait on the meta device; constants (biases, norms) are made in place
    assert drawn and all(p.dim() >= 1 and hasattr(p, "materialize") for _, p in drawn)
    materialize(built, torch.device("cpu"))
    assert not meta_parameters(built)
    _same_parameters(default, built)
    tokens = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    assert torch.equal(built(tokens, positions), default(tokens, positions))


def _builds(rank, world, argv):
    """Worker: the default and the meta builds of ``argv``, compared in this rank's pieces."""
    built = {}
    for meta in ("", META):
        args = parse_args(f"{argv}{meta}".split(), world_size=world)
        run, state = run_and_state(args)
        built[meta] = build_models(run, state)[1]
    assert len(built[""]) == len(built[META])
    for default, chunk in zip(built[""], built[META]):
        _same_parameters(getattr(default, "module", default), getattr(chunk, "module", chunk))
    return sum(1 for c in built[META] for _ in c.parameters())


def _jobs(rank, world, jobs):
    return [fn(rank, world, *job_args) for fn, *job_args in jobs]


def test_parallel_meta_builds_equal_the_default_builds_and_train_alike():
    """TP=2 with SP, PP=2 with two virtual stages each, FSDP2 at DP=2 (fp32 and bf16): each
    rank's weights are the default build's bit for bit, and 3 steps give the same losses."""
    jobs = [(_builds, f"{MODEL} {extra}") for extra in LAYOUTS.values()]
    jobs += [(train_losses, f"{MODEL} {extra}{meta}") for extra in ("--tensor-model-parallel-size 2",
                                                                    "--use-torch-fsdp2")
             for meta in ("", META)]
    for ranks_results in run_workers(_jobs, 2, jobs, timeout=600):
        counts, losses = ranks_results[:len(LAYOUTS)], ranks_results[len(LAYOUTS):]
        assert all(counts)
        assert losses[0] == losses[1] and losses[2] == losses[3], losses


FSDP4 = (TINY.replace("--num-layers 2 --hidden-size 32", "--num-layers 8 --hidden-size 64")
         + " --train-iters 4 --use-torch-fsdp2")


def _build_memory(rank, world):
    """Worker: (peak, retained) bytes of the default and the meta build (model built, sharded
    over DP=4, gradient buffers made), the TP-local model's bytes and its largest weight's
    full fp32 bytes."""
    out = {}
    for meta in ("", META):
        args = parse_args(f"{FSDP4}{meta}".split(), world_size=world)
        run, state = run_and_state(args)
        with PeakMemory("cpu", measure_baseline=False) as meter:
            _, chunks = build_models(run, state)
        out[meta] = (meter.peak_bytes, meter.retained_bytes)
        params = list(chunks[0].module.parameters())  # DTensors: their global shapes
        out["model"] = sum(p.numel() * p.element_size() for p in params)
        out["largest"] = max(p.numel() * 4 for p in params)
        del chunks
    return out


def test_meta_build_under_fsdp2_peaks_at_the_shards_plus_one_weight():
    """The default build holds the whole (TP-local) model before FSDP2 shards it; the meta
    build holds the rank's shards and one weight being drawn (its full fp32 tensor and this
    rank's copy): both end with the same bytes (shards and fp32 gradient buffers), and the
    meta build's peak is lower by at least the model less those bytes and the one weight."""
    for out in run_workers(_build_memory, 4):
        (default_peak, default_kept), (meta_peak, meta_kept) = out[""], out[META]
        model, one_weight = out["model"], 2 * out["largest"]
        assert meta_kept == default_kept > 0
        assert default_peak >= model  # every weight at once, before sharding
        assert meta_peak <= meta_kept + one_weight
        predicted = model - meta_kept - one_weight
        assert predicted > 0.3 * model  # at DP=4: shards and buffers are half the model
        assert default_peak - meta_peak >= predicted, (out, predicted)

