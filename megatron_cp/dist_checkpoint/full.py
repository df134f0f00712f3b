"""One process reads a whole torch_dist checkpoint as full tensors, or writes one from them.

Used by ``tools/checkpoint_convert.py`` (torch <-> torch_dist) and by the tests that
compare the unsharded state of checkpoints saved under different layouts. The tensors keep
their canonical form (:mod:`megatron_cp.dist_checkpoint.canonical`); a checkpoint written
here has one chunk per tensor, which DCP reshards to any layout on load like any other.
"""
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_cp.dist_checkpoint.torch_dist import COMMON, read_common


def read_full(folder):
    """``({key: full tensor}, common)`` of the torch_dist checkpoint in the iteration
    folder ``folder`` (keys ``model.<name>``, ``optimizer.<kind>.<name>``)."""
    reader = dcp.FileSystemReader(folder)
    metadata = reader.read_metadata()
    tensors = {key: torch.empty(md.size, dtype=md.properties.dtype)
               for key, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=reader,
                 planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=True)
    return tensors, read_common(folder)


def write_full(folder, tensors, common, rng_from=None):
    """Write ``tensors`` (full canonical tensors by key) and ``common`` as a torch_dist
    iteration folder ``folder`` (replaced if it exists); ``rng_from``: an iteration folder
    whose ``rng/`` states to copy along."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({k: v.contiguous() for k, v in tensors.items()},
                 storage_writer=dcp.FileSystemWriter(folder),
                 planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=True)
    if rng_from and os.path.isdir(os.path.join(rng_from, "rng")):
        shutil.copytree(os.path.join(rng_from, "rng"), os.path.join(folder, "rng"))
    torch.save(common, os.path.join(folder, COMMON))
