"""Multi-token prediction: its loss and gradients against a reference written here, targets
that never leave a document, 5 training steps under TP+SP, every CP type, PP, DP, EP and packed
documents giving the one-process `lm loss` and `mtp_k loss` (with DeepSeek-V3's MLA and MoE
too), the log line, tensorboard, checkpoint resume and megatron-core's own MTP model."""
import contextlib
import io

import pytest
import torch
import torch.nn.functional as F

from dist_harness import run_workers
from model_utils import tiny_config
from test_mla import DEEPSEEK as MLA_DEEPSEEK
from training_utils import TINY, max_rel_diff, train_losses, train_runs
from megatron_cp.data.batch import add_mtp_targets, get_ltor_batch, mtp_targets
from megatron_cp.model import GPTModel

STEPS = TINY.replace("--num-layers 2", "--num-layers 4") + " --train-iters 5"
PACKED = "--reset-attention-mask --reset-position-ids --eod-mask-loss"


# ----- the shifted targets --------------------------------------------------------------
def test_shifted_targets_never_cross_a_document():
    """Depth k's token/label/mask at i is the one at i + k of the SAME document; a shift that
    would leave the document gives token 0, label 0 and mask 0."""
    eod = 0
    text = torch.tensor([[5, 6, eod, 7, 8, 9, eod, 3, 4],
                         [1, 2, 3, 4, eod, 5, 6, 7, 8]])
    batch = add_mtp_targets(get_ltor_batch(text, eod, True, True, False), 2)
    docs = batch["document_ids"]
    b, s = docs.shape
    for depth in (1, 2):
        for key, name in (("tokens", "mtp_tokens"), ("labels", "mtp_labels"),
                          ("loss_mask", "mtp_loss_mask")):
            got = batch[f"{name}_{depth}"]
            for r in range(b):
                for i in range(s):
                    inside = i + depth < s and docs[r, i + depth] == docs[r, i]
                    want = batch[key][r, i + depth] if inside else 0
                    assert got[r, i] == want, (depth, key, r, i)
    # without document ids the row is one sequence: only the end is cut
    plain = add_mtp_targets(get_ltor_batch(text, eod), 1)
    assert torch.equal(plain["mtp_labels_1"][:, :-1], plain["labels"][:, 1:])
    assert (plain["mtp_loss_mask_1"][:, -1] == 0).all()
    assert len(mtp_targets(batch)) == 2 and mtp_targets(get_ltor_batch(text, eod)) is None


# ----- the loss and its gradients against a reference ------------------------------------
def _reference_objective(model, config, tokens, labels, loss_mask, documents, factor):
    """LM mean loss + factor / D x the depths' mean losses, written from DeepSeek-V3 /
    Megatron-LM's definition with the model's parameters (its transformer layers reused)."""
    params = dict(model.named_parameters())
    b, s = tokens.shape
    position_ids = torch.arange(s).expand(b, s)
    h = model.embedding(tokens, position_ids)
    h = model.decoder(h, position_ids, None, documents, loss_mask)
    h = model.final_layernorm(h)  # [s, b, h]
    table = params["embedding.word_embeddings.weight"]

    def norm(x, name):
        return F.layer_norm(x, (config.hidden_size,), params[name + ".weight"],
                            params[name + ".bias"], config.norm_epsilon)

    def mean_ce(hidden, target, mask):
        logits = hidden.transpose(0, 1) @ table[:config.vocab_size].t()  # [b, s, v]
        ce = F.cross_entropy(logits.reshape(-1, config.vocab_size), target.reshape(-1),
                             reduction="none").view(b, s)
        return (ce * mask).sum() / mask.sum()

    def shift(x):  # one left inside each document, 0 where it would leave it
        out = torch.zeros_like(x)
        for r in range(b):
            for i in range(s - 1):
                if documents is None or documents[r, i + 1] == documents[r, i]:
                    out[r, i] = x[r, i + 1]
        return out

    total, mtp_means = mean_ce(h, labels, loss_mask), []
    for depth in range(config.mtp_num_layers):
        tokens, labels, loss_mask = shift(tokens), shift(labels), shift(loss_mask)
        layer = depth % len(model.mtp.layers)  # --mtp-use-repeated-layer: one for all depths
        prefix = f"mtp.layers.{layer}"
        e = F.embedding(tokens, table).transpose(0, 1)  # [s, b, h]
        x = torch.cat([norm(e, prefix + ".enorm"), norm(h, prefix + ".hnorm")], dim=-1)
        x = x @ params[prefix + ".eh_proj.weight"].t()  # [s, b, h]
        x = model.mtp.layers[layer].mtp_model_layer(x, position_ids, None, documents, None)
        h = norm(x, prefix + ".final_layernorm")
        mtp_means.append(mean_ce(h, labels, loss_mask))
    return total + factor / config.mtp_num_layers * sum(mtp_means), mtp_means


