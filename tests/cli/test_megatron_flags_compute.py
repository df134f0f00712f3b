"""Megatron-LM flags that change what is computed or logged, each with Megatron's meaning and a
test that fails without it: --log-num-zeros-in-grad, --deterministic-mode, --logging-level."""
import contextlib
import io
import os
import re

import numpy as np
import torch

from dist_harness import run_workers
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.optimizer.clip_grads import count_zeros
from training_utils import TINY, train_losses

STEPS = TINY + " --train-iters 3 --log-interval 1"
ZEROS = re.compile(r"iteration\s+(\d+)/.*\| num zeros: (\d+) \|")


# ----- --log-num-zeros-in-grad ---------------------------------------------------------------

def _counted(rank, world):
    """count_zeros over TP=world: a TP-sharded param counts on every rank, a replicated one
    on TP rank 0 only."""
    state = initialize_model_parallel(world, 1, 1, device=torch.device("cpu"))
    sharded, replicated = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(6))
    sharded.tensor_model_parallel = True
    sharded.grad = torch.tensor([0.0, 1.0, 0.0, 2.0]) if rank == 0 else torch.tensor([0.0, 1.0, 1.0, 1.0])
    replicated.grad = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    return count_zeros([sharded, replicated, replicated], state)  # a repeat counts once


def test_count_zeros_counts_each_parameter_once():
    assert run_workers(_counted, 1) == [2 + 3]
    assert run_workers(_counted, 2) == [2 + 1 + 3] * 2


def _zeros_logged(rank, world, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_losses(rank, world, argv)
    return {int(it): int(n) for it, n in ZEROS.findall(out.getvalue())}


def test_num_zeros_in_grad_is_logged_the_same_under_every_layout():
    """The zeros of the gradient (here the rows of the padded and of the unused vocabulary)
    are one number for the model, whatever the layout; without the flag no count is logged."""
    argv = STEPS + " --log-num-zeros-in-grad"
    reference = run_workers(_zeros_logged, 1, argv)[0]
    assert sorted(reference) == [1, 2, 3] and min(reference.values()) > 0, reference
    for world, layout in ((2, "--tensor-model-parallel-size 2 --sequence-parallel"),
                          (2, "--use-distributed-optimizer"),
                          (2, "--pipeline-model-parallel-size 2")):
        logged = run_workers(_zeros_logged, world, f"{argv} {layout}")[0]
        assert logged == reference, (layout, logged, reference)
    assert run_workers(_zeros_logged, 1, STEPS)[0] == {}


# ----- --deterministic-mode ---------------------------------------------------------------

def _deterministic_run(rank, world, argv):
    from megatron_cp.cli.arguments import parse_args
    losses = train_losses(rank, world, argv)
    args = parse_args(argv.split(), world_size=world)
    return (losses, torch.are_deterministic_algorithms_enabled(), args.attention_kernel,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"), os.environ.get("NCCL_ALGO"))


def test_deterministic_mode_turns_on_deterministic_kernels_and_repeats_bit_for_bit():
    first, second = (run_workers(_deterministic_run, 1, STEPS + " --deterministic-mode")[0]
                     for _ in range(2))
    losses, enabled, kernel, cublas, nccl = first
    assert enabled and kernel == "torch" and cublas == ":4096:8" and nccl == "Ring"
    assert second[0] == losses  # bit for bit
    plain = run_workers(_deterministic_run, 1, STEPS)[0]
    assert plain[1:3] == (False, "auto")
    np.testing.assert_allclose(plain[0], losses, rtol=1e-5)  # the same model, other kernels


# ----- --logging-level ----------------------------------------------------------------------

def _main_output(rank, world, argv):
    from megatron_cp.training import main
    text = io.StringIO()
    with contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):
        status = main(argv.split())
    return status, text.getvalue()


def test_logging_level_decides_which_messages_print(tmp_path):
    """A small corpus leaves the test split empty: the data builder warns, unless
    --logging-level is above warnings."""
    from megatron_cp.data.indexed_dataset import IndexedDatasetBuilder
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n in range(12):
        builder.add_document(np.arange(1, 40 + n, dtype=np.uint16) % 150 + 1)
    builder.finalize(prefix + ".idx")
    argv = (STEPS.replace("--mock-data", "") + f" --data-path {prefix} "
            "--tokenizer-type NullTokenizer --split 90,9,1")
    warning = "the test split (weight 0.0100 of 12 documents) holds no document"
    for flags, printed in (("", True), (" --logging-level 30", True),
                           (" --logging-level 40", False)):
        status, text = run_workers(_main_output, 1, argv + flags)[0]
        assert status == 0 and (warning in text) == printed, (flags, text)


# ----- --no-mmap-bin-files ------------------------------------------------------------------

def test_no_mmap_bin_files_reads_the_same_tokens_without_mapping(tmp_path):
    from megatron_cp.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 150, int(rng.integers(5, 50))) for _ in range(20)]
    for doc in docs:
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap_bin=False)
    assert isinstance(mapped._bin_buffer, np.memmap) and read._bin_buffer is None
    for i, doc in enumerate(docs):
        assert read[i].tolist() == mapped[i].tolist() == doc.tolist()
        assert read.get(i, 2, 3).tolist() == doc[2:5].tolist()


def _losses_and_mapping(rank, world, argv):
    from megatron_cp.data import indexed_dataset
    maps = []
    real_map = indexed_dataset._map

    def counting_map(path):
        maps.append(os.path.basename(path))
        return real_map(path)
    indexed_dataset._map = counting_map
    return train_losses(rank, world, argv), sorted(set(maps))


def test_no_mmap_bin_files_trains_the_same_losses(tmp_path):
    from megatron_cp.data.indexed_dataset import IndexedDatasetBuilder
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(1)
    for _ in range(40):
        builder.add_document(rng.integers(1, 150, int(rng.integers(20, 80))))
    builder.finalize(prefix + ".idx")
    argv = (STEPS.replace("--mock-data", "") + f" --data-path {prefix} "
            "--tokenizer-type NullTokenizer --split 100,0,0")
    mapped = run_workers(_losses_and_mapping, 1, argv)[0]
    read = run_workers(_losses_and_mapping, 1, argv + " --no-mmap-bin-files")[0]
    assert mapped[1] == ["corpus.bin", "corpus.idx"] and read[1] == ["corpus.idx"]
    assert read[0] == mapped[0]


# ----- --save-retain-interval ---------------------------------------------------------------

def test_save_retain_interval_keeps_multiples_and_the_latest(tmp_path):
    from megatron_cp.checkpoint.files import saved_iterations
    base = TINY + " --train-iters 7 --save-interval 1"
    for name, extra, kept in (
            ("plain", "", [1, 2, 3, 4, 5, 6, 7]),
            ("torch", " --save-retain-interval 3", [3, 6, 7]),
            ("dist", " --save-retain-interval 3 --ckpt-format torch_dist --async-save", [3, 6, 7])):
        save = tmp_path / name
        run_workers(train_losses, 2, f"{base} --save {save}{extra}")
        assert saved_iterations(str(save)) == kept, (name, saved_iterations(str(save)))
