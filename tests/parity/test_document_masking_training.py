"""--dataloader-inter-document-masking in training: on documents that each end with EOD (the
mock data) it trains as --reset-attention-mask --reset-position-ids, whose documents are the
same there; on documents without EOD it keeps attention inside them (the losses leave a plain
run's), validation included; and CP=2 (p2p) and TP=2 reproduce one process's losses."""
import numpy as np
import pytest

from dist_harness import run_workers
from test_data_gpt_dataset import write_dataset
from training_utils import TINY, max_rel_diff, train_runs, trainer_of

FLAG = "--dataloader-inter-document-masking"
STEPS = f"{TINY} --train-iters 4"
RESET = "--reset-attention-mask --reset-position-ids"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Flags of a run on 300 documents of 2..12 tokens without EOD (NullTokenizer's EOD is
    --vocab-size), with a validation split evaluated every 2 steps."""
    rng = np.random.RandomState(0)
    docs = [rng.randint(0, 150, size=n) for n in rng.randint(2, 13, size=300)]
    prefix = write_dataset(str(tmp_path_factory.mktemp("no_eod") / "docs"), docs)
    return (STEPS.replace("--mock-data", f"--data-path {prefix} --tokenizer-type NullTokenizer")
            .replace("--eval-iters 0", "--eval-iters 1 --eval-interval 2 --split 80,20,0"))


def _losses_and_validation(rank, world, argvs, evaluated):
    """Worker: the training losses of each of ``argvs``, then the validation loss of each of
    ``evaluated`` at initialisation."""
    return train_runs(rank, world, argvs), [trainer_of(argv, world).evaluate()
                                            for argv in evaluated]


@pytest.fixture(scope="module")
def runs(files):
    argvs = {"mock flag": f"{STEPS} {FLAG} --eod-mask-loss",
             "mock reset": f"{STEPS} {RESET} --eod-mask-loss",
             "files flag": f"{files} {FLAG}", "files plain": files}
    losses, validation = run_workers(_losses_and_validation, 1, list(argvs.values()),
                                     [f"{files} {FLAG}", files])[0]
    return {**dict(zip(argvs, losses)), "validation": validation}


def test_flag_matches_reset_on_eod_documents_and_masks_without_them(runs):
    for name in ("mock flag", "mock reset", "files flag", "files plain"):
        assert isinstance(runs[name], list) and len(runs[name]) == 4, (name, runs[name])
    assert max_rel_diff(runs["mock flag"], runs["mock reset"]) < 1e-6
    diff = max_rel_diff(runs["files flag"], runs["files plain"])
    print(f"no-EOD documents, flag vs plain: max relative loss difference {diff:.2e}")
    assert diff > 1e-4  # measured 3.9e-4
    flagged, plain = runs["validation"]  # evaluation reads its documents too
    print(f"validation loss at initialisation: {flagged:.6f} with the flag, {plain:.6f} without")
    assert abs(flagged - plain) > 5e-5 * plain, (flagged, plain)  # measured 1.6e-4


def test_context_and_tensor_parallel_match_one_process(runs, files):
    """CP=2 (p2p) splits each document over the ranks; TP=2 broadcasts the document ids
    from TP rank 0 with the text."""
    layouts = ["--context-parallel-size 2 --cp-comm-type p2p", "--tensor-model-parallel-size 2"]
    for rank_runs in run_workers(train_runs, 2, [f"{files} {FLAG} {x}" for x in layouts]):
        for layout, losses in zip(layouts, rank_runs):
            diff = max_rel_diff(losses, runs["files flag"])
            print(f"{layout} with {FLAG}: max relative loss difference {diff:.2e}")
            assert diff < 1e-5
