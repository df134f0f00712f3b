"""Fill-in-the-middle (FIM) samples, Megatron-LM's ``--fim-data`` (its GPTFIMDataset).

Each sample of ``seq_length + 1`` tokens is cut at its EOD tokens into segments; each segment
(with ``--fim-split-sample``, each fragment between split tokens) is, with probability
``--fim-rate``, turned into text (the tokenizer's special tokens left out), cut at two
uniformly drawn character positions into prefix / middle / suffix, re-tokenized and put in

- PSM order: ``<prefix> prefix <suffix> suffix <middle> middle``, or, with probability
  ``--fim-spm-rate``,
- SPM order: ``<prefix> <suffix> suffix <middle> prefix middle``.

A segment whose text starts with ``--fim-no-prefix`` is left as it is. The EOD tokens
stay between the segments (an empty segment is dropped with its EOD, as Megatron-LM drops
it), and the result is cut, or padded with ``--fim-pad-token``, back to ``seq_length + 1``.
With ``--fim-split-sample`` a sample that holds the split token is transformed (probability
``--fim-rate``) fragment by fragment, each with probability ``--fim-fragment-rate``, the split
tokens kept between them.

The draws follow Megatron-LM's order inside a sample (FIM or not, the two cut points, SPM or
not; the sample-level draw first with a split token). Megatron-LM draws them from one
generator per dataset, consumed in the order samples are read, so what a sample becomes
there depends on which samples were read before it (and on each data-loader worker's copy
of the generator). Here each sample has its own generator, seeded by (--seed, the sample's
index in its dataset): a sample is the same in every run, parallel layout and resume.
"""
from dataclasses import dataclass

import numpy as np

# the five FIM tokens: (flag, argument name); their defaults: megatron_cp.config.data
FIM_TOKENS = (("--fim-prefix-token", "fim_prefix_token"), ("--fim-middle-token", "fim_middle_token"),
              ("--fim-suffix-token", "fim_suffix_token"), ("--fim-pad-token", "fim_pad_token"),
              ("--fim-eod-token", "fim_eod_token"))


@dataclass(frozen=True)
class FimSettings:
    """What the transformation needs: the rates and the token ids."""
    rate: float
    spm_rate: float
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: int | None = None
    fragment_rate: float | None = None
    no_prefix: str | None = None


def fim_settings(data, tokenizer):
    """The :class:`FimSettings` of the data section ``data``
    (:class:`~megatron_cp.config.data.DataConfig`) with ``tokenizer``'s ids of the FIM tokens;
    a ValueError names every token the tokenizer lacks (Megatron-LM would give them the
    unknown token's id, GPT-2's ``<|endoftext|>``: every sentinel the EOD)."""
    names = [(flag, getattr(data, name)) for flag, name in FIM_TOKENS]
    if data.fim_split_sample is not None:
        names.append(("--fim-split-sample", data.fim_split_sample))
    ids = {flag: tokenizer.token_to_id(token) for flag, token in names}
    missing = [f"{flag} {token!r}" for flag, token in names if ids[flag] is None]
    if missing:
        raise ValueError(f"the tokenizer has no token {', '.join(missing)}: add "
                         f"{'them' if len(missing) > 1 else 'it'} to its vocabulary (as special "
                         f"tokens) or name tokens it has")
    return FimSettings(data.fim_rate, data.fim_spm_rate, ids["--fim-prefix-token"],
                       ids["--fim-middle-token"], ids["--fim-suffix-token"],
                       ids["--fim-pad-token"], ids["--fim-eod-token"],
                       ids.get("--fim-split-sample"), data.fim_fragment_rate, data.fim_no_prefix)


class FimTransform:
    """One sample -> its FIM form (see the module docstring); ``tokenizer`` turns ids into
    text and back."""

    def __init__(self, settings, tokenizer):
        self.s, self.tokenizer = settings, tokenizer
        # the tokens left out of a segment's text (Megatron-LM: the tokenizer's special ones)
        self.special = np.array(sorted({settings.prefix, settings.middle, settings.suffix,
                                        settings.pad, settings.eod, tokenizer.eod}))

    def __call__(self, sample, rng):
        """``sample`` [n] int64 -> [n] int64, drawing from ``rng`` (a RandomState)."""
        s = self.s
        pieces = _split_keeping(sample, s.eod, lambda part: self._split_and_permute(part, rng))
        out = np.concatenate(pieces).astype(np.int64)
        if len(out) >= len(sample):
            return out[:len(sample)]
        return np.concatenate([out, np.full(len(sample) - len(out), s.pad, dtype=np.int64)])

    def _split_and_permute(self, segment, rng):
        s = self.s
        if s.split is None or not (segment == s.split).any():
            return self._permute(segment, s.rate, rng)
        if not rng.binomial(1, s.rate):
            return segment
        return np.concatenate(_split_keeping(
            segment, s.split, lambda part: self._permute(part, s.fragment_rate, rng)))

    def _permute(self, segment, rate, rng):
        s = self.s
        if not rng.binomial(1, rate):
            return segment
        text = self.tokenizer.detokenize(segment[~np.isin(segment, self.special)])
        if s.no_prefix is not None and text.startswith(s.no_prefix):
            return segment
        low, high = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (np.array(self.tokenizer.tokenize(part), dtype=np.int64)
                                  for part in (text[:low], text[low:high], text[high:]))
        if rng.binomial(1, s.spm_rate):  # SPM
            return np.concatenate([[s.prefix, s.suffix], suffix, [s.middle], prefix, middle])
        return np.concatenate([[s.prefix], prefix, [s.suffix], suffix, [s.middle], middle])


def _split_keeping(tokens, separator, transform):
    """``tokens`` cut at each ``separator``: the transformed non-empty parts with a separator
    after each, then the transformed last part (empty or not). An empty part before a
    separator is dropped with it, as Megatron-LM's loop drops it."""
    pieces, start = [], 0
    for at in np.flatnonzero(tokens == separator):
        if at > start:
            pieces += [transform(tokens[start:at]), np.array([separator], dtype=np.int64)]
        start = at + 1
    pieces.append(transform(tokens[start:]))
    return pieces


class FimDataset:
    """``dataset``'s samples (``{"text": [seq_length + 1]}``) in FIM form; sample ``i`` draws
    from a generator seeded by (``seed``, ``i``)."""

    def __init__(self, dataset, transform, seed):
        self.dataset, self.transform, self.seed = dataset, transform, int(seed)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, idx):
        idx = int(idx)
        sample = dict(self.dataset[idx])
        rng = np.random.RandomState([self.seed % 2**32, idx])
        sample["text"] = self.transform(sample["text"], rng)
        if "document_ids" in sample:
            # the pieces are gone once the segments are permuted: Megatron-LM's FIM dataset
            # makes the whole sample one document under --dataloader-inter-document-masking
            sample["document_ids"] = np.zeros_like(sample["document_ids"])
        return sample

    def __getattr__(self, name):  # the wrapped dataset's description, indices, ...
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
