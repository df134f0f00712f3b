"""Checkpoint conversion: TP/PP resharding keeps the model exactly; Hugging Face Llama export
gives the same logits and imports back bit for bit. The vocabulary (513 with EOD) pads to 768
at TP=2 and 640 at TP=1: conversions carry exactly the real rows."""
import json

import pytest
import torch

from dist_harness import run_workers
from megatron_cp.checkpoint.hf import llama as hf_llama
from megatron_cp.model import GPTModel
from model_utils import tiny_config
from tools import checkpoint_convert as convert
from training_utils import TINY, train_losses

LLAMA = (TINY.replace("--position-embedding-type rope", "--position-embedding-type rope "
                      "--normalization RMSNorm --swiglu --disable-bias-linear "
                      "--untie-embeddings-and-output-weights --group-query-attention "
                      "--num-query-groups 2 --lr-decay-iters 10")
         .replace("--vocab-size 200 --make-vocab-size-divisible-by 64",
                  "--tokenizer-type NullTokenizer --vocab-size 512"))


def test_tp_spec_matches_the_layers():
    for act in ("gelu", "swiglu"):
        model = GPTModel(tiny_config(activation=act, untie_embeddings_and_output_weights=True,
                                     position_embedding_type="learned_absolute"))
        for name, p in model.named_parameters():
            expected = (p.partition_dim, p.partition_stride) if getattr(
                p, "tensor_model_parallel", False) else None
            assert convert.tp_spec(name, act == "swiglu") == expected, name


def test_reshard_tp2_to_pp2_continues_the_same_loss(tmp_path):
    src, dst = tmp_path / "tp2", tmp_path / "pp2"
    straight = run_workers(train_losses, 2, f"{LLAMA} --train-iters 3 --tensor-model-parallel-size 2 "
                                            f"--save {src} --save-interval 2")[0]
    convert.main(["--load-dir", str(src), "--save-dir", str(dst),
                  "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"])
    # the checkpoint at iteration 3 is the latest; resharded weights must give its next loss
    # as well: compare the forward loss of iteration 4 under both layouts
    tp2_next = run_workers(train_losses, 2, f"{LLAMA} --train-iters 4 --tensor-model-parallel-size 2 "
                                            f"--load {src}")[0]
    pp2_next = run_workers(train_losses, 2, f"{LLAMA} --train-iters 4 "
                                            f"--pipeline-model-parallel-size 2 --load {dst}")[0]
    assert len(straight) == 3 and len(tp2_next) == len(pp2_next) == 1
    assert abs(pp2_next[0] - tp2_next[0]) / tp2_next[0] < 1e-5


