"""Fine-grained activation offloading (Megatron-LM's --fine-grained-activation-offloading and
--offload-modules): what chosen modules save for backward waits in (pinned) host memory.

A *group* is one call of one offloaded module (its name: attn_norm, qkv_linear, core_attn,
attn_proj, mlp_norm, expert_fc1, moe_act) in one microbatch's forward of one model chunk;
every tensor autograd saves inside it is the group's. A saved tensor moves when it lives on
the model's device, is neither a parameter nor a view of one (a linear saves its weight's
transpose) and has at least --min-offloaded-tensor-size elements; a strided view that
covers at least half of its storage moves as the whole storage (a plain copy, rebuilt as
the view in backward), any other as a contiguous copy (Megatron-LM's rule, so the same
bytes move). Backward brings each tensor back when it is unpacked. With core_attn
recomputed, core_attn moves nothing here: the checkpoint keeps its inputs itself, where
Megatron-LM's saves them through the hooks.

Which groups move follows Megatron-LM's policy, from the groups and bytes recorded in the
first training forward (the warmup, in which every group moves):

1. the last group of each name stays on the device where backward needs it at once: on the
   last pipeline stage in every microbatch (its backward follows its forward), elsewhere in
   the first microbatch of each step (Megatron-LM's margin);
2. pipeline rank r keeps r x --delta-offload-bytes-across-pp-ranks bytes on the device: the
   first groups of each step's first microbatches, in forward order, until that many bytes;
3. of the remaining groups with bytes to move, the last (1 - --activation-offload-fraction)
   share (rounded down) in forward order stays.

--fine-grained-offloading-max-inflight-offloads N: at most N copies of one name may still be
in flight when the next group of that name commits (0: wait after each one).

On a CPU the activations already live in host memory: nothing moves, and the offloader
counts what WOULD move (``moved_bytes``: per forward; :func:`plan_offload` gives the same
choice to the memory model). ``move=True`` exercises the copies on CPU tensors (a host copy
of a CPU tensor is a second one), as the tests do.
"""
import collections
import contextlib

import torch

from megatron_cp.distributed import device as device_mod

# a strided view covering at least this share of its storage moves as the whole storage
WHOLE_STORAGE_SHARE = 0.5


def plan_offload(groups, fraction, keep_bytes=0, keep_last=True):
    """Which of one forward's ``groups`` [(name, bytes to move), ...] (in forward order)
    move to the host: a list of bools, by rules 1 to 3 of the module docstring; and the
    bytes of rule 2 left for the next microbatch."""
    moves = [True] * len(groups)
    if keep_last:
        last = {name: i for i, (name, _) in enumerate(groups)}
        for i in last.values():
            moves[i] = False
    for i, (_, size) in enumerate(groups):
        if moves[i] and keep_bytes > 0:
            keep_bytes -= size
            moves[i] = False
    eligible = [i for i, (_, size) in enumerate(groups) if moves[i] and size > 0]
    kept = int(len(eligible) * (1 - fraction))
    for i in eligible[len(eligible) - kept:]:
        moves[i] = False
    return moves, max(keep_bytes, 0)


def copied_bytes(tensor):
    """The bytes one saved tensor takes when it moves (see the module docstring)."""
    size = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage().nbytes()
    if not tensor.is_contiguous() and size >= WHOLE_STORAGE_SHARE * storage and \
            storage % tensor.element_size() == 0:
        return storage
    return size