@pytest.mark.parametrize("packed,repeated", [(False, False), (True, False), (True, True)],
                         ids=["plain", "packed", "packed-repeated-layer"])
def test_loss_and_grads_match_the_reference(packed, repeated):
    config = tiny_config(num_layers=2, mtp_num_layers=2, mtp_loss_scaling_factor=0.3,
                         mtp_use_repeated_layer=repeated)
    model = GPTModel(config)
    torch.manual_seed(0)
    text = torch.randint(1, config.vocab_size, (2, 17))
    text[0, 5] = text[1, 9] = text[0, 11] = 0  # EODs
    batch = add_mtp_targets(get_ltor_batch(text, 0, packed, packed, packed), 2)
    documents = batch["document_ids"]
    out = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                document_ids=documents, loss_mask=batch["loss_mask"],
                mtp_targets=mtp_targets(batch))
    mask = batch["loss_mask"]
    ((out * mask).sum() / mask.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    counts = torch.stack([batch[f"mtp_loss_mask_{d}"].sum() for d in (1, 2)])
    got_means = model.mtp.loss_sums / counts
    model.zero_grad()
    want, want_means = _reference_objective(model, config, batch["tokens"], batch["labels"],
                                            mask, documents, 0.3)
    want.backward()
    torch.testing.assert_close(got_means, torch.stack(want_means).detach(), rtol=1e-5, atol=0)
    built = {n.split(".")[2] for n in grads if n.startswith("mtp.")}
    assert built == ({"0"} if repeated else {"0", "1"}), built
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # the factor matters: without the MTP loss the embedding gradient differs
    model.zero_grad()
    lm_only = GPTModel(tiny_config(num_layers=2, mtp_num_layers=2, mtp_loss_scaling_factor=0.0,
                                   mtp_use_repeated_layer=repeated))
    lm_only.load_state_dict(model.state_dict())
    out = lm_only(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                  document_ids=documents, loss_mask=mask, mtp_targets=mtp_targets(batch))
    ((out * mask).sum() / mask.sum()).backward()
    table = "embedding.word_embeddings.weight"
    assert not torch.allclose(dict(lm_only.named_parameters())[table].grad, grads[table])


# ----- training parity -------------------------------------------------------------------
def _train_recording(rank, world, argvs):
    """Worker: each run of ``argvs`` in turn; per run, per iteration [lm loss, mtp_1, ...]
    as the log sees them."""
    from megatron_cp.observability import training_log
    record = training_log.TrainingLogger.record
    runs = []

    def recording(self, trainer, loss, *rest):
        runs[-1].append([loss, *trainer.mtp_losses])
        return record(self, trainer, loss, *rest)

    training_log.TrainingLogger.record = recording
    try:
        for argv in argvs:
            runs.append([])
            train_losses(rank, world, argv)
    finally:
        training_log.TrainingLogger.record = record
    return runs


def _argv(depths, packed, extra=""):
    return f"{STEPS} --mtp-num-layers {depths} {PACKED if packed else ''} {extra}"


# DeepSeek-V3: Megatron-LM's test flags as tests/model/test_mla.py shrinks them (MLA with q-LoRA
# and YaRN, a dense first layer, then MoE layers with a grouped sigmoid router, expert bias and
# a shared expert, untied embeddings); the MTP layer takes the last decoder layer's kind (MoE)
DEEPSEEK = MLA_DEEPSEEK.split("--train-iters 5 ", 1)[1]
UNTIED = "--untie-embeddings-and-output-weights"  # PP: the last stage keeps a table for MTP
CASES = {  # world size -> (depths, packed, model flags, layout flags)
    4: [(1, False, DEEPSEEK, "--expert-model-parallel-size 2 --context-parallel-size 2 "
                             "--cp-comm-type p2p"),
        (1, True, DEEPSEEK, "--context-parallel-size 2 --cp-comm-type a2a"),
        (1, False, DEEPSEEK, "--tensor-model-parallel-size 2 --sequence-parallel"),
        (1, False, DEEPSEEK, "--tensor-model-parallel-size 2 --sequence-parallel "
                             "--context-parallel-size 2 --cp-comm-type all_gather"),
        (1, True, DEEPSEEK, "--context-parallel-size 4 --cp-comm-type a2a+p2p "
                            "--hierarchical-context-parallel-sizes 2 2"),
        (2, False, DEEPSEEK, "--pipeline-model-parallel-size 2"),
        (1, True, "", "--context-parallel-size 2 --cp-comm-type p2p"),
        (2, False, "", "--context-parallel-size 2 --cp-comm-type a2a"),
        (1, True, UNTIED, "--pipeline-model-parallel-size 2 "
                          "--pipeline-model-parallel-layout Ett|ttmL")],
    8: [(2, True, DEEPSEEK, "--tensor-model-parallel-size 2 --sequence-parallel "
                            "--context-parallel-size 2 --cp-comm-type p2p "
                            "--pipeline-model-parallel-size 2")],
}


NO_MTP_LOSS = "--mtp-loss-scaling-factor 0"


@pytest.fixture(scope="module")
def references():
    """One-process runs of every (depths, packed, model flags) the layouts use, and one
    without the MTP loss's weight."""
    keys = sorted({case[:3] for cases in CASES.values() for case in cases} | {(1, False, "")})
    runs = run_workers(_train_recording, 1, [_argv(*key) for key in keys]
                       + [_argv(1, False, NO_MTP_LOSS)])[0]
    return {**dict(zip(keys, runs)), NO_MTP_LOSS: runs[-1]}


def _layout_argv(case):
    depths, packed, model, layout = case
    return _argv(depths, packed, f"{model} {layout}")


def _check(results, cases, references):
    for runs in results:  # every rank logs the same values
        for (depths, packed, model, extra), run in zip(cases, runs):
            reference = references[(depths, packed, model)]
            assert len(run[0]) == 1 + depths
            for k in range(1 + depths):
                diff = max_rel_diff([it[k] for it in run], [it[k] for it in reference])
                name = "lm loss" if k == 0 else f"mtp_{k} loss"
                print(f"{extra} packed={packed}: {name} max relative difference {diff:.2e}")
                assert diff < 1e-5, (extra, packed, name, diff)


def test_layouts_of_four_ranks_match_one_process(references):
    cases = CASES[4]
    _check(run_workers(_train_recording, 4, [_layout_argv(c) for c in cases], timeout=600),
           cases, references)


def test_tp_cp_pp_packed_on_eight_ranks_matches_one_process(references):
    cases = CASES[8]
    _check(run_workers(_train_recording, 8, [_layout_argv(c) for c in cases], timeout=600),
           cases, references)


def test_mtp_changes_the_training(references):
    """The MTP loss reaches the shared weights: the LM loss curve moves with it."""
    weightless = [it[0] for it in references[NO_MTP_LOSS]]
    assert max_rel_diff(weightless, [it[0] for it in references[(1, False, "")]]) > 1e-4


# ----- log line, tensorboard, checkpoints --------------------------------------------------
def _train_capturing(rank, world, argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        losses = train_losses(rank, world, argv)
    return buf.getvalue(), losses


def test_log_line_and_tensorboard(tmp_path):
    argv = (TINY.replace("--log-interval 100", "--log-interval 2") +
            f" --train-iters 4 --mtp-num-layers 2 --tensorboard-dir {tmp_path}")
    out, _ = run_workers(_train_capturing, 1, argv)[0]
    line = next(line for line in out.splitlines() if "iteration        4/       4" in line)
    assert "| lm loss: " in line and "| mtp_1 loss: " in line and "| mtp_2 loss: " in line
    assert line.index("lm loss:") < line.index("mtp_1 loss:") < line.index("loss scale:")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.step for e in acc.Scalars("mtp_1 loss")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("mtp_2 loss")] == [1, 2, 3, 4]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_checkpoint_resume_keeps_the_mtp_weights(tmp_path, fmt):
    """6 straight iterations == 3 + save + load (PP=2: the MTP layers on the last stage, with
    their copy of the untied word embedding) + 3, and the checkpoint loads at PP=1 (where the
    copy is the embedding itself) with the same next loss."""
    base = (_argv(1, False, f"--pipeline-model-parallel-size 2 --ckpt-format {fmt} {UNTIED}")
            .replace("--train-iters 5", "--train-iters 6"))
    straight, _, resumed = run_workers(train_runs, 2, [
        base, f"{base} --exit-interval 3 --save {tmp_path}", f"{base} --load {tmp_path}"])[0]
    assert resumed == straight[3:]
    one_stage = base.replace("--pipeline-model-parallel-size 2", "")
    resharded = run_workers(train_losses, 1, f"{one_stage} --load {tmp_path}")[0]
    assert max_rel_diff(resharded, straight[3:]) < 1e-5


# ----- megatron-core's own MTP -------------------------------------------------------------
def _our_mtp_losses(rank, world, root, tokens, labels):
    """Worker: our trainer loads ``root`` (TP=world); (per-token LM loss [b, s] and the MTP
    depth means [D]) on one microbatch, in training mode, no update."""
    import torch.distributed as dist
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.training import Trainer
    from training_utils import run_and_state
    args = parse_args(f"{MCORE_RUN} --load {root} --tensor-model-parallel-size {world}".split(),
                      world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.checkpointer.load(trainer.train_state(), root)
    model = trainer.model_chunks[0].module
    model.train()
    batch = add_mtp_targets({"tokens": tokens, "labels": labels,
                             "loss_mask": torch.ones(labels.shape)}, args.mtp_num_layers)
    with torch.no_grad():
        lm = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), labels=labels,
                   mtp_targets=mtp_targets(batch))
    counts = torch.stack([t[2].sum() for t in mtp_targets(batch)])
    assert dist.get_world_size() == world
    return lm, model.mtp.loss_sums / counts


