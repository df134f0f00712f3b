"""Sections of tools/gpu_check.py for layers that landed after its first GPU run (see
tools/gpu_check_paths.py): each on the device against the fp32 CPU reference.

- dropout: the hidden-dropout mask of a context-parallel rank's tokens (and of a
  sequence-parallel slice of them) on the device equals, bit for bit, the CPU's mask of the
  whole sample at the same global coordinates, and so does the dropped output (at the
  dtype's tolerance); the attention-dropout mask of a ring block on the device equals the
  CPU's whole-sample mask at the block's global (query, key) coordinates; attention with
  dropout (the plain-PyTorch tiled path, packed documents, GQA) on the device against the
  same on the CPU in fp32: out, dq, dk, dv.
- tiled: the tiled output layer + cross entropy (``--tiled-logits-chunk-size``) in fp32 /
  bf16 against the untiled fp32 loss: loss, d hidden, d weight (padded vocabulary); the
  chunked MLP (``--mlp-chunks-for-training``, SwiGLU) against the whole MLP: out, dx, dW;
  a GPT with both on the device against the untiled model on the CPU (fp32): per-token loss
  and every gradient.
- tp_overlap: the overlapped column- and row-parallel linears (``--tp-comm-overlap``; each
  sub-flag setting) at TP world size 1 on the device, fp32 / bf16, against F.linear on the
  CPU: out, dx, dW, db. What one process cannot cover: at one rank the ring never posts a
  send, so the point-to-point exchange on the side stream and its overlap with the GEMMs
  (NCCL needs a second GPU) are unchecked; the bulk all-gather / reduce-scatter run as
  one-rank collectives.
- offload: a GPT whose first layers keep their saved activations in host memory
  (``--cpu-offloading-num-layers``: pinned buffers and a side stream on CUDA; on the CPU the
  hooks' own logic, installed by hand) against the same model without offload: fp32 on the
  device against the CPU (with and without full recomputation), bf16 against no offload on
  the device; a row that the hooks moved tensors (pinned on CUDA) and brought every one back;
  then training rows (tools/gpu_check_train.py).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_cp import tensor_parallel as tpar
from megatron_cp.layers.activation_offload import ActivationOffloader, _OnHost
from megatron_cp.context_parallel import AttentionDropout, dropout_key, keep_mask, local_attention
from megatron_cp.data.microbatch import prepare_microbatch
from megatron_cp.layers import hidden_dropout
from megatron_cp.model import GPTConfig, GPTModel
from megatron_cp.layers.mlp import MLP, chunked_mlp
from megatron_cp.tensor_parallel.overlap import ColumnParallelOverlap, RowParallelOverlap
from gpu_check_lib import DTYPE_NAMES, TOLERANCE, Randn, Verdict, microbatch

LAYER_SECTIONS = ("dropout", "tiled", "tp_overlap", "offload")
CPU, FP32 = torch.device("cpu"), torch.float32
MASK_TOL = 0.0  # a mask is bits: equal or wrong


def _cpu32(*tensors):
    """fp32 CPU copies that require grad (the values the device run started from)."""
    return [t.detach().to(CPU, FP32).requires_grad_() for t in tensors]


def _randn(gen, shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _rows(x, index):
    """x [s, b, ...] at rows ``index`` [b, n] of each sample -> [n, b, ...]."""
    return torch.stack([x[index[i], i] for i in range(x.shape[1])], dim=1)


# ----------------------------------------------------------------------------- dropout
def _rank_positions(n, cp_size, seed):
    """Each CP rank's unpadded token positions [b, s/P] of a packed 2-sample microbatch."""
    batch = microbatch(n, 2, packed=True, seed=seed)
    return [prepare_microbatch(batch, r, cp_size)["unpadded_index"] for r in range(cp_size)]


