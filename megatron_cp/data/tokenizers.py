"""Tokenizers, selected by Megatron's ``--tokenizer-type`` names.

Each tokenizer exposes ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]``,
``detokenize(ids) -> str`` and ``token_to_id(token) -> int | None`` (the id of one vocabulary
entry, None when there is none: FIM's special tokens, data/fim.py):

- ``SentencePieceTokenizer`` (aliases ``GPTSentencePieceTokenizer`` and ``Llama2Tokenizer``):
  a sentencepiece model (``--tokenizer-model``); ``tokenize`` adds no bos or eos, ``eod`` is
  the model's eos id (``</s>``; tools/train_tokenizer.py always gives the model one) and
  ``bos`` its bos id: Megatron-LM reads all three names with its one sentencepiece wrapper.
- ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``
  (``--vocab-file``, ``--merge-file``) through the HF ``tokenizers`` library, imported
  lazily; ``eod`` is the id of ``<|endoftext|>``.
- ``HuggingFaceTokenizer``: a LOCAL Hugging Face tokenizer (``--tokenizer-model``): a folder
  written by ``save_pretrained`` (read by ``transformers.AutoTokenizer`` when transformers is
  installed) or a ``tokenizer.json`` file (read by the ``tokenizers`` library). Nothing is
  downloaded. ``eod`` is the tokenizer's eos token.
- ``TikTokenizer``: Megatron-LM's tiktoken BPE over a vocabulary ``.json``
  (``--tokenizer-model``) when the tiktoken package is installed (megatron_cp does not
  depend on it): ids below ``--tiktoken-num-special-tokens`` are the special tokens, ``eod``
  is ``</s>``'s.
- ``NullTokenizer``: text is whitespace-separated integer ids. As in Megatron-LM, the
  eod id is ``vocab_size`` (one past the given ids) and ``.vocab_size`` reports
  ``vocab_size + 1`` so the embedding has a row for it.
"""
import base64
import importlib.util
import json
import os

from megatron_cp.config.data import (NOT_BUILT_TOKENIZERS, SENTENCEPIECE_TYPES,
                                     TIKTOKEN_DEFAULT_VOCAB, TIKTOKEN_SPECIAL_TOKENS,
                                     TOKENIZER_TYPES)


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

    @property
    def bos(self):
        """The model's bos id (-1: it has none); never added by :meth:`tokenize`."""
        return self._sp.bos_id()

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


TIKTOKEN_MISSING = ("--tokenizer-type TikTokenizer needs the tiktoken package, which is not "
                    "installed (megatron_cp does not depend on it): pip install tiktoken")


def tiktoken_available():
    """Whether the tiktoken package (TikTokenizer's) can be imported."""
    return importlib.util.find_spec("tiktoken") is not None


def check_tiktoken_settings(special_tokens, num_special_tokens, vocab_size):
    """Megatron-LM's rules for a TikTokenizer: each special token once, those of
    :data:`TIKTOKEN_SPECIAL_TOKENS` among them, and as many as ``num_special_tokens`` at
    most, which is below the vocabulary size (``vocab_size``, default 2^17)."""
    special = tuple(special_tokens or TIKTOKEN_SPECIAL_TOKENS)
    missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in special]
    if missing or len(set(special)) != len(special):
        raise ValueError(f"--tokenizer-special-tokens must list each token once and include "
                         f"{' '.join(TIKTOKEN_SPECIAL_TOKENS)} (missing: "
                         f"{' '.join(missing) or 'none'})")
    vocab = vocab_size or TIKTOKEN_DEFAULT_VOCAB
    if not len(special) <= num_special_tokens < vocab:
        raise ValueError(f"--tokenizer-type TikTokenizer needs its {len(special)} special "
                         f"tokens <= "
                         f"--tiktoken-num-special-tokens ({num_special_tokens}) < its vocabulary "
                         f"(--vocab-size, default 2^17: {vocab})")


# TikTokenizer's pre-tokenization regexes (Megatron-LM's --tiktoken-pattern v1 and v2)
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


