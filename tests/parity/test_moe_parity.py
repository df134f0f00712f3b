"""Every MoE layout equals one process: 10 training steps, relative difference <= 1e-5 of the
LM loss, of the logged balancing and z-losses and of the gradient norm (every expert parameter
counted once) (fp32, CPU).

References: Megatron-LM's defaults (learned absolute positions, tied embeddings, LayerNorm +
GeLU with biases, NullTokenizer --vocab-size 512, padded by TP; the exact GELU of
--no-bias-gelu-fusion, without which Megatron-LM's routed experts stop) with the default allgather
dispatcher, the same with packed documents (padding under CP, EOD tokens loss-masked), and a
Llama/DeepSeek-style MoE (RMSNorm, SwiGLU, no biases, rope, untied; sigmoid scores with the
aux-loss-free expert bias, group-limited routing, per-sequence balancing loss, a gated shared
expert, a dense first layer, alltoall, the router's input jitter), three balancing losses
together with sqrtsoftplus scores, quantile balancing (plain and packed), all with Megatron-LM's
default dropout (hidden and attention 0.1; every mask, and the jitter, follows global
coordinates: layers/hidden_dropout.py). Layouts: EP alone and borrowing DP ranks, TP x EP with
ETP 1 and 2 (and quantile balancing), EP x CP (every comm type, packed; quantile balancing), EP x PP (also interleaved), TP(SP) x CP x PP x
EP, full recomputation (statistics recorded once), the distributed optimizer with overlapped
reduce-scatter and gathers, and capacity dropping under EP x DP (each rank routes whole
microbatches, as one process does). The balancing losses would differ if padding, loss-masked tokens, TP/CP splits or the
number of microbatches per rank entered them.
"""
import pytest

from dist_harness import run_workers
from training_utils import max_rel_diff

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 "
        "--lr-decay-style cosine --hidden-dropout 0.1 --attention-dropout 0.1 --log-interval 100 "
        "--eval-iters 0 --seed 11 --mock-data --tokenizer-type NullTokenizer --vocab-size 512 "
        "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.05 --moe-z-loss-coeff 0.01 "
        "--moe-ffn-hidden-size 48 --no-bias-gelu-fusion")
PACKED = "--reset-attention-mask --reset-position-ids --eod-mask-loss"
LLAMA = ("--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --moe-router-score-function sigmoid "
         "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 "
         "--moe-router-load-balancing-type seq_aux_loss --moe-router-num-groups 2 "
         "--moe-router-group-topk 1 --moe-shared-expert-intermediate-size 32 "
         "--moe-shared-expert-gate --moe-token-dispatcher-type alltoall "
         "--moe-input-jitter-eps 0.01")
A2A = "--moe-token-dispatcher-type alltoall"
# two balancing losses, each with its coefficient (global_aux_loss pools the microbatches
# that DP ranks run together, so it differs by design between layouts), and Megatron-LM's
# sqrtsoftplus scores with the expert bias
LISTED = ("--moe-router-load-balancing-type aux_loss seq_aux_loss "
          "--moe-aux-loss-coeff 0.05 0.02 --moe-router-score-function sqrtsoftplus "
          "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01")
QB = ("--moe-router-load-balancing-type quantile_balancing --moe-aux-loss-coeff 0 "
      "--moe-router-quantile-balancing-ema 0.5")
REFERENCES = {
    "defaults": BASE,
    "packed": f"{BASE} {PACKED}",
    "llama": f"{BASE} {LLAMA} --moe-layer-freq ([0]+[1])",
    "llama4": f"{BASE} {LLAMA} --num-layers 4 --moe-layer-freq ([0]+[1]*3)",
    "listed": f"{BASE} {LISTED}",
    # quantile balancing (no balancing loss): its bias moves after every step
    "qb": f"{BASE} {QB}",
    "qb_packed": f"{BASE} {QB} {PACKED}",
    "capacity": f"{BASE} {A2A} --moe-expert-capacity-factor 1.0",
    "padded_capacity": f"{BASE} --moe-expert-capacity-factor 1.5 --moe-token-drop-policy position "
                       f"--moe-pad-expert-input-to-capacity",
}
EP2, EP4 = "--expert-model-parallel-size 2", "--expert-model-parallel-size 4"
TP2, CP2, PP2 = ("--tensor-model-parallel-size 2", "--context-parallel-size 2",
                 "--pipeline-model-parallel-size 2")