def check_hidden_dropout(n, cp_size, sp, dtype, units, device):
    """The last CP rank's hidden dropout (its sequence-parallel second half with ``sp``) on
    the device against the CPU mask of the whole sample at the same positions."""
    p, samples, number = 0.3, torch.tensor([5, 2 ** 40 + 3]), 3
    positions = _rank_positions(n, cp_size, seed=n)[-1]  # [b, s/P]
    x = _randn(torch.Generator().manual_seed(n), (n, 2, units), dtype)  # whole samples
    key = hidden_dropout.site_key(1234, hidden_dropout.SITE_MLP, number)
    whole = hidden_dropout.token_coordinates(hidden_dropout.DropoutIds(samples, None), x, (0, 1))
    want_mask = _rows(hidden_dropout.keep_mask(key, whole, units, p), positions)  # [s/P, b, h]
    local, shard = _rows(x, positions), (0, 1)
    if sp:  # this TP rank's second half of the local sequence
        half = local.shape[0] // 2
        local, want_mask, shard = local[half:], want_mask[half:], (1, 2)
    ids = hidden_dropout.DropoutIds(samples.to(device), positions.to(device))
    x_dev = local.to(device)
    coords = hidden_dropout.token_coordinates(ids, x_dev, shard)
    device_key = hidden_dropout.layer_site_keys(1234, number, device)[1]  # the model's buffer
    mask = hidden_dropout.keep_mask(device_key, coords, units, p)
    out = hidden_dropout.hidden_dropout(x_dev, p, True, device_key, coords)
    want = local.float() * want_mask / (1 - p)
    return {"mask": (mask.float(), want_mask.float(), MASK_TOL),
            "out": (out, want, TOLERANCE[dtype])}


def check_attention_mask(n, cp_size, heads, device):
    """The attention-dropout mask of the ring block (last rank's queries x rank 0's keys)
    on the device against the CPU's whole-sample mask at the same coordinates."""
    p, key, samples = 0.2, dropout_key(77, 5), torch.tensor([3, 2 ** 33 + 1])
    heads_index = torch.arange(heads) + heads  # the heads TP rank 1 holds
    positions = _rank_positions(n, cp_size, seed=n + 1)
    q_pos, k_pos = positions[-1], positions[0]
    every = torch.arange(n).expand(2, n)
    whole = keep_mask(key, p, samples, heads_index, every, every)  # [b, h, n, n]
    want = torch.stack([whole[i][:, q_pos[i]][:, :, k_pos[i]] for i in range(2)])
    got = keep_mask(key, p, samples.to(device), heads_index.to(device), q_pos.to(device),
                    k_pos.to(device))
    return {"mask": (got.float(), want.float(), MASK_TOL)}


def check_dropout_attention(n, dtype, device):
    """Attention with dropout (packed documents, GQA 8:2) on the device against the same
    path in fp32 on the CPU."""
    docs = microbatch(n, 2, packed=True, seed=n)["document_ids"]
    rand = Randn(n, dtype, device)
    leaves = [rand.bhsd(2, h, n, view="sbhd").detach().requires_grad_() for h in (8, 2, 2)]
    dout = rand.bhsd(2, 8, n)
    drop = AttentionDropout(0.3, dropout_key(21, 2), torch.tensor([7, 2 ** 40 + 1]),
                            torch.arange(8) + 8, None)
    on_device = drop._replace(samples=drop.samples.to(device), heads=drop.heads.to(device))
    out = local_attention(*leaves, None, docs.to(device), dropout=on_device)
    got = torch.autograd.grad(out, leaves, dout)
    ref_leaves = _cpu32(*leaves)
    ref = local_attention(*ref_leaves, None, docs, dropout=drop)
    want = torch.autograd.grad(ref, ref_leaves, dout.to(CPU, FP32))
    tol = TOLERANCE[dtype]
    return {name: (g, w, tol) for name, g, w in
            zip(("out", "dq", "dk", "dv"), (out, *got), (ref, *want))}


