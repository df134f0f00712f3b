"""The GPU suite: attention kernels, context-parallel algorithms and training on one device.

Every check compares against an fp32 truth (computed on the same device for the first six
sections, on the CPU for the later ones) and prints one row of a table (check, worst
quantity, max abs error, relative error = max abs error / max |truth|, tolerance, result).

- reference: the chunked fp32 reference used for long blocks (``masked_reference``) against
  ``reference_attention`` with autograd, so the truth is proven before it judges anything.
- blocks: every block kind ring attention runs (causal diagonal, full blocks with the ring's
  query / key slices, empty, document-masked segment plans), GQA and MHA, as non-contiguous
  views (slices of [b, h, s, d] tensors, permuted [s, b, h, d] activations), fp32 / bf16 /
  fp16 (what the device supports), s from 40 up to 32k: kernel "auto" and kernel "torch"
  (the second opinion; up to s = 8k, it materialises the scores) against the fp32 masked
  reference: out, log-sum-exp, dq, dk, dv.
- local: the no-CP path (``local_attention``) with packed documents and plain causal.
- cp: ring (p2p), Ulysses (a2a: dummy heads, repeated KV heads) and the hybrid (a2a+p2p)
  replayed in one process (``megatron_cp.context_parallel.simulate``: NCCL refuses two
  ranks on one GPU) on ``prepare_microbatch``'s partition, CP 2 / 4 (/ 8), plain and packed
  documents, reassembled to full order against one-process attention: out, dq, dk, dv.
- train: a small GPT (packed documents, GQA) trained a few AdamW steps on the device against
  the same run on the CPU in fp32 (losses within 1e-4 relative), and bf16 (bf16 parameters,
  fp32 master weights) against fp32 on the device (within a few percent).
- moe (tools/gpu_check_moe.py): the grouped expert matmul in every dtype against the fp32
  per-expert loop, one MoE layer on the device against the CPU (both dispatchers, dropless and
  capacity), a small MoE GPT trained on the device against the CPU and bf16 against fp32.

The paths that landed after the first GPU run, against fp32 on the CPU (details in the
docstrings of tools/gpu_check_paths.py, gpu_check_layers.py and gpu_check_train.py):

- flash: the blocks and packed local checks in fp16 / bf16 with cuDNN bypassed, so that the
  flash kernels (dense and varlen) run on Hopper too; a row that flash ran and cuDNN did not.
- gdn: the gated delta rule (FLA's kernel where it is importable on CUDA, else PyTorch's: the
  route is in the row name) plain, packed and with a state in and out, and the Gated DeltaNet
  layer.
- mla: attention with dv != dk (the memory-efficient kernel on CUDA): blocks, the local path,
  and the multi-latent attention layer.
- dropout: hidden- and attention-dropout masks of CP ranks / SP slices equal to the CPU's
  whole-sample masks at the same global coordinates; attention with dropout.
- tiled: the tiled logits + cross entropy, the chunked MLP, and a model with both.
- tp_overlap: the overlapped TP linears at TP world size 1 (the ring's sends need 2 GPUs).
- offload: a model with activations offloaded to (pinned) host memory against none, and
  training with --cpu-offloading-num-layers.
- mtp, mup, muon, fsdp2, sinkhorn: the real trainer (pretrain_gpt.py, run as a one-rank job
  and its logged losses read) with --mtp-num-layers, --use-mup, --optimizer muon,
  --use-torch-fsdp2, sinkhorn routing, a few steps on the device against the CPU (fp32) and
  bf16 against fp32; Muon's orthogonalised update, the sinkhorn
  balancing and a sinkhorn MoE layer on the device against the CPU.
- fp8 (tools/gpu_check_fp8.py): the FP8 linear's GEMMs on torch._scaled_mm against the CPU's
  (payloads bit for bit), and --fp8-format hybrid training (tensorwise, delayed) against the
  CPU.

Time budgets: each section runs under a budget (--section-seconds; by default on CUDA the
SECTION_SECONDS below, sized so that the whole suite fits 5 minutes on one H100; none on the
CPU). A section past its budget starts no further check: each remaining one prints a
CAPPED row (not run, so not passed either), the section's wall-time line says how many, and
the summary lists them. Every section prints its wall time.

Exit status: 0 every check ran and passed; 1 a check failed (whatever was capped); 2 nothing
failed but some checks were capped (rerun those sections, e.g. --sections gdn with a larger
--section-seconds).

    PYTHONPATH=. python tools/gpu_check.py                       # the GPU suite (cuda:0), one call
    PYTHONPATH=. python tools/gpu_check.py --device cpu --quick  # the same checks, small sizes (a test)
"""
import argparse
import functools
import math
import sys
import time

