"""Fully sharded data parallelism with PyTorch's FSDP2 (Megatron-LM's ``--use-torch-fsdp2``).

``torch.distributed.fsdp.fully_shard`` shards every parameter along its first dim over the
DP x CP ranks (a TP-sharded weight: its TP shard, again over DP x CP), gathers a layer's
params just before the layer runs and frees them after (``reshard_after_forward``;
``--torch-fsdp2-no-reshard-after-forward`` keeps them until backward), and reduce-scatters
its gradients as soon as its backward is done. As in Megatron-LM, each transformer layer is
one FSDP unit and the root (embeddings, final norm, output layer, MTP) another.

Mixed precision is FSDP2's own: the sharded params are fp32 and are the optimizer's main
params; a bf16/fp16 model gathers them cast to its dtype (``param_dtype``) and computes in
it, so the weights a layer computes with are the rounded fp32 masters, as with Megatron-LM's
separate fp32 copy, without a second copy (``compute_dtype`` marks such params).

What stays as everywhere else in megatron_cp:

* the reduction is a SUM (the loss is already divided by the tokens of the whole DP x CP
  group): the divide factor is 1 and sum-only collectives are used (gloo has no AVG);
* gradients are reduced in fp32 (FSDP's ``reduce_dtype``) and accumulate over the
  microbatches in an fp32 ``main_grad`` per shard: a post-accumulate-grad hook on each
  sharded param adds the gradient FSDP just reduced and drops it (:mod:`.data_parallel`
  does the same for replicated params). Every microbatch reduce-scatters, as Megatron-LM's
  FSDP2 does (no unsharded gradient is kept between microbatches);
* norms and zero counts add the shards over DP x CP (``shards_grads``);
* a model built on the meta device (--init-model-with-meta-device) has its weights drawn
  after sharding, each rank writing its rows only (:mod:`.meta_init`);
* checkpoints hold each rank's rows of every param (:func:`~.shards.local_shard`) with the
  model's weights in its dtype and the fp32 masters as the optimizer's main params, the
  same tensors as any other layout's, so any layout reads them back;
* ``--fp8-param-gather``: the FP8 linears' weights are gathered in FP8, one byte per element
  (:mod:`.fsdp_fp8`).
"""
import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from megatron_cp.distributed.fsdp_fp8 import wrap_fp8_masters
from megatron_cp.distributed.meta_init import materialize
from megatron_cp.distributed.shards import local_shard, local_tensor

FLAG = "--use-torch-fsdp2"
MEGATRON_FLAG = "--use-megatron-fsdp"


def _flag(optimizer):
    """The flag that asked for the sharding: Megatron-FSDP's or FSDP2's."""
    if optimizer.use_megatron_fsdp:
        return f"{MEGATRON_FLAG} --data-parallel-sharding-strategy " \
               f"{optimizer.data_parallel_sharding_strategy}"
    return FLAG


def argument_problems(optimizer, parallel, checkpoint, training):
    """One line per setting that the run's data-parallel sharding cannot go with (none
    without it), read from the run's sections (``optimizer``:
    :class:`~megatron_cp.config.optimizer.OptimizerConfig`, ``parallel``:
    :class:`~megatron_cp.config.parallel.ParallelConfig`, ``checkpoint``:
    :class:`~megatron_cp.config.checkpoint.CheckpointConfig`, ``training``:
    :class:`~megatron_cp.config.training.TrainingConfig`).

    --use-torch-fsdp2: Megatron-LM's rules (one pipeline stage, no expert parallelism, no
    distributed optimizer, torch_dist checkpoints) and ours (no Muon, no DP-replica checks:
    FSDP keeps no replicas). --use-megatron-fsdp: Megatron-LM's rules (Adam, fsdp_dtensor
    checkpoints both ways, no weight-hash check under optim_grads_params, not with
    --use-torch-fsdp2) and ours for the strategies that run on FSDP2 (one pipeline stage, no
    hybrid sharding, no DP-replica checks)."""
    problems = []
    if checkpoint.ckpt_format == "fsdp_dtensor" and not optimizer.use_megatron_fsdp:
        problems.append(f"--ckpt-format fsdp_dtensor: Megatron-LM writes it with "
                        f"{MEGATRON_FLAG} only; add {MEGATRON_FLAG} or use --ckpt-format "
                        f"torch_dist")
    if optimizer.use_megatron_fsdp:
        problems += _megatron_fsdp_problems(optimizer, parallel, checkpoint, training)
    elif optimizer.use_torch_fsdp2:
        problems += _torch_fsdp2_problems(optimizer, parallel, checkpoint, training)
    return problems