MCORE_RUN = ("--micro-batch-size 4 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 "
             "--lr-warmup-iters 2 --lr-decay-iters 20 --lr-decay-style cosine --train-iters 20 "
             "--mock-data --eval-iters 0 --log-interval 100 --use-checkpoint-args "
             "--hidden-dropout 0 --attention-dropout 0")  # training mode: no dropout


def test_megatron_core_mtp_checkpoint_in_and_out(tmp_path):
    """megatron-core 0.16.1's GPTModel with an MTP depth trains and saves; our --load gives
    its LM and MTP losses (TP=1 and TP=2), and --to-megatron writes it back in a form
    megatron-core loads strictly, with the same losses."""
    import megatron_core_utils as mcu
    from megatron_cp.checkpoint import files
    from tools import checkpoint_convert as convert
    text = torch.randint(1, mcu.PADDED, (2, mcu.SEQ + 1),
                         generator=torch.Generator().manual_seed(4))
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    root = tmp_path / "theirs"
    lm, mtp = run_workers(mcu.mtp_train_and_save, 1, str(root), tokens, labels)[0]
    for tp in (1, 2):
        ours_lm, ours_mtp = run_workers(_our_mtp_losses, tp, str(root), tokens, labels)[0]
        torch.testing.assert_close(ours_lm, lm, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours_mtp, mtp, rtol=1e-5, atol=0)
    ours_dir, back = tmp_path / "ours", tmp_path / "back"
    convert.main(["--load-dir", str(root), "--save-dir", str(ours_dir),
                  "--target-ckpt-format", "torch_dist"])
    convert.main(["--load-dir", str(ours_dir), "--to-megatron", str(back)])
    folder = files.iteration_dir(str(back), mcu.ITERATION)
    again_lm, again_mtp = run_workers(mcu.mtp_load_strict, 1, folder, tokens, labels)[0]
    torch.testing.assert_close(again_lm, lm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again_mtp, mtp, rtol=1e-5, atol=0)


def test_throughput_counts_the_mtp_depths():
    """Megatron-LM's FLOPs count: each depth adds a transformer layer, its norms and eh_proj,
    and one more output layer."""
    from megatron_cp.observability.training_log import model_flops_per_token
    plain, mtp = tiny_config(num_layers=2), tiny_config(num_layers=2, mtp_num_layers=2)
    s, h = 64, plain.hidden_size
    layer = (model_flops_per_token(tiny_config(num_layers=3), s)
             - model_flops_per_token(plain, s))
    extra = 2 * (layer + 3 * 2 * (3 * h + 2 * h * h) + 3 * 2 * h * plain.padded_vocab_size(1))
    assert model_flops_per_token(mtp, s) - model_flops_per_token(plain, s) == extra
