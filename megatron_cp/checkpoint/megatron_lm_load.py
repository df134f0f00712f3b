"""A TrainState resumes from a checkpoint Megatron-LM wrote, in any layout.

Each rank reads the whole model once (:func:`megatron_lm_format.read`: Megatron's stacked
tensors as our full weights) and copies into its params the boxes it holds, the same boxes a
load of ours fills (:func:`megatron_cp.checkpoint.state.sharded_state`), so every TP / PP / EP /
DP layout and the distributed optimizer load it alike. What carries over: the weights,
the iteration, the consumed samples, the learning-rate schedule (its sample counts turned
into our iterations) and, when Megatron saved them in a form read here, the Adam moments
and step. One line at start-up says what does not (RNG states, Megatron's padded
vocabulary rows, an optimizer state it did not save). What it loads follows the
Checkpointer's sections: the checkpoint's (``ckpt.checkpoint``: ``--finetune``,
``--no-load-optim``) and the optimizer's (``ckpt.optimizer_config``), the TrainState's model
(``train_state.model_config``) and what the TrainState holds (no optimizer: the weights only).
"""
import torch

from megatron_cp.checkpoint import files, fp8_state
from megatron_cp.checkpoint import megatron_lm_format as megatron_lm
from megatron_cp.checkpoint import state as training_state
from megatron_cp.optimizer.inner import set_adam_step


def _canonical(tensor, global_shape):
    """Our canonical form of a full weight: its real vocabulary rows, the strided split
    dim of SwiGLU's fc1 (``[2 ffn, h]`` -> ``[2, ffn, h]``) as a view."""
    if tensor.shape[0] > global_shape[0] and tensor.dim() == len(global_shape):
        tensor = tensor[:global_shape[0]]
    return tensor.reshape(global_shape)


@torch.no_grad()
def _copy_into(pieces_by_key, full_by_key, folder):
    for key, pieces in pieces_by_key.items():
        if key not in full_by_key:
            raise ValueError(f"the Megatron-LM checkpoint {folder} has no tensor for our {key} "
                             f"(compare the model arguments, or --use-checkpoint-args)")
        pieces.fill_from(_canonical(full_by_key[key], pieces.global_shape))


def check_args(saved, train_state, folder):
    """The model of ``train_state`` must be the checkpoint's (its arguments ``saved``, ours):
    the shape of what the TrainState saves (its arguments), and the GELU of its model
    config."""
    files.check_args_match(saved, training_state.saved_arguments(train_state.args))
    model = train_state.model_config
    fused = bool(saved.get("bias_gelu_fusion"))
    if model.activation in ("gelu", "gelu_tanh") and fused != bool(model.bias_gelu_fusion):
        implied = "tanh (its bias-GELU fusion is on)" if fused else "exact (erf)"
        raise ValueError(f"the Megatron-LM checkpoint {folder} computes GELU {implied}; "
                         f"{'drop' if fused else 'pass'} --no-bias-gelu-fusion (or use "
                         f"--use-checkpoint-args) so the logits are Megatron-LM's")


def load(train_state, ckpt, root, it):
    """Load Megatron-LM's checkpoint of iteration ``it`` under ``root`` into ``train_state``;
    returns (iteration, consumed samples)."""
    st, checkpoint, opt = train_state.parallel_state, ckpt.checkpoint, train_state.optimizer
    optimizer = ckpt.optimizer_config.optimizer
    folder = files.iteration_dir(root, it)
    vocab = train_state.model_config.vocab_size
    full, moments, saved, common = megatron_lm.read(folder, vocab_rows=vocab)
    check_args(saved, train_state, folder)
    if opt is not None:
        opt.finish_param_sync()
    step = megatron_lm.adam_step(common)
    with_optimizer = (bool(moments) and step is not None and not checkpoint.finetune
                      and not checkpoint.no_load_optim and optimizer == "adam"
                      and opt is not None)
    state = training_state.sharded_state(train_state, with_optimizer, for_load=True)
    # its FP8 state is in Transformer Engine's _extra_state, which is not read: fresh here
    training_state.loads_fp8(train_state, {})
    state = fp8_state.without_fp8(state)
    tensors = {f"model.{name}": t for name, t in full.items()}
    if with_optimizer:
        moments.setdefault("main_param", full)  # fp32 training: the weights are the main params
        tensors.update({f"optimizer.{kind}.{name}": t for kind, per in moments.items()
                        for name, t in per.items()})
    _copy_into(state, tensors, folder)
    not_carried = ["RNG states (Megatron-LM's are CUDA generator states)"]
    padded = saved.get("padded_vocab_size")
    if padded and padded > vocab:
        not_carried.append(f"its {padded - vocab} padded vocabulary rows")
    if not with_optimizer:
        if opt is not None:
            opt.reload_model_params()
        not_carried.append("the optimizer state (" + (
            "--finetune" if checkpoint.finetune else "--no-load-optim" if checkpoint.no_load_optim
            else "no optimizer here" if opt is None
            else f"--optimizer {optimizer}" if optimizer != "adam"
            else "none saved in a form read here") + ")")
    else:
        set_adam_step(opt.optimizer, step)
        opt.after_load()  # --optimizer-cpu-offload: host main params of fp32 params
    iteration = 0 if checkpoint.finetune else int(common.get("iteration", it))
    consumed = 0 if checkpoint.finetune else int(saved.get("consumed_train_samples") or 0)
    scheduler = train_state.scheduler
    if not checkpoint.finetune and common.get("opt_param_scheduler") and scheduler is not None:
        scheduler.load_state_dict(megatron_lm.scheduler_state(
            common, saved["global_batch_size"], ckpt.optimizer_config.lr_counts_samples))
    elif not checkpoint.finetune and scheduler is not None:
        training_state.resume_schedule_only(train_state, ckpt, root, it, iteration, consumed)
    if st.global_rank == 0:
        print(f" loaded Megatron-LM checkpoint {root} at iteration {iteration} (weights, "
              f"iteration, consumed samples {consumed}, learning-rate schedule"
              f"{', Adam state' if with_optimizer else ''}); not carried over: "
              f"{'; '.join(not_carried)}", flush=True)
    return iteration, consumed