class FineGrainedOffload:
    """The offload groups of one model chunk's layers (module docstring). ``config``: the
    GPTConfig; ``pp_rank`` / ``pp_size``: this chunk's pipeline stage; ``move``: copy to the
    host (default: on a CUDA device only). Set ``num_microbatches`` (the trainer does) for
    the per-step rules."""

    def __init__(self, config, device, pp_rank=0, pp_size=1, move=None):
        self.modules = set(config.offload_modules)
        self.min_size = config.min_offloaded_tensor_size
        self.fraction = config.activation_offload_fraction
        self.keep_bytes = pp_rank * config.delta_offload_bytes_across_pp_ranks
        self.last_stage = pp_rank == pp_size - 1
        self.max_inflight = config.fine_grained_offloading_max_inflight_offloads
        self.device = torch.device(device if device is not None else "cpu")
        self.move = self.device.type == "cuda" if move is None else move
        self.pin = self.device.type == "cuda"
        self.stream = device_mod.side_stream(self.device)
        self.num_microbatches = 1
        self.forwards = 0  # training forwards so far
        self.record = None  # [(name, bytes)] of the warmup forward
        self.moved_bytes = []  # per training forward: bytes moved (CPU: that would move)
        self._plan, self._group_index, self._keep_left = None, 0, 0
        self._active = False  # inside a training forward of the chunk's layers
        self._warmup = None
        self._pending = collections.defaultdict(collections.deque)  # name -> copy events

    def start_forward(self):
        """Called at the start of each forward of the chunk's layers."""
        self._group_index, self._plan = 0, None
        self._active = torch.is_grad_enabled()
        if not self._active:
            return
        microbatch = self.forwards % self.num_microbatches
        self.forwards += 1
        self.moved_bytes.append(0)
        if microbatch == 0:
            self._keep_left = self.keep_bytes
        if self.record is None:
            self._warmup = []  # every group moves; recorded for the plan
            return
        self._plan, self._keep_left = plan_offload(
            self.record, self.fraction, self._keep_left,
            keep_last=self.last_stage or microbatch == 0)

    def end_forward(self):
        """Called after the chunk's layers: the warmup's groups become the plan's record."""
        self._active = False
        if self._warmup is not None:
            self.record, self._warmup = self._warmup, None

    def group(self, name):
        """The context of one call of module ``name`` (a no-op unless it is offloaded)."""
        if name not in self.modules or not self._active or not torch.is_grad_enabled():
            return contextlib.nullcontext()
        index = self._group_index
        self._group_index += 1
        if self._plan is None:  # the warmup: every group moves
            return self._group(name, True)
        return self._group(name, index < len(self._plan) and self._plan[index])

    @contextlib.contextmanager
    def _group(self, name, moves):
        size = [0]

        def pack(tensor):
            if not self._eligible(tensor):
                return tensor
            size[0] += copied_bytes(tensor)
            return self._to_host(tensor) if moves else tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield
        if self._warmup is not None:
            self._warmup.append((name, size[0]))
        if moves:
            self.moved_bytes[-1] += size[0]
            if self.move:
                self._limit_inflight(name)

    def _eligible(self, tensor):
        # weights stay (a linear saves its weight's transpose, a view of the parameter)
        weight = isinstance(tensor, torch.nn.Parameter) or \
            isinstance(tensor._base, torch.nn.Parameter)
        return (tensor.device.type == self.device.type and not weight and
                tensor.numel() >= self.min_size)

    def _to_host(self, tensor):
        if not self.move:
            return tensor
        view = None
        if copied_bytes(tensor) != tensor.numel() * tensor.element_size():  # whole storage
            view = (tensor.size(), tensor.stride(), tensor.storage_offset())
            source = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
                tensor.untyped_storage())  # [storage elements], the whole storage
        else:
            source = tensor.contiguous()
        host = torch.empty(source.shape, dtype=source.dtype, pin_memory=self.pin)
        device_mod.side_waits_for_current(self.stream, self.device)
        with device_mod.stream_context(self.stream):
            host.copy_(source, non_blocking=self.pin)
        device_mod.record_stream(source, self.stream)
        return _Moved(host, tensor.device, view)

    def _unpack(self, packed):
        if not isinstance(packed, _Moved):
            return packed
        device_mod.wait_stream(self.stream)
        back = packed.host.to(packed.device, non_blocking=self.pin)
        if packed.view is not None:
            back = back.as_strided(*packed.view)
        return back

    def _limit_inflight(self, name):
        if self.max_inflight is None or self.stream is None:
            return
        queue = self._pending[name]
        queue.append(device_mod.record_event(self.stream))
        while len(queue) > self.max_inflight:
            device_mod.wait_event(queue.popleft(), self.device)


class _Moved:
    """A saved tensor while it waits in host memory (``view``: the strided view to rebuild
    from the whole storage, or None)."""
    __slots__ = ("host", "device", "view")

    def __init__(self, host, device, view):
        self.host, self.device, self.view = host, device, view


def offload_group(offload, name):
    """``offload.group(name)``, or nothing when the module has no offloader."""
    return offload.group(name) if offload is not None else contextlib.nullcontext()


def fine_grained_note(config, device):
    """The one start-up line saying that fine-grained offloading moves nothing on a CPU (it
    counts what would move), else None."""
    if config.fine_grained_activation_offloading and torch.device(device).type != "cuda":
        return (f"> --fine-grained-activation-offloading ({' '.join(config.offload_modules)}): "
                f"activations already live in host memory on {torch.device(device).type}; "
                f"nothing moves (the offloader counts the bytes that would)")
    return None
