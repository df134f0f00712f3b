"""The tokenizer files of a Hugging Face export, from the tokenizer a checkpoint names.

The checkpoint's arguments name the tokenizer (``tokenizer_type`` and its files); the export
folder gets what ``transformers.AutoTokenizer.from_pretrained(folder)`` needs to encode text
to the ids megatron_cp's tokenizer gives (no bos/eos added: megatron_cp's documents carry
none, and end with the eod token):

- SentencePieceTokenizer (and its aliases GPTSentencePieceTokenizer, Llama2Tokenizer):
  ``tokenizer.json`` built from the ``.model`` (see
  sentencepiece.py), a copy of the ``.model`` as ``tokenizer.model``;
- GPT2BPETokenizer: ``vocab.json`` + ``merges.txt`` for ``GPT2Tokenizer``;
- HuggingFaceTokenizer: the tokenizer files of its folder, or its ``tokenizer.json``;
- NullTokenizer: nothing (text is whitespace-separated ids); a printed note says so.
- TikTokenizer: none; the export refuses it (pass --hf-skip-tokenizer for the weights).

Each writes a ``tokenizer_config.json``; ``split_special_tokens`` keeps text such as
``</s>`` as plain characters, as megatron_cp's tokenizers read it.
"""
import json
import os
import shutil

from megatron_cp.config.data import SENTENCEPIECE_TYPES as SENTENCEPIECE
# the arguments naming each tokenizer's files
NEEDS = {**{kind: ("tokenizer_model",) for kind in SENTENCEPIECE},
         "GPT2BPETokenizer": ("vocab_file", "merge_file"),
         "HuggingFaceTokenizer": ("tokenizer_model",)}
# files save_pretrained writes for a tokenizer (a model folder holds more: they are left out)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
                      "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json")


def _check_files(args, kind):
    for what in NEEDS[kind]:
        path = args.get(what)
        if not path or not os.path.exists(path):
            raise ValueError(f"the checkpoint's {what} ({path!r}) does not exist from here "
                             f"({os.getcwd()}); run the conversion where training ran (paths "
                             f"are as given on its command line), or pass --hf-skip-tokenizer "
                             f"to export the weights alone")


def _write_config(out_dir, config):
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def _sentencepiece(args, out_dir, common):
    from megatron_cp.checkpoint.hf import sentencepiece as hf_sentencepiece

    model = args["tokenizer_model"]
    special = hf_sentencepiece.write_folder(model, out_dir)
    _write_config(out_dir, {"tokenizer_class": "PreTrainedTokenizerFast", **special, **common})
    trainer = hf_sentencepiece.read_proto(model).trainer_spec
    if trainer.model_type == hf_sentencepiece.UNIGRAM:
        print("note: unigram sentencepiece model: where two segmentations score the same (a run "
              "of one repeated character), tokenizer.json may pick the other one (sentencepiece "
              "sums float32 scores); BPE models give the same ids everywhere")


def _gpt2_bpe(args, out_dir, common):
    shutil.copyfile(args["vocab_file"], os.path.join(out_dir, "vocab.json"))
    shutil.copyfile(args["merge_file"], os.path.join(out_dir, "merges.txt"))
    eod = "<|endoftext|>"
    _write_config(out_dir, {"tokenizer_class": "GPT2Tokenizer", "bos_token": eod, "eos_token": eod,
                            "unk_token": eod, "add_prefix_space": False, **common})


def _hugging_face(args, out_dir, common):
    from megatron_cp.data.tokenizers import build_tokenizer

    path = args["tokenizer_model"]
    if os.path.isdir(path):
        names = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
        for name in names:
            shutil.copyfile(os.path.join(path, name), os.path.join(out_dir, name))
        if "tokenizer_config.json" in names:
            return
    else:
        shutil.copyfile(path, os.path.join(out_dir, "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", path)  # finds the eos a bare file implies
    _write_config(out_dir, {"tokenizer_class": "PreTrainedTokenizerFast",
                            "eos_token": tok.detokenize([tok.eod]), **common})


def tokenizer_kind(args):
    """The tokenizer type ``args`` names (None: none named), with its files checked."""
    kind = args.get("tokenizer_type") or ("NullTokenizer" if args.get("vocab_size") else None)
    if kind in (None, "NullTokenizer"):
        return kind
    if kind not in NEEDS:
        raise ValueError(f"tokenizer_type {kind!r} has no Hugging Face export; pass "
                         f"--hf-skip-tokenizer to export the weights alone")
    _check_files(args, kind)
    return kind


def token_ids(args):
    """``{"bos_token_id", "eos_token_id"}`` for the model config: the eod id of the tokenizer
    ``args`` names (sentencepiece: its own bos); ``{}`` when none is named."""
    from megatron_cp.data.tokenizers import build_tokenizer

    kind = tokenizer_kind(args)
    if kind is None:
        return {}
    tok = build_tokenizer(kind, args.get("tokenizer_model"), args.get("vocab_file"),
                          args.get("merge_file"), args.get("vocab_size"))
    ids = {"bos_token_id": tok.eod, "eos_token_id": tok.eod}
    if kind in SENTENCEPIECE:
        from megatron_cp.checkpoint.hf.sentencepiece import read_proto
        bos = read_proto(args["tokenizer_model"]).trainer_spec.bos_id
        if bos >= 0:
            ids["bos_token_id"] = bos
    return ids


def write_tokenizer(args, out_dir):
    """Write the files of the tokenizer ``args`` names into ``out_dir`` (a note when there
    are none to write)."""
    kind = tokenizer_kind(args)
    if kind is None:
        print("note: the checkpoint names no tokenizer (imported from Hugging Face?): the export "
              "has no tokenizer files")
        return
    if kind == "NullTokenizer":
        print(f"note: NullTokenizer has no tokenizer files (text is whitespace-separated ids); "
              f"the config's eos_token_id is its eod id, {int(args['vocab_size'])}")
        return
    os.makedirs(out_dir, exist_ok=True)
    common = {"add_bos_token": False, "add_eos_token": False, "split_special_tokens": True,
              "clean_up_tokenization_spaces": False}
    if args.get("max_position_embeddings"):
        common["model_max_length"] = args["max_position_embeddings"]
    if kind in SENTENCEPIECE:
        _sentencepiece(args, out_dir, common)
    elif kind == "GPT2BPETokenizer":
        _gpt2_bpe(args, out_dir, common)
    else:
        _hugging_face(args, out_dir, common)
