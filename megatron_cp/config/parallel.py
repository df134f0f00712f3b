"""The parallel layout section: the sizes of every parallel dimension, the pipeline's split
and schedule, the process-group backend; and the layout rules the model config checks too
(context parallelism's communication types, the hierarchical Ulysses x ring CP sizes)."""
import math
from dataclasses import dataclass

from megatron_cp.config.setting import check_choices, setting

# Rank orders (Megatron-LM's RankGenerator strings, innermost axis first): data parallel
# outermost (the design card's default; Megatron-LM's --use-tp-pp-dp-mapping) or pipeline
# outermost (Megatron-LM's default)
DP_OUTER_RANK_ORDER, PP_OUTER_RANK_ORDER = "tp-cp-ep-pp-dp", "tp-cp-ep-dp-pp"
DEFAULT_RANK_ORDER = DP_OUTER_RANK_ORDER
RANK_ORDERS = (DP_OUTER_RANK_ORDER, PP_OUTER_RANK_ORDER)


def check_hierarchical_sizes(hierarchical_sizes, context_parallel_size):
    """The hierarchical CP sizes (U, R) as a tuple of ints; ValueError unless there are two,
    each >= 1, whose product is ``context_parallel_size`` (e.g. (2, 4): inner a2a over 2 ranks
    x outer p2p ring over 4 = CP 8)."""
    sizes = tuple(int(size) for size in hierarchical_sizes)
    if len(sizes) != 2:
        raise ValueError(f"hierarchical_context_parallel_sizes {list(sizes)} must be two sizes, "
                         f"U (inner a2a) and R (outer p2p), with U x R = context_parallel_size "
                         f"({context_parallel_size})")
    product = sizes[0] * sizes[1]
    if min(sizes) < 1 or product != context_parallel_size:
        raise ValueError(f"hierarchical_context_parallel_sizes {list(sizes)} multiply to {product}, "
                         f"not context_parallel_size ({context_parallel_size}); give sizes >= 1 "
                         f"whose product is {context_parallel_size}")
    return sizes


COMM_TYPES = ("p2p", "a2a", "a2a+p2p", "all_gather", "auto")
COMM_TYPE_ALIASES = {"allgather": "all_gather"}  # Megatron-LM's --cp-comm-type help's spelling


