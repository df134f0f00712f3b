"""Fill-in-the-middle samples (--fim-data and its flags, Megatron-LM's GPTFIMDataset).

The transformation is checked against hand-computed samples, with the random draws scripted
(FIM or not, the two cut points, SPM or not, in Megatron-LM's order) on a one-letter-per-token
tokenizer; then determinism over a real corpus, the pipeline (a training run changes with the
flag) and the refused inputs. Megatron-LM's FIM flag set trains through tools/flag_set_runs.run
in tests/integration/test_megatron_flag_set_runs.py (gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset, on
the small corpus of tools/fim_corpus.py), as does its muP set (gpt3_mcore_te_tp1_pp1_mup)."""
import numpy as np
import pytest

from dist_harness import run_workers
from megatron_cp.cli.arguments import parse_args
from megatron_cp.config.data import DataConfig
from megatron_cp.config.setting import build_config
from megatron_cp.data.builder import build_train_valid_test_datasets
from megatron_cp.data.fim import FimDataset, FimSettings, FimTransform, fim_settings
from megatron_cp.data.tokenizers import build_tokenizer
from fim_corpus import fim_corpus_flags
from training_utils import assert_refused, max_rel_diff, train_runs

LETTERS = "abcdefghijklmnopqrstuvwxyz|"
EOD, P, M, S, PAD = 30, 31, 32, 33, 34  # ids past the letters
NAMES = {EOD: "<eod>", P: "<P>", M: "<M>", S: "<S>", PAD: "<pad>"}


class Letters:
    """One token per letter (and '|'); the FIM tokens and eod by name."""
    eod = EOD

    def tokenize(self, text):
        return [LETTERS.index(c) for c in text]

    def detokenize(self, ids):
        return "".join(LETTERS[int(i)] if i < len(LETTERS) else NAMES[int(i)] for i in ids)

    def token_to_id(self, token):
        names = {**{n: i for i, n in NAMES.items()}, **{c: i for i, c in enumerate(LETTERS)}}
        return names.get(token)


class Script:
    """A RandomState stand-in that returns scripted draws and records what was asked."""

    def __init__(self, *draws):
        self.draws, self.asked = list(draws), []

    def binomial(self, n, p):
        self.asked.append(("binomial", p))
        return self.draws.pop(0)

    def randint(self, low, high, size):
        self.asked.append(("randint", high))
        return np.array(self.draws.pop(0))


def _ids(text):
    """'ab<eod>c' -> ids."""
    out, i = [], 0
    while i < len(text):
        name = next((n for n in NAMES.values() if text.startswith(n, i)), None)
        if name:
            out.append(next(k for k, v in NAMES.items() if v == name))
            i += len(name)
        else:
            out.append(LETTERS.index(text[i]))
            i += 1
    return np.array(out, dtype=np.int64)


def _fim(sample, *draws, **settings):
    base = dict(rate=0.5, spm_rate=0.25, prefix=P, middle=M, suffix=S, pad=PAD, eod=EOD)
    rng = Script(*draws)
    out = FimTransform(FimSettings(**{**base, **settings}), Letters())(_ids(sample), rng)
    assert not rng.draws, "draws left over"
    return Letters().detokenize(out), rng.asked


def test_psm_cut_at_two_character_positions_and_truncated():
    # cut points drawn (5, 2) -> sorted 2, 5: prefix ab, middle cde, suffix fgh
    out, asked = _fim("abcdefgh", 1, [5, 2], 0)
    assert out == "<P>ab<S>fgh<M>"  # "<P>ab<S>fgh<M>cde" cut back to 8 tokens
    assert asked == [("binomial", 0.5), ("randint", 9), ("binomial", 0.25)]


def test_spm_per_segment_between_eod_tokens():
    # segment abc: FIM, cuts (1, 1): prefix a, middle '', suffix bc, SPM; segment defg: kept
    out, _ = _fim("abc<eod>defg", 1, [1, 1], 1, 0)
    assert out == "<P><S>bc<M>a<eod>d"


def test_empty_segments_drop_their_eod_and_short_samples_are_padded():
    out, asked = _fim("<eod>ab<eod><eod>c", 0, 0)
    assert out == "ab<eod>c<pad><pad>"
    assert len(asked) == 2  # only the non-empty segments draw


def test_an_empty_last_segment_still_draws_and_gets_its_sentinels():
    out, _ = _fim("abcde<eod>", 0, 1, [0, 0], 0)
    assert out == "abcde<eod>"  # "<P><S><M>" of the empty tail cut off
    out, _ = _fim("ab<eod>", 0, 1, [0, 0], 1)
    assert out == "ab<eod>"


