"""The stage split: which global layers each pipeline stage (and virtual stage) owns.

Every way Megatron-LM has to split the model gives one
:class:`~megatron_cp.pipeline_parallel.layout.PipelineLayout` (:func:`pipeline_layout`):

- an even split of ``--num-layers`` over the PP ranks (the default);
- ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``: the first
  and last rank's layer counts, the rest spread evenly over the middle ranks;
- ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``:
  the embedding (loss) takes one layer's place in the even split, so its stage builds one
  transformer layer less (an embedding-only or loss-only stage when that leaves none);
- ``--pipeline-model-parallel-layout``: the stages written out (layout.py's grammar).

Virtual stages (interleaved 1F1B) come from ``--num-layers-per-virtual-pipeline-stage``,
``--num-virtual-stages-per-pipeline-rank`` or the layout string; each rank's layers are cut
into that many equal model chunks and model chunk ``c`` of PP rank ``r`` is virtual stage
``c * PP + r``, so the activations go round the ring of ranks ``VP`` times.

The embedding lives on the first virtual stage (PP rank 0, chunk 0) and the final norm,
output layer and loss on the last one (PP rank PP-1, chunk VP-1). Every chunk is built
from GLOBAL layer numbers, so any split has the single-process weights; the tied output
layer of a last stage without the embedding is initialized identically (see GPTModel).

Everything here checks its input before any process group is touched and raises
ValueError naming the flags and the fix (Megatron-LM's rules).
"""
import dataclasses

from megatron_cp.pipeline_parallel.layout import (EMBEDDING, FLAG, LAYER, LOSS, PipelineLayout,
                                                  check_layout, parse_layout)

FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
ACCOUNT = "--account-for-embedding/loss-in-pipeline-split"
PER_VIRTUAL, VIRTUAL = ("--num-layers-per-virtual-pipeline-stage",
                        "--num-virtual-stages-per-pipeline-rank")


def pipeline_layout(num_layers, pp_size, *, layout=None, num_layers_per_virtual_stage=None,
                    num_virtual_stages=None, first=None, last=None,
                    account_for_embedding=False, account_for_loss=False, mtp_num_layers=None):
    """The :class:`PipelineLayout` the split flags describe (see the module docstring).
    ``mtp_num_layers``: the m's a layout string must hold (the MTP layers are built on the
    last stage with the loss whether or not a layout names them)."""
    if pp_size < 1:
        raise ValueError(f"--pipeline-model-parallel-size ({pp_size}) must be >= 1")
    virtual = {PER_VIRTUAL: num_layers_per_virtual_stage, VIRTUAL: num_virtual_stages,
               FLAG: layout}
    given = [flag for flag, value in virtual.items() if value is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} each set the virtual stages; give one")
    uneven = [flag for flag, value in ((FIRST, first), (LAST, last)) if value is not None]
    accounted = [flag for flag, value in (
        ("--account-for-embedding-in-pipeline-split", account_for_embedding),
        ("--account-for-loss-in-pipeline-split", account_for_loss)) if value]
    if layout is not None:
        if uneven or accounted:
            raise ValueError(f"{FLAG} places every layer itself; drop "
                             f"{', '.join(uneven + accounted)}")
        return check_layout(parse_layout(layout), layout, pp_size, num_layers, mtp_num_layers)
    if uneven and accounted:
        raise ValueError(f"{' / '.join(uneven)} and {' / '.join(accounted)} are two ways to "
                         f"balance the stages; give one")
    for flag, value in ((PER_VIRTUAL, num_layers_per_virtual_stage), (VIRTUAL, num_virtual_stages)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} ({value}) must be >= 1")
    if pp_size == 1 and (uneven or num_layers_per_virtual_stage is not None
                         or (num_virtual_stages or 1) > 1):
        flags = uneven + given
        raise ValueError(f"{', '.join(flags)} split the model over pipeline stages: they need "
                         f"--pipeline-model-parallel-size > 1")
    if uneven:
        if num_layers_per_virtual_stage is not None:
            raise ValueError(f"{PER_VIRTUAL} cannot be combined with {FIRST} / {LAST}; give "
                             f"the virtual stages with {VIRTUAL}")
        counts = _uneven_counts(num_layers, pp_size, first, last)
    else:
        counts = _even_counts(num_layers, pp_size, account_for_embedding, account_for_loss)
    vp_size = _virtual_stages(counts, num_layers_per_virtual_stage, num_virtual_stages,
                              uneven, accounted)
    stages = []
    for chunk in range(vp_size):
        for rank in range(pp_size):
            is_first, is_last = chunk == rank == 0, (chunk, rank) == (vp_size - 1, pp_size - 1)
            # an accounted embedding (loss) takes a layer's place in its stage
            num = counts[rank] // vp_size - (account_for_embedding and is_first) - \
                (account_for_loss and is_last)
            assert num >= 0, (counts, vp_size)
            stages.append(EMBEDDING * is_first + LAYER * num + LOSS * is_last)
    return PipelineLayout(tuple(stages), pp_size)


