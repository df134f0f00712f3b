"""Dynamic against static context parallelism on a variable-length stream (issue 38).

The stream. The document lengths of the main job's corpus (data_work/pydoc_text_document.idx;
examples/prepare_pydoc_data.sh builds it offline when absent, and only if that fails a stated
lognormal stand-in is used) repeated as often as the steps need, plus a long tail: a fraction
``--tail-fraction`` of the documents drawn from a lognormal (median ``--tail-median``, sigma
``--tail-sigma``, numpy seed ``--tail-seed``) capped at seq_length. GPTDataset's own index
(megatron_cp/data/gpt_dataset.py: documents shuffled, cut at every seq_length tokens, samples
shuffled) packs them; a document piece is what one sample holds of a document.

Per global batch, the same DP x CP ranks (TP 1) and the same tokens under two layouts:

- static: DP rank r runs the contiguous share r of the batch (DataParallelBatchSampler's),
  each sample over its CP group by the zigzag, every document padded to a multiple of 2 x CP;
- dynamic: ``dynamic_schedule.schedule(the batch's pieces, pool = DP x CP, max_per_rank =
  seq_length / CP, cost, samples, static_size=CP)``, ``cost`` being the modelled seconds of a
  bin's slowest rank below (the runtime balances by FLOPs; the benchmark by these seconds, so
  communication counts), the static plan kept where it models faster (rule 5).

The headline layout is long-context pretraining as Llama 3 ran it: 128k-token samples of an
8B model with static CP 16 (8k tokens a rank, the ring across two 8-GPU nodes) x DP 4 on 64
H100s: static CP must be sized for the longest document a sample can hold, and every short
document then pays it. Shorter samples at CP 8 within a node are reported beside (no goal):
there the static layout is already near balanced and dynamic CP gains little.

Counted exactly per rank (no averages): matmul FLOPs (6 x the weights a token passes through,
output layer included, x the padded tokens it holds), attention FLOPs (12 x heads x head dim
x layers per causal pair, the pairs of the real query positions in the zigzag chunks the rank
holds), CP bytes sent. Ring (p2p, context_parallel/ring.py): per layer a rank's K and V (bf16)
make k - 1 hops forward and k - 1 in backward, and the fp32 dK/dV accumulators k hops (the last
brings them home). Ulysses (a2a): per layer q, k, v and the output forward, their gradients
backward, (k - 1)/k of each sent. The modelled time of a rank's work is the planner's
(megatron_cp/planning/step_time.py): matmul FLOPs / ``matmul_flops`` + attention FLOPs /
``attention_flops`` + bytes / the link (NVLink within 8 GPUs, InfiniBand across), H100 rates
of GPU_DEFAULTS, communication not overlapped. A static step is its slowest DP rank's sum over
microbatches of each microbatch's slowest CP rank; a dynamic step is the schedule's last
finish (every rank runs its bins in order, a bin starts when all its ranks are free). The
gradient reduction over DP x CP is the same in both (same ranks, same parameters): left out,
its modelled seconds printed beside.

Goals: on the long-tailed stream static / dynamic modelled time >= 1.3 (summed over the
steps); when every sample is one document of seq_length tokens (each needs the whole CP
group), dynamic / static <= 1.03. The measured ratio of CPU processes over gloo sits beside
the modelled one: ``measure_cpu`` trains a small GPT on the same stream scaled to
``--cpu-seq-length`` tokens, static CP ``--cpu-cp`` against dynamic CP on ``--cpu-world``
processes (tools/fork_launch.py), median step times; a 2-core machine makes it noisy.

Run: PYTHONPATH=. python benchmarks/varlen.py [--output benchmarks/results/varlen.json]
(the arithmetic takes seconds, the CPU runs about a minute; the JSON goes to
runs/benchmarks/varlen.json by default). Other layouts at the same tokens per step (``--configs``) and tail fractions
(``--sweep``) are reported beside, without a goal.
"""
import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from bench_common import ROOT, add_output_argument, verdict, write_json
from megatron_cp.config.dynamic_cp import padded
from megatron_cp.context_parallel.dynamic_schedule import FlopCost, schedule
from megatron_cp.data.gpt_dataset import GPTDataset
from megatron_cp.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder,
                                              data_file_path, dataset_exists, index_file_path)
