"""Megatron-LM compatible command line: parse, derive and validate, before any process group.

Flag names and meanings follow Megatron-LM so existing launch scripts carry over. Every
check that can be made from the arguments and the world size is made here, so bad input
fails with a clear ValueError before any collective starts.
"""
import argparse
import math

import torch

from megatron_cp.initialize import validate_sizes
from megatron_cp.pipeline_parallel.stages import (validate_interleaved_microbatches,
                                                  virtual_pipeline_size)

# Parallel dimensions whose issue has not landed yet: accepted, then refused with this note.
NOT_YET_BUILT = {
    "context_parallel_size": "context parallelism",
    "expert_model_parallel_size": "expert parallelism (MoE)",
}


def _model_args(p):
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, required=True, help="Transformer hidden size.")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP hidden size (default 4 x hidden size).")
    g.add_argument("--num-attention-heads", type=int, required=True, help="Number of attention heads.")
    g.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="Number of KV head groups with --group-query-attention.")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Per-head dimension (default hidden size / heads).")
    g.add_argument("--seq-length", type=int, required=True, help="Training sequence length.")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Size of the position table (default seq length).")
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"],
                   default="learned_absolute", help="Position embedding type.")
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base frequency.")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="Fraction of head dims rotated.")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="Normalization layer type.")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the norms.")
    g.add_argument("--swiglu", action="store_true", help="Use the SwiGLU activation in the MLP.")
    g.add_argument("--disable-bias-linear", action="store_true", help="No biases in linear layers.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate input embedding and output layer weights.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on hidden states.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probs.")
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight init.")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocab to a multiple of this times the TP size.")
    g.add_argument("--num-experts", type=int, default=None, help="Number of MoE experts.")


def _training_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True, help="Samples per microbatch per DP rank.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step (default micro batch x DP).")
    g.add_argument("--train-iters", type=int, default=None, help="Number of optimizer steps.")
    g.add_argument("--train-samples", type=int, default=None, help="Train for this many samples instead.")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate at the end of decay.")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear", help="Learning rate decay after warmup.")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warmup iterations.")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warmup as a fraction of the decay iterations.")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Decay iterations (default train iters).")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Gradient clipping by global norm (0: off).")
    g.add_argument("--seed", type=int, default=1234, help="Random seed (init, data, dropout).")
    g.add_argument("--bf16", action="store_true", help="bf16 model with fp32 main params.")
    g.add_argument("--fp16", action="store_true", help="fp16 model with fp32 main params and loss scaling.")
    g.add_argument("--loss-scale", type=float, default=None, help="Constant loss scale for fp16.")
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32, help="Initial dynamic loss scale.")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale.")
    g.add_argument("--loss-scale-window", type=int, default=1000, help="Good steps before the scale grows.")
    g.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before backing off.")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="Activation recomputation granularity.")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="Which layers to recompute with full granularity.")
    g.add_argument("--recompute-num-layers", type=int, default=1,
                   help="Layers per recompute chunk (uniform) or recomputed layers (block).")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Overlap the DP gradient all-reduce with backward.")
    g.add_argument("--exit-interval", type=int, default=None, help="Exit after iterations divisible by this.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, help="Exit after this many minutes.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM, save a checkpoint and exit cleanly.")


def _parallel_args(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor parallel size.")
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (with TP).")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline parallel size.")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Layers per virtual stage (interleaved 1F1B).")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Layers on the first pipeline stage.")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Layers on the last pipeline stage.")
    g.add_argument("--pipeline-seq-length", type=int, default=None,
                   help="Sequence length of the fixed pipeline P2P buffers (default --seq-length): "
                        "every microbatch is padded to it. Raise it above --seq-length for packed "
                        "documents under context parallelism, which pad each document to a "
                        "multiple of 2 x CP.")
    g.add_argument("--overlap-p2p-comm", action="store_true",
                   help="Post the pipeline P2P sends/receives asynchronously and wait for them only "
                        "when the data is needed, hiding their latency behind the forward/backward "
                        "compute (1F1B and interleaved 1F1B; no effect at PP=1).")
    g.add_argument("--context-parallel-size", type=int, default=1, help="Context parallel size.")
    g.add_argument("--cp-comm-type", choices=["p2p", "a2a", "a2a+p2p", "all_gather", "auto"],
                   default="p2p", help="Context-parallel attention communication.")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None,
                   help="Inner (a2a) and outer (p2p) CP sizes for a2a+p2p.")
    g.add_argument("--no-cp-dummy-heads", action="store_true",
                   help="Refuse Ulysses padding with dummy heads when heads % CP != 0.")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="Expert parallel size.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=1, help="Expert tensor parallel size.")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="torch.distributed backend (default nccl with CUDA, else gloo).")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="Timeout of collectives, in minutes.")


