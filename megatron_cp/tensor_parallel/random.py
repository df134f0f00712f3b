"""RNG for tensor parallelism and activation recomputation.

Dropout outside TP regions (on replicated activations) must draw the same mask on every
TP rank; dropout on a rank's own part (hidden dropout on its s/tp tokens under sequence
parallelism) must differ across TP ranks. (Attention dropout draws no random numbers: its
mask is a hash of each element's coordinates, context_parallel/dropout.py.) The default generator is seeded identically on TP ranks; :class:`RNGStatesTracker` keeps
extra named states (the ``model-parallel-rng`` one seeded per TP rank) that ``fork()``
swaps in. :func:`checkpoint` replays the tracker's states during recomputation so
recomputed dropout masks equal the original ones.
"""
import contextlib
import zlib

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from megatron_cp.distributed import device as device_mod
from megatron_cp.fp8 import rows as fp8_rows

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state(device):
    return device_mod.rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state, device):
    if device.type == "cuda":
        device_mod.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states for one device; ``fork(name)`` runs a block on that state."""

    def __init__(self, device=torch.device("cpu")):
        self.device = torch.device(device)
        self.states = {}
        self.recomputing = False  # True while activation recomputation reruns a forward

    def add(self, name, seed):
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            device_mod.manual_seed(seed, self.device)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(saved, self.device)

    def get_states(self):
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states):
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise ValueError(f"RNG state {name!r} was never added; call model_parallel_seed first")
        saved = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(saved, self.device)


def model_parallel_seed(seed, tp_rank, device=torch.device("cpu")):
    """Seed the default generator with ``seed`` (same on TP ranks) and return a tracker whose
    model-parallel state is seeded per TP rank (``seed + 2718 + tp_rank``, Megatron's offset)."""
    torch.manual_seed(seed)
    device_mod.manual_seed(seed, torch.device(device))
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    return tracker


def init_seed(base_seed, name):
    """A seed for one parameter, stable across processes and parallel layouts."""
    return (base_seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


class _SplitInput:
    """--distribute-saved-activations: once the checkpointed forward has run, the tensor
    ``x`` that the checkpoint keeps for its recompute holds only this rank's 1/N of its
    elements (flattened, padded to a multiple of N = the group's size); before the recompute
    an all-gather over ``group`` gives it back whole (Megatron-LM's split of the first
    input of a checkpoint over the TP ranks)."""

    def __init__(self, x, group):
        self.x, self.group, self.shape = x, group, x.shape

    @contextlib.contextmanager
    def split_after(self):
        yield
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        flat = self.x.data.reshape(-1)  # [n]
        piece = -(-flat.numel() // size)
        flat = torch.nn.functional.pad(flat, (0, piece * size - flat.numel()))  # [N x piece]
        self.x.data = flat[rank * piece:(rank + 1) * piece].clone()  # [n/N], its own storage

    def gather(self):
        size = dist.get_world_size(self.group)
        parts = [torch.empty_like(self.x.data) for _ in range(size)]  # [n/N] each
        dist.all_gather(parts, self.x.data.contiguous(), group=self.group)
        numel = self.shape.numel()
        self.x.data = torch.cat(parts)[:numel].view(self.shape)


@torch.compiler.disable
def checkpoint(function, tracker, *args, distribute_group=None):
    """Activation recomputation: run ``function(*args)`` without keeping its activations and
    recompute it in backward with the same default and tracker RNG states.
    ``distribute_group``: split the first argument, which the checkpoint keeps, over this
    group between forward and the recompute (:class:`_SplitInput`).

    Always eager: dynamo cannot trace a checkpoint whose ``context_fn`` replays the tracker,
    so inside a compiled layer (selective recomputation of the eager core attention) the
    call is a graph break, and around compiled layers (full recomputation) it reruns them.
    """
    snapshot = tracker.get_states() if tracker is not None else None
    real = fp8_rows.current()  # the rerun's FP8 input amaxes skip the same pad tokens
    split = None
    if distribute_group is not None and torch.is_grad_enabled() and args[0].requires_grad:
        split = _SplitInput(args[0], distribute_group)

    @contextlib.contextmanager
    def replay():
        if split is not None:
            split.gather()
        with fp8_rows.real_rows(real):
            if tracker is None:
                yield
                return
            current = tracker.get_states()
            tracker.set_states(snapshot)
            tracker.recomputing = True  # layers that record statistics skip the rerun (MoE router)
            try:
                yield
            finally:
                tracker.set_states(current)
                tracker.recomputing = False

    def context_fn():
        return (split.split_after() if split is not None else contextlib.nullcontext()), replay()

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             preserve_rng_state=True, context_fn=context_fn)