from megatron_cp.planning.step_time import GPU_DEFAULTS, DeviceRates

GOALS = {"long_tail_speedup": 1.3, "full_group_slowdown": 1.03}
CORPUS = os.path.join(ROOT, "data_work", "pydoc_text_document")
BF16, FP32 = 2, 4
# Only if the corpus cannot be built: 79 documents (the corpus's count), lognormal lengths
# with its median (~500 tokens) and a spread that reaches its longest (~19k)
STAND_IN = {"documents": 79, "median": 500, "sigma": 1.5, "seed": 0}


@dataclass(frozen=True)
class Model:
    """The shapes the counts need (Llama-3-8B by default: gated MLP, GQA)."""
    hidden: int
    ffn_hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def flops(self):
        """FlopCost with the output layer's 6 h V per token added to the layers'."""
        base = FlopCost.for_model(self.hidden, self.ffn_hidden, self.layers, self.heads,
                                  self.kv_heads, self.head_dim, gated_mlp=True)
        return FlopCost(base.per_token + 6.0 * self.hidden * self.vocab, base.per_pair)


@dataclass
class Work:
    """One rank's counts, summed over what it runs."""
    matmul_flops: int = 0
    attention_flops: int = 0
    cp_bytes: int = 0
    tokens: int = 0
    pairs: int = 0
    seconds: float = 0.0

    def add(self, other):
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


def zigzag_pairs(length, k, rank):
    """Causal pairs (query, key <= query, both in the document) whose query CP rank ``rank``
    of ``k`` holds of a document of ``length`` real tokens: chunks rank and 2k-1-rank of the
    document padded to 2k chunks (pad queries attend to nothing real and are not counted)."""
    if k == 1:
        return length * (length + 1) // 2
    chunk = padded(length, k) // (2 * k)
    pairs = 0
    for j in (rank, 2 * k - 1 - rank):
        lo, hi = j * chunk, min((j + 1) * chunk, length)
        if hi > lo:  # sum of q + 1 for q in [lo, hi)
            pairs += (hi * (hi + 1) - lo * (lo + 1)) // 2
    return pairs


def zigzag_pairs_match_partition(lengths=(1, 7, 100, 1000, 4097), sizes=(1, 2, 4, 8)):
    """zigzag_pairs against the positions megatron_cp's own partition gives each rank."""
    from megatron_cp.context_parallel.partition import zigzag_indices
    for n in lengths:
        for k in sizes:
            for r in range(k):
                held = zigzag_indices(r, k, padded(n, k))
                if zigzag_pairs(n, k, r) != int((held + 1)[held < n].sum()):
                    return False
    return True


