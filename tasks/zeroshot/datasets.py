"""The evaluation samples of the zero-shot tasks, as token ids (no torch here).

WIKITEXT103 (perplexity over one text file): the file is read whole, WikiText's tokenized
spelling is undone (:func:`wikitext_detokenize`) and the text tokenized into one stream of N
tokens, whose N - 1 next-token predictions are each scored exactly once. Window ``k`` holds
the ``seq_length + 1`` tokens from ``k * stride`` (input and label shifted by one); it scores
only the labels that no earlier window scored, the last ``stride`` of them (all of them in the
first window), so with ``stride < seq_length`` every scored token sees at least
``seq_length - stride`` tokens of context. The words of the original text (Megatron's count:
the pieces of ``text.strip().split(" ")``) give the word-level perplexity.

LAMBADA (cloze accuracy): a jsonl file, one ``{"text": passage}`` per line; the passage's last
word is the target. Strict (Megatron's ``--strict-lambada``): the target is the
whitespace-delimited last word, tokenized on its own with a leading space, after the
tokenized context before it. Otherwise the whole passage is tokenized once and the target is
the tokenizer's own split of the last word: the shortest run of final tokens whose text
covers that word.
"""
import json
import os
import re

# WikiText-103 spells hyphens and separators inside numbers as " @-@ ", " @,@ ", " @.@ " and
# separates every punctuation mark and bracket by spaces; these rules join them back.
_WIKITEXT_RULES = (
    (r" @([-,.])@ ", r"\1"),  # 1 @,@ 000 -> 1,000; well @-@ known -> well-known
    (r" ([.,;:!?%])(?=\s|$)", r"\1"),  # word , word -> word, word
    (r"([(\[{]) ", r"\1"),  # ( text ) -> (text)
    (r" ([)\]}])", r"\1"),
    (r" (['’](?:s|re|ve|ll|d|m|t)\b)", r"\1"),  # it 's -> it's
    (r" (n't\b)", r"\1"),
    (r'" ([^"\n]*?) "', r'"\1"'),  # " quoted " -> "quoted"
    (r"(?m)^ +| +$", ""),  # spaces at line starts and ends
)


def wikitext_detokenize(text):
    """``text`` in WikiText's tokenized spelling turned back into ordinary text."""
    for pattern, replacement in _WIKITEXT_RULES:
        text = re.sub(pattern, replacement, text)
    return text


def read_text(path, what):
    """The whole UTF-8 file ``path``; ValueError naming ``what`` when missing or empty."""
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path}: no such file")
    with open(path, "rb") as f:
        text = f.read().decode("utf-8")
    if not text.strip():
        raise ValueError(f"{what} {path} is empty")
    return text


def wikitext_tokens(path, tokenizer, detokenize=True):
    """(token ids, number of words of the original text) of the text file ``path``."""
    text = read_text(path, "--valid-data")
    num_words = len(text.strip().split(" "))
    tokens = tokenizer.tokenize(wikitext_detokenize(text) if detokenize else text)
    if len(tokens) < 2:
        raise ValueError(f"--valid-data {path} has {len(tokens)} token(s); perplexity needs at "
                         f"least 2")
    return list(tokens), num_words


def lm_windows(num_tokens, seq_length, stride):
    """The windows over a stream of ``num_tokens`` tokens: a list of ``(start, first, end)``,
    the window's first token and the half-open range ``[first, end)`` of its label positions
    that it scores (label ``j`` of the window is token ``start + j + 1``)."""
    if not 1 <= stride <= seq_length:
        raise ValueError(f"--overlapping-eval ({stride}) must lie in [1, --seq-length "
                         f"({seq_length})]")
    num_labels = num_tokens - 1
    windows, scored = [], 0  # labels scored so far
    start = 0
    while scored < num_labels:
        end = min(seq_length, num_labels - start)
        first = scored - start  # the labels before it were scored by earlier windows
        windows.append((start, first, end))
        scored = start + end
        start += stride
    return windows


def window_sample(tokens, start, first, end, seq_length):
    """The sample of one window: ``tokens``, ``labels`` and ``loss_mask`` lists (unpadded)."""
    piece = tokens[start:start + seq_length + 1]
    inputs, labels = piece[:-1], piece[1:]
    return {"tokens": inputs, "labels": labels,
            "loss_mask": [1.0 if first <= j < end else 0.0 for j in range(len(labels))]}


def read_lambada(path):
    """The passages of a LAMBADA-format jsonl file (one ``{"text": ...}`` per line)."""
    text = read_text(path, "--valid-data")
    passages = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            passage = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"--valid-data {path} line {number}: expected a json object with a "
                             f"\"text\" field (LAMBADA format)") from None
        if not isinstance(passage, str) or len(passage.split()) < 2:
            raise ValueError(f"--valid-data {path} line {number}: the passage needs a context "
                             f"and a last word")
        passages.append(passage)
    return passages


def _covering_suffix(tokens, tokenizer, word):
    """The number of final ``tokens`` whose text first covers ``word``."""
    for n in range(1, len(tokens)):
        if len(tokenizer.detokenize(tokens[-n:]).strip()) >= len(word):
            return n
    return len(tokens) - 1  # the word is the whole passage but its first token


def lambada_tokens(passage, tokenizer, strict):
    """(context ids, target ids) of one passage (see the module doc)."""
    last_word = passage.split()[-1]
    if strict:
        context_text = passage[:passage.rstrip().rfind(last_word)].strip()
        context = list(tokenizer.tokenize(context_text))
        target = list(tokenizer.tokenize(" " + last_word))
    else:
        tokens = list(tokenizer.tokenize(passage.rstrip()))
        n = _covering_suffix(tokens, tokenizer, last_word) if len(tokens) > 1 else len(tokens)
        context, target = tokens[:-n] if n else tokens, tokens[-n:] if n else []
    if not context or not target:
        raise ValueError(f"the LAMBADA passage {passage[:60]!r}... tokenizes to {len(context)} "
                         f"context and {len(target)} target token(s); both must be non-empty")
    return context, target


def lambada_sample(context, target, seq_length):
    """The sample of one passage: the target's tokens are the scored labels; a passage longer
    than ``seq_length + 1`` tokens keeps its last ones."""
    if len(target) > seq_length:
        raise ValueError(f"a LAMBADA target has {len(target)} tokens, more than --seq-length "
                         f"({seq_length})")
    piece = (context + target)[-(seq_length + 1):]
    inputs, labels = piece[:-1], piece[1:]
    return {"tokens": inputs, "labels": labels,
            "loss_mask": [0.0] * (len(labels) - len(target)) + [1.0] * len(target)}