# name: (world, reference, extra arguments)
LAYOUTS = {
    "ep2": (2, "defaults", EP2),
    "ep2_alltoall": (2, "defaults", f"{EP2} {A2A}"),
    "ep2_llama": (2, "llama", EP2),
    # Megatron-LM's flex dispatcher (DeepEP / HybridEP kernels) runs the all-to-all one here
    "ep2_llama_flex_hybridep": (2, "llama", f"{EP2} --moe-token-dispatcher-type flex "
                                            f"--moe-flex-dispatcher-backend hybridep "
                                            f"--moe-permute-fusion --enable-experimental"),
    "ep2_listed_balancing_sqrtsoftplus": (2, "listed", f"{EP2} {A2A}"),
    "ep2_capacity": (2, "capacity", EP2),
    "ep2_padded_capacity": (2, "padded_capacity", EP2),
    "ep2_full_recompute": (2, "llama", f"{EP2} --recompute-granularity full "
                                       f"--recompute-method uniform --recompute-num-layers 1"),
    "ep2_distributed_optimizer": (2, "defaults", f"{EP2} {A2A} --use-distributed-optimizer "
                                                 f"--overlap-grad-reduce --overlap-param-gather"),
    "ep2_qb": (2, "qb", f"{EP2} {A2A}"),
    "ep4": (4, "defaults", f"{EP4} {A2A}"),
    "tp2_ep2_qb": (4, "qb", f"{TP2} {EP2} --expert-tensor-parallel-size 1 {A2A}"),
    "ep2_cp2_qb_packed": (4, "qb_packed", f"{EP2} {CP2} --cp-comm-type p2p {A2A}"),
    "tp2_ep2_etp1": (4, "defaults", f"{TP2} {EP2} --expert-tensor-parallel-size 1 {A2A}"),
    "tp2_ep2_etp2": (4, "llama", f"{TP2} {EP2} --expert-tensor-parallel-size 2"),
    "tp2_sp_ep2_etp2_allgather": (4, "defaults", f"{TP2} --sequence-parallel {EP2}"),
    "ep2_cp2_p2p_packed": (4, "packed", f"{EP2} {CP2} --cp-comm-type p2p {A2A}"),
    "ep2_cp2_a2a_packed": (4, "packed", f"{EP2} {CP2} --cp-comm-type a2a"),
    "ep2_cp2_all_gather_packed": (4, "packed", f"{EP2} {CP2} --cp-comm-type all_gather {A2A}"),
    "ep2_cp4_hybrid_packed": (4, "packed", f"{EP2} --context-parallel-size 4 --cp-comm-type "
                                           f"a2a+p2p --hierarchical-context-parallel-sizes 2 2"),
    "ep2_pp2": (4, "llama", f"{EP2} {PP2}"),
    "ep2_pp2_interleaved": (4, "llama4", f"{EP2} {PP2} --num-layers-per-virtual-pipeline-stage 1"),
    "tp2_sp_cp2_pp2_ep2_packed": (8, "packed", f"{TP2} --sequence-parallel {CP2} {PP2} {EP2} "
                                               f"--expert-tensor-parallel-size 1 {A2A} {PACKED}"),
}


def _train(rank, world, argv, steps=10):
    """Train ``steps`` iterations; per step: (lm loss, summed balancing loss, summed z-loss,
    gradient norm)."""
    from megatron_cp import moe
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.training import Trainer
    from training_utils import run_and_state

    args = parse_args(argv.split() + ["--train-iters", str(steps)], world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.build_iterators()
    out = []
    for _ in range(steps):
        loss, grad_norm, _ = trainer.train_step()
        aux, z, _ = moe.take_stats(trainer.model_chunks, trainer.state, trainer.config.num_layers,
                                   trainer.config.num_moe_experts)
        out.append((loss, aux.sum().item(), z.sum().item(), grad_norm))
    return out


def _train_all(rank, world, argvs):
    return {name: _train(rank, world, argv) for name, argv in argvs.items()}


@pytest.fixture(scope="module")
def references():
    return run_workers(_train_all, 1, REFERENCES, timeout=400)[0]


def _check(name, curves, reference):
    for column, what in enumerate(("lm loss", "balancing loss", "z-loss", "grad norm")):
        got, want = [step[column] for step in curves], [step[column] for step in reference]
        if what == "balancing loss" and LAYOUTS[name][1].startswith("qb"):
            assert got == want == [0.0] * len(want), name  # quantile balancing: no loss
            continue
        assert min(abs(v) for v in want) > 0, f"{name}: the reference {what} is zero"
        diff = max_rel_diff(got, want)
        print(f"{name:30s} {what:15s} max rel diff {diff:.2e}")
        assert diff <= 1e-5, (name, what, got, want)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_moe_layouts_equal_one_process(world, references):
    names = [n for n, (w, _, _) in LAYOUTS.items() if w == world]
    argvs = {n: f"{REFERENCES[LAYOUTS[n][1]]} {LAYOUTS[n][2]}" for n in names}
    results = run_workers(_train_all, world, argvs, timeout=600)
    # the losses are the same on every rank (reduced over the whole job)
    for name in names:
        _check(name, results[0][name], references[LAYOUTS[name][1]])
        for rank in range(1, world):
            assert results[rank][name] == results[0][name], (name, rank)
