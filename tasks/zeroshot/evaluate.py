"""Run the zero-shot tasks' samples through a loaded model under any TP / CP / PP / DP layout.

The samples (every rank builds the same list) are split over the data-parallel ranks in
contiguous shares, padded with empty samples so every rank runs the same number of
microbatches, each padded to one length (tokens after the real ones carry no loss: causal
attention keeps them out of every real token's view) and partitioned for CP by the training
rule (:func:`megatron_cp.data.microbatch.prepare_microbatch`). The microbatches go through
the training schedules with ``forward_only`` (1F1B / interleaved under PP), in groups.

WIKITEXT103 sums the per-token losses of the scored labels; LAMBADA takes the argmax of the
vocab-parallel logits at every target position (teacher forcing: when every target token is
the argmax given the true tokens before it, greedy decoding produces exactly the target).
"""
import math

import torch
import torch.distributed as dist

from megatron_cp.data.microbatch import prepare_microbatch, split_multiple
from megatron_cp.inference.logits import vocab_parallel_argmax
from megatron_cp.pipeline_parallel import get_forward_backward_func, pipeline_tensor_shape
from megatron_cp.startup import forward_step as loss_forward_step
from tasks.zeroshot.datasets import (lambada_sample, lambada_tokens, lm_windows, read_lambada,
                                     window_sample, wikitext_tokens)

MICROBATCHES_PER_GROUP = 64  # microbatches per schedule call: bounds the memory of one call


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


def sample_length(model, samples):
    """The common padded length: the longest sample, rounded up to what CP (2 x CP chunks) and
    sequence parallelism (TP) split evenly."""
    st, config = model.state, model.config
    granularity = split_multiple(st.size("cp")) * (st.size("tp") if config.sequence_parallel else 1)
    return _round_up(max(len(s["tokens"]) for s in samples), granularity)


def _tensor_batch(samples, length, device):
    """One microbatch dict of [b, length] tensors from sample dicts (None: an empty sample)."""
    rows = {key: [] for key in ("tokens", "labels", "loss_mask")}
    for sample in samples:
        sample = sample or {"tokens": [], "labels": [], "loss_mask": []}
        pad = length - len(sample["tokens"])
        rows["tokens"].append(list(sample["tokens"]) + [0] * pad)
        rows["labels"].append(list(sample["labels"]) + [0] * pad)
        rows["loss_mask"].append(list(sample["loss_mask"]) + [0.0] * pad)
    batch = {"tokens": torch.tensor(rows["tokens"], dtype=torch.long, device=device),
             "labels": torch.tensor(rows["labels"], dtype=torch.long, device=device),
             "loss_mask": torch.tensor(rows["loss_mask"], dtype=torch.float32, device=device)}
    batch["position_ids"] = torch.arange(length, device=device).expand(len(samples), length)
    return batch


