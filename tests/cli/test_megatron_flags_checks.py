"""Megatron-LM's integrity checks, each with Megatron's meaning and a test that fails without
it: --check-weight-hash-across-dp-replicas-interval (DP replicas compared by parameter hash)
and --verify-integrity (a SHA-256 manifest of every checkpoint file, checked on load)."""
import contextlib
import hashlib
import io
import json
import os

import pytest
import torch

from dist_harness import run_workers
from training_utils import TINY

HASHED = TINY + " --train-iters 4 --log-interval 1 --check-weight-hash-across-dp-replicas-interval 2"


# ----- --check-weight-hash-across-dp-replicas-interval -------------------------------------

def _main(rank, world, argv, perturb_at=None):
    """``pretrain_gpt.py``'s main on this rank; with ``perturb_at``, global rank 1 nudges one
    weight after that iteration (a silent fault of one replica). Returns (status, output)."""
    from megatron_cp import training
    from megatron_cp.cli import check_args
    check_args.OTHER_RANK_GRACE_SECONDS = 0.0  # no launcher here to end the other ranks
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    real_step = training.Trainer.train_step

    def train_step(self):
        out = real_step(self)
        if perturb_at == self.iteration and self.state.global_rank == 1:
            with torch.no_grad():
                self.model_chunks[0].module.final_layernorm.weight[0] += 1e-3
        return out

    training.Trainer.train_step = train_step
    text = io.StringIO()
    with contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):
        status = training.main(argv.split())
    return status, text.getvalue()


def test_weight_hashes_match_on_dp_replicas():
    (status, text), _ = run_workers(_main, 2, HASHED)
    assert status == 0, text
    for it in (0, 2, 4):  # before the first iteration, then every 2
        assert f">>> Weight hashes match after {it} iterations..." in text, text
    assert ">>> Weight hashes match after 1 iterations" not in text


def test_a_perturbed_replica_stops_the_run_with_megatrons_message():
    results = run_workers(_main, 2, HASHED, 3)
    for rank, (status, text) in enumerate(results):
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert status == 1 and len(errors) == 1, text
        assert errors[0].startswith(
            f"error: rank {rank}: Parameter hashes not matching across DP replicas after 4 "
            f"iterations (differing from their DP rank 0: rank 1: "
            f"final_layernorm.weight in model chunk0)"), errors
    assert ">>> Weight hashes match after 2 iterations..." in results[0][1]


# ----- --verify-integrity ---------------------------------------------------------------------

INTEGRITY = TINY + " --train-iters 3 --ckpt-format torch_dist --verify-integrity"


def test_verify_integrity_hashes_every_file_and_names_a_changed_one(tmp_path):
    save = tmp_path / "ckpt"
    (status, text), _ = run_workers(_main, 2, f"{INTEGRITY} --save {save}")
    assert status == 0, text
    folder = save / "iter_0000003"
    manifest = json.loads((folder / "integrity.json").read_text())
    written = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                     if p.is_file() and p.name != "integrity.json")
    assert manifest["algorithm"] == "sha256" and sorted(manifest["files"]) == written
    assert {".metadata", "common.pt", "rng/rank_00000.pt", "rng/rank_00001.pt"} <= set(written)
    shard = sorted(folder.glob("*.distcp"))[-1]
    assert manifest["files"][shard.name] == hashlib.sha256(shard.read_bytes()).hexdigest()

    status, text = run_workers(_main, 1, f"{INTEGRITY} --load {save}")[0]  # intact: it loads
    assert status == 0 and " loaded checkpoint from " in text, text
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one changed byte
    shard.write_bytes(data)
    status, text = run_workers(_main, 1, f"{INTEGRITY} --load {save}")[0]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert status == 2 and len(errors) == 1, text
    assert errors[0].startswith(f"error: checkpoint file {shard} does not match its SHA-256 in "
                                f"{folder}/integrity.json (expected "), errors


def test_verify_integrity_goes_with_torch_dist_and_a_manifest(tmp_path):
    from megatron_cp.cli.arguments import ArgumentErrors, parse_args
    from megatron_cp.checkpoint import integrity
    with pytest.raises(ArgumentErrors, match=r"^--verify-integrity hashes --ckpt-format "
                                             r"torch_dist checkpoints \(Megatron-LM's rule\), "
                                             r"not torch; add --ckpt-format torch_dist$"):
        parse_args(f"{TINY} --train-iters 3 --verify-integrity --ckpt-format torch".split())
    assert integrity.problems(str(tmp_path)) == [
        f"--verify-integrity: {tmp_path} has no integrity.json (it was saved without "
        f"--verify-integrity); load it without the flag"]
    (tmp_path / "a.bin").write_bytes(b"abc")
    integrity.write_manifest(str(tmp_path))
    assert integrity.problems(str(tmp_path)) == []
    (tmp_path / "a.bin").unlink()
    assert integrity.problems(str(tmp_path)) == [
        f"checkpoint file {tmp_path}/a.bin (listed in {tmp_path}/integrity.json) is missing"]


# ----- --test-mode ----------------------------------------------------------------------------

TEST_MODE = TINY + " --train-iters 3 --log-interval 1 --qk-layernorm --test-mode"


def _main_perturbing_qk_norm(rank, world, argv, perturb_at):
    """``_main`` where global rank 1 nudges layer 0's query norm after ``perturb_at``."""
    from megatron_cp import training
    real_step = training.Trainer.train_step

    def train_step(self):
        out = real_step(self)
        if perturb_at == self.iteration and self.state.global_rank == 1:
            with torch.no_grad():
                self.model_chunks[0].module.decoder.layers[0].self_attention.q_layernorm \
                    .weight[0] += 1e-3
        return out

    training.Trainer.train_step = train_step
    return _main(rank, world, argv)


def test_test_mode_checks_the_qk_norms_over_dp_replicas_in_every_forward():
    """Megatron-LM's realtime test: with --qk-layernorm, each attention forward compares the
    QK-norm weights over the DP replicas. Equal replicas train on; a replica whose query norm
    drifted stops the run at the next forward, naming it (without --test-mode it trains on)."""
    (status, text), _ = run_workers(_main, 2, TEST_MODE)
    assert status == 0, text
    results = run_workers(_main_perturbing_qk_norm, 2, TEST_MODE, 1)
    for status, text in results:
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert status == 1 and len(errors) == 1, text
        assert "--test-mode: layer 0 attention: q_layernorm.weight differ across the " \
               "data-parallel replicas" in errors[0], errors
    quiet = run_workers(_main_perturbing_qk_norm, 2, TEST_MODE.replace(" --test-mode", ""), 1)
    assert [status for status, _ in quiet] == [0, 0]
