"""``--dist-ckpt-strictness``: what a torch_dist load does when the keys this run loads and the
keys the checkpoint holds differ, with Megatron-LM's names and meanings (its StrictHandling,
megatron/core/dist_checkpointing/validation.py):

- an *unexpected* key: one this rank loads that the checkpoint lacks (a layer or an optimizer
  state the saving run did not have);
- a *missing* key: one the checkpoint holds that no rank of this run loads.

Every mode but the default gathers every rank's keys, so all ranks see the same lists and
stop, or go on, together.

``assume_ok_unexpected`` (the default) checks nothing here: the load itself then fails on an
unexpected key, naming it. ``log_unexpected`` / ``log_all`` print a WARNING naming the keys
and load the rest, an unexpected key keeping the value it has (its initialisation);
``raise_unexpected`` / ``raise_all`` stop before a byte is read, naming them; ``ignore_all``
loads the rest without a word.
"""
import torch.distributed as dist

SHOWN = 8  # keys named in a line; the count says how many more


def _names(keys):
    listed = ", ".join(keys[:SHOWN])
    return listed + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def _gathered(keys, group):
    """The union of every rank's ``keys`` (a collective over ``group`` when there are ranks)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return set(keys)
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sorted(keys), group=group)
    return set().union(*map(set, gathered))


def mismatches(loaded, saved, with_missing, group=None):
    """``(mine, unexpected, missing)``: this rank's keys of ``loaded`` not in ``saved`` (the
    checkpoint's), every rank's such keys, and, when ``with_missing``, the keys of ``saved``
    that no rank loads, sorted. Every rank calls it (the keys are gathered over ``group``), so
    every rank sees the same lists and decides alike: no rank stops while another goes on
    into the load's collectives."""
    mine = set(loaded) - set(saved)
    unexpected = sorted(_gathered(mine, group))
    missing = sorted(set(saved) - _gathered(loaded, group)) if with_missing else []
    return mine, unexpected, missing


def apply(mode, loaded, saved_keys, folder, say, group=None):
    """The keys of ``loaded`` (a dict, this rank's) to read from the checkpoint in ``folder``
    under strictness ``mode``; ``saved_keys()`` gives the checkpoint's keys (read only when
    the mode checks them); ``say(line)`` prints on one rank. Raises ValueError naming the
    keys in the raise_* modes."""
    if mode == "assume_ok_unexpected":
        return loaded
    mine, unexpected, missing = mismatches(loaded, saved_keys(), mode.endswith("_all"), group)
    found = []
    if unexpected:
        found.append(f"{len(unexpected)} key(s) this run loads are not in the checkpoint "
                     f"({_names(unexpected)})")
    if missing:
        found.append(f"{len(missing)} key(s) of the checkpoint are loaded by no rank "
                     f"({_names(missing)})")
    if found and mode.startswith("raise_"):
        raise ValueError(f"--dist-ckpt-strictness {mode}: checkpoint {folder}: "
                         f"{'; '.join(found)}; load it with the model that saved it, or give "
                         f"--dist-ckpt-strictness log_all to load the keys both have")
    if found and mode.startswith("log_"):
        kept = " (those keep their current values)" if unexpected else ""
        say(f"WARNING: --dist-ckpt-strictness {mode}: checkpoint {folder}: "
            f"{'; '.join(found)}; loading the rest{kept}")
    return {key: value for key, value in loaded.items() if key not in mine}