def _data_args(p):
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Dataset prefixes, optionally weighted: 'A' or '0.3 A 0.7 B'.")
    g.add_argument("--split", default="969,30,1", help="Train,valid,test split weights.")
    g.add_argument("--mock-data", action="store_true", help="Synthetic tokens instead of --data-path.")
    g.add_argument("--data-cache-path", default=None, help="Where index files are cached.")
    g.add_argument("--tokenizer-type", default=None,
                   choices=["SentencePieceTokenizer", "GPT2BPETokenizer", "NullTokenizer"],
                   help="Tokenizer class.")
    g.add_argument("--tokenizer-model", default=None, help="sentencepiece model file.")
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json.")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt.")
    g.add_argument("--vocab-size", type=int, default=None, help="Vocab size for NullTokenizer.")
    g.add_argument("--reset-position-ids", action="store_true", help="Restart position ids after each EOD.")
    g.add_argument("--reset-attention-mask", action="store_true", help="Keep attention inside documents.")
    g.add_argument("--eod-mask-loss", action="store_true", help="No loss on EOD tokens.")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes.")


def _io_args(p):
    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None, help="Checkpoint directory to save to.")
    g.add_argument("--load", default=None, help="Checkpoint directory to resume from.")
    g.add_argument("--save-interval", type=int, default=None, help="Save every this many iterations.")
    g.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer state.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not load RNG state.")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="On load, take the LR schedule from the arguments, not the checkpoint.")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="On load, take the LR schedule from the checkpoint, not the arguments.")
    g.add_argument("--finetune", action="store_true",
                   help="Load weights only and start from iteration 0.")
    g.add_argument("--log-interval", type=int, default=100, help="Print a log line every this many iterations.")
    g.add_argument("--eval-interval", type=int, default=1000, help="Evaluate every this many iterations.")
    g.add_argument("--eval-iters", type=int, default=100, help="Batches per evaluation.")
    g.add_argument("--tensorboard-dir", default=None, help="Write tensorboard logs here.")


def build_parser():
    """The argparse parser with every flag (and its help)."""
    p = argparse.ArgumentParser(description="megatron_cp GPT pretraining", allow_abbrev=False)
    for add in (_model_args, _training_args, _parallel_args, _data_args, _io_args):
        add(p)
    return p


def parse_args(argv=None, world_size=1, built=("tensor", "data", "context")):
    """Parse ``argv``, fill derived values and validate against ``world_size``."""
    args = build_parser().parse_args(argv)
    return validate_args(args, world_size, built)


