"""What each pipeline stage holds: Megatron-LM's layout strings and the layout they describe.

A layout lists, for every virtual stage, its pieces in model order: ``E`` the embedding,
``t`` a transformer layer, ``m`` a multi-token-prediction layer, ``L`` the final norm, output
layer and loss. Megatron-LM's ``--pipeline-model-parallel-layout`` writes it as a string:
``|`` separates stages, ``X*N`` repeats a piece and ``(...)*N`` a group (stage separators
included), commas are cosmetic. ``"Et|(tt|)*2,tL"`` is four stages: ``Et``, ``tt``, ``tt``
and ``tL``.

Stage ``i`` is virtual stage ``i // PP`` of PP rank ``i % PP``: the string lists the first
virtual stage of every rank, then the second, and so on, which is also the order the
activations travel. Transformer layers are numbered in that order, so a rank's layers need
not be consecutive (interleaving). Every other way to split the model (an even split,
``--decoder-first/last-pipeline-num-layers``, ``--account-for-embedding/loss-in-pipeline-split``,
virtual stages) builds the same :class:`PipelineLayout` (see stages.py).
"""
import re
from dataclasses import dataclass

EMBEDDING, LAYER, MTP, LOSS = "E", "t", "m", "L"
PIECES = {EMBEDDING: "embedding", LAYER: "transformer layer", MTP: "MTP layer", LOSS: "loss"}
FLAG = "--pipeline-model-parallel-layout"


def parse_layout(text):
    """The stages of a Megatron-LM layout string: a list of strings of pieces (E, t, m, L).

    The grammar is Megatron-LM's: commas are dropped, then ``(group)*N`` and ``X*N`` are
    unrolled (one pass each, groups first; groups do not nest), then ``|`` splits the stages.
    Any other character (spaces included) is a ValueError naming it.
    """
    unrolled = text.replace(",", "")
    for repeat in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        unrolled = re.sub(repeat, lambda m: m.group(1) * int(m.group(2)), unrolled)
    stages = unrolled.split("|")
    for stage in stages:
        for piece in stage:
            if piece not in PIECES:
                raise ValueError(
                    f"{FLAG} {text!r}: {piece!r} is not a piece of a stage; write E "
                    f"(embedding), t (transformer layer), m (MTP layer) and L (loss), '|' "
                    f"between stages, X*N or (...)*N to repeat and commas as separators, "
                    f"without spaces")
    return stages


@dataclass(frozen=True)
class PipelineLayout:
    """The pieces of every virtual stage: ``stages[c * pp_size + r]`` is model chunk ``c``
    of PP rank ``r``. ``str()`` writes it back as a layout string."""
    stages: tuple
    pp_size: int

    @property
    def vp_size(self):
        """Model chunks per rank (1: no interleaving)."""
        return len(self.stages) // self.pp_size

    def stage(self, pp_rank, chunk=0):
        """The pieces of model chunk ``chunk`` of PP rank ``pp_rank``."""
        return self.stages[chunk * self.pp_size + pp_rank]

    def layer_numbers(self, pp_rank, chunk=0):
        """The global (0-based) transformer layers of one model chunk."""
        index = chunk * self.pp_size + pp_rank
        start = sum(stage.count(LAYER) for stage in self.stages[:index])
        return list(range(start, start + self.stages[index].count(LAYER)))

    def chunk_layer_numbers(self, pp_rank):
        """The global layers of every model chunk of ``pp_rank``, chunk order."""
        return [self.layer_numbers(pp_rank, chunk) for chunk in range(self.vp_size)]

    def has_embedding(self, pp_rank, chunk=0):
        return EMBEDDING in self.stage(pp_rank, chunk)

    def has_loss(self, pp_rank, chunk=0):
        return LOSS in self.stage(pp_rank, chunk)

    def __str__(self):
        return "|".join(self.stages)

    def describe(self):
        """One line per PP rank: what each of its model chunks holds (for the banner)."""
        lines = []
        for r in range(self.pp_size):
            chunks = [_describe_stage(self.stage(r, c), self.layer_numbers(r, c))
                      for c in range(self.vp_size)]
            lines.append(f"PP rank {r}: " + " | ".join(chunks))
        return lines


def _describe_stage(pieces, layers):
    parts = ["embedding"] if EMBEDDING in pieces else []
    if layers:
        parts.append(f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}")
    if MTP in pieces:
        parts.append(f"{pieces.count(MTP)} MTP layer(s)")
    if LOSS in pieces:
        parts.append("loss")
    return ", ".join(parts) or "(empty stage)"


def _check_mtp_pieces(stages, said, mtp_num_layers):
    """Megatron-LM's MTP rules for a layout: one m per --mtp-num-layers depth, all in the
    last stage after its transformer layers, before L. (Megatron-LM may also put them on an
    earlier stage of their own, "MTP standalone"; here they live with the output layer and
    loss they share, on the last stage, so that is refused.)"""
    count = "".join(stages).count(MTP)
    if count != (mtp_num_layers or 0):
        raise ValueError(f"{said} holds {count} MTP layers (m) but --mtp-num-layers is "
                         f"{mtp_num_layers}; give one m per MTP depth, in the last stage")
    if count and not stages[-1].endswith(MTP * count + LOSS):
        raise ValueError(f"{said}: the MTP layers (m) must all sit in the last stage, after "
                         f"its transformer layers and right before the loss (L), e.g. "
                         f"'...|tt{MTP * count}L' (an MTP stage of its own is not built)")


def check_layout(stages, text, pp_size, num_layers, mtp_num_layers=None):
    """A :class:`PipelineLayout` from parsed ``stages`` (of the string ``text``), or a
    ValueError naming the rule broken and the fix: Megatron-LM's rules (a multiple of PP
    stages, E first and L last exactly once each, ``--num-layers`` t's, ``--mtp-num-layers``
    m's right before L), and the embedding in the first stage and the loss in the last one,
    where the model builds them (an empty stage may not come before E or after L)."""
    said = f"{FLAG} {text!r}"
    if len(stages) % pp_size != 0:
        raise ValueError(f"{said} has {len(stages)} stages, not a multiple of "
                         f"--pipeline-model-parallel-size ({pp_size}); give PP x (virtual "
                         f"stages per rank) stages separated by '|'")
    pieces = "".join(stages)
    _check_mtp_pieces(stages, said, mtp_num_layers)
    pieces = pieces.replace(MTP, "")
    if pieces.count(EMBEDDING) != 1 or pieces.count(LOSS) != 1:
        raise ValueError(f"{said} must hold the embedding (E) and the loss (L) once each; it "
                         f"holds {pieces.count(EMBEDDING)} E and {pieces.count(LOSS)} L")
    if not pieces.startswith(EMBEDDING) or not pieces.endswith(LOSS):
        raise ValueError(f"{said}: the embedding (E) must come first and the loss (L) last, "
                         f"with every transformer layer (t) between them")
    if not stages[0].startswith(EMBEDDING) or not stages[-1].endswith(LOSS):
        raise ValueError(f"{said}: the embedding (E) belongs in the first stage and the loss "
                         f"(L) in the last, where the model builds them; remove the empty "
                         f"stage before E or after L")
    if pieces.count(LAYER) != num_layers:
        raise ValueError(f"{said} holds {pieces.count(LAYER)} transformer layers (t) but "
                         f"--num-layers is {num_layers}; give every layer one t")
    if len(stages) > pp_size == 1:
        raise ValueError(f"{said} has {len(stages)} stages for one pipeline rank: virtual "
                         f"stages need --pipeline-model-parallel-size > 1")
    return PipelineLayout(tuple(stages), pp_size)