def test_hf_llama_export_and_import(tmp_path):
    from transformers import LlamaForCausalLM
    ck, hf_dir = tmp_path / "ck", tmp_path / "hf"
    run_workers(train_losses, 2, f"{LLAMA} --train-iters 2 --tensor-model-parallel-size 2 --save {ck}")
    full, args, _ = convert.load_full(str(ck))
    assert full["embedding.word_embeddings.weight"].shape[0] == 513  # no TP padding rows
    hf_llama.to_hf(full, args, str(hf_dir))
    hf = LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()
    assert hf.config.vocab_size == 513
    config = tiny_config(vocab_size=513, make_vocab_size_divisible_by=128, normalization="RMSNorm",
                         activation="swiglu", add_bias_linear=False,
                         untie_embeddings_and_output_weights=True, num_query_groups=2, seed=11,
                         max_position_embeddings=32, ffn_hidden_size=128)
    ours = GPTModel(config).eval()  # TP=1: 640 rows
    ours.load_state_dict(convert.pad_vocab_rows(full, args, 1))
    tokens = torch.randint(0, 513, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_logits = ours(tokens, torch.arange(32).expand(2, 32)).transpose(0, 1)  # [b, s, 640]
        hf_logits = hf(input_ids=tokens).logits  # [b, s, 513]
    assert torch.isinf(ours_logits[..., 513:]).all()  # padding is out of every softmax
    torch.testing.assert_close(ours_logits[..., :513], hf_logits, rtol=1e-4, atol=1e-4)
    back, back_args, _ = hf_llama.from_hf(str(hf_dir))
    assert set(back) == set(full)
    for name in full:
        assert torch.equal(back[name], full[name]), name


def _train_all(rank, world, argvs):
    return [train_losses(rank, world, argv) for argv in argvs]


def test_torch_and_torch_dist_round_trip(tmp_path):
    """torch -> torch_dist -> torch gives back the same files (bf16 weights, fp32 main params,
    Adam moments, schedule, RNG); both converted checkpoints resume bit-exactly."""
    from megatron_cp.checkpoint.torch_dist_format import read_full
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run = f"{LLAMA} --bf16 --tensor-model-parallel-size 2"
    run_workers(train_losses, 2, f"{run} --train-iters 3 --save {a} --ckpt-format torch")
    convert.main(["--load-dir", str(a), "--save-dir", str(b), "--target-ckpt-format", "torch_dist"])
    convert.main(["--load-dir", str(b), "--save-dir", str(c), "--target-tensor-parallel-size", "2"])
    tensors, common = read_full(str(b / "iter_0000003"))
    assert common["has_optimizer"] and common["iteration"] == 3
    assert tensors["optimizer.main_param.decoder.layers.1.mlp.linear_fc1.weight"].dtype == torch.float32
    assert tensors["model.decoder.layers.1.mlp.linear_fc1.weight"].shape == (2, 128, 32)  # gate, up
    for rank in range(2):
        shard = f"mp_rank_{rank:02d}/model_optim_rng.pt"
        before = torch.load(a / "iter_0000003" / shard, weights_only=False)
        after = torch.load(c / "iter_0000003" / shard, weights_only=False)
        for name, value in before["model"].items():
            assert torch.equal(after["model"][name], value), name
        opt_before, opt_after = before["optimizer"], after["optimizer"]
        assert len(opt_before["main_params"]) == len(opt_after["main_params"]) > 0
        for x, y in zip(opt_before["main_params"], opt_after["main_params"]):
            assert torch.equal(x, y)
        assert opt_before["optimizer"]["state"].keys() == opt_after["optimizer"]["state"].keys()
        for i, per_param in opt_before["optimizer"]["state"].items():
            for key, value in per_param.items():
                assert torch.equal(opt_after["optimizer"]["state"][i][key], value), (i, key)
        assert after["opt_param_scheduler"] == before["opt_param_scheduler"]
        assert not after.get("converted") and not after["no_rng"]
        assert (c / "iter_0000003" / "rng" / f"rank_0000{rank}.pt").exists()
    # to another layout (PP=2, optimizer carried, RNG not) and back: the same full state
    d, e = tmp_path / "d", tmp_path / "e"
    convert.main(["--load-dir", str(b), "--save-dir", str(d), "--target-tensor-parallel-size", "1",
                  "--target-pipeline-parallel-size", "2"])
    assert torch.load(d / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt",
                      weights_only=False)["no_rng"]
    convert.main(["--load-dir", str(d), "--save-dir", str(e), "--target-ckpt-format", "torch_dist"])
    again, _ = read_full(str(e / "iter_0000003"))
    assert set(again) == set(tensors)
    for key, value in tensors.items():
        assert torch.equal(again[key], value), key
    argvs = [f"{run} --train-iters 5 --load {ck}" for ck in (a, b, c)]
    argvs.append(f"{LLAMA} --bf16 --pipeline-model-parallel-size 2 --train-iters 5 --load {d}")
    nexts = run_workers(_train_all, 2, argvs)[0]
    assert nexts[0] == nexts[1] == nexts[2] and len(nexts[0]) == 2
    assert max(abs(x - y) / y for x, y in zip(nexts[3], nexts[0])) < 1e-2  # bf16, another layout


def test_hf_llama_export_and_import_carry_llama3_rope_scaling(tmp_path):
    """--use-rope-scaling exports as config.json's rope_scaling of rope type llama3 (factor
    and Megatron-LM's fixed constants): transformers' logits are ours at positions where the
    scaling matters, and without the entry they are not; the import gives back the flags and
    the weights bit for bit, and refuses llama3 constants --use-rope-scaling cannot express."""
    from transformers import LlamaForCausalLM
    config = tiny_config(normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                         untie_embeddings_and_output_weights=True, rotary_base=500000.0,
                         use_rope_scaling=True, rope_scaling_factor=16.0, init_method_std=0.3,
                         make_vocab_size_divisible_by=128)
    model = GPTModel(config).eval()
    full = {name: t[:120] if "word_embeddings" in name or "output_layer" in name else t
            for name, t in model.state_dict().items()}
    args = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
            "max_position_embeddings": 64, "normalization": "RMSNorm", "swiglu": True,
            "disable_bias_linear": True, "position_embedding_type": "rope",
            "untie_embeddings_and_output_weights": True, "true_vocab_size": 120,
            "norm_epsilon": 1e-5, "rotary_base": 500000.0, "use_rope_scaling": True,
            "rope_scaling_factor": 16.0}
    hf_dir = tmp_path / "hf"
    hf_llama.to_hf(full, args, str(hf_dir))
    saved = json.loads((hf_dir / "config.json").read_text())
    assert saved["rope_scaling"] == {"rope_type": "llama3", "factor": 16.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}
    tokens = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9000, 9016).expand(2, 16)  # the slow channels have turned

    def hf_logits(folder):
        hf = LlamaForCausalLM.from_pretrained(str(folder)).eval()
        with torch.no_grad():
            return hf(input_ids=tokens, position_ids=positions).logits  # [b, s, 120]

    with torch.no_grad():
        ours = model(tokens, positions).transpose(0, 1)[..., :120]  # [b, s, 120]
    torch.testing.assert_close(hf_logits(hf_dir), ours, rtol=1e-4, atol=1e-4)
    plain_dir = tmp_path / "plain"
    hf_llama.to_hf(full, {**args, "use_rope_scaling": False}, str(plain_dir))
    assert "rope_scaling" not in json.loads((plain_dir / "config.json").read_text())
    assert (hf_logits(plain_dir) - ours).abs().max() > 1e-2  # the check sees the scaling
    back, back_args, _ = hf_llama.from_hf(str(hf_dir))
    assert (back_args["use_rope_scaling"], back_args["rope_scaling_factor"]) == (True, 16.0)
    assert "use_rope_scaling" not in hf_llama.from_hf(str(plain_dir))[1]
    for name in full:
        assert torch.equal(back[name], full[name]), name
    saved["rope_scaling"]["high_freq_factor"] = 2.0
    (hf_dir / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="llama3 rope scaling with high_freq_factor=2.0"):
        hf_llama.from_hf(str(hf_dir))
    with pytest.raises(ValueError, match="rotary_seq_len_interpolation_factor"):
        hf_llama.to_hf(full, {**args, "rotary_seq_len_interpolation_factor": 2}, str(plain_dir))
