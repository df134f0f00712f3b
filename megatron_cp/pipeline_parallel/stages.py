"""The stage split: which global layers each pipeline stage (and virtual stage) owns.

Layers are spread evenly over the PP stages, or with ``first`` / ``last`` layer counts for
the first and last stage and the rest spread evenly over the middle stages (Megatron's
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``). With
virtual stages (interleaved 1F1B, ``--num-layers-per-virtual-pipeline-stage``) the model is
cut into ``PP x VP`` pieces of equal size and model chunk ``c`` of PP rank ``r`` owns the
piece ``c * PP + r``, so the activations go round the ring of ranks ``VP`` times.

The embedding lives on the first virtual stage (PP rank 0, chunk 0) and the final norm,
output layer and loss on the last one (PP rank PP-1, chunk VP-1). Every chunk is built
from GLOBAL layer numbers, so any split has the single-process weights; the tied output
layer of a last stage without the embedding is initialized identically (see GPTModel).

Everything here checks its input before any process group is touched and raises
ValueError naming the values and the fix.
"""


def stage_layer_counts(num_layers, pp_size, first=None, last=None):
    """Layers per pipeline stage, in stage order (a list of ``pp_size`` ints).

    ``first`` / ``last``: layer counts of the first and last stage (None: even split); the
    other stages share the remaining layers evenly.
    """
    if pp_size < 1:
        raise ValueError(f"--pipeline-model-parallel-size ({pp_size}) must be >= 1")
    if pp_size > num_layers:
        raise ValueError(f"--pipeline-model-parallel-size ({pp_size}) must not exceed --num-layers "
                         f"({num_layers}): every stage needs at least one layer; use at most "
                         f"{num_layers} stages")
    if pp_size == 1:
        if first is not None or last is not None:
            raise ValueError(f"--decoder-first/last-pipeline-num-layers ({first}, {last}) need "
                             f"--pipeline-model-parallel-size > 1")
        return [num_layers]
    for name, value in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and value < 1:
            raise ValueError(f"{name} ({value}) must be >= 1: every stage needs at least one layer")
    fixed = {0: first, pp_size - 1: last}
    fixed = {stage: n for stage, n in fixed.items() if n is not None}
    middle = pp_size - len(fixed)
    rest = num_layers - sum(fixed.values())
    if not fixed:
        if num_layers % pp_size != 0:
            raise ValueError(f"--num-layers ({num_layers}) must be divisible by "
                             f"--pipeline-model-parallel-size ({pp_size}); change one of them or "
                             f"give --decoder-first-pipeline-num-layers / "
                             f"--decoder-last-pipeline-num-layers for an uneven split")
        return [num_layers // pp_size] * pp_size
    if middle == 0 and rest != 0 or middle > 0 and (rest < middle or rest % middle != 0):
        raise ValueError(
            f"--num-layers ({num_layers}) minus the first/last stage layers "
            f"({first}, {last}) leaves {rest} layers for the {middle} other stage(s) of "
            f"--pipeline-model-parallel-size ({pp_size}); that must be "
            f"{'0' if middle == 0 else f'a positive multiple of {middle}'}. Adjust "
            f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
    per_middle = rest // middle if middle else 0
    return [fixed.get(stage, per_middle) for stage in range(pp_size)]


def virtual_pipeline_size(num_layers, pp_size, num_layers_per_virtual_stage=None,
                          first=None, last=None):
    """The number of model chunks per rank (None: no interleaving), validated.

    ``num_layers_per_virtual_stage`` must divide the layers of a stage; a value equal to a
    stage's layer count means one chunk, i.e. plain 1F1B (returns None).
    """
    counts = stage_layer_counts(num_layers, pp_size, first, last)
    if num_layers_per_virtual_stage is None:
        return None
    if pp_size == 1:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage ({num_layers_per_virtual_stage}) "
                         f"needs --pipeline-model-parallel-size > 1")
    if first is not None or last is not None:
        raise ValueError("--num-layers-per-virtual-pipeline-stage cannot be combined with "
                         "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers; "
                         "drop one of them")
    per_stage = counts[0]
    if num_layers_per_virtual_stage < 1 or per_stage % num_layers_per_virtual_stage != 0:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage ({num_layers_per_virtual_stage}) "
                         f"must divide the layers per pipeline stage (--num-layers {num_layers} / "
                         f"--pipeline-model-parallel-size {pp_size} = {per_stage})")
    vp_size = per_stage // num_layers_per_virtual_stage
    return vp_size if vp_size > 1 else None


def validate_interleaved_microbatches(num_microbatches, pp_size, vp_size):
    """Interleaving needs the microbatches in whole groups of ``pp_size`` (Megatron's rule)."""
    if vp_size is not None and vp_size > 1 and num_microbatches % pp_size != 0:
        raise ValueError(
            f"the interleaved schedule needs the number of microbatches ({num_microbatches}) to "
            f"be a multiple of --pipeline-model-parallel-size ({pp_size}); set "
            f"--global-batch-size (or each --step-batch-size-schedule batch size) to a multiple "
            f"of micro batch x data-parallel size x {pp_size}, or drop --num-layers-per-virtual-pipeline-stage")


def chunk_layer_numbers(num_layers, pp_size, pp_rank, vp_size=None, first=None, last=None):
    """The global layer numbers of each model chunk of ``pp_rank``: a list of ``vp_size or 1``
    lists, chunk order."""
    counts = stage_layer_counts(num_layers, pp_size, first, last)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank ({pp_rank}) must lie in [0, {pp_size})")
    if not vp_size or vp_size == 1:
        start = sum(counts[:pp_rank])
        return [list(range(start, start + counts[pp_rank]))]
    if counts[0] % vp_size != 0:
        raise ValueError(f"the {counts[0]} layers of a stage do not split into vp_size ({vp_size}) "
                         f"equal chunks")
    per_chunk = counts[0] // vp_size
    pieces = []
    for chunk in range(vp_size):
        piece = chunk * pp_size + pp_rank  # the virtual stage this chunk plays
        pieces.append(list(range(piece * per_chunk, (piece + 1) * per_chunk)))
    return pieces


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


def build_model_chunks(config, state, first=None, last=None, model_cls=None):
    """This rank's GPT model chunks (unwrapped), one per virtual stage, with the embedding on
    the first virtual stage and the output layer + loss on the last.

    ``state.virtual_pipeline_model_parallel_size`` gives the number of chunks (None: one).
    """
    if model_cls is None:
        from megatron_cp.model import GPTModel as model_cls
    pp_size, pp_rank = state.size("pp"), state.rank("pp")
    vp_size = state.virtual_pipeline_model_parallel_size or 1
    layers = chunk_layer_numbers(config.num_layers, pp_size, pp_rank, vp_size, first, last)
    chunks, tracker = [], None
    for chunk, layer_numbers in enumerate(layers):
        pre = pp_rank == 0 and chunk == 0
        post = pp_rank == pp_size - 1 and chunk == vp_size - 1
        # One RNG tracker for all chunks (seeded once): one dropout stream per rank.
        chunks.append(model_cls(config, state=state, rng_tracker=tracker, pre_process=pre,
                                post_process=post, layer_numbers=layer_numbers))
        tracker = chunks[0].rng_tracker
    return chunks