def _megatron_fsdp_problems(optimizer, parallel, checkpoint, training):
    strategy, flag = optimizer.data_parallel_sharding_strategy, _flag(optimizer)
    pp = parallel.pipeline_model_parallel_size
    rules = [
        (not optimizer.use_torch_fsdp2,
         f"{FLAG} and {MEGATRON_FLAG} are two FSDPs (Megatron-LM's checks cannot pass both: "
         f"their checkpoint formats differ); give one"),
        (checkpoint.ckpt_format == "fsdp_dtensor",
         f"--ckpt-format {checkpoint.ckpt_format}: {MEGATRON_FLAG} saves --ckpt-format "
         f"fsdp_dtensor (Megatron-LM's rule); use it"),
        (optimizer.optimizer == "adam",
         f"--optimizer {optimizer.optimizer}: Megatron-FSDP takes Adam only (Megatron-LM's "
         f"rule); use --optimizer adam"),
        (not (strategy == "optim_grads_params"
              and training.check_weight_hash_across_dp_replicas_interval),
         "--check-weight-hash-across-dp-replicas-interval is not supported with "
         "optim_grads_params (Megatron-LM's rule: no replicas to compare); drop one"),
    ]
    if optimizer.fully_sharded:  # on FSDP2: its limits
        rules += [
            (pp == 1,
             f"--pipeline-model-parallel-size {pp}: {flag} runs on FSDP2 here, which shards "
             f"one whole model per rank; use --pipeline-model-parallel-size 1 or "
             f"--data-parallel-sharding-strategy optim"),
            (optimizer.num_distributed_optimizer_instances == 1,
             f"--num-distributed-optimizer-instances "
             f"{optimizer.num_distributed_optimizer_instances}: Megatron-FSDP's hybrid "
             f"sharding (HSDP) is not built for {flag}; drop it or use "
             f"--data-parallel-sharding-strategy optim"),
            (not training.check_weight_hash_across_dp_replicas_interval,
             f"--check-weight-hash-across-dp-replicas-interval: {flag} keeps no "
             f"data-parallel replicas of the params between steps; drop one"),
            (not training.test_mode,
             f"--test-mode compares data-parallel replicas, which {flag} does not keep; "
             f"drop one"),
        ]
    elif strategy == "no_shard" and optimizer.num_distributed_optimizer_instances > 1:
        rules.append((False, f"--num-distributed-optimizer-instances "
                             f"{optimizer.num_distributed_optimizer_instances}: {flag} "
                             f"shards no optimizer state to copy; drop one"))
    return [line for ok, line in rules if not ok]


def _torch_fsdp2_problems(optimizer, parallel, checkpoint, training):
    pp, ep = parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size
    tp, etp = parallel.tensor_model_parallel_size, parallel.expert_tensor_parallel_size
    rules = [
        (pp == 1,
         f"--pipeline-model-parallel-size {pp}: {FLAG} shards one whole model per rank; use "
         f"--pipeline-model-parallel-size 1"),
        (ep == 1,
         f"--expert-model-parallel-size {ep}: {FLAG} shards the experts over DP x CP too; use "
         f"--expert-model-parallel-size 1"),
        (etp in (None, tp),
         f"--expert-tensor-parallel-size {etp}: {FLAG} shards every param over one DP x CP "
         f"group; give it the --tensor-model-parallel-size ({tp})"),
        (not optimizer.use_distributed_optimizer,
         f"--use-distributed-optimizer: {FLAG} shards the optimizer state already; drop one"),
        (checkpoint.ckpt_format == "torch_dist",
         f"--ckpt-format {checkpoint.ckpt_format}: {FLAG} saves each rank's shards; use "
         f"--ckpt-format torch_dist"),
        (optimizer.optimizer == "adam",
         f"--optimizer {optimizer.optimizer}: Muon orthogonalizes whole matrices, which {FLAG} "
         f"holds in pieces; use --optimizer adam"),
        (not training.check_weight_hash_across_dp_replicas_interval,
         f"--check-weight-hash-across-dp-replicas-interval: {FLAG} keeps no data-parallel "
         f"replicas to compare; drop one"),
        (not training.test_mode,
         f"--test-mode compares data-parallel replicas, which {FLAG} does not keep; drop one"),
    ]
    return [line for ok, line in rules if not ok]


