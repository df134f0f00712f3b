"""A checkpoint's model on this rank, for inference: its chunks, tokenizer and config.

:class:`InferenceModel` builds the model chunks this rank holds in the parallel layout of the
run's sections (TP shards, the pipeline stage and its virtual stages) exactly as training
builds them, in eval mode and without gradients, then loads their weights from ``--load`` with
the training run's loader (:class:`~megatron_cp.checkpoint.checkpointer.Checkpointer`): any
checkpoint format, saved under any layout. Only the weights are read: the TrainState it loads
has no optimizer, schedule or rerun machine, and no DDP wrapper or optimizer is built.
"""
from dataclasses import replace

import torch

from megatron_cp.checkpoint import files as checkpoint_files
from megatron_cp.checkpoint import load_save, megatron_lm_format
from megatron_cp.checkpoint.checkpointer import Checkpointer
from megatron_cp.checkpoint.train_state import TrainState
from megatron_cp.model import GPTModel
from megatron_cp.pipeline_parallel import build_model_chunks, layout_from_config
from megatron_cp.observability.run_report import print_rank_0


def check_checkpoint(checkpoint, data):
    """ValueError unless the checkpoint section's ``--load`` names a folder with a checkpoint
    and the data section names a tokenizer (before any group starts)."""
    if not checkpoint.load:
        raise ValueError("give --load DIR, the checkpoint to evaluate or generate from "
                         "(with --use-checkpoint-args for its model and tokenizer flags)")
    if checkpoint_files.load_iteration(checkpoint.load, checkpoint.ckpt_step) is None:
        raise ValueError(f"--load {checkpoint.load}: no checkpoint there (no "
                         f"{checkpoint_files.TRACKER}); give the --save folder of a training run")
    if data.tokenizer_type is None and data.vocab_size is None:
        raise ValueError("no tokenizer: add --use-checkpoint-args (the checkpoint names it) or "
                         "give --tokenizer-type and its files")


def _saved_vocab_size(root, step=None):
    """The real vocabulary size the latest checkpoint under ``root`` (``--ckpt-step``'s when
    given) was trained with (None if it does not say); its tensors are mapped, not read."""
    it = checkpoint_files.load_iteration(root, step)
    if megatron_lm_format.is_megatron_lm(checkpoint_files.iteration_dir(root, it)):
        return load_save.saved_args(root, step).get("true_vocab_size")  # a pickled Namespace
    path = load_save.args_file(root, step)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # noqa: BLE001 - a damaged file: the checked read names it
        payload = {"args": load_save.saved_args(root, step)}
    return payload["args"].get("true_vocab_size")


class InferenceModel:
    """This rank's model chunks of the checkpoint under ``run.checkpoint.load``, loaded, in
    eval mode.

    ``run``: the :class:`~megatron_cp.config.run.RunConfig` of the script's checked arguments,
    built with ``tokenizer``'s vocabulary (:func:`megatron_cp.inference.launch.load_model`
    builds both). ``checkpoint_args``: the parsed arguments, which the load compares with the
    checkpoint's saved ones for the model's shape (the TrainState's ``args``).

    Attributes: ``run`` (its checkpoint section set to load the weights only), ``state``,
    ``device``, ``tokenizer``, ``config`` (the GPTConfig), ``model_chunks`` (one per virtual
    stage of this pipeline rank), ``iteration`` (of the checkpoint).
    """

    def __init__(self, run, state, tokenizer, *, checkpoint_args):
        load, step = run.checkpoint.load, run.checkpoint.ckpt_step
        check_checkpoint(run.checkpoint, run.data)
        # weights only: the optimizer, schedule and RNG of the run stay in the checkpoint
        self.run = replace(run, checkpoint=load_save.weights_only(run.checkpoint))
        self.state, self.device, self.tokenizer = state, state.device, tokenizer
        self.config = run.model
        saved = _saved_vocab_size(load, step)
        if saved is not None and saved != self.config.vocab_size:
            raise ValueError(f"the tokenizer has {self.config.vocab_size} tokens but the "
                             f"checkpoint under {load} was trained with {saved}; use its "
                             f"tokenizer (--use-checkpoint-args)")
        if state.size("pp") > 1:
            layout = layout_from_config(run.parallel, run.model.num_layers, run.model.mtp_num_layers)
            chunks = build_model_chunks(self.config, state, layout)
        else:
            chunks = [GPTModel(self.config, state=state, device=self.device)]
        for chunk in chunks:
            chunk.eval()
            chunk.requires_grad_(False)
        self.model_chunks = chunks
        print_rank_0(f"> loading weights from {load} ...")
        weights = TrainState(model_chunks=chunks, parallel_state=state, model_config=self.config,
                             args=checkpoint_args)  # no optimizer, schedule or rerun machine
        Checkpointer(self.run.checkpoint, run.parallel, run.optimizer).load(weights)
        self.iteration = checkpoint_files.load_iteration(load, step)
        print_rank_0(f" loaded the weights of iteration {self.iteration} "
                     f"(TP={state.size('tp')}, CP={state.size('cp')}, PP={state.size('pp')}, "
                     f"DP={state.size('dp')})")

    @property
    def is_last_stage(self):
        """Whether this rank computes the logits (the last pipeline stage)."""
        return self.state.is_pipeline_last_stage

    def vocab_size(self):
        """The real vocabulary size (without the TP padding)."""
        return self.config.vocab_size

    @torch.no_grad()
    def agree(self, tensor):
        """``tensor`` as held by the last pipeline stage (TP rank 0), on every rank of this
        model replica: a broadcast over TP on the last stage, then over PP."""
        import torch.distributed as dist
        st = self.state
        if st.is_pipeline_last_stage and st.size("tp") > 1:
            dist.broadcast(tensor, src=st.group_ranks("tp")[0], group=st.group("tp"))
        if st.size("pp") > 1:
            dist.broadcast(tensor, src=st.group_ranks("pp")[-1], group=st.group("pp"))
        return tensor