def resolve_comm_type(comm_type, num_kv_heads, cp_size, hierarchical_sizes=None):
    """(comm type, (U, R) or None) actually used; "auto" picks U = gcd(num_kv_heads, cp_size).

    auto: pure a2a when U == cp_size, pure p2p when U == 1, else a2a+p2p with (U, cp/U).
    The one rule for which hierarchical CP groups a model needs: the trainer calls it before
    ``initialize_model_parallel`` builds them, each attention layer when it is built.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"cp comm type {comm_type!r} is unknown; use one of {list(COMM_TYPES)}")
    if comm_type == "auto":
        inner = math.gcd(num_kv_heads, cp_size)
        if inner == cp_size:
            return "a2a", None
        if inner == 1:
            return "p2p", None
        return "a2a+p2p", (inner, cp_size // inner)
    if comm_type != "a2a+p2p":
        return comm_type, None
    if hierarchical_sizes is None or len(hierarchical_sizes) != 2:
        raise ValueError(f"--cp-comm-type a2a+p2p needs hierarchical_sizes (U, R) with U x R = "
                         f"cp size ({cp_size}); got {hierarchical_sizes}")
    return "a2a+p2p", check_hierarchical_sizes(hierarchical_sizes, cp_size)


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = setting(1, group="parallelism",
        help="Tensor parallel size.")
    pipeline_model_parallel_size: int = setting(1, group="parallelism",
        help="Pipeline parallel size.")
    num_layers_per_virtual_pipeline_stage: int | None = setting(None, group="parallelism",
        help="Layers per virtual stage (interleaved 1F1B).")
    num_virtual_stages_per_pipeline_rank: int | None = setting(None, group="parallelism",
        help="Virtual stages (model chunks) per pipeline rank, interleaved 1F1B; unlike "
             "--num-layers-per-virtual-pipeline-stage it combines with "
             "--decoder-first/last-pipeline-num-layers (each rank's layers are cut into this "
             "many equal chunks).")
    decoder_first_pipeline_num_layers: int | None = setting(None, group="parallelism",
        help="Layers on the first pipeline stage (default: an even split); the middle stages "
             "share the rest evenly.")
    decoder_last_pipeline_num_layers: int | None = setting(None, group="parallelism",
        help="Layers on the last pipeline stage (default: an even split).")
    account_for_embedding_in_pipeline_split: bool = setting(False, group="parallelism",
        help="Count the embedding as one layer when splitting the layers evenly over the "
             "pipeline stages: the first stage builds one transformer layer less (none: an "
             "embedding-only stage).")
    account_for_loss_in_pipeline_split: bool = setting(False, group="parallelism",
        help="Count the output layer and loss as one layer when splitting the layers evenly: the"
             " last stage builds one transformer layer less (none: a loss-only stage).")
    pipeline_model_parallel_layout: str | None = setting(None, group="parallelism",
        help="Write out what every (virtual) stage holds: E embedding, t transformer layer, m "
             "MTP layer (one per --mtp-num-layers depth, in the last stage right before L), L "
             "loss, '|' between stages, X*N and (...)*N repeat, commas are cosmetic; e.g. "
             "\"Et|(tt|)*2,tL\". PP x N stages give N virtual stages per rank, stage i being "
             "virtual stage i // PP of rank i % PP.")
    microbatch_group_size_per_vp_stage: int | None = setting(None,
        flag="--microbatch-group-size-per-virtual-pipeline-stage",
        arg="microbatch_group_size_per_vp_stage", group="parallelism",
        help="Interleaved 1F1B: microbatches each virtual stage runs in a row, forward and "
             "backward (default --pipeline-model-parallel-size, the depth-first schedule); it "
             "lies between PP and the number of microbatches, and a larger value admits "
             "microbatch counts that are not a multiple of PP.")
    rank_order: str = setting(DEFAULT_RANK_ORDER, choices=RANK_ORDERS, group="parallelism",
        help="How the ranks are laid out, innermost axis first. The default tp-cp-ep-pp-dp "
             "puts data parallel outermost, so a data-parallel replica's ranks are consecutive; "
             "tp-cp-ep-dp-pp is Megatron-LM's default (pipeline outermost: a stage's ranks are "
             "consecutive). TP is innermost in both; experts are laid out inside each stage.")
    use_tp_pp_dp_mapping: bool = setting(False, group="parallelism",
        help="Megatron-LM's spelling of the default --rank-order tp-cp-ep-pp-dp.")
    pipeline_seq_length: int | None = setting(None, group="parallelism",
        help="Fix the sequence length of the pipeline P2P buffers: every microbatch is padded to"
             " it. By default the length follows each step's data (packed documents under "
             "context parallelism pad each document to a multiple of 2 x CP), rounded up so "
             "shapes rarely change, and is agreed by the stages before the first send.")
    overlap_p2p_comm: bool = setting(True,
        flag="--overlap-p2p-comm", negative=("--no-overlap-p2p-communication",
        "Run the pipeline P2P sends/receives synchronously. By default (as in Megatron-LM) "
        "they are posted asynchronously and waited for only when the data is needed, hiding "
        "their latency behind the forward/backward compute (1F1B and interleaved 1F1B; no "
        "effect at PP=1)."), group="parallelism",
        help="Overlap the pipeline P2P communication (the default).")
    context_parallel_size: int = setting(1, group="parallelism", help="Context parallel size.")
    dynamic_context_parallel: bool = setting(False, group="parallelism",
        aliases=("--hybrid-context-parallel",),
        help="Dynamic context parallelism (Megatron-LM's; --hybrid-context-parallel is its older "
             "spelling): every packed document of a global batch runs on a CP group sized for "
             "it, out of the DP x CP ranks, with documents re-packed into bins of at most "
             "--max-seqlen-per-dp-cp-rank tokens per rank (context_parallel/dynamic_schedule.py). "
             "Needs --calculate-per-token-loss.")
    max_seqlen_per_dp_cp_rank: int | None = setting(None, group="parallelism",
        help="Dynamic context parallelism: the most tokens one rank holds of a bin (padding for "
             "the zigzag split included); a document runs on the smallest power-of-two group "
             "that keeps it under this. A good start: --seq-length / --context-parallel-size.")
    min_dynamic_context_parallel_size: int = setting(1, group="parallelism",
        help="Dynamic context parallelism: the smallest CP group a document runs on (a power "
             "of two; default 1, no CP).")
    expert_model_parallel_size: int = setting(1, group="parallelism",
        help="Expert parallel size.")
    expert_tensor_parallel_size: int | None = setting(None, group="parallelism",
        help="Tensor parallel size of the expert layers (default --tensor-model-parallel-size). "
             "The expert mesh re-views each pipeline stage's ranks as expert-data x EP x ETP.")
    distributed_backend: str | None = setting(None, choices=("nccl", "gloo", None), group="parallelism",
        help="torch.distributed backend (default nccl with CUDA, else gloo).")
    distributed_timeout_minutes: int = setting(10, group="parallelism",
        help="Timeout of collectives, in minutes.")
    distributed_timeout_seconds_after_init: int | None = setting(None, group="parallelism",
        help="Once the first iteration of the run has finished, the timeout of every process "
             "group becomes this many seconds (the first iteration, slower, keeps "
             "--distributed-timeout-minutes).")
    use_gloo_process_groups: bool = setting(True, flag="--disable-gloo-process-groups",
        arg="use_gloo_process_groups", store_false=True, group="parallelism",
        help="Create no gloo process group: checkpoint coordination (DCP's plan exchange, "
             "--verify-integrity) runs over the default process group instead of a gloo group "
             "of its own; an --async-save is then written before training goes on.")

    # derived by the command line's checks (megatron_cp/cli/checks.py)
    world_size: int = setting(1, flag=None, arg="world_size", help="Ranks in the job.")
    data_parallel_size: int | None = setting(
        None, flag=None, arg="data_parallel_size",
        help="world size / (TP x CP x PP): the data-parallel replicas.")
    virtual_pipeline_model_parallel_size: int | None = setting(
        None, flag=None, arg="virtual_pipeline_model_parallel_size",
        help="Model chunks per pipeline rank (None: no virtual stages).")

    def __post_init__(self):
        check_choices(self)
