"""The Gated DeltaNet kernels as pure functions: the causal depthwise conv1d and the gated
delta rule (chunked, and token by token), with document boundaries of packed sequences.

Per value head, with a state S [dk, dv] (fp32), gate g_t <= 0 (log decay), write strength
beta_t in (0, 1), unit-norm key k_t, query q_t (scaled by 1/sqrt(dk) here):

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,     o_t = S_t^T q_t

A packed sequence restarts at every document boundary: the state before a document's first
token is zero and the conv sees no token of another document. Boundaries come as
``document_ids`` [b, s] (a token starts a document where its id differs from the previous
token's) or, for one packed row, as FLA's ``cu_seqlens`` (:func:`documents_from_cu_seqlens`).
A sequence's first token continues ``initial_state`` / the conv's incoming tail: that is what
a context-parallel wrapper passes from the rank before, and what a generation cache holds.

:func:`chunk_gated_delta_rule` is the chunked form (WY representation: per chunk of C tokens
one triangular solve and matrix products, then one state step per chunk). On CUDA, for bf16 /
fp16 models, it hands over to flash-linear-attention's ``chunk_gated_delta_rule`` when FLA is
importable (layers/accelerators.py; fla-core 0.6.0, setup.py's ``gpu`` extra) with the arguments its entry
point takes (:func:`_fla_chunk`: q, k, v and beta in the model's dtype, g fp32, packed
documents as one row with int64 ``cu_seqlens`` from :func:`packed_cu_seqlens`);
tests/layers/test_fla_call.py (fla_call_checks.py) drives that call on CPU through FLA's real entry
point. fp32 models
and everything else run :func:`torch_chunk_gated_delta_rule`, plain PyTorch. Its reference is
:func:`recurrent_gated_delta_rule`, the recurrence above run token by token.
"""
import torch
import torch.nn.functional as F

from megatron_cp.layers import accelerators

CHUNK_SIZE = 64  # FLA's and Megatron-LM's chunk


def documents_from_cu_seqlens(cu_seqlens, length):
    """FLA's ``cu_seqlens`` [n + 1] (document starts of one packed row, ending at
    ``length``) -> document ids [1, length]."""
    positions = torch.arange(length, device=cu_seqlens.device)
    return (torch.bucketize(positions, cu_seqlens[1:], right=True)).unsqueeze(0)  # [1, s]


def l2norm(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and Qwen3-Next's q/k normalisation)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def causal_conv1d(x, weight, bias=None, activation="silu", initial_tail=None, document_ids=None):
    """Causal depthwise conv over the sequence, restarted at every document boundary.

    x [b, s, c]; weight [c, 1, w] (nn.Conv1d's depthwise layout; tap w-1 is the current
    token); ``initial_tail`` [b, c, w-1]: the w-1 inputs before x (None: zeros), seen only by
    the first document; ``document_ids`` [b, s] or None. Returns (y [b, s, c], tail
    [b, c, w-1]): the last w-1 inputs of the last document (zeros before its start), the
    tail a continuation of that document needs.
    """
    b, s, c = x.shape
    w = weight.shape[-1]
    tail = x.new_zeros(b, w - 1, c) if initial_tail is None else initial_tail.transpose(1, 2)
    xp = torch.cat([tail.to(x.dtype), x], dim=1)  # [b, w-1+s, c]
    keep = None
    if document_ids is not None:  # the tail belongs to the first token's document
        docs = torch.cat([document_ids[:, :1].expand(b, w - 1), document_ids], dim=1)  # [b, w-1+s]
    taps = weight.reshape(c, w)
    y = torch.zeros_like(x) if bias is None else bias.to(x.dtype).expand(b, s, c).clone()
    for i in range(w):  # output t sees input t-(w-1)+i, which sits at xp[t+i]
        term = xp[:, i:i + s] * taps[:, i]
        if document_ids is not None:
            keep = (docs[:, i:i + s] == docs[:, w - 1:]).unsqueeze(-1)  # [b, s, 1]
            term = term * keep
        y = y + term
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"activation ({activation!r}) of the GDN conv must be 'silu' or None")
    out_tail = xp[:, s:]  # [b, w-1, c]
    if document_ids is not None:
        out_tail = out_tail * (docs[:, s:] == docs[:, -1:]).unsqueeze(-1)
    return y, out_tail.transpose(1, 2)  # [b, s, c], [b, c, w-1]


