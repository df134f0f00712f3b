"""Generate text from a checkpoint, launched like training (torchrun, the same TP / PP flags).

    python tools/run_text_generation.py --load CK --use-checkpoint-args \\
        --prompt "The for statement" --max-new-tokens 32 --greedy
    torchrun --nproc-per-node 2 tools/run_text_generation.py --load CK --use-checkpoint-args \\
        --tensor-model-parallel-size 2 --prompt "import os" --prompt "class" \\
        --temperature 0.8 --top-p 0.9 --seed 7

``--use-checkpoint-args`` takes the model and its tokenizer from the checkpoint. Each
``--prompt`` is tokenized and continued by up to ``--max-new-tokens`` tokens: the most
likely one each step with ``--greedy``, else sampled (``--temperature``, ``--top-k``,
``--top-p``) from a generator seeded with ``--seed`` plus the prompt's number, so a run is
repeatable whatever the layout. A sequence stops at the end-of-document token; with learned
absolute positions it stops at ``--max-position-embeddings`` tokens. Decoding keeps a
key/value cache (``--no-kv-cache`` recomputes the whole sequence each step). With data
parallelism the prompts are shared out over the model replicas. Global rank 0 prints, per
prompt, the prompt and its completion. A bad flag prints one ``error:`` line (status 2).
"""
import sys


import torch.distributed as dist

from megatron_cp.inference.launch import run_inference_script
from megatron_cp.inference.sampling import SamplingParams
from megatron_cp.observability.run_report import print_rank_0

SAMPLING_FLAGS = (("--temperature", "temperature"), ("--top-k", "top_k"), ("--top-p", "top_p"))


def get_generation_args(parser):
    """The generation flags."""
    g = parser.add_argument_group("text generation")
    g.add_argument("--prompt", action="append", default=None,
                   help="Text to continue (repeat the flag for several prompts).")
    g.add_argument("--max-new-tokens", type=int, default=32,
                   help="Tokens to generate at most (default 32).")
    g.add_argument("--greedy", action="store_true", help="Take the most likely token each step.")
    g.add_argument("--temperature", type=float, default=None,
                   help="Sampling: divide the logits by this (default 1.0).")
    g.add_argument("--top-k", type=int, default=None,
                   help="Sampling: keep the k most likely tokens (default 0: all).")
    g.add_argument("--top-p", type=float, default=None,
                   help="Sampling: keep the most likely tokens up to this total probability "
                        "(default 0: all).")
    g.add_argument("--no-kv-cache", action="store_true",
                   help="Recompute the whole sequence each step instead of caching keys and "
                        "values (slower; the same tokens).")
    return parser


def sampling_params(args):
    """The SamplingParams of the flags; ValueError for a contradiction."""
    given = [flag for flag, name in SAMPLING_FLAGS if getattr(args, name) is not None]
    if args.greedy and given:
        raise ValueError(f"--greedy takes the most likely token; {', '.join(given)} only apply "
                         f"to sampling: drop one or the other")
    return SamplingParams(greedy=args.greedy,
                          temperature=1.0 if args.temperature is None else args.temperature,
                          top_k=args.top_k or 0, top_p=args.top_p or 0.0)


def check_generation_args(args):
    """ValueError for flags generation cannot honour (before any process group starts)."""
    if not args.prompt:
        raise ValueError("give at least one --prompt TEXT")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens ({args.max_new_tokens}) must be >= 1")
    if args.context_parallel_size > 1:
        raise ValueError(f"--context-parallel-size {args.context_parallel_size}: generation splits "
                         f"the model over TP and PP only; use --context-parallel-size 1")
    sampling_params(args)
    args.sequence_parallel = False  # a few new tokens per step: nothing to split over TP


def run_generation(args, state):
    """Load the checkpoint and continue every prompt; returns, on every rank, a list of
    ``{"prompt", "prompt_ids", "ids", "text"}`` (generated ids without the stop token)."""
    from megatron_cp.inference.generation import generate, max_total_length
    from megatron_cp.inference.launch import load_model
    model = load_model(args, state)
    tok, params = model.tokenizer, sampling_params(args)
    dp_rank, dp_size = prompt_share(state, model.config)
    mine = []
    for number in range(dp_rank, len(args.prompt), dp_size):
        prompt = args.prompt[number]
        ids = list(tok.tokenize(prompt))
        if not ids:
            raise ValueError(f"--prompt {prompt!r} has no tokens; give some text")
        limit = max_total_length(model.config, len(ids), args.max_new_tokens)
        if limit < len(ids) + args.max_new_tokens and state.rank("tp") == state.rank("pp") == 0:
            print(f" prompt {number}: generation stops at {limit} tokens, the size of the "
                  f"learned position table (max_position_embeddings)", flush=True)
        out = generate(model, [ids], args.max_new_tokens, params, seed=args.seed + number,
                       use_cache=not args.no_kv_cache, stop_token=tok.eod)
        new = out.new_tokens(0, tok.eod)
        mine.append((number, {"prompt": prompt, "prompt_ids": ids, "ids": new,
                              "text": tok.detokenize(new) if new else ""}))
    gathered = [mine]
    if dp_size > 1:
        gathered = [None] * dp_size
        dist.all_gather_object(gathered, mine, group=state.group("dp"))
    return [result for _, result in sorted(item for part in gathered for item in part)]


def prompt_share(state, config):
    """``(rank, number of ranks)`` the prompts are dealt over: the DP ranks, unless MoE layers
    exchange tokens between DP ranks (EP x ETP borrowing DP ranks): every forward of those
    ranks must run together, so each of them generates every prompt (the same tokens)."""
    if config.num_moe_experts:
        dp_index = {rank: i for ranks in state.layout["dp"] for i, rank in enumerate(ranks)}
        if any(len({dp_index[rank] for rank in ranks}) > 1 for ranks in state.layout["ep_etp"]):
            return 0, 1
    return state.rank("dp"), state.size("dp")


def format_results(results):
    """The printed output: each prompt and its completion."""
    blocks = []
    for number, result in enumerate(results):
        blocks.append(f"----- prompt {number} -----\n{result['prompt']}\n"
                      f"----- completion {number} ({len(result['ids'])} tokens) -----\n"
                      f"{result['text']}")
    return "\n".join(blocks)


def main(argv=None):
    """Entry point: 0 on success, 2 after one ``error:`` line."""
    def body(args, state):
        print_rank_0(format_results(run_generation(args, state)))
    return run_inference_script(body, argv, get_generation_args, check_generation_args)


if __name__ == "__main__":
    sys.exit(main())
