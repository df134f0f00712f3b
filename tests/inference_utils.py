"""A small trained checkpoint for the evaluation and generation tests, and its Hugging Face twin.

:func:`trained_checkpoint` builds, from Python's bundled documentation: a sentencepiece
tokenizer, the ``.bin/.idx`` dataset, a tiny Llama-style GPT (4 layers, RMSNorm, SwiGLU, rotary,
GQA, no biases, tied embeddings) trained a few dozen iterations by the real trainer and saved as
torch_dist (which loads into any layout), the same checkpoint exported to a Hugging Face
Llama folder, and held-out text (a text file and a LAMBADA-format jsonl).
"""
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

from dist_harness import run_workers
from training_utils import train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NUM_TRAIN_DOCS = 40
LLAMA_ARGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
              "--group-query-attention --num-query-groups 2 --normalization RMSNorm --swiglu "
              "--disable-bias-linear --position-embedding-type rope --hidden-dropout 0 "
              "--attention-dropout 0 --make-vocab-size-divisible-by 64 --seed 5")
TRAIN_ARGS = ("--micro-batch-size 4 --global-batch-size 8 --lr 5e-3 --min-lr 5e-4 "
              "--lr-warmup-iters 3 --lr-decay-style cosine --log-interval 1000 --eval-iters 0 "
              "--clip-grad 1.0 --split 100,0,0 --ckpt-format torch_dist")


@dataclass
class Checkpoint:
    """Paths of the trained checkpoint and what goes with it."""
    load: str  # --load (torch_dist)
    hf: str  # the exported LlamaForCausalLM folder
    tokenizer: str  # the sentencepiece model
    text: str  # held-out plain text (WIKITEXT103)
    lambada: str  # held-out LAMBADA-format jsonl


def _topics():
    from pydoc_data.topics import topics
    return [topics[key] for key in sorted(topics)]


def _passages(texts, num_passages):
    """LAMBADA-like passages from ``texts``: 16 words each (a few more than 64 tokens), ending
    on a word."""
    passages = []
    for text in texts:
        words = text.split()
        for start in range(0, len(words) - 40, 60):
            piece = " ".join(words[start:start + 16]).rstrip(".,:;)")
            if piece.split()[-1].isalpha():
                passages.append(piece)
            if len(passages) == num_passages:
                return passages
    return passages


def _of_the_passages(texts, num_passages):
    """Passages ending in "of the": an easy last word, which even this model gets right."""
    passages = []
    for text in texts:
        words = text.split()
        for i in range(15, len(words)):
            if words[i - 1] == "of" and words[i] == "the" and len(passages) < num_passages:
                passages.append(" ".join(words[i - 15:i + 1]))
    return passages


def trained_checkpoint(tmp, train_iters=80):
    """Build everything under ``tmp`` (a pathlib.Path) and return a :class:`Checkpoint`."""
    from tools import checkpoint_convert as convert
    texts = _topics()
    corpus = tmp / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for text in texts[:NUM_TRAIN_DOCS]:
            f.write(json.dumps({"text": text[:6000]}) + "\n")
    tools = os.path.join(ROOT, "tools")
    subprocess.run([sys.executable, os.path.join(tools, "train_tokenizer.py"), "--input",
                    str(corpus), "--model-prefix", str(tmp / "spm"), "--vocab-size", "400"],
                   check=True, capture_output=True, timeout=300)
    spm = str(tmp / "spm.model")
    subprocess.run([sys.executable, os.path.join(tools, "preprocess_data.py"), "--input",
                    str(corpus), "--json-keys", "text", "--append-eod", "--tokenizer-type",
                    "SentencePieceTokenizer", "--tokenizer-model", spm, "--output-prefix",
                    str(tmp / "pydoc"), "--workers", "1"], check=True, capture_output=True,
                   timeout=300)
    load = str(tmp / "ck")
    run_workers(train_losses, 1, f"{LLAMA_ARGS} {TRAIN_ARGS} --train-iters {train_iters} "
                                 f"--data-path {tmp / 'pydoc_text_document'} --tokenizer-type "
                                 f"SentencePieceTokenizer --tokenizer-model {spm} --save {load} "
                                 f"--data-cache-path {tmp / 'cache'}")
    hf = str(tmp / "hf")
    convert.main(["--load-dir", load, "--to-hf", hf])
    heldout = texts[NUM_TRAIN_DOCS:NUM_TRAIN_DOCS + 3]
    text = tmp / "heldout.txt"
    text.write_text("\n".join(t[:1500] for t in heldout), encoding="utf-8")
    lambada = tmp / "lambada.jsonl"
    with open(lambada, "w", encoding="utf-8") as f:  # seen passages (some right), new ones
        for passage in (_passages(texts[:6], 4) + _passages(texts[NUM_TRAIN_DOCS:], 4)
                        + _of_the_passages(texts[NUM_TRAIN_DOCS:], 4)):
            f.write(json.dumps({"text": passage}) + "\n")
    return Checkpoint(load, hf, spm, str(text), str(lambada))


def hf_model(path):
    """The exported LlamaForCausalLM in eval mode (fp32)."""
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(path, torch_dtype="float32").eval()


def free_port():
    """A TCP port nobody listens on now (MASTER_PORT of a one-process command-line run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def imported_checkpoint(tmp, make_hf):
    """(transformers model made by ``make_hf(folder)``, its folder, our torch_dist checkpoint
    of it written by tools/checkpoint_convert.py --from-hf) under ``tmp``."""
    from tools import checkpoint_convert
    hf = make_hf(tmp / "hf")
    checkpoint_convert.main(["--from-hf", str(tmp / "hf"), "--save-dir", str(tmp / "ck"),
                             "--target-ckpt-format", "torch_dist"])
    return hf, tmp / "hf", str(tmp / "ck")