import torch

from megatron_cp.distributed import device as device_mod
from megatron_cp.context_parallel import (Block, block_backward, block_forward, classify_block,
                                          local_attention, zigzag_indices)
from megatron_cp.context_parallel.reference import softmax_scale_for
from megatron_cp.context_parallel.layout import RingLayout
from megatron_cp.context_parallel.simulate import simulated_attention
from megatron_cp.data.microbatch import prepare_microbatch
from megatron_cp.model import GPTConfig, GPTModel
from gpu_check_moe import section_moe
from gpu_check_lib import (AUTOGRAD_REFERENCE_MAX_SEQ, DTYPE_NAMES, HEAD_DIM, LSE_TOLERANCE,
                           TOLERANCE, TRAIN_BF16_TOL, TRAIN_FP32_TOL, Randn, Report, Series,
                           Verdict, masked_reference, microbatch, process_group, self_reference,
                           supported_dtypes)
from gpu_check_paths import PATH_SECTIONS, path_sections

SECTIONS = ("reference", "blocks", "local", "cp", "train", "moe", *PATH_SECTIONS)
TORCH_KERNEL_MAX_SEQ = 8192  # the "torch" kernel materialises [b, nh, sq, sk] fp32 scores


def _tols(dtype):
    return TOLERANCE[dtype], LSE_TOLERANCE[dtype]


# ----------------------------------------------------------------------------- reference
def check_reference(device):
    """masked_reference (chunked to a few rows, GQA, documents) against reference_attention."""
    rand, s = Randn(1, torch.float32, device), 40
    q, dout, k, v = rand.bhsd(2, 4, s), rand.bhsd(2, 4, s), rand.bhsd(2, 2, s), rand.bhsd(2, 2, s)
    docs = microbatch(s, 2, packed=True, seed=3)["document_ids"].to(device)
    want = self_reference(q, k, v, dout, docs)
    tokens = torch.arange(s, device=device).expand(2, s)
    got = masked_reference(q, k, v, dout, tokens, tokens, docs, docs, budget=2 * 4 * s * 7)
    return {name: (g, w, 1e-5) for name, g, w in
            zip(("out", "dq", "dk", "dv"), got[:1] + got[2:], want)}


# ----------------------------------------------------------------------------- blocks
BLOCK_CASES = (  # (layout, query rank i, key rank j, nh, nkv, view) of a CP=2 ring
    ("zigzag", 1, 1, 4, 4, "sbhd"),  # causal diagonal
    ("zigzag", 1, 0, 8, 2, "bhsd"),  # full: Q x KV early half (a key slice)
    ("zigzag", 0, 1, 4, 1, "sbhd"),  # full: Q late half (a query slice) x KV
    ("contiguous", 1, 0, 4, 2, "bhsd"),  # full, classified from the metadata
    ("contiguous", 0, 1, 4, 2, "sbhd"),  # empty
    ("packed", 1, 1, 4, 2, "sbhd"),  # document-masked segments (causal + full)
    ("packed", 1, 0, 8, 2, "bhsd"),
    ("packed", 0, 1, 4, 4, "sbhd"),
)


