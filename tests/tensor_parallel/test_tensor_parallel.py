"""Tensor-parallel mappings, layers, loss and RNG against single-process PyTorch."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_harness import run_workers
from megatron_cp import tensor_parallel as tpar
from megatron_cp.distributed.initialize import initialize_model_parallel

close = torch.testing.assert_close


def _mappings(rank, world):
    state = initialize_model_parallel(tensor_model_parallel_size=world)
    g = state.group("tp")
    torch.manual_seed(0)
    full = torch.randn(world * 2, 3, world * 4)  # [s, b, h], identical on all ranks
    up = torch.randn_like(full)  # upstream gradient of the full tensor
    s_chunk, h_chunk = full.shape[0] // world, full.shape[2] // world
    mine_s = slice(rank * s_chunk, (rank + 1) * s_chunk)
    mine_h = slice(rank * h_chunk, (rank + 1) * h_chunk)

    def run(fn, x, grad):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(grad)
        return y.detach(), x.grad

    # f: identity forward, all-reduce backward (each rank's grad = rank-scaled upstream)
    y, gx = run(lambda x: tpar.copy_to_tensor_model_parallel_region(x, g), full, up * (rank + 1))
    close(y, full)
    close(gx, up * sum(range(1, world + 1)))
    # g: all-reduce forward, identity backward
    y, gx = run(lambda x: tpar.reduce_from_tensor_model_parallel_region(x, g), full * (rank + 1), up)
    close(y, full * sum(range(1, world + 1)))
    close(gx, up)
    # scatter / gather along the last dim
    y, gx = run(lambda x: tpar.scatter_to_tensor_model_parallel_region(x, g), full, up[..., mine_h])
    close(y, full[..., mine_h])
    expect = torch.zeros_like(full)
    for r in range(world):  # gathered grads: each rank contributes its slice of `up`
        expect[..., r * h_chunk:(r + 1) * h_chunk] = up[..., r * h_chunk:(r + 1) * h_chunk]
    close(gx, expect)
    y, gx = run(lambda x: tpar.gather_from_tensor_model_parallel_region(x, g), full[..., mine_h], up)
    close(y, full)
    close(gx, up[..., mine_h])
    # sequence parallel: scatter along s, gather (+reduce-scatter bwd), reduce-scatter (+gather bwd)
    y, gx = run(lambda x: tpar.scatter_to_sequence_parallel_region(x, g), full, up[mine_s])
    close(y, full[mine_s])
    close(gx, up)
    y, gx = run(lambda x: tpar.gather_from_sequence_parallel_region(x, g), full[mine_s], up * (rank + 1))
    close(y, full)
    close(gx, (up * sum(range(1, world + 1)))[mine_s])
    y, gx = run(lambda x: tpar.reduce_scatter_to_sequence_parallel_region(x, g), full * (rank + 1),
                up[mine_s])
    close(y, (full * sum(range(1, world + 1)))[mine_s])
    close(gx, up)
    return True


def _layers(rank, world):
    state = initialize_model_parallel(tensor_model_parallel_size=world)
    g = state.group("tp")
    init = tpar.normal_init(0.5)
    s, b, h_in, h_out, vocab = 4 * world, 2, 8, 4 * world, 8 * world
    torch.manual_seed(1)
    x = torch.randn(s, b, h_in)
    for sp in (False, True):
        for stride in (1, 2):
            col = tpar.ColumnParallelLinear(h_in, h_out, tp_group=g, init_method=init, seed=3,
                                            sequence_parallel=sp, gather_output=stride == 1,
                                            stride=stride)
            with torch.no_grad():
                col.bias.normal_(generator=torch.Generator().manual_seed(10 + rank))
            ref = torch.nn.Linear(h_in, h_out)
            with torch.no_grad():
                ref.weight.copy_(tpar.merge_shards(_all(col.weight, g), 0, stride))
                ref.bias.copy_(tpar.merge_shards(_all(col.bias, g), 0, stride))
            xin = x[rank * (s // world):(rank + 1) * (s // world)] if sp else x
            xin = xin.clone().requires_grad_()
            xr = x.clone().requires_grad_()
            out, out_ref = col(xin), ref(xr)
            if stride > 1:  # stacked sub-matrices: gather the shards back into full order
                gathered = tpar.gather_from_tensor_model_parallel_region(out, g)  # [s, b, out]
                out = tpar.merge_shards(gathered.chunk(world, dim=-1), out.dim() - 1, stride)
            close(out, out_ref)
            out.sum().backward()
            out_ref.sum().backward()
            close(tpar.merge_shards(_all(col.weight.grad, g), 0, stride), ref.weight.grad)
            close(tpar.merge_shards(_all(col.bias.grad, g), 0, stride), ref.bias.grad)
            close(xin.grad, xr.grad[rank * (s // world):(rank + 1) * (s // world)] if sp else xr.grad)
        row = tpar.RowParallelLinear(h_out, h_in, tp_group=g, init_method=init, seed=4,
                                     sequence_parallel=sp)
        ref = torch.nn.Linear(h_out, h_in)
        with torch.no_grad():
            row.bias.normal_(generator=torch.Generator().manual_seed(5))
            ref.weight.copy_(tpar.merge_shards(_all(row.weight, g), 1))
            ref.bias.copy_(row.bias)
        full_in = torch.randn(s, b, h_out, generator=torch.Generator().manual_seed(6))
        chunk = h_out // world
        xin = full_in[..., rank * chunk:(rank + 1) * chunk].clone().requires_grad_()
        xr = full_in.clone().requires_grad_()
        out, out_ref = row(xin), ref(xr)
        mine = slice(rank * (s // world), (rank + 1) * (s // world))
        close(out, out_ref[mine] if sp else out_ref)
        (out * 1.5).sum().backward()
        (out_ref * 1.5).sum().backward()
        close(tpar.merge_shards(_all(row.weight.grad, g), 1), ref.weight.grad)
        bias_grad = row.bias.grad.clone()
        if sp:  # each rank saw its own tokens: the bias gradient is summed over TP
            dist.all_reduce(bias_grad, group=g)
        close(bias_grad, ref.bias.grad)
        close(xin.grad, xr.grad[..., rank * chunk:(rank + 1) * chunk])
    # vocab-parallel embedding
    emb = tpar.VocabParallelEmbedding(vocab, 6, tp_group=g, init_method=init, seed=8)
    ref = torch.nn.Embedding(vocab, 6)
    with torch.no_grad():
        ref.weight.copy_(tpar.merge_shards(_all(emb.weight, g), 0))
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(9))
    out, out_ref = emb(tokens), ref(tokens).transpose(0, 1)
    close(out, out_ref)
    out.pow(2).sum().backward()
    out_ref.pow(2).sum().backward()
    close(tpar.merge_shards(_all(emb.weight.grad, g), 0), ref.weight.grad)
    # vocab-parallel cross entropy, with large logits for stability
    logits = torch.randn(s, b, vocab, generator=torch.Generator().manual_seed(11)) * 30
    target = torch.randint(0, vocab, (s, b), generator=torch.Generator().manual_seed(12))
    chunk = vocab // world
    local = logits[..., rank * chunk:(rank + 1) * chunk].clone().requires_grad_()
    full = logits.clone().requires_grad_()
    loss = tpar.vocab_parallel_cross_entropy(local, target, g)
    loss_ref = F.cross_entropy(full.view(-1, vocab), target.view(-1), reduction="none").view(s, b)
    close(loss, loss_ref)
    w = torch.rand(s, b, generator=torch.Generator().manual_seed(13))
    (loss * w).sum().backward()
    (loss_ref * w).sum().backward()
    close(local.grad, full.grad[..., rank * chunk:(rank + 1) * chunk])
    # TP weights equal the TP=1 ones: the full weight is drawn first, then split
    lone = tpar.ColumnParallelLinear(h_in, h_out, tp_group=None, init_method=init, seed=3)
    close(lone.weight, tpar.merge_shards(_all(tpar.ColumnParallelLinear(
        h_in, h_out, tp_group=g, init_method=init, seed=3).weight, g), 0))
    return True


def _all(t, g):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(g))]
    dist.all_gather(parts, t.detach().contiguous(), group=g)
    return parts


def _rng(rank, world):
    state = initialize_model_parallel(tensor_model_parallel_size=world)
    tracker = tpar.model_parallel_seed(123, state.rank("tp"))
    x = torch.ones(1000)
    outside = F.dropout(x, 0.5, True)
    with tracker.fork():
        inside = F.dropout(x, 0.5, True)
    after = F.dropout(x, 0.5, True)  # the default stream continues as if fork never ran
    torch.manual_seed(123)
    F.dropout(x, 0.5, True)
    close(after, F.dropout(x, 0.5, True))
    gathered = [_all(t, state.group("tp")) for t in (outside, inside)]
    close(gathered[0][0], gathered[0][1])
    assert not torch.equal(gathered[1][0], gathered[1][1]), "TP-region dropout masks must differ"
    return True


def test_mappings_forward_backward():
    assert all(run_workers(_mappings, 2)) and all(run_workers(_mappings, 4))


def test_layers_match_torch():
    assert all(run_workers(_layers, 2))


def test_rng_tracker():
    assert all(run_workers(_rng, 2))
