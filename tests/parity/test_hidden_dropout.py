"""Hidden dropout and the router's input jitter are functions of global coordinates.

The keep bit of element (sample, position in the unpadded sample, hidden unit) at a site is a
hash of (seed, site, sample, position, unit) only: cutting the hidden state into CP zigzag
chunks (with packed-document padding) and SP slices reads the same bits as one process,
while other sites, samples and seeds draw other masks. The layout parity of whole training
runs with dropout on is in the training parity tests (training_utils.TINY has it on).
"""
import math

import pytest
import torch

from megatron_cp.context_parallel import zigzag_indices
from megatron_cp.data.microbatch import prepare_microbatch
from megatron_cp.layers.hidden_dropout import (HIDDEN_START, SITE_ATTENTION, SITE_EMBEDDING,
                                              SITE_JITTER, SITE_MLP, Coordinates, DropoutIds,
                                              hidden_dropout, site_key, token_coordinates,
                                              token_states, uniform_multiplier, unit_hash)
from test_attention_dropout import _python_chain
from test_context_parallel_partition import DOC_LENGTHS, make_batch

P = 0.1
SCALE = 1.0 / (1.0 - P)


def _keep(key, ids, x, shard=(0, 1)):
    """bool [s_x, b, h]: the mask hidden_dropout applies to x at site ``key``."""
    ones = torch.ones_like(x)
    return hidden_dropout(ones, P, True, key, token_coordinates(ids, x, shard)) != 0


def test_hash_is_exact_integer_arithmetic():
    """Each element's bits equal the overflow-free Python chain, for a seed and sample
    numbers past 2^32 and positions up to 2^32 - 1."""
    seed = 2 ** 40 + 3
    key = site_key(seed, SITE_MLP, 5)
    assert key == _python_chain(HIDDEN_START, (seed, seed >> 32, SITE_MLP, 5))
    samples = torch.tensor([0, 2 ** 62 - 3])
    positions = torch.tensor([[0, 7, 2 ** 32 - 1], [1, 2 ** 20, 3]])
    got = unit_hash(token_states(key, Coordinates(samples, positions)), 4)  # [3, 2, 4]
    for j in range(2):
        for i in range(3):
            for unit in range(4):
                sample = int(samples[j])
                want = _python_chain(key, (sample, sample >> 32, int(positions[j, i]), unit))
                assert int(got[i, j, unit]) == want, (i, j, unit)


@pytest.mark.parametrize("cp,tp", [(1, 2), (2, 1), (2, 2), (4, 2)])
def test_mask_is_the_same_under_cp_chunks_and_sp_slices(cp, tp):
    """Plain samples: CP rank c's zigzag chunks, then (SP) TP rank t's contiguous slice of
    them, drop exactly the elements one process drops at those tokens."""
    s, b, h = 32, 2, 16
    samples = torch.tensor([40, 41])
    key = site_key(11, SITE_ATTENTION, 3)
    full = _keep(key, DropoutIds(samples, None), torch.empty(s, b, h))  # [s, b, h]
    for c in range(cp):
        local = zigzag_indices(c, cp, s) if cp > 1 else torch.arange(s)  # [s/cp]
        ids = DropoutIds(samples, None if cp == 1 else local.expand(b, -1))
        rows = s // cp // tp
        for t in range(tp):
            mine = _keep(key, ids, torch.empty(rows, b, h), (t, tp))  # [s/cp/tp, b, h]
            assert torch.equal(mine, full[local[t * rows:(t + 1) * rows]]), (c, t)


def test_packed_documents_with_cp_padding_read_the_unpadded_position():
    """Packed documents padded per document for CP (prepare_microbatch): every real token of
    every CP rank and SP slice gets the bits of its unpadded position."""
    batch = make_batch(doc_lengths=DOC_LENGTHS)
    b, s, h = 2, batch["tokens"].shape[1], 8
    samples = torch.tensor([7, 2 ** 40])
    key = site_key(3, SITE_EMBEDDING, 0)
    full = _keep(key, DropoutIds(samples, None), torch.empty(s, b, h))  # [s, b, h]
    cp, tp = 4, 2
    for c in range(cp):
        mine = prepare_microbatch(batch, c, cp)
        where, real = mine["unpadded_index"], mine["loss_mask"] > 0  # [b, s_local] each
        rows = where.shape[1] // tp
        for t in range(tp):
            keep = _keep(key, DropoutIds(samples, where), torch.empty(rows, b, h), (t, tp))
            part = slice(t * rows, (t + 1) * rows)
            want = full[where[:, part].t(), torch.arange(b)]  # [rows, b, h]
            ok = real[:, part].t()  # [rows, b]: pad tokens may draw anything
            assert torch.equal(keep[ok], want[ok]), (c, t)