def ring_layouts(n, b, device):
    """{name: [P=2, b, n/2] token indices and document ids (or None)} of three CP=2 layouts
    of n-token samples: zigzag, contiguous halves, and packed documents (prepare_microbatch)."""
    zigzag = torch.stack([zigzag_indices(r, 2, n) for r in range(2)])[:, None].expand(2, b, -1)
    contiguous = torch.arange(n).view(2, 1, n // 2).expand(2, b, -1)
    parts = [prepare_microbatch(microbatch(n, b, packed=True, seed=n), r, 2) for r in range(2)]
    packed = (torch.stack([p["token_index"] for p in parts]),
              torch.stack([p["document_ids"] for p in parts]))
    layouts = {"zigzag": (zigzag, None), "contiguous": (contiguous, None), "packed": packed}
    return {name: tuple(None if t is None else t.contiguous().to(device) for t in meta)
            for name, meta in layouts.items()}


def ring_blocks(tokens, docs, i, j):
    """The Blocks ring attention runs for query rank i against rank j's KV (RingLayout's
    plan; an empty block, which the ring skips, as the kind "empty" over all rows)."""
    blocks = RingLayout.from_metadata(tokens, docs).plan(i, j)
    if blocks:
        return blocks
    kind, plan = classify_block(tokens[i], tokens[j], None if docs is None else docs[i],
                                None if docs is None else docs[j])
    return [Block(slice(None), slice(None), kind, plan)]


def check_block(block, meta, shapes, dtype, kernel, seed, device):
    """One block through block_forward / block_backward against masked_reference."""
    (tq, tk, dq_ids, dk_ids), (b, nh, nkv, sq, sk, view) = meta, shapes
    rand = Randn(seed, dtype, device)
    q, k, v = rand.bhsd(b, nh, sq, view=view), rand.bhsd(b, nkv, sk, view=view), \
        rand.bhsd(b, nkv, sk, view=view)
    q, k, v = q[:, :, block.q_slice], k[:, :, block.kv_slice], v[:, :, block.kv_slice]  # views
    dout = rand.bhsd(b, nh, q.shape[2])
    scale = softmax_scale_for(q)
    out, lse = block_forward(q, k, v, scale, block.kind, block.segments, kernel)
    grads = block_backward(dout, q, k, v, out, lse, scale, block.kind, block.segments, kernel)
    want = masked_reference(q, k, v, dout, tq[:, block.q_slice], tk[:, block.kv_slice],
                            None if dq_ids is None else dq_ids[:, block.q_slice],
                            None if dk_ids is None else dk_ids[:, block.kv_slice])
    tol, lse_tol = _tols(dtype)
    return {"out": (out, want[0], tol), "lse": (lse, want[1], lse_tol),
            "dq": (grads[0], want[2], tol), "dk": (grads[1], want[3], tol),
            "dv": (grads[2], want[4], tol)}


def section_blocks(report, device, sizes, dtypes, kernels=("auto", "torch"), prefix="blocks"):
    """Every block case at every size and dtype, each of ``kernels``; rows ``prefix/...``."""
    kinds = set()
    for n in sizes:
        b = 2 if n <= AUTOGRAD_REFERENCE_MAX_SEQ else 1
        layouts = ring_layouts(n, b, device)
        for case_id, (name, i, j, nh, nkv, view) in enumerate(BLOCK_CASES):
            tokens, docs = layouts[name]
            meta = (tokens[i], tokens[j], None if docs is None else docs[i],
                    None if docs is None else docs[j])
            shapes = (b, nh, nkv, tokens.shape[2], tokens.shape[2], view)
            for block in ring_blocks(tokens, docs, i, j):
                kinds.add(block.kind)
                for dtype in dtypes:
                    for kernel in kernels:
                        if kernel == "torch" and n > TORCH_KERNEL_MAX_SEQ:
                            continue
                        label = (f"{prefix}/{block.kind}/{name}:{i}<-{j}/h{nh}:{nkv}/{view}/"
                                 f"s={n}/{DTYPE_NAMES[dtype]}/{kernel}")
                        report.run(label, check_block, block, meta, shapes, dtype, kernel,
                                   n + case_id, device)
    wanted = {"causal", "full", "empty", "segments"}
    report.run(f"{prefix}/kinds-covered", lambda: Verdict(
        wanted <= kinds, f"block kinds run: {sorted(kinds)} (wanted {sorted(wanted)}); the "
                         f"torch kernel up to s = {TORCH_KERNEL_MAX_SEQ}"))


# ----------------------------------------------------------------------------- local path
def check_local(n, packed, dtype, kernel, seed, device):
    """local_attention of whole samples ([s, b, h, d] activations) against the reference."""
    b = 2 if n <= AUTOGRAD_REFERENCE_MAX_SEQ else 1
    docs = microbatch(n, b, packed=True, seed=seed)["document_ids"].to(device) if packed else None
    rand = Randn(seed, dtype, device)
    leaves = [rand.bhsd(b, h, n, view="sbhd").detach().requires_grad_() for h in (8, 2, 2)]
    dout = rand.bhsd(b, 8, n)
    out = local_attention(*leaves, None, docs, kernel=kernel)
    grads = torch.autograd.grad(out, leaves, dout)
    want = self_reference(*leaves, dout, docs)
    tol = TOLERANCE[dtype]
    return {name: (got, ref, tol) for name, got, ref in
            zip(("out", "dq", "dk", "dv"), (out, *grads), want)}


LOCAL_VARIANTS = ((True, "auto"), (True, "torch"), (False, "auto"))  # (packed, kernel)


def section_local(report, device, sizes, dtypes, variants=LOCAL_VARIANTS, prefix="local"):
    for n in sizes:
        for dtype in dtypes:
            for packed, kernel in variants:
                if kernel == "torch" and n > TORCH_KERNEL_MAX_SEQ:
                    continue
                label = (f"{prefix}/{'packed' if packed else 'plain'}/h8:2/sbhd/s={n}/"
                         f"{DTYPE_NAMES[dtype]}/{kernel}")
                report.run(label, check_local, n, packed, dtype, kernel, n + 7, device)


# ----------------------------------------------------------------------------- CP simulation
def cp_cases(cp_size):
    """(comm type, (U, R) or None, nh, nkv, packed, view) simulated at ``cp_size`` ranks."""
    dummy = cp_size + cp_size // 2  # not divisible by cp_size: dummy heads
    cases = [("p2p", None, 4, 2, False, "bhsd"), ("p2p", None, 4, 4, True, "sbhd"),
             ("a2a", None, 2 * cp_size, 2, True, "sbhd"),  # nkv < cp from 4: KV repeated
             ("a2a", None, dummy, dummy // 3, False, "bhsd")]  # dummy heads, KV repeated
    if cp_size >= 4:
        hierarchies = {(2, cp_size // 2), (cp_size // 2, 2)}
        for inner, outer in sorted(hierarchies):
            cases += [("a2a+p2p", (inner, outer), 8, 2, True, "sbhd"),
                      ("a2a+p2p", (inner, outer), 4, 1, False, "bhsd")]  # KV repeated inside
    return cases


def _take(x, index):
    """Rows ``index`` [b, s_local] of x [b, h, s, d] -> [b, h, s_local, d]."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _put(full, index, shard):
    """Scatter a rank's shard [b, h, s_local, d] into the full-order tensor at ``index``."""
    full.scatter_(2, index[:, None, :, None].expand(-1, full.shape[1], -1, full.shape[3]), shard)


def check_cp(case, cp_size, n, dtype, seed, device):
    """Every CP rank of one simulated attention against the full-sequence reference."""
    comm, sizes, nh, nkv, packed, view = case
    parts = [prepare_microbatch(microbatch(n, 2, packed, seed), r, cp_size) for r in range(cp_size)]
    index = [p["token_index"].to(device) for p in parts]
    docs = [p["document_ids"].to(device) for p in parts] if packed else None
    b, total = index[0].shape[0], cp_size * index[0].shape[1]
    full_docs = None
    if packed:
        full_docs = torch.zeros(b, total, dtype=torch.int64, device=device)
        for idx, doc in zip(index, docs):
            full_docs.scatter_(1, idx, doc)
    rand = Randn(seed, dtype, device)
    q, dout = rand.bhsd(b, nh, total), rand.bhsd(b, nh, total)
    k, v = rand.bhsd(b, nkv, total), rand.bhsd(b, nkv, total)
    leaves, local = [], []
    for full in (q, k, v):
        shards = [_take(full, idx) for idx in index]
        if view == "sbhd":  # the model's [s/P, b, h, d] activations, permuted views
            leaves.append([x.permute(2, 0, 1, 3).contiguous().requires_grad_() for x in shards])
            local.append([x.permute(1, 2, 0, 3) for x in leaves[-1]])
        else:
            leaves.append([x.contiguous().requires_grad_() for x in shards])
            local.append(leaves[-1])
    outs = simulated_attention(comm, *local, index, docs, sizes, kernel="auto")
    torch.autograd.backward(outs, [_take(dout, idx) for idx in index])
    got = [torch.zeros(b, h, total, HEAD_DIM, dtype=dtype, device=device)
           for h in (nh, nh, nkv, nkv)]  # out, dq, dk, dv in full order
    for rank, idx in enumerate(index):
        _put(got[0], idx, outs[rank].detach())
        for full, shards in zip(got[1:], leaves):
            grad = shards[rank].grad
            _put(full, idx, grad.permute(1, 2, 0, 3) if view == "sbhd" else grad)
    want = self_reference(q, k, v, dout, full_docs)
    tol = TOLERANCE[dtype]
    return {name: (g, w, tol) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


def section_cp(report, device, cp_sizes, n, dtypes):
    for cp_size in cp_sizes:
        for case_id, case in enumerate(cp_cases(cp_size)):
            comm, sizes, nh, nkv, packed, view = case
            name = comm if sizes is None else f"{comm}(U{sizes[0]}xR{sizes[1]})"
            for dtype in dtypes:
                label = (f"cp/{name}/P={cp_size}/{'packed' if packed else 'plain'}/h{nh}:{nkv}/"
                         f"{view}/s={n}/{DTYPE_NAMES[dtype]}")
                report.run(label, check_cp, case, cp_size, n, dtype, 100 * cp_size + case_id,
                           device)


# ----------------------------------------------------------------------------- training
def gpt_config(seq, params_dtype):
    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     vocab_size=256, ffn_hidden_size=128, max_position_embeddings=seq,
                     hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=64,
                     params_dtype=params_dtype)


def train_batch(seq, step):
    """A packed microbatch a small model learns in a few steps: in every document each token
    is the previous one plus a stride (1 or 2 by sample) mod 256, from a random start; the
    label is the next token (the document's last token predicts its successor)."""
    batch = microbatch(seq, 2, packed=True, seed=1000 + step)
    gen = torch.Generator().manual_seed(2000 + step)
    docs, positions = batch["document_ids"], batch["position_ids"]
    starts = torch.randint(0, 256, (2, int(docs.max()) + 1), generator=gen)
    stride = torch.tensor([[1], [2]])
    batch["tokens"] = (starts.gather(1, docs) + stride * positions) % 256  # [b, s]
    batch["labels"] = (batch["tokens"] + stride) % 256
    return batch


def train_losses(device, params_dtype, steps, seq, config=None):
    """Losses of ``steps`` AdamW steps of a small GPT (``config``, default :func:`gpt_config`)
    on packed documents. Low-precision parameters keep fp32 master weights (the trainer's
    --bf16): grads are copied up, the optimizer steps the masters, the model gets them back
    rounded."""
    model = GPTModel(config or gpt_config(seq, params_dtype), device=device)
    params = list(model.parameters())
    masters = params if params_dtype == torch.float32 else \
        [p.detach().float().clone().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(masters, lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        batch = {key: value.to(device) for key, value in train_batch(seq, step).items()}
        per_token = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                          document_ids=batch["document_ids"],
                          loss_mask=batch["loss_mask"])  # [b, s] fp32
        mask = batch["loss_mask"]
        loss = (per_token.float() * mask).sum() / mask.sum()
        loss.backward()
        if masters is not params:
            for master, param in zip(masters, params):
                master.grad, param.grad = param.grad.float(), None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if masters is not params:
            with torch.no_grad():
                for master, param in zip(masters, params):
                    param.copy_(master)
        losses.append(float(loss.detach()))
    return torch.tensor(losses, dtype=torch.float64)


def section_train(report, device, steps, seq):
    losses = functools.cache(lambda where, dtype: train_losses(where, dtype, steps, seq))
    cpu = torch.device("cpu")
    report.run(f"train/fp32/{device.type}-vs-cpu/{steps}-steps/s={seq}/loss", lambda: Series(
        losses(device, torch.float32), losses(cpu, torch.float32), TRAIN_FP32_TOL))
    name = f"train/bf16-vs-fp32/{device.type}/{steps}-steps/s={seq}/loss"
    if torch.bfloat16 not in supported_dtypes(device):
        report.skip(name, f"{device} has no bf16 support")
        return
    report.run(name, lambda: Series(losses(device, torch.bfloat16), losses(device, torch.float32),
                                    TRAIN_BF16_TOL))


# ----------------------------------------------------------------------------- main
# Each section's time budget in seconds (--section-seconds replaces them all): two to four
# times what its sizes are estimated to take on an H100 (the first six: the 2026-11-28 H200
# run, 38 s together, plus a third for the H100's lower bandwidth; the later ones: their CPU
# references on the host's cores and the start-up of pretrain_gpt.py's runs; gdn: room for the first
# compilation of FLA's Triton kernels), so that the whole suite, start-up and a check past a
# budget included, stays within 5 minutes there. On the CPU no budget applies unless given.
SUITE_SECONDS, START_UP_SECONDS = 300, 30  # the goal on an H100; Python, torch and CUDA start
SECTION_SECONDS = {"reference": 5, "blocks": 36, "local": 18, "cp": 25, "train": 8, "moe": 10,
                   "flash": 25, "gdn": 25, "mla": 12, "dropout": 12, "tiled": 10,
                   "tp_overlap": 8, "offload": 12, "mtp": 8, "mup": 8, "muon": 10, "fsdp2": 8,
                   "sinkhorn": 10, "fp8": 10}
EXIT_PASS, EXIT_FAIL, EXIT_CAPPED = 0, 1, 2


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="exit status: 0 every check ran and passed, 1 a check failed, 2 nothing failed "
               "but some checks were CAPPED (their section ran out of its time budget)")
    parser.add_argument("--device", default="cuda",
                        help="device to check (default cuda; cpu proves the suite's logic)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: s up to 512, CP 2 and 4, fewer training steps")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--max-seq", type=int, default=None,
                        help="largest block / local sequence length, from 40 128 512 2048 8192 "
                             "32768 (default 32768 on CUDA, 2048 on the CPU; 512 with --quick)")
    parser.add_argument("--section-seconds", type=float, default=None,
                        help="time budget of every section: once a section has run this long "
                             "it starts no more checks and prints the rest CAPPED (default: "
                             "each section's budget sized for an H100 on CUDA, none on the CPU)")
    args = parser.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    return args


def plan_sizes(args, device):
    """(block / local lengths, CP sizes, CP sequence length, training steps, training seq)."""
    default_max = 512 if args.quick else (32768 if device.type == "cuda" else 2048)
    max_seq = args.max_seq or default_max
    sizes = [n for n in (40, 128, 512, 2048, 8192, 32768) if n <= max_seq]
    if args.quick:
        return sizes, (2, 4), 128, 5, 64
    return sizes, (2, 4, 8), 4096 if device.type == "cuda" else 1024, 8, 256


def section_budget(args, device, name):
    if args.section_seconds is not None:
        return args.section_seconds
    return SECTION_SECONDS[name] if device.type == "cuda" else math.inf


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not device_mod.accelerator_available():
        print("no CUDA device: nothing checked (use --device cpu to check the suite's logic)")
        return EXIT_FAIL
    if device.type == "cuda" and device.index is None:  # the training runs take its index
        device = torch.device("cuda", torch.cuda.current_device())
    torch.set_float32_matmul_precision("highest")  # the fp32 truth must not run on TF32
    sizes, cp_sizes, cp_seq, steps, train_seq = plan_sizes(args, device)
    dtypes = supported_dtypes(device)
    wanted = args.sections.split(",")
    print(f"gpu_check on {device}{' (quick)' if args.quick else ''}: dtypes "
          f"{[DTYPE_NAMES[d] for d in dtypes]}, block sizes {sizes}, CP {list(cp_sizes)} at "
          f"s={cp_seq}; rel err = max abs err / max |fp32 truth|; hA:B = A query, B KV heads")
    report, start = Report(), time.perf_counter()
    sections = {
        "reference": lambda: report.run("reference/chunked-vs-reference_attention/s=40/fp32",
                                        check_reference, device),
        "blocks": lambda: section_blocks(report, device, sizes, dtypes),
        "local": lambda: section_local(report, device, sizes, dtypes),
        "cp": lambda: section_cp(report, device, cp_sizes, cp_seq, dtypes),
        "train": lambda: section_train(report, device, steps, train_seq),
        "moe": lambda: section_moe(report, device, steps, train_seq, train_losses),
        **path_sections(report, device, args.quick, dtypes, sizes, section_blocks, section_local),
    }
    with process_group(device):  # the checks of distributed code (the TP linears) run in one
        for name in SECTIONS:
            if name in wanted:
                run_section(report, name, sections[name], section_budget(args, device, name))
    failed, capped = report.failures(), report.capped()
    counts = {s: sum(1 for _, status in report.rows if status == s)
              for s in ("PASS", "FAIL", "SKIP", "CAPPED")}
    print(f"{len(report.rows)} checks: {counts['PASS']} PASS, {counts['FAIL']} FAIL, "
          f"{counts['SKIP']} SKIP, {counts['CAPPED']} CAPPED in "
          f"{time.perf_counter() - start:.1f} s")
    for name in failed:
        print(f"FAILED: {name}")
    for name in capped:
        print(f"CAPPED (not run, not passed): {name}")
    if failed:
        return EXIT_FAIL
    return EXIT_CAPPED if capped else EXIT_PASS


def run_section(report, name, run, budget):
    """One section under its time budget, then a line with its wall time (and what was
    capped)."""
    began, capped_before = time.perf_counter(), len(report.capped())
    report.begin(budget)
    try:
        run()
    except Exception as exc:  # e.g. out of memory outside a single check
        report.error(f"{name}/section-aborted", exc)
    capped = len(report.capped()) - capped_before
    note = f", over its {budget:g} s budget: {capped} checks CAPPED" if capped else ""
    print(f"    [{name}: {time.perf_counter() - began:.1f} s{note}]")


if __name__ == "__main__":
    sys.exit(main())
