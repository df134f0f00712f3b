"""Hugging Face conversion: Megatron's default architecture as GPT2LMHeadModel (logits equal to
transformers', a bit-exact round trip), the layout chosen from the checkpoint's arguments, and
the tokenizer files that travel with every export (sentencepiece, GPT-2 BPE, Hugging Face):
``AutoTokenizer`` on the export folder gives megatron_cp's ids.

The trained models use NullTokenizer --vocab-size 512 (513 entries with EOD), padded to 768
rows at TP=2 and 640 at TP=1: the export holds exactly the 513 real rows."""
import json
import os

import pytest
import torch

from dist_harness import run_workers
from megatron_cp.checkpoint.hf import convert as hf_convert, gpt2 as hf_gpt2
from megatron_cp.checkpoint.hf import sentencepiece as hf_sentencepiece, tokenizer as hf_tokenizer
from megatron_cp.data.tokenizers import build_tokenizer
from megatron_cp.model import GPTModel
from model_utils import tiny_config
from test_data_tokenizers import load_tool, small_corpus
from tools import checkpoint_convert as convert
from training_utils import TINY, train_losses

# Megatron's defaults: learned absolute positions, tied embeddings, LayerNorm + GELU, biases
GPT2 = (TINY.replace("--position-embedding-type rope", "--lr-decay-iters 10")
        .replace("--vocab-size 200 --make-vocab-size-divisible-by 64",
                 "--tokenizer-type NullTokenizer --vocab-size 512"))
LLAMA_FLAGS = ("--position-embedding-type rope --normalization RMSNorm --swiglu "
               "--disable-bias-linear --untie-embeddings-and-output-weights")
TEXTS = ["hello world", "\nleading newline", "  two leading spaces", "trailing  ",
         "def f(x):\n    return x ** 2  # 12345\n", "unicode: é ü 漢字", "a</s>b <s> <unk>", ""]


def _texts():
    from pydoc_data.topics import topics
    return TEXTS + [topics[k][:2000] for k in sorted(topics)[20:50]]


def _gpt_model(args, full, **overrides):
    """A one-process megatron_cp GPTModel holding ``full`` (vocabulary padded for TP=1)."""
    same = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
            "max_position_embeddings", "position_embedding_type", "normalization",
            "untie_embeddings_and_output_weights")
    config = tiny_config(
        **{key: args[key] for key in same}, vocab_size=args["true_vocab_size"],
        make_vocab_size_divisible_by=args.get("make_vocab_size_divisible_by", 128),
        activation="swiglu" if args["swiglu"] else "gelu",
        add_bias_linear=not args["disable_bias_linear"],
        bias_gelu_fusion=args.get("bias_gelu_fusion", False), **overrides)
    model = GPTModel(config).eval()
    model.load_state_dict(convert.pad_vocab_rows(full, args, 1))
    return model


def _logits(model, tokens):
    """[b, s, padded vocab] logits of a megatron_cp model."""
    b, s = tokens.shape
    with torch.no_grad():
        return model(tokens, torch.arange(s).expand(b, s)).transpose(0, 1)