class TikTokenizer(_SizedTokenizer):
    """Megatron-LM's TikTokenizer: byte-level BPE (tiktoken) over a vocabulary ``.json``, a
    list of ``{"rank": i, "token_bytes": base64, "token_str": ...}`` whose first 256 entries
    are the single bytes. Ids ``0 .. num_special_tokens - 1`` are the special tokens
    (``special_tokens``, then ``<SPECIAL_i>`` fillers); the vocabulary's entry of rank r has
    id ``num_special_tokens + r``, and only its first ``vocab_size - num_special_tokens``
    entries are used. ``tokenize`` reads special-token text in the input as those tokens and
    adds none; ``eod`` is ``</s>``'s id."""

    def __init__(self, path, pattern=None, vocab_size=None, num_special_tokens=1000,
                 special_tokens=None):
        import tiktoken

        check_tiktoken_settings(special_tokens, num_special_tokens, vocab_size)
        special = list(special_tokens or TIKTOKEN_SPECIAL_TOKENS)
        vocab_size = vocab_size or TIKTOKEN_DEFAULT_VOCAB
        if not os.path.isfile(path):
            raise ValueError(f"TikTokenizer: {path} does not exist; give its vocabulary .json "
                             f"as --tokenizer-model")
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)[:vocab_size - num_special_tokens]
        ranks = {}
        for i, entry in enumerate(entries):
            token = base64.b64decode(entry["token_bytes"])
            if entry["rank"] != i or (i < 256 and token != bytes([i])):
                raise ValueError(f"TikTokenizer: {path} entry {i} has rank {entry['rank']} "
                                 f"and bytes {token!r}: the ranks must count 0, 1, ... and "
                                 f"the first 256 be the single bytes")
            ranks[token] = num_special_tokens + i
        if len(ranks) != vocab_size - num_special_tokens:
            raise ValueError(f"TikTokenizer: {path} has {len(ranks)} tokens, fewer than "
                             f"--vocab-size ({vocab_size}) - --tiktoken-num-special-tokens "
                             f"({num_special_tokens}); lower --vocab-size")
        special += [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        self.special_tokens = special
        self._vocab_size, self._eod = vocab_size, special.index("</s>")
        self._bos = special.index("<s>")
        self._enc = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))),
            pat_str=TIKTOKEN_PATTERNS[pattern or "v2"], mergeable_ranks=ranks,
            special_tokens={token: i for i, token in enumerate(special)})

    @property
    def bos(self):
        return self._bos

    def tokenize(self, text):
        """Token ids of ``text``; special-token text becomes its id, nothing is added."""
        return self._enc.encode(text, allowed_special="all")

    def detokenize(self, ids):
        """Text of ``ids`` (special tokens kept as their text)."""
        return self._enc.decode([int(i) for i in ids])

    def token_to_id(self, token):
        """The id of ``token`` (a special token, or one vocabulary entry), None otherwise."""
        if token in self.special_tokens:
            return self.special_tokens.index(token)
        try:
            return self._enc.encode_single_token(token)
        except KeyError:
            return None


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
                    vocab_size=None, include_special_tokens=True, tiktoken_pattern=None,
                    tiktoken_num_special_tokens=1000, special_tokens=None):
    """Build the tokenizer named by ``tokenizer_type`` (one of :data:`TOKENIZER_TYPES`);
    ``include_special_tokens``: a Hugging Face tokenizer's (see :class:`HuggingFaceTokenizer`);
    ``tiktoken_pattern``, ``tiktoken_num_special_tokens``, ``special_tokens`` and
    ``vocab_size``: a TikTokenizer's (see :class:`TikTokenizer`)."""
    if tokenizer_type in NOT_BUILT_TOKENIZERS:
        raise ValueError(f"{tokenizer_type}: {NOT_BUILT_TOKENIZERS[tokenizer_type]}")
    if tokenizer_type in SENTENCEPIECE_TYPES:
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
    if tokenizer_type == "TikTokenizer":
        if not tiktoken_available():
            raise ValueError(TIKTOKEN_MISSING)
        if not tokenizer_model:
            raise ValueError("TikTokenizer needs --tokenizer-model (its vocabulary .json)")
        return TikTokenizer(tokenizer_model, tiktoken_pattern, vocab_size,
                            tiktoken_num_special_tokens, special_tokens)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; choose one of "
                     f"{', '.join(TOKENIZER_TYPES)}")


def tokenizer_from_config(data):
    """The tokenizer that the data section ``data`` (:class:`~megatron_cp.config.data.DataConfig`)
    names (NullTokenizer when none)."""
    return build_tokenizer(data.tokenizer_type or "NullTokenizer", data.tokenizer_model,
                           data.vocab_file, data.merge_file, data.vocab_size,
                           not data.tokenizer_hf_no_include_special_tokens,
                           data.tiktoken_pattern, data.tiktoken_num_special_tokens,
                           data.special_tokens)
