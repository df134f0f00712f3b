"""A sentencepiece model as a Hugging Face ``tokenizers`` pipeline (``tokenizer.json``).

megatron_cp's SentencePieceTokenizer calls ``SentencePieceProcessor.encode`` (no bos/eos);
the pipeline built here gives the same ids for the models tools/train_tokenizer.py trains
(BPE or unigram, verbatim or normalized, with or without byte fallback). Each step is one
step of sentencepiece's own encoder, read from the model's proto:

- normalizer: the model's character map (NFKC models), whitespace folding when
  ``remove_extra_whitespaces``, the dummy ``▁`` prefix (always, even before a leading space
  or newline), spaces escaped to ``▁``;
- pre-tokenizer: a word starts at each ``▁`` (``split_by_whitespace``), and user-defined
  symbols (``\n`` in verbatim models) stand alone: sentencepiece matches them on the
  normalized text and never merges them. (Hugging Face's added tokens would not do: they are
  matched before the dummy prefix is added, or normalized themselves.)
- model: unigram with the model's scores (control pieces made unreachable), or BPE whose
  merge ranks follow the scores of the merged pieces: sentencepiece merges the adjacent pair
  whose concatenation is the best-scored piece, so every split of a piece into two pieces is
  a merge, ranked by that piece's score. Runs of unknown characters give one ``<unk>``.
- control pieces (``<s>``, ``</s>``) and ``<unk>`` are special tokens that text never produces
  (sentencepiece does not match them in text either: ``encode_special_tokens``, and
  ``split_special_tokens`` in the tokenizer config).

One known difference: a unigram model whose best segmentations tie exactly (a run of one
repeated character) may resolve the tie the other way, since sentencepiece sums float32
scores; BPE models have no ties.
"""
import os
import re
import shutil

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE_TYPE = 1, 2
SPACE = "\u2581"  # sentencepiece's escaped space


def read_proto(model_file):
    """The ``ModelProto`` of a sentencepiece ``.model`` file."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def _check_supported(proto, model_file):
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type not in (UNIGRAM, BPE_TYPE):
        raise ValueError(f"{model_file}: sentencepiece model_type {trainer.model_type} (word or "
                         f"char) has no Hugging Face export; train a bpe or unigram model")
    if trainer.treat_whitespace_as_suffix or not norm.escape_whitespaces:
        raise ValueError(f"{model_file}: treat_whitespace_as_suffix "
                         f"({trainer.treat_whitespace_as_suffix}) / escape_whitespaces "
                         f"({norm.escape_whitespaces}) are not exported; train with the defaults "
                         f"(tools/train_tokenizer.py does)")


def _merges(proto):
    """BPE merges: every split of a normal piece into two vocabulary pieces, best piece first."""
    mergeable = {p.piece for p in proto.pieces if p.type in (NORMAL, BYTE)}
    ranked = []
    for i, p in enumerate(proto.pieces):
        if p.type != NORMAL or len(p.piece) < 2:
            continue
        for k in range(1, len(p.piece)):
            left, right = p.piece[:k], p.piece[k:]
            if left in mergeable and right in mergeable:
                ranked.append((-p.score, i, k, left, right))
    ranked.sort()  # best score first; one piece's splits stay together
    return [(left, right) for *_, left, right in ranked]


def _model(proto):
    from tokenizers import models

    trainer = proto.trainer_spec
    if trainer.model_type == UNIGRAM:
        normal = [p.score for p in proto.pieces if p.type == NORMAL]
        unreachable = min(normal, default=0.0) - 1e6  # control pieces: never chosen from text
        vocab = [(p.piece, p.score if p.type in (NORMAL, USER_DEFINED, BYTE) else unreachable)
                 for p in proto.pieces]
        return models.Unigram(vocab, unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback)
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    return models.BPE(vocab, _merges(proto), unk_token=proto.pieces[trainer.unk_id].piece,
                      fuse_unk=True, byte_fallback=trainer.byte_fallback)


def _normalizer(proto):
    from tokenizers import Regex, normalizers

    norm = proto.normalizer_spec
    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True),
                  normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    steps.append(normalizers.Replace(" ", SPACE))
    return normalizers.Sequence(steps)


def _pre_tokenizer(proto, model_file):
    """Words start at each ``▁``; user-defined symbols stand alone (sentencepiece matches them
    on the normalized text, dummy prefix included, and never merges them)."""
    from tokenizers import Regex, pre_tokenizers

    steps = []
    if proto.trainer_spec.split_by_whitespace:
        steps.append(pre_tokenizers.Split(SPACE, behavior="merged_with_next"))
    user = sorted((p.piece for p in proto.pieces if p.type == USER_DEFINED), key=len, reverse=True)
    if user and proto.trainer_spec.model_type == BPE_TYPE and max(map(len, user)) > 1:
        raise ValueError(f"{model_file}: BPE with multi-character user_defined_symbols "
                         f"({[u for u in user if len(u) > 1][:5]}) is not exported (no merge "
                         f"builds them); use single characters or a unigram model")
    if user:
        steps.append(pre_tokenizers.Split(Regex("|".join(re.escape(u) for u in user)),
                                          behavior="isolated"))
    return pre_tokenizers.Sequence(steps) if steps else None


def _decoder(proto):
    from tokenizers import decoders

    steps = [decoders.Replace(SPACE, " ")]
    if proto.trainer_spec.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if proto.normalizer_spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def build_tokenizer_json(model_file):
    """A ``tokenizers.Tokenizer`` that encodes text as ``SentencePieceProcessor(model_file)``
    does (with ``encode_special_tokens`` on: control pieces never come from text)."""
    from tokenizers import AddedToken, Tokenizer

    proto = read_proto(model_file)
    _check_supported(proto, model_file)
    tok = Tokenizer(_model(proto))
    tok.normalizer = _normalizer(proto)
    tok.pre_tokenizer = _pre_tokenizer(proto, model_file)
    tok.decoder = _decoder(proto)
    tok.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                            for p in proto.pieces if p.type in (CONTROL, UNKNOWN)])
    tok.encode_special_tokens = True
    return tok


def special_pieces(model_file):
    """``{"bos_token", "eos_token", "unk_token", "pad_token"}`` pieces the model defines."""
    proto = read_proto(model_file)
    trainer, out = proto.trainer_spec, {}
    for key, index in (("unk_token", trainer.unk_id), ("bos_token", trainer.bos_id),
                       ("eos_token", trainer.eos_id), ("pad_token", trainer.pad_id)):
        if 0 <= index < len(proto.pieces):
            out[key] = proto.pieces[index].piece
    return out


def write_folder(model_file, out_dir):
    """Write ``tokenizer.json`` (+ a copy of the ``tokenizer.model``) into ``out_dir``; returns
    the special tokens for ``tokenizer_config.json``."""
    build_tokenizer_json(model_file).save(os.path.join(out_dir, "tokenizer.json"))
    shutil.copyfile(model_file, os.path.join(out_dir, "tokenizer.model"))
    return special_pieces(model_file)