def _perturbed(full, seed=0):
    """``full`` with every tensor moved well away from its init (norm weights around 1): the
    activations reach the range where erf and tanh GELU differ."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in full.items():
        noise = torch.randn(t.shape, generator=g, dtype=t.dtype)
        out[name] = (1.0 + 0.3 * noise) if "layernorm.weight" in name else t + 0.3 * noise
    return out


def _train_all(rank, world, argvs):
    return [train_losses(rank, world, argv) for argv in argvs]


def test_gpt2_export_logits_and_bit_exact_round_trip(tmp_path, capsys):
    from transformers import GPT2LMHeadModel
    ck, hf_dir, back_ck = tmp_path / "ck", tmp_path / "hf", tmp_path / "back"
    tp2 = f"{GPT2} --tensor-model-parallel-size 2"
    run_workers(train_losses, 2, f"{tp2} --train-iters 2 --save {ck} --ckpt-format torch")
    convert.main(["--load-dir", str(ck), "--to-hf", str(hf_dir)])
    out = capsys.readouterr().out
    assert "NullTokenizer has no tokenizer files" in out and "GPT2LMHeadModel" in out
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["vocab_size"] == 513
    # Megatron-LM's default bias-GELU fusion computes the tanh GELU: GPT-2's own gelu_new
    assert config["n_positions"] == 32 and config["activation_function"] == "gelu_new"
    assert config["eos_token_id"] == 512 and config["tie_word_embeddings"]
    full, args, _ = convert.load_full(str(ck))
    hf = GPT2LMHeadModel.from_pretrained(str(hf_dir)).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied
    ours = _gpt_model(args, full)
    tokens = torch.randint(0, 513, (2, 32), generator=torch.Generator().manual_seed(0))
    ours_logits = _logits(ours, tokens)  # [b, s, 640]
    with torch.no_grad():
        hf_logits = hf(input_ids=tokens).logits  # [b, s, 513]
    assert ours_logits.shape[-1] == 640 and torch.isinf(ours_logits[..., 513:]).all()
    assert (ours_logits[..., :513] - hf_logits).abs().max() <= 1e-4
    # back: --from-hf reads config.json's model_type; the TP=2 shards equal the trained ones
    convert.main(["--from-hf", str(hf_dir), "--save-dir", str(back_ck),
                  "--target-tensor-parallel-size", "2"])
    back, back_args, _ = convert.load_full(str(back_ck))
    assert set(back) == set(full)
    for name in full:
        assert torch.equal(back[name], full[name]), name
    for rank in range(2):
        shard = f"mp_rank_{rank:02d}/model_optim_rng.pt"
        trained = torch.load(ck / "iter_0000002" / shard, weights_only=False)["model"]
        imported = torch.load(back_ck / "iter_0000000" / shard, weights_only=False)["model"]
        assert trained.keys() == imported.keys()
        for name, value in trained.items():
            assert torch.equal(imported[name], value), (rank, name)
    # the imported checkpoint trains: its first loss is the trained weights' loss on step 1
    first = run_workers(_train_all, 2, [f"{tp2} --train-iters 1 --load {back_ck}",
                                        f"{tp2} --train-iters 1 --load {ck} --finetune"])[0]
    assert first[0] == first[1]


@pytest.mark.parametrize("untie, fused", [(False, True), (True, False)])
def test_gpt2_layout_details_change_the_logits(tmp_path, untie, fused):
    """Weights far from init: the export still matches, and the check is sharp enough to see
    the other GELU (gelu_new for the exact one, gelu for the bias-GELU fusion's tanh) or a
    q|k|v layout taken per head (megatron_cp's) instead of GPT-2's."""
    from transformers import GPT2LMHeadModel
    config = tiny_config(position_embedding_type="learned_absolute", vocab_size=120,
                         max_position_embeddings=40, untie_embeddings_and_output_weights=untie)
    full = _perturbed(GPTModel(config).state_dict())
    args = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
            "max_position_embeddings": 40, "normalization": "LayerNorm", "swiglu": False,
            "disable_bias_linear": False, "position_embedding_type": "learned_absolute",
            "untie_embeddings_and_output_weights": untie, "true_vocab_size": 120,
            "make_vocab_size_divisible_by": 32, "bias_gelu_fusion": fused}
    assert hf_convert.pick_layout(args) == "gpt2"
    hf_gpt2.to_hf(full, args, str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["tie_word_embeddings"] is not untie and saved["vocab_size"] == 120
    assert saved["activation_function"] == ("gelu_new" if fused else "gelu")
    tokens = torch.randint(0, 120, (2, 40), generator=torch.Generator().manual_seed(1))
    ours = _logits(_gpt_model(args, full), tokens)[..., :120]

    def hf_max_diff(**config_changes):
        path = tmp_path / "config.json"
        saved = json.loads(path.read_text())
        path.write_text(json.dumps({**saved, **config_changes}))
        hf = GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
        path.write_text(json.dumps(saved))
        with torch.no_grad():
            return (ours - hf(input_ids=tokens).logits).abs().max().item()

    assert hf_max_diff() <= 1e-4
    assert hf_max_diff(activation_function="gelu" if fused else "gelu_new") > 1e-3
    wrong = dict(full)
    for i in range(2):  # megatron_cp's per-head [q|k|v] rows written unpermuted
        name = f"decoder.layers.{i}.self_attention.linear_qkv.weight"
        wrong[name] = full[name].view(3, 4, 8, 32).transpose(0, 1).reshape(96, 32)
    hf_gpt2.to_hf(wrong, args, str(tmp_path))
    assert hf_max_diff() > 1e-2


def test_import_a_transformers_gpt2(tmp_path):
    """A GPT2LMHeadModel saved by transformers (untied) imports with the same logits, with
    the exact GELU (gelu) or GPT-2's own tanh one (gelu_new: the bias-GELU fusion)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=100, n_positions=24, n_embd=32, n_layer=2, n_head=4, n_inner=48,
        activation_function="gelu", initializer_range=0.3, tie_word_embeddings=False,
        layer_norm_epsilon=1e-6)).eval()
    hf.save_pretrained(str(tmp_path / "gelu"))
    full, args, meta = hf_convert.import_hf(str(tmp_path / "gelu"))
    assert meta["iteration"] == 0 and args["untie_embeddings_and_output_weights"]
    assert args["true_vocab_size"] == 100 and args["max_position_embeddings"] == 24
    ours = _gpt_model(args, full, norm_epsilon=1e-6)
    tokens = torch.randint(0, 100, (3, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    assert (_logits(ours, tokens)[..., :100] - expected).abs().max() <= 1e-4
    assert not args["bias_gelu_fusion"]
    hf.config.activation_function = "gelu_new"
    hf.save_pretrained(str(tmp_path / "tanh"))
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "tanh")).eval()
    full, args, _ = hf_convert.import_hf(str(tmp_path / "tanh"))
    assert args["bias_gelu_fusion"]
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    ours = _logits(_gpt_model(args, full, norm_epsilon=1e-6), tokens)[..., :100]
    assert (ours - expected).abs().max() <= 1e-4
    convert.main(["--from-hf", str(tmp_path / "tanh"), "--save-dir", str(tmp_path / "ck")])
    imported_args = convert.load_full(str(tmp_path / "ck"))[1]
    assert imported_args["position_embedding_type"] == "learned_absolute"


