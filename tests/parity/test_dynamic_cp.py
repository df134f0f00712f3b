"""Dynamic context parallelism (--dynamic-context-parallel; Megatron-LM's
--hybrid-context-parallel): every document of a global batch re-packed into bins and run on a
CP group sized for it reproduces one process's 6-step loss curve on the same global batches
(fp32, relative 1e-5), with packed documents, p2p, a2a and all_gather, with TP (+SP), at world
sizes 4 and 8 (CP groups of 1, 2, 4 and 8 ranks; pools from DP x CP and from DP alone), with
learned absolute positions and tied embeddings, without document masking, and with MoE; the
parameters after training equal one process's (every gradient entered them), and so does an
evaluation pass; a checkpoint saved under dynamic CP resumes to the uninterrupted curve, also
under a static layout. With expert parallelism (EP 2) the bins run in lockstep rounds."""
import pytest
import torch

from dist_harness import run_workers
from training_utils import NO_DROPOUT, TINY, max_rel_diff, train_losses, trained

PACKED = (f"{TINY}{NO_DROPOUT} --train-iters 6 --calculate-per-token-loss "
          "--reset-attention-mask --reset-position-ids")
DYNAMIC = "--dynamic-context-parallel --max-seqlen-per-dp-cp-rank"


@pytest.fixture(scope="module")
def reference():
    return run_workers(train_losses, 1, PACKED)[0]


def _check(results, reference, what):
    assert reference[-1] < reference[0], "the tiny model must learn"
    for losses in results:  # every rank reports the same global loss
        diff = max_rel_diff(losses, reference)
        print(f"{what}: max relative loss difference {diff:.2e}")
        assert diff < 1e-5


@pytest.mark.parametrize("world,extra", [
    # pool 4 = DP2 x CP2 at 8 tokens a rank: documents on 1, 2 and 4 ranks
    (4, f"--context-parallel-size 2 {DYNAMIC} 8"),
    (4, f"{DYNAMIC} 8 --cp-comm-type all_gather"),  # pool 4 = DP4: dynamic CP without static CP
    # pool 8 = DP2 x CP4 at 4 tokens a rank: groups of 1, 2, 4 and 8 ranks
    (8, f"--context-parallel-size 4 {DYNAMIC} 4"),
    (8, f"--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 {DYNAMIC} 8 "
        "--cp-comm-type a2a --overlap-grad-reduce --use-distributed-optimizer"),
])
def test_dynamic_cp_matches_one_process(reference, world, extra):
    _check(run_workers(train_losses, world, f"{PACKED} {extra}"), reference, extra)


def test_megatron_defaults_and_unmasked_samples():
    """Learned absolute positions, tied embeddings, LayerNorm/GELU (TINY's), documents that
    keep counting positions (no --reset-position-ids), then samples without document
    masking (each sample one sequence) under a minimum group size of 2."""
    learned = (f"{TINY}{NO_DROPOUT} --train-iters 6 --calculate-per-token-loss "
               "--position-embedding-type learned_absolute --reset-attention-mask")
    _check(run_workers(train_losses, 4, f"{learned} --context-parallel-size 2 {DYNAMIC} 8"),
           run_workers(train_losses, 1, learned)[0], "learned absolute")
    whole = f"{TINY}{NO_DROPOUT} --train-iters 6 --calculate-per-token-loss"
    _check(run_workers(train_losses, 4, f"{whole} {DYNAMIC} 16 "
                       "--min-dynamic-context-parallel-size 2"),
           run_workers(train_losses, 1, whole)[0], "whole samples")


def test_moe_without_per_microbatch_balancing():
    """MoE with aux-loss-free balancing, experts local (EP1) and split over 2 ranks (EP2:
    lockstep rounds; without them this run hangs)."""
    moe = (f"{PACKED} --train-iters 6 --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0 "
           "--moe-router-enable-expert-bias --moe-router-score-function sigmoid --swiglu")
    reference = run_workers(train_losses, 1, moe)[0]
    _check(run_workers(train_losses, 4, f"{moe} --context-parallel-size 2 {DYNAMIC} 8"),
           reference, "MoE")
    # expert parallelism: bins in lockstep rounds, empty ones where a rank has none
    extra = "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
    _check(run_workers(train_losses, 4, f"{moe} {extra} {DYNAMIC} 8"), reference, extra)


def _params(rank, world, argv):
    """Worker: the parameters after training, the group sizes of the last step's bins, and
    the loss of an evaluation pass after training."""
    losses, trainer = trained(rank, world, argv)
    schedule = getattr(trainer.data, "last_schedule", None)
    sizes = sorted({b.size for b in schedule.bins}) if schedule else None
    params = {name: p.detach().clone() for name, p in trainer.model.module.named_parameters()}
    return params, sizes, trainer.evaluate()


def test_parameters_and_evaluation_after_training_equal_one_process():
    argv = f"{PACKED} --train-iters 3 --eval-iters 2 --eval-interval 1000"
    one, _, one_eval = run_workers(_params, 1, argv)[0]
    for got, sizes, evaluated in run_workers(_params, 4,
                                             f"{argv} --context-parallel-size 2 {DYNAMIC} 8"):
        assert sizes == [1, 2, 4]  # the step really ran groups of every size
        assert abs(evaluated - one_eval) / abs(one_eval) < 1e-5, (evaluated, one_eval)
        assert got.keys() == one.keys()
        for name in one:
            torch.testing.assert_close(got[name], one[name], rtol=1e-5, atol=1e-6, msg=name)



def test_resume_from_a_dynamic_checkpoint(reference, tmp_path):
    """Saved at iteration 3 under dynamic CP (torch_dist), resumed to 6 under dynamic CP and
    under static CP2 x DP2: both continue the uninterrupted curve."""
    dynamic = f"{PACKED} --context-parallel-size 2 {DYNAMIC} 8"
    first = run_workers(train_losses, 4, f"{dynamic} --exit-interval 3 --save {tmp_path}/a")[0]
    again = run_workers(train_losses, 4, f"{dynamic} --load {tmp_path}/a")[0]
    _check([first + again], reference, "dynamic -> dynamic")
    static = f"{PACKED} --context-parallel-size 2"
    moved = run_workers(train_losses, 4, f"{static} --load {tmp_path}/a")[0]
    _check([first + moved], reference, "dynamic -> static")


def test_megatron_lm_data_path():
    """Megatron-LM's dynamic CP reads documents from the dataset's cu_seqlens
    (--dataloader-inter-document-masking): the same documents here, equal to one process."""
    documents = (f"{TINY}{NO_DROPOUT} --train-iters 6 --calculate-per-token-loss "
                 "--dataloader-inter-document-masking")
    _check(run_workers(train_losses, 4, f"{documents} --context-parallel-size 2 "
                       "--hybrid-context-parallel --max-seqlen-per-dp-cp-rank 8"),
           run_workers(train_losses, 1, documents)[0], "inter-document masking")

