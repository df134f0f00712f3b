"""Tokenizers, selected by Megatron's ``--tokenizer-type`` names.

Each tokenizer exposes ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]``,
``detokenize(ids) -> str`` and ``token_to_id(token) -> int | None`` (the id of one vocabulary
entry, None when there is none: FIM's special tokens, data/fim.py):

- ``SentencePieceTokenizer`` (alias ``GPTSentencePieceTokenizer``): a sentencepiece
  model (``--tokenizer-model``); ``eod`` is the model's eos id (``</s>``;
  tools/train_tokenizer.py always gives the model one), as Megatron's GPT sentencepiece.
- ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``
  (``--vocab-file``, ``--merge-file``) through the HF ``tokenizers`` library, imported
  lazily; ``eod`` is the id of ``<|endoftext|>``.
- ``HuggingFaceTokenizer``: a LOCAL Hugging Face tokenizer (``--tokenizer-model``): a folder
  written by ``save_pretrained`` (read by ``transformers.AutoTokenizer`` when transformers is
  installed) or a ``tokenizer.json`` file (read by the ``tokenizers`` library). Nothing is
  downloaded. ``eod`` is the tokenizer's eos token.
- ``NullTokenizer``: text is whitespace-separated integer ids. As in Megatron-LM, the
  eod id is ``vocab_size`` (one past the given ids) and ``.vocab_size`` reports
  ``vocab_size + 1`` so the embedding has a row for it.
"""
import json
import os

from megatron_cp.config.data import TOKENIZER_TYPES

# GPTSentencePieceTokenizer is accepted as Megatron's name for the same eos-as-eod behaviour.


class SentencePieceTokenizer:
    """A sentencepiece model; ``eod`` is its eos id."""

    def __init__(self, model_file):
        import sentencepiece

        self.model_file = model_file
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._eod = self._sp.eos_id()
        if self._eod < 0:
            raise ValueError(f"sentencepiece model {model_file} has no eos piece (eos_id = -1); "
                             "retrain it with tools/train_tokenizer.py, which keeps </s>")

    @property
    def vocab_size(self):
        return self._sp.get_piece_size()

    @property
    def eod(self):
        return self._eod

    def tokenize(self, text):
        """Token ids of ``text`` (no bos/eos added)."""
        return list(self._sp.encode(text))

    def detokenize(self, ids):
        """Text of ``ids``."""
        return self._sp.decode([int(i) for i in ids])

    def token_to_id(self, token):
        """The id of piece ``token`` (None: not a piece of the model)."""
        piece_id = self._sp.piece_to_id(token)
        return piece_id if self._sp.id_to_piece(piece_id) == token else None


class _SizedTokenizer:
    """``vocab_size`` and ``eod`` read from what the subclass's constructor found."""

    @property
    def vocab_size(self):
        return self._vocab_size

    @property
    def eod(self):
        return self._eod