def test_export_refusals_name_the_setting(tmp_path):
    base = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
            "normalization": "LayerNorm", "swiglu": False, "disable_bias_linear": False,
            "position_embedding_type": "learned_absolute",
            "untie_embeddings_and_output_weights": False}
    with pytest.raises(ValueError, match="normalization='RMSNorm'.*LlamaForCausalLM needs.*"
                                         "GPT2LMHeadModel needs"):
        hf_convert.pick_layout({**base, "normalization": "RMSNorm"})
    assert hf_convert.pick_layout({**base, **hf_convert.llama.REQUIRED}) == "llama"
    with pytest.raises(ValueError, match=r"num_query_groups \(2\).*grouped-query"):
        hf_gpt2.to_hf({}, {**base, "num_query_groups": 2}, str(tmp_path))
    with pytest.raises(ValueError, match="--hf-skip-tokenizer"):
        hf_tokenizer.token_ids({"tokenizer_type": "SentencePieceTokenizer",
                                "tokenizer_model": str(tmp_path / "missing.model")})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert' has no import"):
        hf_convert.import_hf(str(tmp_path))


def _train_spm(tmp_path, model_type="bpe", vocab_size=300, **options):
    corpus = small_corpus(str(tmp_path / "corpus.jsonl"))
    prefix = str(tmp_path / f"spm_{model_type}")
    return load_tool("train_tokenizer").train(corpus, prefix, vocab_size, model_type, **options)


@pytest.mark.parametrize("model_type,options", [
    ("bpe", {}), ("bpe", {"verbatim": False}),
    ("unigram", {"byte_fallback": True, "vocab_size": 400})])
def test_sentencepiece_tokenizer_json_gives_sentencepiece_ids(tmp_path, model_type, options):
    import sentencepiece
    model = _train_spm(tmp_path, model_type, **options)
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    tok = hf_sentencepiece.build_tokenizer_json(model)
    for text in _texts():
        assert tok.encode(text).ids == sp.encode(text), text[:40]
        ids = sp.encode(text)
        if sp.unk_id() not in ids:  # sentencepiece writes an unknown piece as " ⁇ "
            assert tok.decode(ids) == sp.decode(ids), text[:40]


