"""Dynamic context parallelism's rules (--dynamic-context-parallel, Megatron-LM's
--hybrid-context-parallel): what it needs and what it cannot run with, each a line naming the
flag and the fix, checked before anything starts.

Megatron-LM's own rules (megatron/training/arguments.py at the census commit): no pipeline
parallelism, no CUDA graphs (refused here anyway), no Megatron FSDP, the single dataloader
(the only one built here), and
--calculate-per-token-loss (once a global batch's documents are re-packed into bins, a
microbatch's own mean means nothing: only the token-weighted mean over the global batch is
the same function); MLA refuses it. The further ones here follow from what the schedule does
to a step:

- the pool (DP x CP) is a power of two: its groups are aligned power-of-two blocks;
- anything whose result depends on how the global batch is cut into microbatches is
  refused: MTP (its loss weight uses each microbatch's counts), FP8 (each microbatch's amax
  sets the scales), MoE balancing losses, z-loss, Sinkhorn and quantile balancing, and
  capacity-factor token dropping (each over one microbatch's tokens);
- expert parallelism's all-to-all needs every rank of its group in the same forward: the
  bins then run in lockstep rounds (dynamic_schedule.rounds), a rank without a bin running
  an empty one; FSDP2's per-layer all-gathers over the whole pool would need the same, and
  it is refused;
- Gated DeltaNet (linear attention) passes its state along a fixed CP group: not built
  for groups that change per bin.

The group-size rule itself (:func:`group_size`: the smallest power-of-two group whose ranks
each hold at most the bound of a document once padded for the zigzag) lives here too: the
schedule (context_parallel/dynamic_schedule.py) and the start-up check share it.
"""


def is_power_of_two(n):
    return n >= 1 and n & (n - 1) == 0


def granule(k, tp_multiple=1):
    """Padded-length step of a document on a CP group of ``k`` ranks: 2 x k zigzag chunks
    (none at k = 1), times TP when sequence parallelism splits the sequence too."""
    return (1 if k == 1 else 2 * k) * tp_multiple


def padded(length, k, tp_multiple=1):
    step = granule(k, tp_multiple)
    return -(-length // step) * step


def group_size(length, max_per_rank, pool, tp_multiple=1, least=1):
    """The smallest power-of-two group (<= ``pool``, >= ``least``) whose ranks hold at most
    ``max_per_rank`` of a document of ``length`` tokens; ValueError naming the fix when
    even the whole pool cannot."""
    k = least
    while padded(length, k, tp_multiple) > k * max_per_rank:
        k *= 2
        if k > pool:
            need = -(-padded(length, pool, tp_multiple) // pool)
            raise ValueError(
                f"a document of {length} tokens does not fit the {pool} ranks of the DP x CP "
                f"pool at --max-seqlen-per-dp-cp-rank {max_per_rank}; raise it to at least "
                f"{need}")
    return k


def dynamic_cp_problems(parallel, training, model, seq_length, use_torch_fsdp2=False,
                        use_megatron_fsdp=False):
    """Lines for every rule the sections break (empty when dynamic CP is off and its flags
    are unset). ``parallel``: ParallelConfig; ``training``: TrainingConfig; ``model``:
    GPTConfig (read only with dynamic CP on); ``seq_length``: the samples' length (the longest
    document one can hold, which must fit the pool)."""
    p = parallel
    if not p.dynamic_context_parallel:
        if p.max_seqlen_per_dp_cp_rank is not None:
            return ["--max-seqlen-per-dp-cp-rank is read only by dynamic context parallelism; "
                    "add --dynamic-context-parallel or drop it"]
        if p.min_dynamic_context_parallel_size != 1:
            return ["--min-dynamic-context-parallel-size is read only by dynamic context "
                    "parallelism; add --dynamic-context-parallel or drop it"]
        return []
    problems = []
    why = "dynamic context parallelism (--dynamic-context-parallel)"
    if p.max_seqlen_per_dp_cp_rank is None or p.max_seqlen_per_dp_cp_rank < 1:
        problems.append(f"{why} needs --max-seqlen-per-dp-cp-rank (the tokens one rank holds; "
                        f"e.g. --seq-length / --context-parallel-size)")
    pool = (p.data_parallel_size or 1) * p.context_parallel_size
    if pool & (pool - 1):
        problems.append(f"{why} needs a power-of-two DP x CP pool; DP "
                        f"({p.data_parallel_size}) x CP ({p.context_parallel_size}) = {pool}: "
                        f"change the sizes")
    least = p.min_dynamic_context_parallel_size
    if least < 1 or least & (least - 1) or least > pool:
        problems.append(f"--min-dynamic-context-parallel-size {least} must be a power of two "
                        f"between 1 and DP x CP ({pool})")
    elif not problems:  # a whole sample is the longest document: it must fit the pool
        tp_multiple = p.tensor_model_parallel_size if model.sequence_parallel else 1
        try:
            group_size(seq_length, p.max_seqlen_per_dp_cp_rank, pool, tp_multiple, least)
        except ValueError as err:
            problems.append(f"--seq-length {seq_length}: {err}")
    if p.pipeline_model_parallel_size > 1:
        problems.append(f"{why} does not run with pipeline parallelism (Megatron-LM's rule); "
                        f"use --pipeline-model-parallel-size 1")
    if not training.calculate_per_token_loss:
        problems.append(f"{why} needs --calculate-per-token-loss (Megatron-LM's rule: re-packed "
                        f"microbatches have no mean of their own)")
    refused = [
        (model.multi_latent_attention, "--multi-latent-attention (Megatron-LM's rule)"),
        (any(model.linear_attention_pattern()), "Gated DeltaNet layers (their state passing "
         "runs on a fixed CP group)"),
        (bool(model.mtp_num_layers), "--mtp-num-layers (its loss weight uses each "
         "microbatch's token counts)"),
        (model.fp8 is not None, "--fp8-format (each microbatch's amax sets the scales)"),
        (use_torch_fsdp2, "--use-torch-fsdp2 (its all-gathers need every rank of the pool in "
         "the same number of forwards)"),
        (use_megatron_fsdp, "--use-megatron-fsdp (Megatron-LM's rule)"),
    ]
    if model.num_moe_experts:
        kinds = model.moe_router_load_balancing_type
        kinds = set(kinds if isinstance(kinds, (tuple, list)) else [kinds])
        refused += [
            (bool(model.balancing_losses()) or model.moe_z_loss_coeff, "MoE balancing or "
             "z-losses (each over one microbatch's tokens; use --moe-aux-loss-coeff 0, "
             "--moe-z-loss-coeff 0, or aux-loss-free --moe-router-enable-expert-bias)"),
            (bool(kinds & {"sinkhorn", "quantile_balancing"}),
             "--moe-router-load-balancing-type sinkhorn or quantile_balancing (each balances "
             "one microbatch's tokens)"),
            (model.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor "
             "(token dropping over one microbatch's tokens)"),
        ]
    problems += [f"{why} does not run with {what}: drop one of the two"
                 for bad, what in refused if bad]
    return problems


def dynamic_cp_note(parallel):
    """The start-up note of a dynamic-CP run: what it does with each step."""
    p = parallel
    return (f"dynamic context parallelism: every step's documents are re-packed into bins of "
            f"at most {p.max_seqlen_per_dp_cp_rank} tokens per rank, each run on a CP group of "
            f"its own size out of the {p.data_parallel_size * p.context_parallel_size} DP x CP "
            f"ranks (every rank reads the whole global batch); dropout masks follow each bin's "
            f"tokens, not a static layout's")
