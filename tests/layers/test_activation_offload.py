"""--cpu-offloading-num-layers (Megatron-LM's flag): the saved-tensor hooks that keep a layer's
activations in host memory, exercised on CPU tensors (a host copy of a CPU tensor is a second
one), and the flag on a CPU run: the same losses and one note saying nothing is offloaded."""
import contextlib
import io

import torch

from dist_harness import run_workers
from megatron_cp.layers.activation_offload import ActivationOffloader, _OnHost
from megatron_cp.model import GPTModel
from model_utils import tiny_config
from training_utils import TINY, assert_refused, train_losses


class _Counting(ActivationOffloader):
    """The offloader, counting what it moved and what it brought back."""

    def __init__(self):
        super().__init__("cpu", pin=False)
        self.moved = self.restored = 0

    def pack(self, tensor):
        packed = super().pack(tensor)
        self.moved += isinstance(packed, _OnHost)
        return packed

    def unpack(self, packed):
        self.restored += isinstance(packed, _OnHost)
        return super().unpack(packed)


def test_pack_moves_a_copy_and_unpack_brings_it_back():
    offloader = ActivationOffloader("cpu", pin=False)
    x = torch.randn(4, 6).t()  # a non-contiguous view
    packed = offloader.pack(x)
    assert isinstance(packed, _OnHost)
    assert packed.host.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(offloader.unpack(packed), x, rtol=0, atol=0)
    weight = torch.nn.Parameter(torch.randn(3))
    assert offloader.pack(weight) is weight  # parameters stay where they are
    assert offloader.pack(torch.randn(2, device="meta")).device.type == "meta"  # another device


def test_a_model_backward_through_the_hooks_gives_the_same_gradients():
    gen = torch.Generator().manual_seed(5)
    tokens, labels = (torch.randint(0, 120, (2, 16), generator=gen) for _ in range(2))
    pos = torch.arange(16).expand(2, 16)
    grads = []
    offloader = _Counting()
    for context in (contextlib.nullcontext(), offloader.context()):
        model = GPTModel(tiny_config(activation="swiglu"))
        with context:
            loss = model(tokens, pos, labels=labels)
        loss.mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert offloader.moved > 10 and offloader.restored == offloader.moved
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0)


def test_with_full_recompute_the_checkpoints_move_and_the_gradients_stay():
    """Under full recomputation the offloaded layer's checkpoint input goes to the host and
    its own tensors stay with the checkpoint (hooks inside it would break its recompute)."""
    gen = torch.Generator().manual_seed(5)
    tokens, labels = (torch.randint(0, 120, (2, 16), generator=gen) for _ in range(2))
    pos = torch.arange(16).expand(2, 16)
    grads, moved = [], []
    for num_layers in (0, 1):
        model = GPTModel(tiny_config(recompute_granularity="full", recompute_method="uniform",
                                     recompute_num_layers=1, cpu_offloading_num_layers=num_layers))
        model.decoder.offloader = _Counting() if num_layers else None  # as a GPU would have
        model(tokens, pos, labels=labels).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        moved.append(model.decoder.offloader and model.decoder.offloader.moved)
    assert 1 <= moved[1] <= 3, moved  # layer 0's checkpoint input (and its position ids)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0)


def _logged_losses(rank, world, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = train_losses(rank, world, argv)
    return losses, out.getvalue()


def test_flag_on_cpu_changes_nothing_and_says_so():
    argv = TINY + " --train-iters 3"
    reference, plain_log = run_workers(_logged_losses, 1, argv)[0]
    losses, log = run_workers(_logged_losses, 1, argv + " --cpu-offloading-num-layers 1")[0]
    assert losses == reference
    note = "> --cpu-offloading-num-layers 1: activations already live in host memory on cpu"
    assert log.count(note) == 1 and note not in plain_log


def test_the_last_layer_is_never_offloaded():
    assert_refused(TINY + " --train-iters 1 --cpu-offloading-num-layers 2",
                   "--cpu-offloading-num-layers (2) must be from 0 to --num-layers - 1 (1)")