def _as_heads(x):
    """[b, s, h, d] -> fp32 [b, h, s, d]."""
    return x.transpose(1, 2).to(torch.float32)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               document_ids=None, scale=None):
    """The recurrence of the module docstring, one token at a time, in the dtype of
    ``initial_state`` or fp32 (fp64 in the kernel tests; also one decode step).

    q, k [b, s, h, dk] (l2-normalised by the caller, heads already matching v's); v
    [b, s, h, dv]; g, beta [b, s, h]; initial_state [b, h, dk, dv]. Returns (o [b, s, h, dv]
    in v's dtype, final state or None)."""
    dtype = torch.float32 if initial_state is None else initial_state.dtype
    out_dtype = v.dtype
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (q, k, v))  # [b, h, s, d]
    g, beta = (x.transpose(1, 2).to(dtype) for x in (g, beta))  # [b, h, s]
    b, h, s, dk = k.shape
    scale = dk ** -0.5 if scale is None else scale
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for t in range(s):
        if document_ids is not None and t > 0:
            new_doc = (document_ids[:, t] != document_ids[:, t - 1]).to(dtype)  # [b]
            state = state * (1 - new_doc)[:, None, None, None]
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]  # [b, h, dk]
        delta = (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, k_t)) * beta[:, :, t, None]
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t] * scale))
    out = torch.stack(outs, dim=1).to(out_dtype)  # [b, s, h, dv]
    return out, (state if output_final_state else None)


def _chunks(x, n, c):
    """[b, h, n*c, ...] -> [b, h, n, c, ...]."""
    return x.reshape(x.shape[0], x.shape[1], n, c, *x.shape[3:])


SPAN_CHUNKS = 64  # chunks whose [C, C] matrices are formed at once (4096 tokens at C = 64)


def torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                                 document_ids=None, scale=None, chunk_size=CHUNK_SIZE,
                                 span_chunks=SPAN_CHUNKS):
    """:func:`recurrent_gated_delta_rule` computed chunk by chunk in fp32, plain PyTorch.

    Within a chunk, with G the cumulative log decay, D_tj = exp(G_t - G_j) (j <= t, same
    document: M_tj) and c_t = 1 while no document has started in the chunk up to t:
        (I + A) U = beta V,  (I + A) W = beta exp(G) c K,  A_tj = beta_t D_tj M_tj k_t.k_j (j < t)
        delta = U - W S0;  O = exp(G) c (Q S0) + (Q K^T * D * M) delta
        S_end = exp(G_C) c_C S0 + (K * exp(G_C - G) * M_C)^T delta.
    Tokens padded onto the last chunk have k = v = beta = g = 0: they change nothing.

    The sequence runs in spans of ``span_chunks`` chunks (:func:`_chunk_span`), the state
    carried from one to the next, so that the per-chunk [C, C] matrices (64 times the size of
    q) are made a span at a time: the arithmetic is the same, but the allocator reuses memory
    of a bounded size instead of mapping (and page-faulting) fresh memory for tensors that
    grow with the sequence, which made long sequences cost more than linearly on the CPU.
    The spans are split views (``split``), whose backward joins the gradients once.
    """
    b, s, h, dk = k.shape
    dv, out_dtype = v.shape[-1], v.dtype
    scale = dk ** -0.5 if scale is None else scale
    c = chunk_size
    n = (s + c - 1) // c
    pad = n * c - s
    q, k, v = (F.pad(_as_heads(x), (0, 0, 0, pad)) for x in (q, k, v))  # [b, h, n*c, d]
    g, beta = (F.pad(x.transpose(1, 2).to(torch.float32), (0, pad)) for x in (g, beta))
    if document_ids is None:
        docs = torch.zeros(b, n * c, dtype=torch.long, device=k.device)
    else:  # padded tokens join the last document
        docs = F.pad(document_ids, (0, pad), mode="replicate") if pad else document_ids
    q = q * scale
    state = k.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    span = span_chunks * c
    previous = docs[:, :1]  # [b, 1]: the first token continues the incoming state
    outs = []
    for q_i, k_i, v_i, g_i, beta_i, docs_i in zip(
            *(x.split(span, dim=2) for x in (q, k, v)), g.split(span, dim=2),
            beta.split(span, dim=2), docs.split(span, dim=1)):
        out, state = _chunk_span(q_i, k_i, v_i, g_i, beta_i, docs_i, previous, state, c)
        outs.append(out)  # [b, h, span, dv]
        previous = docs_i[:, -1:]
    out = torch.cat(outs, dim=2)[:, :, :s]  # [b, h, s, dv]
    return out.transpose(1, 2).to(out_dtype), (state if output_final_state else None)