def megatron_fsdp_flag_problems(args):
    """Megatron-LM's rules for --use-megatron-fsdp (and for its hybrid-sharding flags) that
    involve flags of the compat table (megatron_cp/cli/megatron_flags.py), read before the
    table drops them from ``args``; one line each."""
    given = vars(args)
    hybrid = given.get("num_distributed_optimizer_instances", 1) > 1
    rules = [
        (not (hybrid and given.get("outer_dp_sharding_strategy") == "optim"),
         "--outer-dp-sharding-strategy optim: sharding the optimizer state over the outer "
         "group of Megatron-FSDP's hybrid sharding is not built (Megatron-LM takes it with "
         "optim_grads_params only); drop it (no_shard: the K optimizer copies of "
         "--num-distributed-optimizer-instances)"),
    ]
    if not given.get("use_megatron_fsdp"):
        return [line for ok, line in rules if not ok]
    rules += [
        (not (given.get("moe_single_grouped_weight") or given.get("moe_single_grouped_bias")),
         "--moe-single-grouped-weight / --moe-single-grouped-bias: Megatron-FSDP does not "
         "support single grouped MoE params (Megatron-LM's rule); drop them"),
        (not (given.get("init_model_with_meta_device")
              and given.get("data_parallel_sharding_strategy") == "no_shard"),
         "--init-model-with-meta-device is not supported or needed with "
         "--data-parallel-sharding-strategy no_shard (Megatron-LM's rule); drop one"),
        (not ((given.get("fsdp_double_buffer") or given.get("megatron_fsdp_max_pool_double_buffer"))
              and given.get("overlap_moe_expert_parallel_comm")),
         "--fsdp-double-buffer: Megatron-FSDP's 1F1B overlap "
         "(--overlap-moe-expert-parallel-comm) does not support the double buffer "
         "(Megatron-LM's rule); drop one"),
    ]
    return [line for ok, line in rules if not ok]


def apply_megatron_fsdp(args):
    """Map --use-megatron-fsdp onto megatron_cp's machinery (the table in docs/parallelism.md):
    optim is the distributed optimizer, no_shard plain DDP, optim_grads and optim_grads_params
    FSDP2 (:attr:`~megatron_cp.config.optimizer.OptimizerConfig.fully_sharded`). Megatron-FSDP v1
    steps its own sharded optimizer whatever --use-distributed-optimizer says, so here the
    strategy decides it; the parameter all-gather overlap of a strategy without the
    distributed optimizer is FSDP2's prefetch (or nothing to gather). Returns the start-up
    notes."""
    if not args.use_megatron_fsdp:
        return []
    strategy, notes = args.data_parallel_sharding_strategy, []
    args.use_distributed_optimizer = strategy == "optim"
    if args.overlap_param_gather and strategy != "optim":
        args.overlap_param_gather = False
        notes.append(f"--overlap-param-gather: under --data-parallel-sharding-strategy "
                     f"{strategy} " + ("FSDP2 prefetches the next layer's all-gather itself"
                                       if strategy != "no_shard" else
                                       "no parameter is sharded, so none is gathered"))
    if args.overlap_grad_reduce and strategy in ("optim_grads", "optim_grads_params"):
        notes.append(f"--overlap-grad-reduce: under --data-parallel-sharding-strategy "
                     f"{strategy} FSDP2 reduce-scatters each layer's gradients as soon as its "
                     f"backward is done")
    return notes


def _expert_modules(module):
    """The outermost submodules all of whose params are routed experts' (``is_expert``):
    the modules whose forward runs the experts, each one FSDP unit."""
    found, inside = [], set()
    for sub in module.modules():
        if id(sub) in inside:
            continue
        params = list(sub.parameters())
        if params and all(getattr(p, "is_expert", False) for p in params):
            found.append(sub)
            inside.update(id(m) for m in sub.modules())
    return found


def is_fully_sharded(model_chunks):
    """True when the chunks are :class:`TorchFullyShardedDataParallel` wrappers."""
    return any(isinstance(c, TorchFullyShardedDataParallel) for c in model_chunks)


