"""Zero-shot evaluation of a checkpoint, with Megatron-LM's task names and flags.

Launched like training (the same parallel flags; any TP / CP / PP / DP layout, whatever
layout saved the checkpoint, torch or torch_dist)::

    torchrun --nproc-per-node 2 tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens \\
        --load CK --use-checkpoint-args --tensor-model-parallel-size 2 [--overlapping-eval 32]
    torchrun --nproc-per-node 2 tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl \\
        --load CK --use-checkpoint-args --pipeline-model-parallel-size 2 [--strict-lambada]

``--use-checkpoint-args`` takes the model's shape, its tokenizer and ``--seq-length`` (the
evaluation window) from the checkpoint; flags on the command line win. No training flag is
needed (``--micro-batch-size`` defaults to 1). WIKITEXT103 prints the average loss, the
token-level perplexity and the word-level ("adjusted") one; LAMBADA prints the accuracy.
A bad flag or input prints one ``error:`` line and exits with status 2.
"""
import os
import sys


from megatron_cp.inference.launch import run_inference_script
from megatron_cp.observability.run_report import print_rank_0

TASKS = ("WIKITEXT103", "LAMBADA")


def get_tasks_args(parser):
    """The tasks' own flags (Megatron-LM's names)."""
    g = parser.add_argument_group("tasks")
    g.add_argument("--task", choices=TASKS, required=True, help="The evaluation task.")
    g.add_argument("--valid-data", nargs="*", default=None,
                   help="The evaluation file: a text file (WIKITEXT103) or a jsonl of "
                        "{\"text\": passage} lines (LAMBADA).")
    g.add_argument("--overlapping-eval", type=int, default=None,
                   help="WIKITEXT103: stride of the sliding window (default --seq-length: no "
                        "overlap); each window scores only the tokens no earlier window scored.")
    g.add_argument("--strict-lambada", action="store_true",
                   help="LAMBADA: the target is the whitespace-delimited last word, tokenized "
                        "on its own (Megatron's strict mode); by default the tokenizer's split "
                        "of the last word in the tokenized passage.")
    return parser


def check_task_args(args):
    """ValueError for a task flag that cannot work (before any process group starts)."""
    if args.task is None:
        raise ValueError(f"give --task, one of {', '.join(TASKS)}")
    if not args.valid_data or len(args.valid_data) != 1:
        raise ValueError(f"give one evaluation file: --valid-data FILE (got "
                         f"{args.valid_data or 'none'})")
    if not os.path.isfile(args.valid_data[0]):
        raise ValueError(f"--valid-data {args.valid_data[0]}: no such file")
    if args.overlapping_eval is not None:
        if args.task != "WIKITEXT103":
            raise ValueError("--overlapping-eval sets the WIKITEXT103 window stride; drop it for "
                             f"--task {args.task}")
        if not 1 <= args.overlapping_eval <= args.seq_length:
            raise ValueError(f"--overlapping-eval ({args.overlapping_eval}) must lie in [1, "
                             f"--seq-length ({args.seq_length})]")
    if args.strict_lambada and args.task != "LAMBADA":
        raise ValueError(f"--strict-lambada applies to --task LAMBADA, not {args.task}")


def run_task(args, state):
    """Load the checkpoint, evaluate ``args.task`` and return its result dict (every rank)."""
    from megatron_cp.inference.launch import load_model
    from tasks.zeroshot.evaluate import evaluate_lambada, evaluate_wikitext
    model = load_model(args, state)
    print_rank_0(f"> evaluating {args.task} on {args.valid_data[0]} ...")
    if args.task == "WIKITEXT103":
        return evaluate_wikitext(model, args.valid_data[0], args.overlapping_eval)
    return evaluate_lambada(model, args.valid_data[0], args.strict_lambada)


def format_result(result):
    """The result line(s) of a task, Megatron-style."""
    if result["task"] == "WIKITEXT103":
        return (f"WIKITEXT103 | windows: {result['num_windows']} | tokens: "
                f"{result['num_tokenized_tokens']} | words: {result['num_original_tokens']} | "
                f"avg loss: {result['avg_loss']:.4E} | token-level ppl: {result['ppl']:.4E} | "
                f"word-level (adjusted) ppl: {result['adjusted_ppl']:.4E} | token ratio: "
                f"{result['token_ratio']:.4f}")
    return (f"LAMBADA{' (strict)' if result['strict'] else ''} | number correct: "
            f"{result['num_correct']} | total examples: {result['num_examples']} | "
            f"avg accuracy: {result['accuracy']:.4E}")


def main(argv=None):
    """Entry point: 0 on success, 2 after one ``error:`` line."""
    def body(args, state):
        print_rank_0(format_result(run_task(args, state)))
    return run_inference_script(body, argv, get_tasks_args, check_task_args)


if __name__ == "__main__":
    sys.exit(main())