class GPT2BPETokenizer(_SizedTokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` and ``merges.txt`` (HF ``tokenizers``)."""

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file, merge_file):
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        except ImportError as err:
            raise ImportError("GPT2BPETokenizer needs the HF tokenizers library: "
                              "pip install tokenizers") from err
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        if self.EOD_TOKEN not in vocab:
            raise ValueError(f"{vocab_file} has no {self.EOD_TOKEN} entry, which "
                             "GPT2BPETokenizer uses as eod; add it to the vocabulary")
        self._eod = int(vocab[self.EOD_TOKEN])
        self._vocab = {token: int(i) for token, i in vocab.items()}
        self._vocab_size = max(len(vocab), max(int(v) for v in vocab.values()) + 1)
        model = models.BPE.from_file(vocab_file, merge_file)
        self._tok = Tokenizer(model)
        # GPT-2: its regex split, bytes mapped to printable characters, no prefix space.
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()

    def tokenize(self, text):
        """Token ids of ``text``."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids):
        """Text of ``ids``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token):
        """The id of vocabulary entry ``token`` (None: not in vocab.json)."""
        return self._vocab.get(token)


class HuggingFaceTokenizer(_SizedTokenizer):
    """A local Hugging Face tokenizer: a ``save_pretrained`` folder or a ``tokenizer.json``.

    ``include_special_tokens`` (Megatron-LM's default): encoding adds the special tokens the
    tokenizer's post-processor adds (a Llama tokenizer's bos, ...) and decoding keeps them;
    without it (``--tokenizer-hf-no-include-special-tokens``) encoding adds none and decoding
    drops them, as Megatron-LM's HuggingFaceTokenizer does."""

    # eos names looked up in a bare tokenizer.json, which records no eos of its own
    EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>")

    def __init__(self, path, include_special_tokens=True):
        self.include_special_tokens = include_special_tokens
        if not os.path.exists(path):
            raise ValueError(f"HuggingFaceTokenizer: {path} does not exist; give a local folder "
                             f"written by save_pretrained or a tokenizer.json file (hub names "
                             f"are not downloaded)")
        self.path = path
        self._hf = _auto_tokenizer(path) if os.path.isdir(path) else None
        if self._hf is not None:
            eos, self._vocab_size = self._hf.eos_token_id, len(self._hf)
        else:
            file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(file)
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._vocab_size = max(len(vocab), max(vocab.values()) + 1)
            eos = vocab.get(_configured_eos(os.path.dirname(file)) or "")
            if eos is None:
                eos = next((vocab[name] for name in self.EOS_NAMES if name in vocab), None)
        if eos is None:
            raise ValueError(f"HuggingFaceTokenizer: {path} has no eos token, which is used as "
                             f"eod; give the tokenizer one (e.g. eos_token='</s>' in "
                             f"tokenizer_config.json)")
        self._eod = int(eos)

    def tokenize(self, text):
        """Token ids of ``text`` (with the special tokens the tokenizer adds, unless off)."""
        special = self.include_special_tokens
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=special))
        return self._tok.encode(text, add_special_tokens=special).ids

    def detokenize(self, ids):
        """Text of ``ids`` (special tokens dropped when they are not included)."""
        ids, skip = [int(i) for i in ids], not self.include_special_tokens
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=skip,
                                   clean_up_tokenization_spaces=False)
        return self._tok.decode(ids, skip_special_tokens=skip)

    def token_to_id(self, token):
        """The id of vocabulary entry ``token``, added tokens included (None: not there)."""
        if self._hf is not None:
            return self._hf.get_vocab().get(token)
        return self._tok.token_to_id(token)


def _auto_tokenizer(folder):
    """``transformers.AutoTokenizer`` of a local folder, or None without transformers."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _configured_eos(folder):
    """The eos token named by ``tokenizer_config.json`` in ``folder``, if any."""
    config = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(config):
        return None
    with open(config, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


class NullTokenizer:
    """Whitespace-separated integer ids; eod is ``vocab_size`` (Megatron's convention)."""

    def __init__(self, vocab_size):
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self._vocab_size_without_eod = int(vocab_size)

    @property
    def vocab_size(self):
        return self._vocab_size_without_eod + 1

    @property
    def eod(self):
        return self._vocab_size_without_eod

    def tokenize(self, text):
        """``"3 1 4"`` -> ``[3, 1, 4]``."""
        return [int(x) for x in text.split()]

    def detokenize(self, ids):
        """``[3, 1, 4]`` -> ``"3 1 4"``."""
        return " ".join(str(int(i)) for i in ids)

    def token_to_id(self, token):
        """None: ids have no names here."""
        return None


def build_tokenizer(tokenizer_type, tokenizer_model=None, vocab_file=None, merge_file=None,
                    vocab_size=None, include_special_tokens=True):
    """Build the tokenizer named by ``tokenizer_type`` (one of :data:`TOKENIZER_TYPES`);
    ``include_special_tokens``: a Hugging Face tokenizer's (see :class:`HuggingFaceTokenizer`)."""
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        if not tokenizer_model:
            raise ValueError(f"{tokenizer_type} needs --tokenizer-model (a .model file; "
                             "tools/train_tokenizer.py makes one)")
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise ValueError(f"GPT2BPETokenizer needs --vocab-file and --merge-file, got "
                             f"vocab_file={vocab_file!r}, merge_file={merge_file!r}")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (a local folder written "
                             "by save_pretrained, or a tokenizer.json file)")
        return HuggingFaceTokenizer(tokenizer_model, include_special_tokens)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; choose one of "
                     f"{', '.join(TOKENIZER_TYPES)}")


def tokenizer_from_config(data):
    """The tokenizer that the data section ``data`` (:class:`~megatron_cp.config.data.DataConfig`)
    names (NullTokenizer when none)."""
    return build_tokenizer(data.tokenizer_type or "NullTokenizer", data.tokenizer_model,
                           data.vocab_file, data.merge_file, data.vocab_size,
                           not data.tokenizer_hf_no_include_special_tokens)