def _chunk_span(q, k, v, g, beta, docs, previous, state, c):
    """One span of :func:`torch_chunk_gated_delta_rule`: q, k [b, h, m*c, dk] (q scaled), v
    [b, h, m*c, dv], g, beta [b, h, m*c] fp32, docs [b, m*c] and ``previous`` [b, 1] (the
    document of the token before the span), ``state`` [b, h, dk, dv] fp32 at the span's
    start. Returns (o [b, h, m*c, dv] fp32, the state after the span)."""
    b, h, length, _ = k.shape
    n = length // c
    q, k, v = (_chunks(x, n, c) for x in (q, k, v))  # [b, h, n, c, d]
    g, beta = _chunks(g, n, c), _chunks(beta, n, c)  # [b, h, n, c]
    dv = v.shape[-1]
    docs = docs.reshape(b, 1, n, c)  # [b, 1, n, c]
    # the token before each chunk (for chunk 0: the one before the span)
    before = torch.cat([previous.view(b, 1, 1, 1), docs[:, :, :-1, -1:]], dim=2)  # [b, 1, n, 1]
    carry = (docs == before).float()  # [b, 1, n, c]: c_t
    same = (docs.unsqueeze(-1) == docs.unsqueeze(-2))  # [b, 1, n, c, c]: M_tj
    causal = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
    G = g.cumsum(-1)  # [b, h, n, c]
    diff = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf"))
    decay = diff.exp() * same  # [b, h, n, c, c]: D * M, zero above the diagonal
    strict = decay.masked_fill(causal.logical_not().logical_or(torch.eye(
        c, dtype=torch.bool, device=k.device)), 0.0)
    a = (k @ k.transpose(-1, -2)) * strict * beta.unsqueeze(-1)  # [b, h, n, c, c]
    lower = a + torch.eye(c, device=k.device)
    rhs = torch.cat([v * beta.unsqueeze(-1),
                     k * (beta * G.exp() * carry).unsqueeze(-1)], dim=-1)  # [.., c, dv+dk]
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]  # [b, h, n, c, dv], [b, h, n, c, dk]
    inner = (q @ k.transpose(-1, -2)) * decay  # [b, h, n, c, c]
    q_carry = q * (G.exp() * carry).unsqueeze(-1)  # [b, h, n, c, dk]
    last_same = same[..., -1, :].float()  # [b, 1, n, c]: M_{C, j}
    k_end = k * ((G[..., -1:] - G).exp() * last_same).unsqueeze(-1)  # [b, h, n, c, dk]
    end_decay = (G[..., -1].exp() * carry[..., -1]).unsqueeze(-1).unsqueeze(-1)  # [b, h, n, 1, 1]
    # The chunks as separate tensors, split once: unbind's backward stacks the n gradients,
    # where indexing [:, :, i] in the loop would give each chunk's gradient a zero tensor of
    # the whole span.
    per_chunk = zip(*(x.unbind(2) for x in (u, w, q_carry, inner, end_decay, k_end)))
    outs = []
    for u_i, w_i, q_i, inner_i, end_i, k_end_i in per_chunk:
        delta = u_i - w_i @ state  # [b, h, c, dv]
        outs.append(q_i @ state + inner_i @ delta)  # [b, h, c, dv]
        state = end_i * state + k_end_i.transpose(-1, -2) @ delta  # [b, h, dk, dv]
    return torch.stack(outs, dim=2).reshape(b, h, n * c, dv), state