def validate_args(args, world_size, built=("tensor", "data", "context")):
    """Derive defaults (DP size, batch sizes, dtype) and raise ValueError on bad combinations."""
    for name, what in NOT_YET_BUILT.items():
        if getattr(args, name) > 1 and what.split()[0] not in built:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: {what} is not built "
                             f"yet in this version of megatron_cp; set it to 1")
    if args.num_experts:
        raise ValueError(f"--num-experts {args.num_experts}: MoE layers are not built yet in this "
                         f"version of megatron_cp; drop the flag for a dense model")
    args.world_size = world_size
    args.data_parallel_size = validate_sizes(
        world_size, args.tensor_model_parallel_size, args.context_parallel_size,
        args.pipeline_model_parallel_size, args.expert_model_parallel_size,
        args.expert_tensor_parallel_size)
    tp, dp = args.tensor_model_parallel_size, args.data_parallel_size
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are exclusive; pick one")
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp) != 0:
        raise ValueError(f"--global-batch-size ({args.global_batch_size}) must be divisible by "
                         f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size ({dp}); "
                         f"use a multiple of {args.micro_batch_size * dp}")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    _validate_pipeline(args)
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    for name in ("num_attention_heads", "num_query_groups"):
        if getattr(args, name) % tp != 0:
            raise ValueError(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp})")
    if args.num_attention_heads % args.num_query_groups != 0:
        raise ValueError(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
                         f"--num-query-groups ({args.num_query_groups})")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads != 0:
        raise ValueError(f"--hidden-size ({args.hidden_size}) must be divisible by "
                         f"--num-attention-heads ({args.num_attention_heads}), or give --kv-channels")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and \
            args.max_position_embeddings < args.seq_length:
        raise ValueError(f"--max-position-embeddings ({args.max_position_embeddings}) must be at least "
                         f"--seq-length ({args.seq_length}) with learned absolute positions")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron turns it off silently for TP=1
    cp = args.context_parallel_size
    split = 2 * cp if cp > 1 else 1
    if args.seq_length % (split * (tp if args.sequence_parallel else 1)) != 0:
        raise ValueError(f"--seq-length ({args.seq_length}) must be divisible by "
                         f"{'2 x CP (' + str(2 * cp) + ')' if cp > 1 else '1'}"
                         f"{' x TP (' + str(tp) + ') for sequence parallelism' if args.sequence_parallel else ''}")
    if args.train_iters is None and args.train_samples is None:
        raise ValueError("give --train-iters (or --train-samples)")
    if args.train_iters is None:
        args.train_iters = math.ceil(args.train_samples / args.global_batch_size)
    if args.lr is None:
        raise ValueError("give --lr, the peak learning rate")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters >= args.lr_decay_iters and args.lr_warmup_iters > 0:
        raise ValueError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than "
                         f"--lr-decay-iters ({args.lr_decay_iters}, default --train-iters); "
                         f"shorten the warmup or lengthen the decay")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
    if not args.mock_data:
        if not args.data_path:
            raise ValueError("no data: give --data-path PREFIX (from tools/preprocess_data.py) "
                             "or --mock-data")
        if args.tokenizer_type is None:
            raise ValueError("--data-path needs --tokenizer-type (and its model or vocab files)")
    if args.tokenizer_type == "SentencePieceTokenizer" and not args.tokenizer_model:
        raise ValueError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if (args.tokenizer_type == "NullTokenizer" or (args.mock_data and args.tokenizer_type is None)) \
            and args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer (and --mock-data without a tokenizer) "
                         "needs --vocab-size")
    if args.exit_signal_handler and not args.save:
        raise ValueError("--exit-signal-handler saves a checkpoint on SIGTERM: give --save")
    if cp > 1 and args.attention_dropout > 0:
        raise ValueError(f"--attention-dropout ({args.attention_dropout}) is not supported inside "
                         f"context-parallel attention (--context-parallel-size {cp}); "
                         f"pass --attention-dropout 0")
    if args.hierarchical_context_parallel_sizes is not None:
        prod = math.prod(args.hierarchical_context_parallel_sizes)
        if prod != cp:
            raise ValueError(f"--hierarchical-context-parallel-sizes {args.hierarchical_context_parallel_sizes} "
                             f"multiply to {prod}, not --context-parallel-size ({cp})")
    if args.cp_comm_type == "a2a+p2p" and cp > 1 and args.hierarchical_context_parallel_sizes is None:
        raise ValueError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes U R")
    return args


def _validate_pipeline(args):
    """Stage split, virtual stages, interleaving's microbatch rule and the buffer length."""
    pp = args.pipeline_model_parallel_size
    args.virtual_pipeline_model_parallel_size = virtual_pipeline_size(
        args.num_layers, pp, args.num_layers_per_virtual_pipeline_stage,
        args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
    validate_interleaved_microbatches(args.num_microbatches, pp,
                                      args.virtual_pipeline_model_parallel_size)
    if args.pipeline_seq_length is None:
        args.pipeline_seq_length = args.seq_length
    if args.pipeline_seq_length < args.seq_length:
        raise ValueError(f"--pipeline-seq-length ({args.pipeline_seq_length}) must be at least "
                         f"--seq-length ({args.seq_length}): every microbatch is padded to it")
    if pp == 1:
        return
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    divisor = (2 * cp if cp > 1 else 1) * (tp if args.sequence_parallel else 1)
    if args.pipeline_seq_length % divisor != 0:
        raise ValueError(f"--pipeline-seq-length ({args.pipeline_seq_length}) must be divisible by "
                         f"{'2 x CP' if cp > 1 else '1'}{' x TP' if args.sequence_parallel else ''} "
                         f"= {divisor}; use a multiple of {divisor}")
    max_pos = args.max_position_embeddings or args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.pipeline_seq_length > max_pos:
        raise ValueError(f"--pipeline-seq-length ({args.pipeline_seq_length}) pads microbatches "
                         f"past --max-position-embeddings ({max_pos}) with learned absolute "
                         f"positions; raise --max-position-embeddings to at least "
                         f"{args.pipeline_seq_length} or use --position-embedding-type rope")
