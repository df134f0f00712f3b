"""Where megatron_cp deliberately differs from Megatron-LM, each with its reason
(docs/megatron_lm_compatibility.md prints this list; tests/cli/test_config_declarations.py holds
every default to Megatron-LM's census except these), and the defaults Megatron-LM fills in
later than its parser.
"""

# (what, Megatron-LM, megatron_cp, why): the whole list of deliberate differences
DELIBERATE = (
    ("padded vocabulary rows", "take part in the softmax as tokens no label names",
     "are left out of the softmax (their logits -inf, no gradient)",
     "the loss is then the same under every TP size, whose padding differs"),
    ("rank order", "tp-cp-ep-dp-pp (pipeline outermost)",
     "tp-cp-ep-pp-dp (data parallel outermost; Megatron-LM's --use-tp-pp-dp-mapping; "
     "--rank-order tp-cp-ep-dp-pp gives Megatron-LM's)",
     "this project's design card: a data-parallel replica is a block of consecutive ranks, "
     "and the expert mesh is built inside each pipeline stage in either order"),
    ("--distributed-backend default", "nccl", "nccl where CUDA is available, else gloo",
     "the same on a GPU cluster; a CPU run (the tests, CI, a laptop) needs no flag"),
    ("MoE routing statistics (balancing losses' token counts, quantile balancing's quantiles)",
     "count every token of the microbatch",
     "count the tokens with loss (padding and loss-masked tokens left out; the same when "
     "nothing is masked)",
     "padding differs between layouts and packed documents, so counting only loss tokens "
     "keeps every layout equal to the one-process run"),
    ("Megatron-FSDP gradients of a bf16 / fp16 model (--megatron-fsdp-main-grads-dtype and "
     "--megatron-fsdp-grad-comm-dtype auto, their default)",
     "accumulated and reduced in the model's dtype",
     "accumulated and reduced in fp32 (those flags' fp32 choice), as under every other "
     "layout here",
     "the gradients then equal the one-process run's; a reduction over ranks in bf16 / fp16 "
     "rounds differently under every layout"),
    ("context-parallel loss", "each CP rank divides its loss by its own token count",
     "the whole microbatch's token count (one all-reduce)",
     "every layout then equals the one-process run, which Megatron-LM's CP runs do not"),
    ("--rope-scaling-factor", "parsed, but pretrain_gpt.py never hands it to the model "
     "(gpt_config_from_args passes --use-rope-scaling only), so the model scales by 8",
     "scales by the factor given",
     "the flag's help and Megatron-LM's own Hugging Face config check, which compares it with "
     "the checkpoint's rope_scaling factor, mean the factor; at its default, 8, the two agree"),
    ("FP8 delayed scaling's amax history and scales (--fp8-recipe delayed)",
     "move after each microbatch's forward (Transformer Engine's fp8_autocast)",
     "move once per global batch, from each tensor's max over all the step's microbatches "
     "and every rank of the pipeline stage",
     "the scales then do not depend on how many microbatches each rank runs: every DP / "
     "microbatch split quantizes as one process does"),
    ("FP8 delayed scaling in evaluation",
     "evaluation forwards under fp8_autocast enter their amaxes into the history",
     "evaluation forwards quantize with the current scales and leave the history alone",
     "training then goes on with the scales it would have had without the evaluation"),
    ("FP8 block recipes' token blocks (--fp8-recipe blockwise / mxfp8 under SP or CP)",
     "each rank quantizes the wgrad copies of its own rows (Transformer Engine: the SP shard "
     "before its FP8 all-gather, the CP rank's zigzag chunks)",
     "the blocks of one process's rows: SP's input gathered before it is quantized, a CP "
     "token block's amax reduced over the CP ranks holding its tokens",
     "every layout then quantizes as one process does; the same blocks as Megatron-LM's "
     "where each shard or chunk is whole blocks (128 or 32 rows)"),
    ("MoE routed experts under FP8 (--fp8-format with --num-experts, tensorwise and "
     "delayed)",
     "Transformer Engine's GroupedLinear: one quantizer per local expert, its "
     "current-scaling amax over the rows this rank received (every sender's, DP peers' "
     "microbatches together) and its own ETP slice of the weight",
     "one scale per expert and microbatch: the amax over that microbatch's rows routed to "
     "the expert, reduced over the ranks holding pieces of it, never across DP peers; the "
     "weight's over its whole expert (ETP); delayed: per expert, reduced over the stage at "
     "step end",
     "every EP / ETP / TP / CP / DP layout then quantizes the experts as one process does"),
    ("--moe-router-padding-for-quantization (--moe-router-padding-for-fp8)",
     "the rows the padding adds (probability 0) enter the experts' FP8 amaxes",
     "they run through the experts but stay out of the amaxes; their gradients are 0",
     "each rank pads its own piece of the microbatch, so what the padding adds depends on "
     "the layout; left out, it changes nothing any layout computes"),
    ("dynamic CP's data (--dynamic-context-parallel / --hybrid-context-parallel)",
     "each DP rank reads its G/DP samples; documents go to their ranks by an all-to-all",
     "every rank reads the whole global batch and keeps the documents of its bins",
     "the schedule is then a pure function every rank computes alike, with nothing to "
     "exchange; the cost is G x (seq_length + 1) token ids read per rank per step"),
    ("dynamic CP's microbatches",
     "one forward per document (sub-sample), groups of them separated by barriers; "
     "BalancedCPScheduler's L^2/k workload estimate",
     "documents of one group size packed into bins of at most --max-seqlen-per-dp-cp-rank "
     "tokens a rank, one forward per bin, placed by modelled FLOPs; the static layout kept "
     "where it models faster; lockstep rounds only with expert parallelism",
     "fewer, larger forwards and no barrier; with --calculate-per-token-loss (required by "
     "both) the step computes the same function of the global batch"),
    ("dropout under dynamic CP", "each rank's RNG stream",
     "drawn from each bin's own coordinates (the bin's first sample, the token's place in "
     "the bin): reproducible, but not the masks a static layout gives the same tokens",
     "a bin mixes documents of several samples; exactness against one process is tested "
     "without dropout"),
)

# flag -> the DELIBERATE row (its first column) that explains its different default
DEFAULTS_THAT_DIFFER = {"--distributed-backend": "--distributed-backend default"}

# flag -> (the value Megatron-LM uses, where it fills it in): its parser's default is None
# and its argument checks fill the value ours declares
FILLED_IN_LATER = {
    "--dataloader-type": ("single", "megatron/training/arguments.py validate_args: None "
                                    "becomes 'single'"),
    "--split": ("969, 30, 1", "megatron/training/arguments.py validate_args: None becomes "
                              "the legacy split when --data-path is given"),
}
