"""A torch.distributed.checkpoint (DCP) value made of boxes of one global tensor, and the
planners that read and write it.

DCP already knows how to save a tensor as chunks (offsets + sizes inside a global shape)
written by many ranks, to drop chunks that several ranks hold identically (replicas write
once: its planner deduplicates write items by name and offset), and to load any other
chunking of the same tensor by reading the overlaps (resharding). DTensor and
ShardedTensor hand it one regular chunk per rank; here a rank may hold several irregular
boxes of a tensor (a distributed-optimizer shard that starts mid-row, the real vocabulary
rows of the last TP rank), so the two planners make DCP's write and read items from
:class:`Pieces` themselves and look pieces up by offset; the rest (deduplication, the
global metadata, resharding reads, the file layout) is DCP's default.
"""
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_cp.checkpoint.canonical import CanonicalSpec


class Pieces:
    """This rank's boxes of the global tensor ``global_shape``: ``[(offsets, tensor), ...]``.

    The tensors are views of live state (saving reads them, loading writes into them), or
    copies when staged for an asynchronous save.
    """

    def __init__(self, global_shape, boxes):
        self.global_shape = torch.Size(global_shape)
        self.boxes = [(torch.Size(offsets), tensor) for offsets, tensor in boxes]

    @classmethod
    def of_flat(cls, spec: CanonicalSpec, flat, start, stop):
        """The boxes of the local flat range ``[start, stop)`` whose values are the 1-D
        tensor ``flat`` (``stop - start`` elements): each box is a view of it."""
        assert flat.numel() == stop - start, (spec.name, flat.numel(), start, stop)
        boxes = []
        for offsets, sizes, first in spec.boxes(start, stop):
            numel = 1
            for size in sizes:
                numel *= size
            boxes.append((offsets, flat[first - start:first - start + numel].view(sizes)))
        return cls(spec.global_shape, boxes)

    def staged(self):
        """A copy on CPU that training may not touch (for an asynchronous save)."""
        return Pieces(self.global_shape,
                      [(off, t.detach().to("cpu", copy=True)) for off, t in self.boxes])

    def chunks(self):
        """DCP's description of the boxes: offsets and sizes in the global tensor."""
        return [ChunkStorageMetadata(offsets=offsets, sizes=t.size()) for offsets, t in self.boxes]

    def write_items(self, fqn):
        """One DCP write item per box, keyed by (name, offsets): replicas deduplicate."""
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=chunk, properties=TensorProperties.create_from_tensor(t),
                              size=self.global_shape))
                for chunk, (_, t) in zip(self.chunks(), self.boxes)]

    def fill_from(self, full):
        """Copy each box out of ``full``, the whole global tensor (a load from tensors
        already in memory: a torch or Megatron-LM checkpoint read whole)."""
        for offsets, tensor in self.boxes:
            box = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
            tensor.copy_(full[box])

    def piece_at(self, index):
        """The box tensor at ``index.offset`` (``index.index``: a hint of its position)."""
        if index.index is not None and index.index < len(self.boxes) \
                and self.boxes[index.index][0] == index.offset:
            return self.boxes[index.index][1]
        for offsets, tensor in self.boxes:
            if offsets == index.offset:
                return tensor
        raise ValueError(f"no piece of {index.fqn} at offset {tuple(index.offset)} on this rank")


def check_saved(fqn, saved_shape, pieces):
    """ValueError unless the checkpoint holds ``fqn`` (``saved_shape``: its global shape
    there, None when absent) in the shape of this model's ``pieces``."""
    if saved_shape is None:
        raise ValueError(f"the checkpoint has no tensor {fqn}: it was saved from another "
                         f"model (compare the model arguments) or without it "
                         f"(--no-save-optim)")
    if torch.Size(saved_shape) != pieces.global_shape:
        raise ValueError(f"{fqn} is {tuple(saved_shape)} in the checkpoint but "
                         f"{tuple(pieces.global_shape)} in this model; load it into the "
                         f"model it was saved from")


def fill_from_full(state, tensors):
    """Fill every :class:`Pieces` of ``state`` ({key: Pieces}) from ``tensors`` ({key: whole
    global tensor}), checking each key and shape as a DCP load does."""
    for fqn, pieces in _pieces(state):
        full = tensors.get(fqn)
        check_saved(fqn, None if full is None else full.shape, pieces)
        pieces.fill_from(full)


def _pieces(state_dict):
    for fqn, value in state_dict.items():
        if not isinstance(value, Pieces):
            raise TypeError(f"{fqn}: the pieces planners take Pieces values only, got {type(value)}")
        yield fqn, value


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (deduplication, metadata) over a dict of :class:`Pieces`."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self):
        self.plan = SavePlan([item for fqn, pieces in _pieces(self.state_dict)
                              for item in pieces.write_items(fqn)])
        return self.plan

    def lookup_object(self, index):
        return self.state_dict[index.fqn].piece_at(index)


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (resharding reads) over a dict of :class:`Pieces`."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        # The default set-up walks the values to materialize meta tensors; nothing here is on
        # the meta device, and nothing is flattened.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self):
        saved = self.metadata.state_dict_metadata
        requests = []
        for fqn, pieces in _pieces(self.state_dict):
            check_saved(fqn, saved[fqn].size if fqn in saved else None, pieces)
            requests += create_read_items_for_chunk_list(fqn, saved[fqn], pieces.chunks())
        return LoadPlan(requests)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn].piece_at(index)