class Counter:
    """Exact per-rank work of a bin of documents on ``k`` ranks and its modelled seconds;
    an instance is the ``cost`` callable ``schedule`` takes (the bin's slowest rank)."""

    def __init__(self, model, rates, comm_type):
        self.model, self.rates, self.comm_type = model, rates, comm_type
        self.flops = model.flops()
        # integers (the FLOPs per token and pair are whole numbers): sums over ranks exact
        self.per_token, self.per_pair = int(self.flops.per_token), int(self.flops.per_pair)

    def cp_bytes(self, tokens, k):
        """Bytes one rank holding ``tokens`` sends per microbatch (forward + backward)."""
        m = self.model
        if k == 1:
            return 0
        if self.comm_type == "p2p":
            kv = 2 * tokens * m.kv_heads * m.head_dim  # K and V elements
            return m.layers * ((k - 1) * kv * BF16 * 2 + k * kv * FP32)
        heads = -(-m.heads // k) * k  # plan_heads: dummy heads when k does not divide them
        kv_heads = m.kv_heads * (k // math.gcd(m.kv_heads, k))  # KV heads repeated
        # per direction: q, k, v and out (forward), dout, dq, dk, dv (backward)
        return m.layers * 2 * (k - 1) * tokens * (2 * heads + 2 * kv_heads) * m.head_dim \
            * BF16 // k

    def rank_work(self, lengths, k, rank):
        tokens = sum(padded(n, k) for n in lengths) // k
        pairs = sum(zigzag_pairs(n, k, rank) for n in lengths)
        work = Work(self.per_token * tokens, self.per_pair * pairs,
                    self.cp_bytes(tokens, k), tokens, pairs)
        work.seconds = work.matmul_flops / self.rates.matmul_flops \
            + work.attention_flops / self.rates.attention_flops \
            + work.cp_bytes / link_bytes_per_s(self.rates, k)
        return work

    def __call__(self, padded_lengths, lengths, k):
        return max(self.rank_work(lengths, k, r).seconds for r in range(k))


# ----- the stream ----------------------------------------------------------------------
def corpus_lengths(prefix, notes):
    """Document lengths of the main job's corpus, built first when absent."""
    if not dataset_exists(prefix) and prefix == CORPUS:
        script = os.path.join(ROOT, "examples", "prepare_pydoc_data.sh")
        done = subprocess.run(["bash", script, os.path.dirname(prefix)], cwd=ROOT,
                              capture_output=True, text=True)
        notes.append(f"built {prefix} with examples/prepare_pydoc_data.sh (exit "
                     f"{done.returncode})")
    if dataset_exists(prefix):
        return (np.asarray(IndexedDataset(prefix).sequence_lengths, dtype=np.int64),
                os.path.relpath(prefix, ROOT))
    rng = np.random.default_rng(STAND_IN["seed"])
    notes.append(f"corpus {prefix} unavailable: stand-in lognormal lengths {STAND_IN}")
    lengths = rng.lognormal(math.log(STAND_IN["median"]), STAND_IN["sigma"],
                            STAND_IN["documents"])
    return np.maximum(1, lengths.astype(np.int64)), "stand-in"


class _Lengths:
    """What GPTDataset reads of an indexed dataset to build its index: the lengths."""

    def __init__(self, lengths):
        self.sequence_lengths = lengths

    def __len__(self):
        return len(self.sequence_lengths)


def stream(corpus, a, tail_fraction):
    """The global batches: per batch ``a.global_batch`` samples, each its document pieces."""
    samples = a.global_batch * a.steps
    copies = max(1, -(-(samples * a.seq_length + 1) // int(corpus.sum())))
    base = np.tile(corpus, copies)
    num_tail = round(tail_fraction / (1 - tail_fraction) * len(base)) if tail_fraction else 0
    rng = np.random.default_rng(a.tail_seed)
    tail = rng.lognormal(math.log(a.tail_median), a.tail_sigma, num_tail)
    tail = np.clip(tail.astype(np.int64), 1, a.seq_length)
    lengths = np.concatenate((base, tail))
    data = GPTDataset(_Lengths(lengths), (0, len(lengths)), samples, a.seq_length, a.data_seed,
                      path_prefix="varlen-stream")
    sizes = lengths[data.document_index]  # the shuffled documents' lengths
    batch, batches = [], []
    for idx in range(samples):
        i = int(data.shuffle_index[idx])
        (pos_beg, off_beg), (pos_end, off_end) = data.sample_index[i], data.sample_index[i + 1]
        if pos_beg == pos_end:
            pieces = [int(off_end - off_beg)]
        else:  # input tokens [i s, (i + 1) s): the label-only last token is not held
            pieces = [int(sizes[pos_beg] - off_beg)] + [int(n) for n in sizes[pos_beg + 1:pos_end]]
            pieces.append(int(off_end))
        batch.append([n for n in pieces if n > 0])
        if len(batch) == a.global_batch:
            batches.append(batch)
            batch = []
    info = {"corpus_documents_per_copy": len(corpus), "corpus_copies": copies,
            "tail_documents": num_tail,
            "tail_token_share": float(tail.sum() / lengths.sum()) if num_tail else 0.0,
            "document_length_percentiles": dict(zip(
                ("p50", "p90", "p99", "max"),
                (int(x) for x in np.percentile(lengths, [50, 90, 99, 100]))))}
    return batches, info


# ----- the two layouts -----------------------------------------------------------------
def static_step(batch, a, counter):
    """Per-rank work of static CP (rank (dp, cp) -> Work) and the step's modelled seconds."""
    ranks = [Work() for _ in range(a.dp * a.cp)]
    dp_seconds = [0.0] * a.dp
    share = len(batch) // a.dp
    for j, sample in enumerate(batch):
        dp = j // share  # DataParallelBatchSampler: contiguous shares of the batch
        works = [counter.rank_work(sample, a.cp, r) for r in range(a.cp)]
        dp_seconds[dp] += max(w.seconds for w in works)
        for r, w in enumerate(works):
            ranks[dp * a.cp + r].add(w)
    return ranks, max(dp_seconds)


def dynamic_step(batch, a, counter):
    """Per-rank work of dynamic CP (pool slot -> Work), the step's seconds and its bins."""
    lengths = [n for sample in batch for n in sample]
    samples, start = [], 0
    for sample in batch:  # each sample's document numbers: the static plan (rule 5)
        samples.append(list(range(start, start + len(sample))))
        start += len(sample)
    plan = schedule(lengths, a.dp * a.cp, a.seq_length // a.cp, counter, samples=samples,
                    static_size=a.cp)
    ranks = [Work() for _ in range(plan.pool)]
    for b in plan.bins:
        for slot in b.ranks:
            ranks[slot].add(counter.rank_work(b.lengths, b.size, slot - b.first))
    sizes = {}
    for b in plan.bins:
        sizes[b.size] = sizes.get(b.size, 0) + 1
    return ranks, plan.step_time, {"bins": len(plan.bins), "bins_per_group_size": sizes,
                                   "static_plan_kept": plan.static}


def megatron_estimate_step(batch, a, counter):
    """The dynamic step when the schedule places bins by Megatron-LM's workload estimate
    (``L^2 / k`` per document, its BalancedCPScheduler's) instead of the modelled seconds,
    then timed with the exact counts (every rank runs its bins in the schedule's order)."""
    lengths = [n for sample in batch for n in sample]
    plan = schedule(lengths, a.dp * a.cp, a.seq_length // a.cp,
                    lambda _padded, docs, k: sum(n * n for n in docs) / k)
    ready = [0.0] * plan.pool
    for b in plan.bins:  # in run order
        finish = max(ready[r] for r in b.ranks) + counter(None, b.lengths, b.size)
        for r in b.ranks:
            ready[r] = finish
    return max(ready)


def megatron_group_sizes_differ(batch, a):
    """Documents whose group here differs from Megatron-LM's 2^ceil(log2(L / M))."""
    m = a.seq_length // a.cp
    lengths = [n for sample in batch for n in sample]
    differ = 0
    for n in lengths:
        k = 1
        while padded(n, k) > k * m:
            k *= 2
        differ += k != max(1, 2 ** math.ceil(math.log2(n / m)))
    return differ, len(lengths)


def _summary(ranks, step_seconds):
    """The largest rank's counts, the totals over the ranks, the mean rank's modelled
    seconds and the step's."""
    out = {name: max(getattr(w, name) for w in ranks)
           for name in ("matmul_flops", "attention_flops", "cp_bytes", "seconds")}
    return out | {"mean_rank_seconds": sum(w.seconds for w in ranks) / len(ranks),
                  "total_matmul_flops": sum(w.matmul_flops for w in ranks),
                  "total_attention_flops": sum(w.attention_flops for w in ranks),
                  "padded_tokens": sum(w.tokens for w in ranks), "step_seconds": step_seconds}


def run_scenario(batches, a, counter):
    """Per step: both layouts' largest-rank counts and modelled seconds; ``checks_passed``:
    the causal pairs over all ranks equal those of the documents in both layouts, attention
    FLOPs are per-pair FLOPs x pairs, every token is held (padding only adds)."""
    steps, checks = [], []
    for batch in batches:
        static, static_s = static_step(batch, a, counter)
        dynamic, dynamic_s, bins = dynamic_step(batch, a, counter)
        lengths = [n for sample in batch for n in sample]
        pairs = sum(n * (n + 1) // 2 for n in lengths)
        for ranks in (static, dynamic):
            checks.append(sum(w.pairs for w in ranks) == pairs)
            checks.append(sum(w.attention_flops for w in ranks) == counter.per_pair * pairs)
            checks.append(sum(w.matmul_flops for w in ranks)
                          == counter.per_token * sum(w.tokens for w in ranks))
            extra = sum(w.tokens for w in ranks) - sum(lengths)  # padding: < 2k per document
            checks.append(0 <= extra < len(lengths) * 2 * a.dp * a.cp)
        checks.append(sum(w.tokens for w in static)
                      == sum(padded(n, a.cp) for n in lengths))
        checks.append(sum(lengths) == a.global_batch * a.seq_length)
        differ, docs = megatron_group_sizes_differ(batch, a)
        estimate_s = megatron_estimate_step(batch, a, counter)
        steps.append({"static": _summary(static, static_s),
                      "dynamic": _summary(dynamic, dynamic_s) | bins,
                      "documents": docs, "tokens": sum(lengths), "causal_pairs": pairs,
                      "megatron_group_size_differs": differ,
                      "dynamic_by_megatron_estimate_seconds": estimate_s,
                      "static_over_dynamic": static_s / dynamic_s})
    static_total = sum(s["static"]["step_seconds"] for s in steps)
    dynamic_total = sum(s["dynamic"]["step_seconds"] for s in steps)
    estimate_total = sum(s["dynamic_by_megatron_estimate_seconds"] for s in steps)
    ratios = [s["static_over_dynamic"] for s in steps]
    return {"steps": steps, "static_seconds": static_total, "dynamic_seconds": dynamic_total,
            "static_over_dynamic": static_total / dynamic_total,
            "static_over_dynamic_per_step": {"min": min(ratios), "max": max(ratios)},
            "static_over_dynamic_by_megatron_estimate": static_total / estimate_total,
            "checks_passed": all(checks)}


def cpu_stream(corpus, a, notes, directory):
    """The CPU run's corpus (an indexed dataset in ``directory``): the same
    stream's documents (corpus lengths plus the tail), every length scaled by
    ``cpu_seq_length / seq_length`` (at least 2), random token ids (NullTokenizer,
    vocabulary 256, numpy seed ``tail_seed``) ending with EOD, so --reset-attention-mask
    finds each document."""
    scale = a.cpu_seq_length / a.seq_length
    copies = max(1, -(-(a.cpu_global_batch * (a.cpu_iters + 1) * a.seq_length)
                      // int(corpus.sum())))
    base = np.tile(corpus, copies)
    num_tail = round(a.tail_fraction / (1 - a.tail_fraction) * len(base)) if a.tail_fraction else 0
    rng = np.random.default_rng(a.tail_seed)
    tail = np.clip(rng.lognormal(math.log(a.tail_median), a.tail_sigma, num_tail).astype(np.int64),
                   1, a.seq_length)
    lengths = np.maximum(2, np.round(np.concatenate((base, tail)) * scale).astype(np.int64))
    prefix = os.path.join(directory, "stream")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    for n in lengths:
        builder.add_document(np.append(rng.integers(0, 256, n - 1), 256).astype(np.uint16))
    builder.finalize(index_file_path(prefix))
    notes.append(f"CPU stream: {len(lengths)} documents, lengths scaled by {scale:g}")
    return prefix


def _cpu_step_ms(a, prefix, extra):
    """Median step time (ms, the log's, after 2 warm-up steps) of ``a.cpu_world`` CPU
    processes over gloo (tools/fork_launch.py) training a small GPT on ``prefix``."""
    flags = (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length "
             f"{a.cpu_seq_length} --max-position-embeddings {a.cpu_seq_length} "
             f"--micro-batch-size 1 --global-batch-size {a.cpu_global_batch} --train-iters "
             f"{a.cpu_iters} --lr 1e-4 --data-path {prefix} --split 100,0,0 --tokenizer-type "
             f"NullTokenizer --vocab-size 256 "
             f"--calculate-per-token-loss --log-interval 1 --eval-iters 0 --seed 1 "
             f"--position-embedding-type rope --context-parallel-size {a.cpu_cp} {extra}")
    command = [sys.executable, os.path.join(ROOT, "tools", "fork_launch.py"), "--nproc-per-node",
               str(a.cpu_world), os.path.join(ROOT, "pretrain_gpt.py")] + flags.split()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)",
                                          done.stdout + done.stderr)]
    if done.returncode != 0 or len(times) < 3:
        raise RuntimeError(f"the CPU run failed ({done.returncode}): "
                           f"{(done.stdout + done.stderr)[-2000:]}")
    return float(np.median(times[2:]))


def measure_cpu(a, corpus, notes):
    """Measured static / dynamic step time of ``a.cpu_world`` CPU processes over gloo (a noisy
    ratio): the scaled stream (:func:`cpu_stream`) through the training loop, static CP
    ``a.cpu_cp`` against dynamic CP on the same ranks at ``cpu_seq_length / cpu_cp`` tokens a
    rank, median step times (the best of ``--cpu-repeats`` alternating runs each), also with
    every sample one sequence. None with ``--cpu-iters 0``."""
    if a.cpu_iters <= 0:
        return None
    with tempfile.TemporaryDirectory(prefix="varlen_cpu_") as directory:
        prefix = cpu_stream(corpus, a, notes, directory)
        dynamic_flags = (f"--dynamic-context-parallel --max-seqlen-per-dp-cp-rank "
                         f"{a.cpu_seq_length // a.cpu_cp}")
        documents = "--reset-attention-mask --reset-position-ids"
        runs = {"static": documents, "dynamic": f"{documents} {dynamic_flags}",
                # every sample one sequence (no document masking): each needs the whole group
                "full_static": "", "full_dynamic": dynamic_flags}
        best = {name: math.inf for name in runs}
        for _ in range(a.cpu_repeats):  # alternating, the best median of each: load spikes
            for name, extra in runs.items():  # of a shared 2-core box hit one run, not all
                best[name] = min(best[name], _cpu_step_ms(a, prefix, extra))
        static, dynamic = best["static"], best["dynamic"]
        full_static, full_dynamic = best["full_static"], best["full_dynamic"]
    notes.append(f"CPU: {a.cpu_world} processes, seq {a.cpu_seq_length}, static CP {a.cpu_cp}: "
                 f"median step {static:.1f} ms static, {dynamic:.1f} ms dynamic; whole samples "
                 f"{full_static:.1f} ms static, {full_dynamic:.1f} ms dynamic")
    return {"static_ms": static, "dynamic_ms": dynamic, "static_over_dynamic": static / dynamic,
            "full_group_static_ms": full_static, "full_group_dynamic_ms": full_dynamic,
            "full_group_dynamic_over_static": full_dynamic / full_static}


def link_bytes_per_s(rates, span):
    """The link of a group of ``span`` consecutive ranks: NVLink within a node."""
    if span <= rates.gpus_per_node:
        return rates.intra_node_bytes_per_s
    return rates.inter_node_bytes_per_s


def grad_sync_seconds(model, a, rates):
    """The DP x CP gradient reduction (fp32, ring): the same for both layouts."""
    m = model
    layer = m.hidden * m.head_dim * (m.heads + 2 * m.kv_heads) + m.heads * m.head_dim * m.hidden \
        + 3 * m.hidden * m.ffn_hidden + 2 * m.hidden
    params = m.layers * layer + 2 * m.vocab * m.hidden + m.hidden
    group = a.dp * a.cp
    return 2 * (group - 1) / group * params * FP32 / link_bytes_per_s(rates, group)


def evaluate(a, corpus, counter):
    """Both scenarios at the configuration ``a``: the long-tailed stream and one document of
    seq_length tokens per sample."""
    batches, stream_info = stream(corpus, a, a.tail_fraction)
    long_tail = run_scenario(batches, a, counter)
    full_group = run_scenario([[[a.seq_length] for _ in range(a.global_batch)]], a, counter)
    return stream_info, long_tail, full_group


def _variant(a, spec):
    """``a`` at ``SEQ:DP:CP`` with the same tokens per step."""
    seq, dp, cp = (int(x) for x in spec.split(":"))
    batch = max(dp, a.global_batch * a.seq_length // seq // dp * dp)
    return argparse.Namespace(**vars(a) | {"seq_length": seq, "dp": dp, "cp": cp,
                                           "global_batch": batch})


def _config(a):
    return f"S {a.seq_length}, DP {a.dp} x CP {a.cp}, {a.global_batch} samples"


def _mean(res, layout, key):
    return sum(s[layout][key] for s in res["steps"]) / len(res["steps"])


def print_largest(name, res):
    """Mean over the steps of the largest rank's counts."""
    for layout in ("static", "dynamic"):
        print(f"  {name:<10} {layout:<7} matmul {_mean(res, layout, 'matmul_flops') / 1e15:7.3f} "
              f"PFLOP, attention {_mean(res, layout, 'attention_flops') / 1e15:7.3f} PFLOP, "
              f"CP {_mean(res, layout, 'cp_bytes') / 2**30:7.2f} GiB, busy "
              f"{_mean(res, layout, 'seconds'):6.3f} s (mean rank "
              f"{_mean(res, layout, 'mean_rank_seconds'):6.3f} s)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-length", type=int, default=131072)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--cp", type=int, default=16, help="static CP; dynamic's pool is DP x CP")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step (mbs 1)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cp-comm-type", choices=("p2p", "a2a"), default="p2p")
    p.add_argument("--model", type=int, nargs=7, metavar=("HIDDEN", "FFN", "LAYERS", "HEADS",
                                                         "KV_HEADS", "HEAD_DIM", "VOCAB"),
                   default=[4096, 14336, 32, 32, 8, 128, 128256])
    p.add_argument("--data-prefix", default=CORPUS)
    p.add_argument("--data-seed", type=int, default=1234, help="GPTDataset's shuffle seed")
    p.add_argument("--tail-fraction", type=float, default=0.1,
                   help="share of the documents drawn from the tail")
    p.add_argument("--tail-median", type=float, default=16384.0)
    p.add_argument("--tail-sigma", type=float, default=1.0)
    p.add_argument("--tail-seed", type=int, default=38)
    p.add_argument("--sweep", type=float, nargs="*", default=[0.0, 0.02, 0.05, 0.2],
                   help="other tail fractions at the goal's configuration (no goal)")
    p.add_argument("--configs", nargs="*", default=["32768:8:8", "65536:8:8", "131072:8:8",
                                                    "32768:4:16"],
                   help="other SEQ:DP:CP layouts, same tokens per step (no goal)")
    p.add_argument("--cpu-world", type=int, default=2, help="CPU processes of the measured run")
    p.add_argument("--cpu-cp", type=int, default=2, help="static CP of the measured run")
    p.add_argument("--cpu-seq-length", type=int, default=1024)
    p.add_argument("--cpu-global-batch", type=int, default=8)
    p.add_argument("--cpu-iters", type=int, default=8, help="0: no measured run")
    p.add_argument("--cpu-repeats", type=int, default=2,
                   help="runs of each CPU case, alternating; the best median counts")
    add_output_argument(p, "varlen")
    a = p.parse_args(argv)
    for spec in [f"{a.seq_length}:{a.dp}:{a.cp}"] + a.configs:
        b = _variant(a, spec)
        if b.global_batch % b.dp or b.seq_length % (2 * b.cp):
            raise ValueError(f"{spec}: the global batch ({b.global_batch}) must be a multiple of "
                             f"DP ({b.dp}) and the sequence length of 2 x CP ({2 * b.cp})")
    started, notes = time.time(), []
    model = Model(*a.model)
    rates = DeviceRates(GPU_DEFAULTS["matmul_flops"], GPU_DEFAULTS["attention_flops"],
                        GPU_DEFAULTS["intra_node_bytes_per_s"],
                        GPU_DEFAULTS["inter_node_bytes_per_s"])
    counter = Counter(model, rates, a.cp_comm_type)
    corpus, source = corpus_lengths(a.data_prefix, notes)
    stream_info, long_tail, full_group = evaluate(a, corpus, counter)
    measured = measure_cpu(a, corpus, notes)
    sweep = {str(f): run_scenario(stream(corpus, a, f)[0], a, counter)["static_over_dynamic"]
             for f in a.sweep}
    configs = {}
    for spec in a.configs:
        b = _variant(a, spec)
        _, tail_b, full_b = evaluate(b, corpus, counter)
        configs[_config(b)] = {"long_tail_static_over_dynamic": tail_b["static_over_dynamic"],
                               "full_group_dynamic_over_static":
                                   1 / full_b["static_over_dynamic"],
                               "checks_passed": tail_b["checks_passed"] and full_b["checks_passed"]}
    speedup, slowdown = long_tail["static_over_dynamic"], 1 / full_group["static_over_dynamic"]
    passed = {"long_tail_speedup": speedup >= GOALS["long_tail_speedup"],
              "full_group_slowdown": slowdown <= GOALS["full_group_slowdown"],
              "exact_counts": long_tail["checks_passed"] and full_group["checks_passed"]
              and all(c["checks_passed"] for c in configs.values())
              and zigzag_pairs_match_partition()}

    print(f"Dynamic vs static CP: TP 1, {_config(a)} per step (mbs 1), {a.steps} steps; dynamic "
          f"on the {a.dp * a.cp}-rank pool at --max-seqlen-per-dp-cp-rank "
          f"{a.seq_length // a.cp}; cp-comm-type {a.cp_comm_type}")
    print(f"model {model}; H100 rates (planner's GPU_DEFAULTS) {rates}")
    print(f"stream: {source} x {stream_info['corpus_copies']} + {stream_info['tail_documents']} "
          f"tail documents ({a.tail_fraction:g} of them; lognormal median {a.tail_median:g}, "
          f"sigma {a.tail_sigma:g}, capped at {a.seq_length}, seed {a.tail_seed}), "
          f"{stream_info['tail_token_share']:.0%} of the tokens in the tail; lengths "
          f"{stream_info['document_length_percentiles']}")
    measured_cell = "not measured (--cpu-iters 0)" if measured is None \
        else f"{measured['static_over_dynamic']:.3f} (static/dynamic)"
    full_cell = "-" if measured is None \
        else f"{measured['full_group_dynamic_over_static']:.3f} (dynamic/static)"
    print(f"{'stream':<11} {'static s/step':>13} {'dynamic s/step':>14} {'modelled':>9}  "
          f"{'measured CPU':<42} goal")
    print(f"{'long tail':<11} {long_tail['static_seconds'] / a.steps:>13.3f} "
          f"{long_tail['dynamic_seconds'] / a.steps:>14.3f} {speedup:>9.3f}  {measured_cell:<42} "
          f"static/dynamic >= {GOALS['long_tail_speedup']}: {verdict(passed['long_tail_speedup'])}")
    print(f"{'full group':<11} {full_group['static_seconds']:>13.3f} "
          f"{full_group['dynamic_seconds']:>14.3f} {slowdown:>9.3f}  {full_cell:<42} "
          f"dynamic/static <= {GOALS['full_group_slowdown']}: "
          f"{verdict(passed['full_group_slowdown'])}")
    print("largest rank per step (mean over the steps):")
    print_largest("long tail", long_tail)
    print_largest("full group", full_group)
    print(f"exact counts (each rank's causal pairs = those of the positions partition.py gives "
          f"it; over the ranks = over the documents; FLOPs and padding from them; both layouts, "
          f"every configuration): {verdict(passed['exact_counts'])}")
    print(f"left out of both: the DP x CP gradient reduction, "
          f"{grad_sync_seconds(model, a, rates):.3f} s modelled")
    differ = sum(s["megatron_group_size_differs"] for s in long_tail["steps"])
    docs = sum(s["documents"] for s in long_tail["steps"])
    print(f"Megatron-LM's group size 2^ceil(log2(L / M)) differs from the schedule's for {differ} "
          f"of {docs} documents (the schedule pads for the zigzag first)")
    per_step = long_tail["static_over_dynamic_per_step"]
    print(f"long tail static/dynamic per step: min {per_step['min']:.3f}, max "
          f"{per_step['max']:.3f}; placed by Megatron-LM's estimate L^2 / k instead of the "
          f"modelled seconds: {long_tail['static_over_dynamic_by_megatron_estimate']:.3f}")
    print("tail fractions, long tail static/dynamic: "
          + ", ".join(f"{f}: {r:.3f}" for f, r in sweep.items()))
    for name, c in configs.items():
        print(f"{name}: long tail static/dynamic {c['long_tail_static_over_dynamic']:.3f}, "
              f"full group dynamic/static {c['full_group_dynamic_over_static']:.3f}")
    for note in notes:
        print("note:", note)
    report = {"config": vars(a) | {"data_prefix": source, "tp": 1, "max_seqlen_per_dp_cp_rank": a.seq_length // a.cp,
                                   "model": asdict(model), "rates": asdict(rates),
                                   "flops_per_token": counter.per_token,
                                   "flops_per_pair": counter.per_pair, "corpus": source},
              "stream": stream_info, "long_tail": long_tail, "full_group": full_group,
              "measured_cpu_static_over_dynamic": measured, "tail_fraction_sweep": sweep,
              "other_configs": configs, "grad_sync_seconds": grad_sync_seconds(model, a, rates),
              "goals": GOALS, "passed": passed, "notes": notes,
              "elapsed_seconds": time.time() - started}
    write_json(a.output, report)
    return 0 if passed["exact_counts"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