def section_dropout(report, device, quick, dtypes):
    hidden_sizes, units = ((48,), 16) if quick else ((512, 4096), 256)
    for n in hidden_sizes:
        for cp_size in (2, 4):
            for sp in (False, True):
                for dtype in dtypes:
                    name = f"dropout/hidden/P={cp_size}{'/sp' if sp else ''}/s={n}/" \
                           f"{DTYPE_NAMES[dtype]}/{device.type}-vs-cpu"
                    report.run(name, check_hidden_dropout, n, cp_size, sp, dtype, units, device)
    n = hidden_sizes[0]  # the whole-sample CPU mask is [b, h, s, s] int64 hashes
    for cp_size in (2, 4):
        report.run(f"dropout/attention/mask/P={cp_size}/s={n}/{device.type}-vs-cpu",
                   check_attention_mask, n, cp_size, 4, device)
    for n in (48,) if quick else (512, 2048):
        for dtype in dtypes:
            report.run(f"dropout/attention/packed/h8:2/s={n}/{DTYPE_NAMES[dtype]}/"
                       f"{device.type}-vs-cpu", check_dropout_attention, n, dtype, device)


# ----------------------------------------------------------------------------- tiled
def check_tiled_logits(shape, dtype, device):
    """tiled_vocab_parallel_cross_entropy on the device against the untiled fp32 loss."""
    s, b, h, vocab, rows, chunk = shape
    gen = torch.Generator().manual_seed(s)
    hidden, weight = _randn(gen, (s, b, h), dtype), _randn(gen, (rows, h), dtype, h ** -0.5)
    target = torch.randint(0, vocab, (s, b), generator=gen)
    weights = torch.rand(s, b, generator=gen)
    leaves = [t.to(device).requires_grad_() for t in (hidden, weight)]
    loss = tpar.tiled_vocab_parallel_cross_entropy(*leaves, target.to(device), vocab, None, chunk)
    got = torch.autograd.grad((loss * weights.to(device)).sum(), leaves)
    ref_leaves = _cpu32(hidden, weight)
    logits = tpar.mask_padded_vocab(F.linear(*ref_leaves), vocab, None)
    ref = tpar.vocab_parallel_cross_entropy(logits, target, None)
    want = torch.autograd.grad((ref * weights).sum(), ref_leaves)
    tol = TOLERANCE[dtype]
    return {"loss": (loss, ref, tol), "dhidden": (got[0], want[0], tol),
            "dweight": (got[1], want[1], tol)}


def tiny_gpt(hidden, seq, params_dtype=FP32, **settings):
    return GPTConfig(num_layers=3, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
                     vocab_size=250, ffn_hidden_size=2 * hidden, max_position_embeddings=seq,
                     activation="swiglu", hidden_dropout=0.0, attention_dropout=0.0,
                     make_vocab_size_divisible_by=64, params_dtype=params_dtype,
                     init_method_std=0.05, **settings)


def check_chunked_mlp(s, hidden, chunks, dtype, device):
    """chunked_mlp (each chunk recomputed in backward) of a SwiGLU MLP on the device against
    the whole MLP on the CPU in fp32 with the same (rounded) weights."""
    mlp = MLP(tiny_gpt(hidden, s, dtype), "decoder.layers.0.mlp", None, device=device)
    reference = MLP(tiny_gpt(hidden, s), "decoder.layers.0.mlp", None)
    reference.load_state_dict({k: v.float().cpu() for k, v in mlp.state_dict().items()})
    gen = torch.Generator().manual_seed(s)
    x, grad = _randn(gen, (s, 2, hidden), dtype), _randn(gen, (s, 2, hidden), dtype)
    leaf = x.to(device).requires_grad_()
    params = [p for _, p in sorted(mlp.named_parameters())]
    out = chunked_mlp(mlp, leaf, chunks, None)
    got = torch.autograd.grad(out, [leaf] + params, grad.to(device))
    ref_leaf = _cpu32(x)[0]
    ref = reference(ref_leaf)
    want = torch.autograd.grad(ref, [ref_leaf] + [p for _, p in sorted(
        reference.named_parameters())], grad.float())
    names = ["dx"] + ["d" + n for n, _ in sorted(mlp.named_parameters())]
    tol = TOLERANCE[dtype]
    quantities = {"out": (out, ref, tol)}
    quantities.update({n: (g, w, tol) for n, g, w in zip(names, got, want)})
    return quantities