def _even_counts(num_layers, pp_size, account_for_embedding, account_for_loss):
    """Pieces per rank of an even split, the accounted embedding and loss among them."""
    pieces = num_layers + account_for_embedding + account_for_loss
    accounted = f" plus the accounted embedding / loss (= {pieces})" if pieces > num_layers else ""
    if pieces == num_layers and pp_size > num_layers:
        raise ValueError(f"--pipeline-model-parallel-size ({pp_size}) must not exceed --num-layers "
                         f"({num_layers}): every stage needs at least one layer; use at most "
                         f"{num_layers} stages, or place the layers with {FLAG}")
    if pieces % pp_size != 0:
        raise ValueError(f"--num-layers ({num_layers}){accounted} must be divisible "
                         f"by --pipeline-model-parallel-size ({pp_size}); change one of them or "
                         f"make the split explicit: {FIRST} / {LAST}, {ACCOUNT} or {FLAG}")
    return [pieces // pp_size] * pp_size


def _uneven_counts(num_layers, pp_size, first, last):
    """Layers per rank with the first / last rank's counts given (Megatron-LM's rule: the
    middle ranks share the rest evenly)."""
    for name, value in ((FIRST, first), (LAST, last)):
        if value is not None and value < 1:
            raise ValueError(f"{name} ({value}) must be >= 1: every stage needs at least one layer")
    fixed = {stage: n for stage, n in ((0, first), (pp_size - 1, last)) if n is not None}
    middle = pp_size - len(fixed)
    rest = num_layers - sum(fixed.values())
    if middle == 0 and rest != 0 or middle > 0 and (rest < middle or rest % middle != 0):
        raise ValueError(
            f"--num-layers ({num_layers}) minus the first/last stage layers "
            f"({first}, {last}) leaves {rest} layers for the {middle} other stage(s) of "
            f"--pipeline-model-parallel-size ({pp_size}); that must be "
            f"{'0' if middle == 0 else f'a positive multiple of {middle}'}. Adjust "
            f"{FIRST} / {LAST}")
    return [fixed.get(stage, rest // middle if middle else 0) for stage in range(pp_size)]


def _virtual_stages(counts, per_virtual, virtual, uneven, accounted):
    """Model chunks per rank: every rank's pieces split into that many equal chunks."""
    counting = f", {' and '.join(accounted)} counting as layers" if accounted else ""
    if per_virtual is not None:
        if counts[0] % per_virtual != 0:
            raise ValueError(f"{PER_VIRTUAL} ({per_virtual}) must divide the layers per "
                             f"pipeline stage ({counts[0]}{counting})")
        return counts[0] // per_virtual
    vp_size = virtual or 1
    for rank, count in enumerate(counts):
        if count % vp_size != 0:
            where = "each stage"
            if uneven:
                where = {0: "the first stage", len(counts) - 1: "the last stage"}.get(
                    rank, "each middle stage")
            raise ValueError(f"{VIRTUAL} ({vp_size}) must divide the layers of {where} "
                             f"({count}{counting}); change it or the split")
    return vp_size


def _layout_of(values):
    """The :class:`PipelineLayout` of the settings ``values`` (a mapping of their names)."""
    return pipeline_layout(
        values["num_layers"], values["pipeline_model_parallel_size"],
        layout=values.get("pipeline_model_parallel_layout"),
        num_layers_per_virtual_stage=values.get("num_layers_per_virtual_pipeline_stage"),
        num_virtual_stages=values.get("num_virtual_stages_per_pipeline_rank"),
        first=values.get("decoder_first_pipeline_num_layers"),
        last=values.get("decoder_last_pipeline_num_layers"),
        account_for_embedding=bool(values.get("account_for_embedding_in_pipeline_split")),
        account_for_loss=bool(values.get("account_for_loss_in_pipeline_split")),
        mtp_num_layers=values.get("mtp_num_layers"))


def layout_from_args(args):
    """The :class:`PipelineLayout` of a run's arguments (a namespace, or a checkpoint's
    saved dict: flags it predates take their defaults)."""
    return _layout_of(args if isinstance(args, dict) else vars(args))


def layout_from_config(model, parallel):
    """The :class:`PipelineLayout` of a run's sections: the model's (GPTConfig) layers and
    MTP depths, split as the parallel section (ParallelConfig) says."""
    values = {f.name: getattr(parallel, f.name) for f in dataclasses.fields(parallel)}
    values.update(num_layers=model.num_layers, mtp_num_layers=model.mtp_num_layers)
    return _layout_of(values)


def validate_interleaved_microbatches(num_microbatches, pp_size, vp_size, group_size=None):
    """Megatron-LM's rule for the interleaved schedule: it runs the microbatches in groups
    of ``group_size`` (``--microbatch-group-size-per-virtual-pipeline-stage``, default PP)
    per virtual stage, which must lie in [PP, number of microbatches], and a last, smaller
    group must still hold at least PP microbatches (fewer would stall the pipeline)."""
    if vp_size is None or vp_size < 2:
        return
    group_flag = "--microbatch-group-size-per-virtual-pipeline-stage"
    fix = (f"set --global-batch-size so that micro batch x data-parallel size x "
           f"{pp_size} divides it, or drop the virtual stages")
    if group_size is None:
        if num_microbatches % pp_size != 0:
            raise ValueError(
                f"the interleaved schedule needs the number of microbatches ({num_microbatches}) "
                f"to be a multiple of --pipeline-model-parallel-size ({pp_size}) unless "
                f"{group_flag} is given; {fix}")
        return
    if not pp_size <= group_size <= num_microbatches:
        raise ValueError(f"{group_flag} ({group_size}) must lie between "
                         f"--pipeline-model-parallel-size ({pp_size}) and the number of "
                         f"microbatches ({num_microbatches})")
    rest = num_microbatches % group_size
    if 0 < rest < pp_size:
        raise ValueError(
            f"the interleaved schedule runs the {num_microbatches} microbatches in groups of "
            f"{group_flag} ({group_size}); the last group would hold {rest}, fewer than "
            f"--pipeline-model-parallel-size ({pp_size}), which stalls the pipeline: pick a "
            f"group size whose remainder is 0 or at least {pp_size}")


def pipeline_tensor_shape(seq_length, micro_batch_size, hidden_size, cp_size=1, tp_size=1,
                          sequence_parallel=False):
    """The one shape of every activation and gradient between stages:
    ``[seq_length / CP (/ TP with SP), micro_batch_size, hidden_size]``."""
    divisor = cp_size * (tp_size if sequence_parallel else 1)
    if seq_length % divisor != 0:
        raise ValueError(f"the pipeline sequence length ({seq_length}) must be divisible by "
                         f"CP ({cp_size}){f' x TP ({tp_size}) with sequence parallelism' if sequence_parallel else ''}"
                         f" = {divisor}; change --pipeline-seq-length / --seq-length")
    return (seq_length // divisor, micro_batch_size, hidden_size)  # [s/cp(/tp), b, h]


def build_model_chunks(config, state, layout=None, model_cls=None):
    """This rank's GPT model chunks (unwrapped), one per virtual stage of ``layout`` (a
    :class:`PipelineLayout`; None: the even split), with the embedding on the first virtual
    stage and the output layer + loss on the last."""
    if model_cls is None:
        from megatron_cp.model import GPTModel as model_cls
    pp_size, pp_rank = state.size("pp"), state.rank("pp")
    if layout is None:
        layout = pipeline_layout(config.num_layers, pp_size,
                                 num_virtual_stages=state.virtual_pipeline_model_parallel_size)
    assert layout.pp_size == pp_size and layout.vp_size == (
        state.virtual_pipeline_model_parallel_size or 1), (str(layout), state)
    chunks, tracker = [], None
    for chunk, layer_numbers in enumerate(layout.chunk_layer_numbers(pp_rank)):
        # One RNG tracker for all chunks (seeded once): one dropout stream per rank.
        chunks.append(model_cls(config, state=state, rng_tracker=tracker,
                                pre_process=layout.has_embedding(pp_rank, chunk),
                                post_process=layout.has_loss(pp_rank, chunk),
                                layer_numbers=layer_numbers))
        tracker = chunks[0].rng_tracker
    return chunks