class TorchFullyShardedDataParallel(nn.Module):
    """Wrap ``module`` (a GPTModel) in FSDP2 over the ``dp_cp`` group of ``state``; the same
    interface as :class:`~megatron_cp.distributed.data_parallel.DistributedDataParallel`.

    ``unit_types``: the module classes that each become one FSDP unit (the transformer
    layers); ``offload_params``: FSDP2's CPUOffloadPolicy, the rows, their gradients and
    ``main_grad`` in host memory (``pin_memory``: page-locked, on a GPU) -- what
    --optimizer-cpu-offload with an offload fraction of 1 is under FSDP2; ``grad_check(index, grad)``, when set, sees each param's reduced local shard
    gradient in :meth:`finish_grad_sync` (FSDP reduces inside backward, so the rerun checks
    see this rank's shard of the summed gradient, not its own part before the reduction).
    """

    use_distributed_optimizer = False

    def __init__(self, module, state, unit_types, params_dtype=torch.float32,
                 reshard_after_forward=True, keep_params_whole=False, offload_params=False,
                 pin_memory=True, fp8_param_gather=False):
        super().__init__()
        self.module, self.state = module, state
        self.offload_params = offload_params  # the rows and their main_grad live on the host
        self.grad_check = None
        self.keep_params_whole = keep_params_whole
        half = params_dtype in (torch.bfloat16, torch.float16)
        # fully_shard replaces each param by a DTensor and drops the attributes set on it
        # (tensor_model_parallel, sequence_parallel, ...): keep them and put them back.
        attrs = {name: dict(vars(p)) for name, p in module.named_parameters()}
        for name, param in module.named_parameters():
            if param.dtype != params_dtype:
                raise ValueError(f"{name} is {param.dtype} in a {params_dtype} model; {FLAG} "
                                 f"computes every param of a layer in one dtype")
            if half:
                param.data = param.data.float()  # the fp32 master (module docstring)
        if fp8_param_gather:  # the FP8 linears' weights gathered in FP8 (fsdp_fp8.py)
            if any(p.is_meta for p in module.parameters()):
                raise ValueError("fp8_param_gather with FSDP2 and init_model_with_meta_device "
                                 "is not built; drop --init-model-with-meta-device")
            wrap_fp8_masters(module, params_dtype)
        mesh = DeviceMesh.from_group(state.group("dp_cp"), state.device.type)
        # inputs keep their dtypes: the model casts what it computes with itself
        policy = MixedPrecisionPolicy(param_dtype=params_dtype if half else None,
                                      reduce_dtype=torch.float32, cast_forward_inputs=False)
        settings = dict(mesh=mesh, reshard_after_forward=reshard_after_forward and
                        not keep_params_whole, mp_policy=policy)
        if offload_params:  # --optimizer-cpu-offload of every row: FSDP2's own host offload
            settings["offload_policy"] = CPUOffloadPolicy(
                pin_memory=pin_memory and state.device.type == "cuda")
        # routed experts (EP > 1 or not) are their own units over the expert-DP group, the
        # ranks that hold the same experts, as the DDP reduces their gradients
        experts = _expert_modules(module)
        if experts:
            expert_mesh = DeviceMesh.from_group(state.group("edp"), state.device.type)
            for unit in experts:
                fully_shard(unit, **{**settings, "mesh": expert_mesh})
        units = [m for m in module.modules() if isinstance(m, tuple(unit_types))]
        for unit in units:
            fully_shard(unit, **settings)
        fully_shard(module, **settings)
        self.units = experts + units + [module]
        for unit in self.units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            if keep_params_whole:  # ZeRO-2: gathered once per step (reshard_params)
                unit.set_reshard_after_backward(False)
        for name, param in module.named_parameters():
            for key, value in attrs[name].items():
                setattr(param, key, value)
            if half:
                param.compute_dtype = params_dtype
        # built on the meta device (--init-model-with-meta-device): draw this rank's rows now
        materialize(module, state.device)
        if fp8_param_gather:
            # FSDP2 re-pads an unevenly sharded param's rows into new storage at its lazy init
            # when they are a tensor subclass (its reset_sharded_param): do it now, before the
            # optimizer takes views of the rows
            module._get_fsdp_state()._lazy_init()
        self.params = []
        for param in module.parameters():
            if param.requires_grad:
                flat, _, _ = local_shard(param)
                param.main_grad = torch.zeros(flat.numel(), dtype=torch.float32,
                                              device=flat.device)  # [local numel]
                param.register_post_accumulate_grad_hook(self._accumulate_hook)
                self.params.append(param)

    def forward(self, *args, **kwargs):
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    @staticmethod
    def _accumulate_hook(param):
        param.main_grad.add_(local_tensor(param.grad).reshape(-1))  # fp32 over microbatches
        param.grad = None

    def no_sync(self):
        """Every microbatch reduce-scatters its gradients (nothing unsharded is kept)."""
        return contextlib.nullcontext()

    def finish_grad_sync(self):
        """FSDP reduced every gradient during backward; run the rerun checks on the shards.
        Params kept whole (ZeRO-2) are freed here, after the step's last backward: the module
        holds its sharded params again (what the gradient steps after this read), and the
        next forward gathers them updated."""
        self.reshard_params()
        if self.grad_check is not None:
            for index, param in enumerate(self.params):
                self.grad_check(index, param.main_grad)

    def zero_grad_buffer(self):
        """Zero every ``main_grad`` (call once per step, before the first microbatch)."""
        for param in self.params:
            param.main_grad.zero_()
            param.grad = None

    def start_param_sync(self, force_sync=False):
        """Nothing to gather after a step: FSDP gathers each layer when it runs."""

    def reshard_params(self):
        """Free the gathered params (kept whole with ``keep_params_whole``), so the next
        forward gathers the updated shards: after the step's last backward, after each step
        (an evaluation may have gathered them) and after a load."""
        if self.keep_params_whole:
            for unit in self.units:
                unit.reshard()

    def finish_param_sync(self):
        """Nothing is in flight between steps."""

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (DTensor values)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Load into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
