"""megatron-core's own training loop on one CPU gloo process, as Megatron-LM's pretrain_gpt.py
runs it: its GPTDataset over a .bin/.idx corpus (its index builder, its sample order), its
DistributedDataParallel, its Adam (get_megatron_optimizer) and LR schedule, its schedule
(get_forward_backward_func) weighting each microbatch's loss, and a checkpoint saved the way
Megatron-LM's training saves one. Run inside a dist_harness worker (megatron-core keeps its
parallel state in module globals).

The loss function is pretrain_gpt.py's contract with the schedule (the masked loss sum, the
number of loss tokens, the [sum, tokens] report): the weighting itself, default or
``--calculate-per-token-loss``, is the schedule's (megatron/core/pipeline_parallel/
schedules.py), and the logged ``lm loss`` is Megatron-LM's training log's: the reports'
summed losses over their summed tokens.
"""
import contextlib
import os
from functools import partial

import numpy
import torch

import megatron_core_utils as mcu

SEQ, VOCAB = 32, 127  # NullTokenizer --vocab-size 127: 128 tokens with EOD, padded nowhere
MICRO, GLOBAL = 2, 8  # 4 microbatches of a global batch in one process
SAVED_AT, TRAIN_ITERS = 3, 8  # a checkpoint at iteration 3, then 5 more iterations
LR = dict(lr=1e-2, min_lr=1e-3, lr_warmup_iters=2, lr_decay_iters=TRAIN_ITERS,
          lr_decay_style="cosine", weight_decay=0.01)


def write_corpus(prefix, num_docs=120, seed=7):
    """A .bin/.idx corpus written by megatron-core's IndexedDatasetBuilder: documents of
    2 to 30 tokens, each ended by EOD, so under --eod-mask-loss every sample (and every CP
    part of it) has its own number of loss tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(num_docs):
        doc = rng.integers(0, VOCAB, size=int(rng.integers(2, 31))).tolist() + [VOCAB]
        builder.add_item(torch.tensor(doc, dtype=torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def our_flags(prefix):
    """Our command line for the same run (data, batch, schedule, optimizer)."""
    return (f"--data-path {prefix} --split 100,0,0 --tokenizer-type NullTokenizer "
            f"--vocab-size {VOCAB} --make-vocab-size-divisible-by 64 --seq-length {SEQ} "
            f"--max-position-embeddings {SEQ} --micro-batch-size {MICRO} "
            f"--global-batch-size {GLOBAL} --train-iters {TRAIN_ITERS} --lr {LR['lr']} "
            f"--min-lr {LR['min_lr']} --lr-warmup-iters {LR['lr_warmup_iters']} "
            f"--lr-decay-iters {LR['lr_decay_iters']} --lr-decay-style {LR['lr_decay_style']} "
            f"--weight-decay {LR['weight_decay']} --eod-mask-loss --eval-iters 0 "
            f"--log-interval 100 --hidden-dropout 0 --attention-dropout 0 --num-workers 0")


def _dataset(prefix, cache):
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"},
                                                  vocab_size=VOCAB)
    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, blend=([prefix], None),
                              split="100,0,0", path_to_cache=cache, tokenizer=tokenizer,
                              reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=True)
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [TRAIN_ITERS * GLOBAL, 0, 0], lambda: True, config).build()
    return train


def _batches(dataset):
    """Microbatches in Megatron's order (its pretraining sampler at DP=1: sample after
    sample), stacked as its data loader stacks them."""
    for start in range(0, len(dataset), MICRO):
        samples = [dataset[i] for i in range(start, start + MICRO)]
        yield {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
               for key in samples[0]}


def _loss_func(loss_mask, output_tensor):
    """pretrain_gpt.py's contract: (masked loss sum, loss tokens, {'lm loss': [sum, tokens]})."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                    num_tokens.view(1)])}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")


@contextlib.contextmanager
def _cuda_tensors_on_cpu():
    """While inside, torch's tensor factories make on the CPU what megatron-core asks to
    make on 'cuda' (its schedule's token counter, its optimizer's loss scale), and a CPU
    fp32 tensor names its type as the CUDA one (its gradient clipping asserts that)."""
    made = {name: getattr(torch, name) for name in FACTORIES}
    type_of = torch.Tensor.type

    def cuda_type(tensor, *args, **kwargs):
        name = type_of(tensor, *args, **kwargs)
        return "torch.cuda.FloatTensor" if name == "torch.FloatTensor" else name

    def on_cpu(make):
        def call(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)
        return call
    for name, make in made.items():
        setattr(torch, name, on_cpu(make))
    torch.Tensor.type = cuda_type
    try:
        yield
    finally:
        for name, make in made.items():
            setattr(torch, name, make)
        torch.Tensor.type = type_of


RUNS = [(kind, per_token) for kind in ("gpt", "llama") for per_token in (False, True)]


def checkpoint_dir(root, kind, per_token_loss):
    return os.path.join(root, f"{kind}_{'per_token' if per_token_loss else 'default'}")


def train_all(rank, world, prefix, root):
    """Worker: for each of RUNS, megatron-core trains the model kind from its initialisation
    for TRAIN_ITERS iterations with that loss weighting, saving at SAVED_AT (under
    checkpoint_dir) as Megatron-LM's training saves; {run: the logged lm loss of every
    iteration}."""
    with _cuda_tensors_on_cpu():
        return {run: _train(run[0], prefix, checkpoint_dir(root, *run), run[1]) for run in RUNS}


def _train(kind, prefix, root, per_token_loss):
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    model = mcu.build(kind, vocab=VOCAB + 1, seq=SEQ)
    model.config.calculate_per_token_loss = per_token_loss
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR["lr"], min_lr=LR["min_lr"],
                        weight_decay=LR["weight_decay"], clip_grad=1.0), [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR["lr"], min_lr=LR["min_lr"],
        lr_warmup_steps=LR["lr_warmup_iters"] * GLOBAL,
        lr_decay_steps=LR["lr_decay_iters"] * GLOBAL, lr_decay_style=LR["lr_decay_style"],
        start_wd=LR["weight_decay"], end_wd=LR["weight_decay"],
        wd_incr_steps=TRAIN_ITERS * GLOBAL, wd_incr_style="constant")
    config = model.config
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    data = _batches(_dataset(prefix, os.path.join(root, "index_cache")))
    forward_backward = get_forward_backward_func()
    losses = []
    for iteration in range(1, TRAIN_ITERS + 1):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(forward_step_func=_forward_step, data_iterator=data,
                                   model=[ddp], num_microbatches=GLOBAL // MICRO,
                                   seq_length=SEQ, micro_batch_size=MICRO, forward_only=False)
        ok, _, _ = optimizer.step()
        assert ok
        scheduler.step(increment=GLOBAL)
        total = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)  # [sum, tokens]
        losses.append((total[0] / total[1]).item())
        if iteration == SAVED_AT:
            mcu.save_checkpoint(model, optimizer, scheduler, kind, root, iteration,
                                dict(seq_length=SEQ, max_position_embeddings=SEQ,
                                     vocab_size=VOCAB, padded_vocab_size=VOCAB + 1,
                                     make_vocab_size_divisible_by=64, micro_batch_size=MICRO,
                                     global_batch_size=GLOBAL, train_iters=TRAIN_ITERS,
                                     calculate_per_token_loss=per_token_loss,
                                     eod_mask_loss=True, **LR))
    return losses
