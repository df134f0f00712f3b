"""megatron-core itself on one CPU gloo process: its GPTModel (local layer spec), a step or
two of training, a checkpoint saved the way Megatron-LM's training saves one, and a strict
load of a checkpoint we wrote. Run inside a dist_harness worker (megatron-core keeps its
parallel state in module globals, so each use gets a fresh process).

On CPU its torch.cuda calls are pointed at the CPU: its RNG tracker forks nothing (dropout
is 0), the default causal mask is passed in, its async writer's memory probe (psutil) and
CUDA synchronisation are stubbed, and the router's Transformer Engine GEMM is absent.
"""
import argparse
import contextlib
import os
import queue

import torch
import torch.nn.functional as F

SEQ, VOCAB, PADDED = 16, 121, 128  # NullTokenizer --vocab-size 120 (+ EOD), divisible by 32
GBS, ITERATION = 4, 10
KINDS = {
    "gpt": dict(config=dict(bias_activation_fusion=True), position="learned_absolute",
                tied=True, args=dict()),
    "llama": dict(config=dict(normalization="RMSNorm", gated_linear_unit=True,
                              activation_func=F.silu, add_bias_linear=False, num_query_groups=2,
                              ffn_hidden_size=64, bias_activation_fusion=False),
                  position="rope", tied=False,
                  args=dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                            group_query_attention=True, num_query_groups=2, ffn_hidden_size=64,
                            untie_embeddings_and_output_weights=True,
                            position_embedding_type="rope", bias_swiglu_fusion=True)),
    "moe": dict(config=dict(normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, ffn_hidden_size=64,
                            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                            moe_aux_loss_coeff=0.0),
                position="rope", tied=False,
                args=dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                          ffn_hidden_size=64, untie_embeddings_and_output_weights=True,
                          position_embedding_type="rope", num_experts=4, moe_router_topk=2,
                          moe_ffn_hidden_size=16, moe_layer_freq=1, moe_aux_loss_coeff=0.0)),
}
# DeepSeek-V3's multi-token prediction on the Llama-style model: one MTP depth. Its losses
# are compared, and megatron-core's softmax runs over the padded vocabulary: none here.
KINDS["mtp"] = dict(config={**KINDS["llama"]["config"], "mtp_num_layers": 1,
                            "mtp_loss_scaling_factor": 0.1},
                    position="rope", tied=False,
                    args={**KINDS["llama"]["args"], "mtp_num_layers": 1,
                          "mtp_loss_scaling_factor": 0.1, "vocab_size": PADDED - 1})
TRAIN_FLAGS = dict(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, lr_decay_iters=20, train_iters=20,
                   lr_decay_style="cosine", global_batch_size=GBS, micro_batch_size=GBS,
                   seq_length=SEQ, max_position_embeddings=SEQ, weight_decay=0.01)


def _patch_cpu():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    filesystem_async._process_memory = lambda: 0
    writer = filesystem_async.FileSystemWriterAsync

    def write_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue):
        # harness workers are daemonic: no writer processes, the buckets written here
        results, count = queue.Queue(), queue.Queue()
        out = {}
        for i, bucket in enumerate(write_buckets):
            count.put(i)
            writer.write_preloaded_data(transform_list, i, bucket, results, count, use_fsync=True)
            index, written = results.get()
            if isinstance(written, Exception):
                raise written
            out[index] = written
        global_results_queue.put(out)

    writer.write_preloaded_data_multiproc = staticmethod(write_in_process)
    filesystem_async._get_write_results_queue = lambda: queue.Queue()
    mrandom.CudaRNGStatesTracker.fork = contextlib.contextmanager(lambda self, name=None: (yield))
    moe_utils.te_general_gemm = None


def build(kind, vocab=PADDED, seq=SEQ):
    """megatron-core's GPTModel of ``kind`` (TP=1 on the gloo group already started) over a
    ``vocab``-row embedding and ``seq`` positions."""
    import warnings
    warnings.filterwarnings("ignore")
    _patch_cpu()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    spec = KINDS[kind]
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               use_cpu_initialization=True, params_dtype=torch.float32,
                               hidden_dropout=0.0, attention_dropout=0.0, **spec["config"])
    layer_spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                          moe_grouped_gemm=False,
                                          normalization=config.normalization)
    mtp_spec = None
    if config.mtp_num_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
    torch.manual_seed(5)
    return GPTModel(config, layer_spec, vocab_size=vocab, max_sequence_length=seq,
                    position_embedding_type=spec["position"],
                    share_embeddings_and_output_weights=spec["tied"], mtp_block_spec=mtp_spec)