def test_fragments_split_on_the_split_token():
    """The sample-level draw at --fim-rate, then each fragment at --fim-fragment-rate; the
    split tokens stay between the fragments."""
    split = dict(split=LETTERS.index("|"), fragment_rate=0.9)
    out, asked = _fim("ab|cdefg", 1, 0, 1, [0, 3], 0, **split)
    assert out == "ab|<P><S>fg<M>"  # ab | <P> '' <S> fg <M> cde, cut back to 8 tokens
    assert [p for kind, p in asked if kind == "binomial"] == [0.5, 0.9, 0.9, 0.25]
    out, asked = _fim("ab|cd", 0, **split)  # the sample-level draw says no: untouched
    assert out == "ab|cd" and len(asked) == 1
    out, asked = _fim("abcd", 0, **split)  # no split token: a plain segment at --fim-rate
    assert asked == [("binomial", 0.5)]


def test_no_prefix_leaves_matching_segments_alone():
    out, asked = _fim("abcd<eod>xbcd", 1, 1, [1, 3], 0, no_prefix="ab")
    assert out == "abcd<eod><P>x<S>d"  # abcd kept (no cut drawn); xbcd: <P>x<S>d<M>bc, cut
    assert [kind for kind, _ in asked] == ["binomial", "binomial", "randint", "binomial"]


def test_special_tokens_are_left_out_of_the_text():
    # a stray <M> inside the segment is not part of the text that is cut
    out, asked = _fim("ab<M>cd", 1, [2, 2], 0)
    assert asked[1] == ("randint", 5) and out == "<P>ab<S>c"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return fim_corpus_flags(str(tmp_path_factory.mktemp("fim")))


def _args(corpus, extra=""):
    return parse_args(f"--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 64 "
                      f"--micro-batch-size 2 --global-batch-size 2 --train-iters 2 "
                      f"--eval-iters 0 --lr 1e-3 --fim-data {extra}".split() + corpus,
                      world_size=1)


def _datasets(corpus, extra="", seed=5):
    args = _args(corpus, extra)
    tok = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                          merge_file=args.merge_file)
    fim = FimTransform(fim_settings(build_config(DataConfig, args), tok), tok)
    plain = build_train_valid_test_datasets(args.data_path, "1,0,0", [40, 0, 0], 64, seed, tok,
                                            data_cache_path=None)[0]
    return plain, FimDataset(plain, fim, seed), tok


def test_samples_are_the_same_in_every_run_and_order(corpus):
    plain, fim, tok = _datasets(corpus)
    _, again, _ = _datasets(corpus)
    _, other_seed, _ = _datasets(corpus, seed=6)
    forward = [fim[i]["text"] for i in range(len(fim))]
    backward = [again[i]["text"] for i in reversed(range(len(again)))][::-1]
    assert all((a == b).all() for a, b in zip(forward, backward))
    assert all(len(t) == 65 for t in forward)
    ids = fim_settings(build_config(DataConfig, _args(corpus)), tok)
    changed = [i for i, t in enumerate(forward) if (t != plain[i]["text"]).any()]
    with_sentinels = [i for i, t in enumerate(forward) if (t == ids.prefix).any()]
    assert changed and changed == with_sentinels
    assert any((a != b["text"]).any() for a, b in zip(forward, other_seed))
    # FIM samples keep their text: the characters, re-ordered
    i = changed[0]
    kept = [t for t in forward[i] if t not in (ids.prefix, ids.middle, ids.suffix, ids.pad)]
    assert set(tok.detokenize(kept)) <= set(tok.detokenize(plain[i]["text"]))


def test_training_reads_fim_samples(corpus):
    base = (" ".join(corpus) + " --num-layers 1 --hidden-size 16 --num-attention-heads 2 "
            "--seq-length 64 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 "
            "--eval-iters 0 --lr 1e-3 --hidden-dropout 0 --attention-dropout 0 --seed 3 "
            "--split 1,0,0")
    plain, fim, spm = run_workers(train_runs, 1, [
        base, base + " --fim-data --fim-rate 1.0", base + " --fim-data --fim-rate 1.0 "
        "--fim-spm-rate 1.0"])[0]
    assert max_rel_diff(fim, plain) > 1e-4 and max_rel_diff(spm, fim) > 1e-4


def test_refused_inputs(corpus, tmp_path):
    tiny = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 64 "
            "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --lr 1e-3 ")
    mock = tiny + "--mock-data --vocab-size 100 --tokenizer-type NullTokenizer"
    assert_refused(mock + " --fim-data", "--fim-data transforms the text")
    assert_refused(mock + " --fim-no-prefix x", "--fim-no-prefix only apply with --fim-data")
    data = tiny + " ".join(corpus)
    assert_refused(data + " --fim-data --fim-rate 0", "--fim-rate (0.0) must be in (0, 1]")
    assert_refused(data + " --fim-data --fim-split-sample |",
                   "--fim-split-sample needs --fim-fragment-rate")
    args = _args(corpus, "--fim-middle-token <mid> --fim-pad-token <nothing>")
    tok = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                          merge_file=args.merge_file)
    with pytest.raises(ValueError, match="the tokenizer has no token --fim-middle-token '<mid>', "
                                         "--fim-pad-token '<nothing>'"):
        fim_settings(build_config(DataConfig, args), tok)