def test_sentencepiece_run_exports_a_tokenizer_auto_tokenizer_loads(tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM
    model = _train_spm(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    data = load_tool("preprocess_data").main([
        "--input", str(corpus), "--output-prefix", str(tmp_path / "docs"), "--append-eod",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
        "--workers", "1"])["text"]
    ck, hf_dir = tmp_path / "ck", tmp_path / "hf"
    spm_args = (f"{TINY.replace('--mock-data', '').replace('--position-embedding-type rope', '')} "
                f"{LLAMA_FLAGS} --train-iters 2 --lr-decay-iters 10 --data-path {data} "
                f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {model} "
                f"--data-cache-path {tmp_path / 'cache'} --tensor-model-parallel-size 2")
    spm_args = spm_args.replace("--vocab-size 200 --make-vocab-size-divisible-by 64", "")
    run_workers(train_losses, 2, f"{spm_args} --save {ck}")
    convert.main(["--load-dir", str(ck), "--to-hf", str(hf_dir)])
    files = set(os.listdir(hf_dir))
    assert {"tokenizer.json", "tokenizer.model", "tokenizer_config.json"} <= files
    ours = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    hf_tok = AutoTokenizer.from_pretrained(str(hf_dir))
    assert hf_tok.eos_token_id == ours.eod == 2 and len(hf_tok) == ours.vocab_size == 300
    for text in _texts():
        assert hf_tok(text)["input_ids"] == ours.tokenize(text), text[:40]
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 1
    # the exported Llama reads the exported tokenizer's ids as megatron_cp reads its own
    full, args, _ = convert.load_full(str(ck))
    text = _texts()[10]
    tokens = torch.tensor([ours.tokenize(text)[:32]])
    hf = LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        hf_logits = hf(**hf_tok(text, return_tensors="pt", max_length=32, truncation=True)).logits
    ours_logits = _logits(_gpt_model(args, full), tokens)[..., :300]
    assert (ours_logits - hf_logits).abs().max() <= 1e-4


def _hand_bpe(tmp_path):
    """The hand-written byte-level BPE of test_data_tokenizers: (vocab file, merges file)."""
    vocab = {"<|endoftext|>": 0, "h": 1, "e": 2, "l": 3, "o": 4, "Ġ": 5, "w": 6, "r": 7,
             "d": 8, "he": 9, "ll": 10, "hell": 11, "hello": 12, "Ġw": 13, "or": 14, "Ġwor": 15}
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
    vocab_file, merge_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    merge_file.write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return str(vocab_file), str(merge_file)


def _trained_bpe(tmp_path):
    """A byte-level BPE trained here, saved as GPT-2's vocab.json + merges.txt."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(_texts() * 3, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "trained_bpe"
    folder.mkdir()
    tok.model.save(str(folder))
    return str(folder / "vocab.json"), str(folder / "merges.txt")


@pytest.mark.parametrize("which", ["hand", "trained"])
def test_gpt2_bpe_export_loads_with_auto_tokenizer(tmp_path, which):
    from transformers import AutoTokenizer
    vocab_file, merge_file = (_hand_bpe if which == "hand" else _trained_bpe)(tmp_path)
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    config = tiny_config(position_embedding_type="learned_absolute", vocab_size=ours.vocab_size,
                         make_vocab_size_divisible_by=128)
    full = dict(GPTModel(config).state_dict())
    args = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
            "max_position_embeddings": 64, "normalization": "LayerNorm", "swiglu": False,
            "disable_bias_linear": False, "position_embedding_type": "learned_absolute",
            "untie_embeddings_and_output_weights": False, "true_vocab_size": ours.vocab_size,
            "tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab_file,
            "merge_file": merge_file}
    out = tmp_path / "hf"
    assert hf_convert.export_hf(full, args, str(out)) == "GPT2LMHeadModel"
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.eos_token_id == ours.eod and len(hf_tok) == ours.vocab_size
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == ours.eod
    texts = ["hello world hello", "world  hello", ""] if which == "hand" else _texts()
    for text in texts + ["hello<|endoftext|>world" if which == "trained" else "hello"]:
        assert hf_tok(text)["input_ids"] == ours.tokenize(text), text[:40]


@pytest.mark.parametrize("as_file", [False, True])
def test_hugging_face_tokenizer_export(tmp_path, as_file):
    from test_data_tokenizers import _train_hf_bpe
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    raw, file = _train_hf_bpe(tmp_path)
    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>").save_pretrained(str(folder))
    path = file if as_file else str(folder)
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    out = tmp_path / "hf"
    hf_tokenizer.write_tokenizer({"tokenizer_type": "HuggingFaceTokenizer",
                                  "tokenizer_model": path}, str(out))
    assert hf_tokenizer.token_ids({"tokenizer_type": "HuggingFaceTokenizer",
                                   "tokenizer_model": path})["eos_token_id"] == ours.eod
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.eos_token_id == ours.eod
    for text in ["def main():\n    return 0\n", "hello world, hello tokenizers"]:
        assert hf_tok.encode(text, add_special_tokens=False) == ours.tokenize(text)