def packed_cu_seqlens(document_ids):
    """document_ids [b, s] -> FLA's ``cu_seqlens`` of the b rows flattened into one packed row
    of b * s tokens: int64 [n + 1] on their device, every document start (each sample's first
    token included: documents never run across samples) and then b * s. ``torch.nonzero``
    makes it wait on the device once: compute it once per microbatch and hand it to every
    layer (:func:`_fla_chunk`'s ``cu_seqlens``); the same tensor also lets FLA reuse the chunk
    indices it derives from it (cached by identity)."""
    b, s = document_ids.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.nonzero(starts.reshape(-1)).reshape(-1)  # int64
    return torch.cat([first, first.new_full((1,), b * s)])


def packed_rows(document_ids):
    """(cu_seqlens on the device, the same on the host) of the documents of ``document_ids``
    [b, s] with the samples flattened into one row (:func:`packed_cu_seqlens`: FLA's packed
    input), worked out once per microbatch (``chunk_gated_delta_rule``'s ``packed_rows``)."""
    cu_seqlens = packed_cu_seqlens(document_ids)
    return cu_seqlens, cu_seqlens.cpu()


FLA_DTYPES = (torch.bfloat16, torch.float16)  # v dtypes that go to FLA (not fp32: see below)


def _fla_device(x):
    """Whether FLA's Triton kernels run on x's device (CUDA; tests/fla_call_checks.py patches
    it to drive the FLA call on CPU, with FLA's kernels replaced by its PyTorch reference)."""
    return x.is_cuda


def fla_runs(x, dtype):
    """Whether :func:`chunk_gated_delta_rule` hands values of ``dtype`` on x's device to FLA
    (a sequence without a state carried in or out of packed documents)."""
    return (_fla_device(x) and dtype in FLA_DTYPES
            and accelerators.fla_chunk_gated_delta_rule() is not None)


def fla_packed_rows(layout, document_ids, dtype):
    """FLA's :func:`packed_rows` of ``document_ids``, kept once in ``layout`` (the
    microbatch's SequenceLayout, or an all-to-all's gathered one); None where FLA does not
    run (no documents, not CUDA, fp32 values, FLA absent): nothing is read then."""
    if document_ids is None or not fla_runs(document_ids, dtype):
        return None
    return layout.once("gdn_packed_rows", lambda: packed_rows(document_ids))