def model_step(model, seq, device, seed):
    """(per-token loss [b, s], {name: grad}) of one forward + backward on packed documents."""
    batch = {k: v.to(device) for k, v in microbatch(seq, 2, packed=True, seed=seed).items()}
    loss = model(batch["tokens"] % 250, batch["position_ids"], labels=batch["labels"] % 250,
                 document_ids=batch["document_ids"], loss_mask=batch["loss_mask"])
    mask = batch["loss_mask"]
    ((loss.float() * mask).sum() / mask.sum()).backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def compare_models(got, want, tol):
    """:func:`model_step` results -> quantities: the loss and every gradient."""
    quantities = {"loss": (got[0], want[0], tol)}
    quantities.update({"d" + n: (g, want[1][n], tol) for n, g in got[1].items()})
    return quantities


def check_tiled_model(seq, hidden, device):
    """A GPT with tiled logits and a chunked MLP on the device against the plain model on
    the CPU (fp32, the same weights)."""
    tiled = GPTModel(tiny_gpt(hidden, seq, tiled_logits_chunk_size=seq // 3,
                              mlp_chunks_for_training=3), device=device)
    plain = GPTModel(tiny_gpt(hidden, seq))
    plain.load_state_dict({k: v.cpu() for k, v in tiled.state_dict().items()})
    return compare_models(model_step(tiled, seq, device, 5), model_step(plain, seq, CPU, 5),
                          TOLERANCE[FP32])


def section_tiled(report, device, quick, dtypes):
    shape = (37, 2, 8, 50, 64, 5) if quick else (2048, 2, 128, 16000, 16384, 384)
    seq, hidden = (24, 32) if quick else (512, 256)
    for dtype in dtypes:
        s, b, h, vocab, rows, chunk = shape
        report.run(f"tiled/logits/s={s}/v={vocab}:{rows}/chunk={chunk}/{DTYPE_NAMES[dtype]}",
                   check_tiled_logits, shape, dtype, device)
        report.run(f"tiled/mlp/s={seq}/h={hidden}/chunks=3/{DTYPE_NAMES[dtype]}",
                   check_chunked_mlp, seq, hidden, 3, dtype, device)
    report.run(f"tiled/model/s={seq}/fp32/{device.type}-vs-cpu", check_tiled_model, seq, hidden,
               device)


# ----------------------------------------------------------------------------- tp_overlap
OVERLAP_SETTINGS = {  # Megatron-LM's defaults, then each sub-flag switched
    "default": tpar.TPCommOverlap(), "rs_dgrad": tpar.TPCommOverlap(rs_dgrad=True),
    "no-ag-rs": tpar.TPCommOverlap(ag=False, rs=False),
    "no-bulk": tpar.TPCommOverlap(bulk_dgrad=False, bulk_wgrad=False),
}


def check_overlap(kind, setting, shape, dtype, group, device):
    """The overlapped ``kind`` ("column" / "row") linear on a one-rank TP group against
    F.linear on the CPU in fp32."""
    s, b, n_in, n_out = shape
    gen = torch.Generator().manual_seed(n_in + n_out)
    x, weight = _randn(gen, (s, b, n_in), dtype), _randn(gen, (n_out, n_in), dtype, n_in ** -0.5)
    bias, upstream = _randn(gen, (n_out,), dtype), _randn(gen, (s, b, n_out), dtype)
    tensors = (x, weight, bias) if kind == "column" else (x, weight)
    leaves = [t.to(device).requires_grad_() for t in tensors]
    if kind == "column":
        out = ColumnParallelOverlap.apply(*leaves, group, setting)
    else:
        out = RowParallelOverlap.apply(*leaves, group, setting)
    got = torch.autograd.grad(out, leaves, upstream.to(device))
    ref_leaves = _cpu32(*tensors)
    ref = F.linear(*ref_leaves)
    want = torch.autograd.grad(ref, ref_leaves, upstream.float())
    tol = TOLERANCE[dtype]
    quantities = {"out": (out, ref, tol)}
    quantities.update({n: (g, w, tol) for n, g, w in zip(("dx", "dW", "db"), got, want)})
    return quantities