def local_share(model, num_samples):
    """This DP rank's sample indices, as microbatches (lists of indices, None for padding);
    every DP rank gets the same number of microbatches (a multiple of PP with virtual stages)."""
    st, mb = model.state, model.run.training.micro_batch_size
    per_rank = -(-num_samples // st.size("dp"))
    first = st.rank("dp") * per_rank
    indices = [i if i < num_samples else None for i in range(first, first + per_rank)]
    num_micro = -(-per_rank // mb)
    if (st.virtual_pipeline_model_parallel_size or 1) > 1:
        num_micro = _round_up(num_micro, st.size("pp"))
    indices += [None] * (num_micro * mb - len(indices))
    return [indices[k * mb:(k + 1) * mb] for k in range(num_micro)]


def run_microbatches(model, samples, forward_step_func, loss_func):
    """Every local microbatch of ``samples`` through the model, forward only. Yields, per
    group, the (indices, prepared microbatch) pairs and the schedule's per-microbatch
    outputs (``loss_func``'s second value; empty except on the last pipeline stage)."""
    st, config = model.state, model.config
    length = sample_length(model, samples)
    shape = None
    if st.size("pp") > 1:
        shape = pipeline_tensor_shape(length, model.run.training.micro_batch_size,
                                      config.hidden_size, st.size("cp"), st.size("tp"),
                                      config.sequence_parallel)
    schedule = get_forward_backward_func(st, dtype=config.params_dtype)
    micro = local_share(model, len(samples))
    group = _round_up(MICROBATCHES_PER_GROUP, st.size("pp"))
    for begin in range(0, len(micro), group):
        part = micro[begin:begin + group]
        prepared = [prepare_microbatch(
            _tensor_batch([samples[i] if i is not None else None for i in indices], length,
                          model.device), st.rank("cp"), st.size("cp"), length)
            for indices in part]
        with torch.no_grad():
            outputs = schedule(forward_step_func, loss_func, prepared, model.model_chunks, st,
                               forward_only=True, tensor_shape=shape)
        yield list(zip(part, prepared)), outputs


def _sum_over_replicas(model, value):
    """``value`` summed over DP and CP, and taken from the last pipeline stage."""
    st = model.state
    total = torch.tensor([value], dtype=torch.float64, device=model.device)
    dist.all_reduce(total, group=st.group("dp_cp"))
    if st.size("pp") > 1:  # the other stages hold 0
        dist.all_reduce(total, group=st.group("pp"))
    return total.item()


def _exp(value):
    return math.exp(value) if value < 700 else float("inf")


def evaluate_wikitext(model, path, stride=None):
    """Perplexity of the text file ``path``: a dict with the total loss (nats), the token and
    word counts, the average loss, the token-level and the word-level ("adjusted") perplexity.

    As in Megatron-LM, ``N`` tokens give ``N - 1`` scored predictions and ``W`` words
    ``W - 1``: ppl = exp(loss / (N - 1)), adjusted ppl = exp(loss / (W - 1)), i.e. the average
    loss scaled by the token ratio (N - 1) / (W - 1)."""
    seq_length = model.run.data.seq_length
    tokens, num_words = wikitext_tokens(path, model.tokenizer)
    windows = lm_windows(len(tokens), seq_length, stride or seq_length)
    samples = [window_sample(tokens, *window, seq_length) for window in windows]

    def loss_func(output, batch):  # output: per-token loss [b, s/cp]
        loss_sum = (output.double() * batch["loss_mask"].double()).sum()
        return loss_sum, loss_sum

    local = 0.0
    for _, outputs in run_microbatches(model, samples, loss_forward_step, loss_func):
        local += float(sum(o.item() for o in outputs))
    total_loss = _sum_over_replicas(model, local)
    num_scored, num_word_targets = len(tokens) - 1, max(num_words - 1, 1)
    avg_loss = total_loss / num_scored
    return {"task": "WIKITEXT103", "total_loss": total_loss, "num_tokenized_tokens": len(tokens),
            "num_original_tokens": num_words, "num_windows": len(windows), "avg_loss": avg_loss,
            "ppl": _exp(avg_loss), "adjusted_ppl": _exp(total_loss / num_word_targets),
            "token_ratio": num_scored / num_word_targets}


def _logits_forward_step(model, batch):
    """Vocab-parallel logits [s/cp, b, v/tp] of one microbatch (hidden states before the last
    stage)."""
    return model(batch["tokens"], batch["position_ids"], token_index=batch.get("token_index"))


def _full_predictions(model, batch, predictions):
    """``predictions`` [b, s/cp] of this CP rank placed at their token positions: [b, s], summed
    over the CP group (each position is predicted on one CP rank)."""
    index = batch.get("token_index")
    if index is None:
        return predictions
    length = index.shape[1] * model.state.size("cp")
    full = torch.zeros(index.shape[0], length, dtype=predictions.dtype, device=predictions.device)
    full.scatter_(1, index, predictions)
    dist.all_reduce(full, group=model.state.group("cp"))
    return full


def evaluate_lambada(model, path, strict=False):
    """Cloze accuracy on the LAMBADA-format file ``path``: a dict with the number correct, the
    number of passages, the accuracy, and per passage the target ids, the predicted ids (the
    argmax at each target position) and whether all of them match."""
    st, tok, seq_length = model.state, model.tokenizer, model.run.data.seq_length
    pairs = [lambada_tokens(p, tok, strict) for p in read_lambada(path)]
    samples = [lambada_sample(context, target, seq_length) for context, target in pairs]
    tp_group = st.group("tp")

    def loss_func(output, batch):  # output: logits [s/cp, b, v/tp]
        predictions = vocab_parallel_argmax(output, tp_group).t()  # [b, s/cp]
        return predictions, predictions

    records = []
    for pairs_done, outputs in run_microbatches(model, samples, _logits_forward_step, loss_func):
        for (indices, batch), predictions in zip(pairs_done, outputs):
            full = _full_predictions(model, batch, predictions)  # [b, s]
            if st.rank("tp") != 0 or st.rank("cp") != 0:
                continue
            for row, i in enumerate(indices):
                if i is None:
                    continue
                n = len(pairs[i][1])
                real = len(samples[i]["labels"])
                records.append((i, full[row, real - n:real].tolist()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    predicted = dict(item for part in gathered for item in part)
    targets = [target for _, target in pairs]
    predictions = [predicted[i] for i in range(len(samples))]
    correct = [p == t for p, t in zip(predictions, targets)]
    return {"task": "LAMBADA", "num_correct": sum(correct), "num_examples": len(correct),
            "accuracy": sum(correct) / len(correct), "strict": strict, "targets": targets,
            "predictions": predictions, "correct": correct}