def logits(model, tokens):
    """[b, s, padded vocab] logits of megatron-core's model."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    with torch.no_grad():
        return model(tokens, positions, mask).float()


def mtp_losses(model, tokens, labels):
    """(per-token LM loss [b, s], the depths' mean MTP losses [D]) of megatron-core's MTP
    model in training mode (its MTPLossLoggingHelper records the latter), no update."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    MTPLossLoggingHelper.tracker.clear()
    model.train()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    with torch.no_grad():
        lm = model(tokens, positions, mask, labels=labels).float()
    return lm, MTPLossLoggingHelper.tracker["values"].clone()


def mtp_train_and_save(rank, world, root, tokens, labels):
    """Worker: megatron-core's MTP model trains two Adam steps on its own objective (mean LM
    loss, the MTP loss through its MTPLossAutoScaler) and is saved as Megatron-LM saves;
    its losses after."""
    model = build("mtp")
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    positions = torch.arange(SEQ).expand_as(tokens)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    for _ in range(2):
        adam.zero_grad()
        model(tokens, positions, mask, labels=labels).float().mean().backward()
        adam.step()
    _save(model, adam, "mtp", root)
    return mtp_losses(model, tokens, labels)


def mtp_load_strict(rank, world, folder, tokens, labels):
    """Worker: megatron-core's MTP model loads ``folder`` strictly; its losses."""
    model = _load_strict_model("mtp", folder)[0]
    return mtp_losses(model, tokens, labels)


def megatron_args(kind, **overrides):
    """The Namespace Megatron-LM's training pickles: its defaults (the flag census), the
    model's flags, what its validate_args derives, and one of its enums (``overrides``: a
    run's own values)."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron_cp.checkpoint.megatron_lm_convert import megatron_defaults
    values = megatron_defaults()
    values.update(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
                  ffn_hidden_size=128, tokenizer_type="NullTokenizer", vocab_size=VOCAB - 1,
                  make_vocab_size_divisible_by=32, padded_vocab_size=PADDED, hidden_dropout=0.0,
                  attention_dropout=0.0, params_dtype=torch.float32,
                  attention_backend=AttnBackend.auto, add_bias_linear=True,
                  position_embedding_type="learned_absolute", iteration=ITERATION,
                  consumed_train_samples=ITERATION * GBS, ckpt_format="torch_dist",
                  num_query_groups=1, **TRAIN_FLAGS)
    values.update(KINDS[kind]["args"])
    values.update(overrides)
    return argparse.Namespace(**values)


def scheduler_state():
    """Megatron's OptimizerParamScheduler.state_dict() at ITERATION (counted in samples)."""
    f = TRAIN_FLAGS
    return {"max_lr": f["lr"], "lr_warmup_steps": f["lr_warmup_iters"] * GBS,
            "num_steps": ITERATION * GBS, "lr_decay_style": f["lr_decay_style"],
            "lr_decay_steps": f["lr_decay_iters"] * GBS, "min_lr": f["min_lr"],
            "start_wd": f["weight_decay"], "end_wd": f["weight_decay"],
            "wd_incr_style": "constant", "wd_incr_steps": f["train_iters"] * GBS}


def train_and_save(rank, world, kind, root, tokens):
    """Worker: build, train two Adam steps, save as Megatron-LM does; its logits after."""
    model = build(kind)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        adam.zero_grad()
        positions = torch.arange(SEQ).expand_as(tokens)
        mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
        out = model(tokens, positions, mask)  # [b, s, v]
        F.cross_entropy(out[:, :-1].reshape(-1, PADDED), tokens[:, 1:].reshape(-1)).backward()
        adam.step()
    _save(model, adam, kind, root)
    return logits(model, tokens)


def _save(model, adam, kind, root):
    """Save ``model`` and its Adam as Megatron-LM's training saves at ITERATION."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
    # its FP32Optimizer around the torch Adam (built by hand: its __init__ puts a tensor on CUDA)
    optimizer = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(optimizer, adam, OptimizerConfig(clip_grad=0.0, lr=1e-2), None)
    optimizer._scale, optimizer.is_stub_optimizer = torch.ones(1), False
    state = {"args": megatron_args(kind), "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": model.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    state["opt_param_scheduler"] = scheduler_state()
    state["num_floating_point_operations_so_far"] = 0
    _write(state, root, ITERATION)


def save_checkpoint(model, optimizer, scheduler, kind, root, iteration, args):
    """Save as Megatron-LM's training saves at ``iteration``: megatron-core's own optimizer
    and LR scheduler, ``args`` (the run's values) over megatron_args(kind)."""
    args = megatron_args(kind, iteration=iteration,
                         consumed_train_samples=iteration * args["global_batch_size"], **args)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["num_floating_point_operations_so_far"] = 0
    _write(state, root, iteration)


def _write(state, root, iteration):
    from megatron.core import dist_checkpointing
    folder = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    dist_checkpointing.save(state, folder)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as file:
        file.write(str(iteration))


def load_strict(rank, world, kind, folder, tokens):
    """Worker: megatron-core's GPTModel loads ``folder`` strictly; its logits."""
    model, loaded = _load_strict_model(kind, folder)
    return logits(model, tokens), vars(loaded["args"]), loaded["iteration"]


def _load_strict_model(kind, folder):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    model = build(kind)
    for p in model.parameters():  # nothing of the init may survive the load
        p.data.fill_(float("nan"))
    # as Megatron-LM's load_checkpoint: the model's sharded state under "model", the
    # common state (args, iteration) merged in
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder,
                                     strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(loaded["model"], strict=True)
    return model, loaded


# --- Megatron-FSDP (megatron-core's own FSDP) on CPU -------------------------------------------

class _NoStream:
    """A CUDA stream or event that does nothing (CPU ops are synchronous): every method
    returns another (an event recorded on it)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _NoStream()


def _patch_fsdp_cpu():
    """Megatron-FSDP's CUDA calls pointed at the CPU: streams and events do nothing, its device
    meshes are CPU meshes, and a tensor it asks for on CUDA is made on the CPU."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.overrides import TorchFunctionMode
    torch.cuda.Stream = torch.cuda.Event = _NoStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.current_device = lambda: 0
    torch.cuda.empty_cache = lambda: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    from_group = DeviceMesh.from_group

    def cpu_mesh(group, device_type=None, *args, **kwargs):
        return from_group(group, "cpu", *args, **kwargs)
    DeviceMesh.from_group = staticmethod(cpu_mesh)

    class OnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            device = kwargs.get("device")
            if device is not None and (isinstance(device, int) or "cuda" in str(device)):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)
    OnCpu().__enter__()


def fsdp_train_and_save(rank, world, kind, root, tokens):
    """Worker: megatron-core's GPTModel of ``kind`` under its Megatron-FSDP
    (optim_grads_params) and DistributedOptimizer trains two steps on ``tokens``, and is saved
    as Megatron-LM's training saves --ckpt-format fsdp_dtensor at ITERATION, without its
    optimizer state (--no-save-optim); its logits after (rank 0's)."""
    import torch.distributed.checkpoint as dcp
    model = build(kind)
    _patch_fsdp_cpu()
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import fsdp_dtensor_checkpoint as fdc
    from megatron.core.transformer.transformer_layer import TransformerLayer
    config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True,
        data_parallel_sharding_strategy="optim_grads_params",
        gradient_reduce_div_fusion=False)  # gloo has no PREMUL_SUM
    wrapped = FullyShardedDataParallel(model.config, config, model,
                                       fsdp_unit_modules=[TransformerLayer],
                                       device=torch.device("cpu"))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=0.0),
        [wrapped])
    positions = torch.arange(SEQ).expand_as(tokens)
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    for _ in range(2):
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        out = wrapped(tokens, positions, mask)  # [b, s, v]
        F.cross_entropy(out[:, :-1].reshape(-1, PADDED), tokens[:, 1:].reshape(-1)).backward()
        wrapped.finish_grad_sync()
        optimizer.step()
    state = {"args": megatron_args(kind, ckpt_format="fsdp_dtensor", use_megatron_fsdp=True,
                                   use_distributed_optimizer=True, transformer_impl="local",
                                   data_parallel_size=world, world_size=world),
             "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": wrapped.state_dict_for_save_checkpoint()}
    # (no optimizer state: a param of this tiny model may have no element on a rank, which
    # then holds no Adam state for it, and the uneven-DTensor preprocessing below runs one
    # collective per DTensor: different counts on the two ranks hang it)
    state["opt_param_scheduler"] = scheduler_state()
    state["num_floating_point_operations_so_far"] = 0
    fdc.handle_fp8_extra_state_case(state["model"])  # its preprocess (no SwiGLU, no experts)
    preprocess_state_dict_for_uneven_dtensor(state)
    folder = os.path.join(root, f"iter_{ITERATION:07d}")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as file:
            file.write(str(ITERATION))
    with torch.no_grad():
        return wrapped(tokens, positions, mask).float()