def section_tp_overlap(report, device, quick, dtypes):
    s, b, hidden, ffn = (8, 2, 16, 24) if quick else (1024, 2, 512, 2048)
    group = dist.new_group([dist.get_rank()])  # TP world size 1
    for kind, (n_in, n_out) in (("column", (hidden, ffn)), ("row", (ffn, hidden))):
        for name, setting in OVERLAP_SETTINGS.items():
            for dtype in dtypes:
                report.run(f"tp_overlap/{kind}/{name}/tp=1/{n_in}x{n_out}/{DTYPE_NAMES[dtype]}",
                           check_overlap, kind, setting, (s, b, n_in, n_out), dtype, group,
                           device)


# ----------------------------------------------------------------------------- offload
def counted_offloader(model, device, moves):
    """The model's offloader (built by hand on the CPU, where the model installs none),
    counting into ``moves`` what it moves out, brings back, and how many host copies are
    pinned."""
    offloader = model.decoder.offloader or ActivationOffloader(device, pin=False)
    model.decoder.offloader = offloader
    pack, unpack = offloader.pack, offloader.unpack

    def counting_pack(tensor):
        packed = pack(tensor)
        if isinstance(packed, _OnHost):
            moves["moved"] += 1
            moves["pinned"] += packed.host.is_pinned()
        return packed

    def counting_unpack(packed):
        moves["restored"] += isinstance(packed, _OnHost)
        return unpack(packed)

    offloader.pack, offloader.unpack = counting_pack, counting_unpack
    return model


def check_offload(seq, hidden, dtype, recompute, device, moves, against_cpu):
    """The offloaded model (2 of 3 layers) on the device against the same weights without
    offload: on the CPU in fp32 (``against_cpu``) or on the device in ``dtype``."""
    settings = dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1) if recompute else {}
    model = counted_offloader(GPTModel(tiny_gpt(hidden, seq, dtype, cpu_offloading_num_layers=2,
                                                **settings), device=device), device, moves)
    where, ref_dtype = (CPU, FP32) if against_cpu else (device, dtype)
    plain = GPTModel(tiny_gpt(hidden, seq, ref_dtype, **settings), device=where)
    plain.load_state_dict({k: v.to(where) for k, v in model.state_dict().items()})
    return compare_models(model_step(model, seq, device, 6), model_step(plain, seq, where, 6),
                          TOLERANCE[dtype])


def check_moves(device, moves):
    pinned = device.type != "cuda" or moves["pinned"] == moves["moved"]
    return Verdict(moves["moved"] > 0 and moves["restored"] == moves["moved"] and pinned,
                   f"saved tensors moved to host memory {moves['moved']}, brought back "
                   f"{moves['restored']}, pinned {moves['pinned']} (pinned copies on CUDA only)")


def section_offload(report, device, quick, dtypes):
    seq, hidden = (24, 32) if quick else (1024, 256)
    moves = {"moved": 0, "restored": 0, "pinned": 0}
    for recompute in (False, True):
        kind = "recompute" if recompute else "plain"
        report.run(f"offload/model/{kind}/s={seq}/fp32/{device.type}-vs-cpu", check_offload, seq,
                   hidden, FP32, recompute, device, moves, True)
    for dtype in dtypes:
        if dtype != FP32:
            report.run(f"offload/model/plain/s={seq}/{DTYPE_NAMES[dtype]}/vs-no-offload",
                       check_offload, seq, hidden, dtype, False, device, moves, False)
    report.run("offload/hooks", check_moves, device, moves)


def layer_sections(report, device, quick, dtypes, training):
    """{section: run} of :data:`LAYER_SECTIONS`; ``training``: tools/gpu_check_train.py's
    sections (the offload section ends with its training rows)."""
    def offload():
        section_offload(report, device, quick, dtypes)
        training["offload"]()

    return {"dropout": lambda: section_dropout(report, device, quick, dtypes),
            "tiled": lambda: section_tiled(report, device, quick, dtypes),
            "tp_overlap": lambda: section_tp_overlap(report, device, quick, dtypes),
            "offload": offload}