def _fla_chunk(q, k, v, g, beta, initial_state=None, output_final_state=False,
               document_ids=None, scale=None, cu_seqlens=None, cu_seqlens_cpu=None,
               chunk_indices=None):
    """The gated delta rule by FLA's ``chunk_gated_delta_rule`` (accelerators.py), given what Megatron-LM
    gives it (megatron/core/ssm/gated_delta_net): q, k and v in one dtype, the model's bf16 /
    fp16 (v's), g the fp32 log decay, beta in the model's dtype; FLA's kernels take q and k
    with the v-derived tensors into the same dot products and return ``o`` in q's dtype. Our q,
    k (unit norm, computed in fp32) and beta (a sigmoid computed in fp32) are rounded to v's
    dtype here: Megatron-LM's values (FLA's l2norm computes in fp32 and returns the input's
    dtype; its sigmoid of a bf16 tensor as well). Returns (o [b, s, h, dv] in v's dtype, final
    fp32 state or None).

    Packed documents (``document_ids`` [b, s], or ``cu_seqlens`` already computed from them by
    :func:`packed_cu_seqlens`, the row of all b samples) run as FLA's one packed row: the batch
    flattened to [1, b * s] with int64 ``cu_seqlens`` on the device, as FLA documents it
    (``torch.LongTensor``); no incoming or outgoing state then (chunk_gated_delta_rule keeps
    those on the PyTorch kernel). FLA derives its chunk indices from ``cu_seqlens``, which
    reads the lengths on the host (a device sync) unless ``cu_seqlens_cpu`` (the same values
    on the CPU) or ``chunk_indices`` (``fla.ops.utils.index.prepare_chunk_indices(cu_seqlens,
    64)``) is given: both are handed on as they are.
    """
    fla = accelerators.fla_chunk_gated_delta_rule()
    dtype = v.dtype
    q, k, beta, g = q.to(dtype), k.to(dtype), beta.to(dtype), g.to(torch.float32)
    if document_ids is None and cu_seqlens is None:
        return fla(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state)
    if initial_state is not None or output_final_state:
        raise ValueError("packed documents go to FLA without an incoming or outgoing state")
    b, s = k.shape[:2]
    if cu_seqlens is None:
        cu_seqlens = packed_cu_seqlens(document_ids)
    out, _ = fla(*(x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, g, beta)), scale=scale,
                 cu_seqlens=cu_seqlens.to(torch.int64), cu_seqlens_cpu=cu_seqlens_cpu,
                 chunk_indices=chunk_indices)
    return out.reshape(b, s, *out.shape[2:]), None


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                           document_ids=None, cu_seqlens=None, scale=None, packed_rows=None):
    """The gated delta rule over a (packed) sequence: q, k [b, s, h, dk], v [b, s, h, dv],
    g (log decay, fp32) and beta [b, s, h]; ``initial_state`` [b, h, dk, dv] fp32; document
    boundaries from ``document_ids`` [b, s] or ``cu_seqlens`` (b == 1). Returns
    (o [b, s, h, dv] in v's dtype, final fp32 state [b, h, dk, dv] or None).

    FLA's kernel (:func:`_fla_chunk`) runs on CUDA for bf16 / fp16 values (v's dtype) when
    flash-linear-attention is importable, except where a packed sequence also carries a state
    in or out; everything else runs :func:`torch_chunk_gated_delta_rule`: fp32 models too
    (FLA's Triton dot products round fp32 operands to TF32 where the GPU has it), and so the
    context-parallel state passing, which widens v to fp32. ``packed_rows``: (cu_seqlens,
    cu_seqlens_cpu) of ``document_ids`` flattened (:func:`packed_cu_seqlens` and its host
    copy), worked out once per microbatch, so FLA's route waits on the device for neither.
    """
    if cu_seqlens is not None:
        if document_ids is not None or k.shape[0] != 1:
            raise ValueError("cu_seqlens describes one packed row (batch 1) and replaces "
                             "document_ids; give one of them")
        document_ids = documents_from_cu_seqlens(cu_seqlens, k.shape[1])
    packed_state = document_ids is not None and (initial_state is not None or output_final_state)
    if fla_runs(k, v.dtype) and not packed_state:
        cu_cpu = None
        if packed_rows is not None and cu_seqlens is None:
            cu_seqlens, cu_cpu = packed_rows
        return _fla_chunk(q, k, v, g, beta, initial_state, output_final_state, document_ids,
                          scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_cpu)
    return torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state, output_final_state,
                                        document_ids, scale)