def test_sites_samples_and_seeds_draw_other_masks():
    """About p^2 + (1-p)^2 of the bits agree between any two other coordinates (independent
    masks; another step's samples have other numbers), within 5 binomial standard
    deviations."""
    s, b, h = 64, 2, 64
    x = torch.empty(s, b, h)
    ids = DropoutIds(torch.tensor([10, 11]), None)
    base = _keep(site_key(11, SITE_MLP, 2), ids, x)
    others = [_keep(site_key(11, SITE_ATTENTION, 2), ids, x),  # the other site of the layer
              _keep(site_key(11, SITE_MLP, 3), ids, x),  # the next layer
              _keep(site_key(11, SITE_EMBEDDING, 2), ids, x),  # MTP depth 2's embedding
              _keep(site_key(11, SITE_MLP, 2), DropoutIds(torch.tensor([12, 13]), None), x),
              _keep(site_key(12, SITE_MLP, 2), ids, x)]
    agree, n = P * P + (1 - P) ** 2, base.numel()
    for k, other in enumerate(others):
        rate = (other == base).float().mean().item()
        assert abs(rate - agree) < 5 * math.sqrt(agree * (1 - agree) / n), (k, rate)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction_and_scale(p):
    """The kept fraction is 1 - p within 5 binomial standard deviations, neighbouring units
    are dropped independently, and kept elements are scaled by 1/(1-p)."""
    s, b, h = 128, 4, 128
    x = torch.rand(s, b, h) + 0.5
    coords = token_coordinates(DropoutIds(torch.arange(b) + 99, None), x, (0, 1))
    out = hidden_dropout(x, p, True, site_key(1234, SITE_MLP, 0), coords)
    keep = out != 0
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    both = (~keep[..., 1:] & ~keep[..., :-1]).float().mean().item()
    m = keep[..., 1:].numel()
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / m)
    torch.testing.assert_close(out[keep], x[keep] / (1 - p), rtol=1e-6, atol=0)


def test_eval_p0_and_p1():
    """Eval mode and p == 0 return x itself (no hash drawn: coordinates may be None); p == 1
    drops everything."""
    x = torch.randn(8, 2, 4)
    key = site_key(1, SITE_MLP, 0)
    assert hidden_dropout(x, P, False, key, None) is x
    assert hidden_dropout(x, 0.0, True, key, None) is x
    coords = token_coordinates(None, x, (0, 1))
    assert torch.equal(hidden_dropout(x, 1.0, True, key, coords), torch.zeros_like(x))


def test_without_sample_ids_a_fresh_draw_per_call():
    """A caller that gives no sample numbers gets a random start per call, repeatable from
    the default generator's state (as recomputation restores it)."""
    x = torch.empty(16, 2, 8)
    torch.manual_seed(5)
    first, second = _keep(1, None, x), _keep(1, None, x)
    torch.manual_seed(5)
    assert torch.equal(_keep(1, None, x), first)
    assert not torch.equal(first, second)


def test_jitter_is_uniform_in_range_and_layout_free():
    """The router's jitter multiplier lies in [1 - eps, 1 + eps), has the uniform's mean
    and variance, and a token's row of it follows its coordinates, not its place."""
    eps, s, b, h = 0.01, 64, 2, 64
    coords = Coordinates(torch.tensor([3, 4]), torch.arange(s).expand(b, s))
    key = site_key(7, SITE_JITTER, 1)
    states = token_states(key, coords)  # [s, b]
    m = uniform_multiplier(states.reshape(-1), h, eps, torch.float32)  # [T, h]
    assert m.min() >= 1 - eps and m.max() < 1 + eps
    n = m.numel()
    sd = 2 * eps / math.sqrt(12)
    assert abs(m.mean().item() - 1.0) < 5 * sd / math.sqrt(n)
    # a uniform's kurtosis is 1.8: sd(sample variance) = sd^2 sqrt(0.8 / n), half that for sd
    assert abs(m.std().item() - sd) < 5 * sd * math.sqrt(0.8 / n) / 2
    part = Coordinates(coords.samples, coords.positions[:, 40:50])  # another split's rows
    got = uniform_multiplier(token_states(key, part).reshape(-1), h, eps, torch.float32)
    assert torch.equal(got, m.view(s, b, h)[40:50].reshape(-1, h))
