"""Hidden dropout (and the MoE router's input jitter) drawn from global coordinates.

Megatron-LM draws hidden-dropout masks from each rank's RNG stream, so which element is
dropped depends on the layout. Here the keep bit of the element (sample, token, hidden unit)
at a dropout site is the counter-based hash (megatron_cp/layers/counter_hash.py) of

    (seed, the site, the sample's number in the run's stream of samples,
     the token's index in its unpadded sample, the hidden unit)

Sites: the embedding's dropout (depth 0, and depth k for MTP depth k's lookup), each
layer's dropout after attention and after the MLP (its global layer number; MTP layers are
numbered after the decoder's), and the router's input jitter of each MoE layer. A hidden
state at a site is [s_x, b, h] with s_x = s_local (this CP rank's zigzag or packed-document
chunks, ``DropoutIds.positions`` giving their unpadded index) or, under sequence
parallelism, this TP rank's contiguous s_local/tp slice of them. :func:`token_coordinates`
names each local token's (sample, position); nothing in the hash depends on the rank, so
one process, DP, TP (replicated or SP), CP, PP and recomputation draw the same bits.

Cost: the [b, s_x] part of the hash is built once per site, the hidden unit absorbed last
(one finaliser over [s_x, b, h] int64); eval mode and p == 0 skip it entirely. Under
--torch-compile the mask is built eagerly (:func:`keep_mask`), the rest of the layer compiled.
"""
from collections import namedtuple

import torch
import torch.distributed as dist

from megatron_cp.layers.counter_hash import absorb, absorb_64, chain, dropout_scale, keep_threshold

DropoutIds = namedtuple("DropoutIds", "samples positions")
DropoutIds.__doc__ = """Where a microbatch's tokens sit in the run, for every random draw:
``samples`` [b] int64 (each sample's number in the run's stream of training samples; None:
a fresh random number per call) and ``positions`` [b, s_local] int64 (each token's index in
its unpadded sample; None: the token index is that)."""

Coordinates = namedtuple("Coordinates", "samples positions")
Coordinates.__doc__ = """The local hidden state's tokens: ``samples`` [b] int64 and
``positions`` [b, s_x] int64 (index in the unpadded sample of each of its s_x rows)."""

HIDDEN_START = 0x7F4A7C15  # not attention dropout's start word: the two never share a key
SITE_EMBEDDING, SITE_ATTENTION, SITE_MLP, SITE_JITTER = range(4)


def fresh_samples(b, device):
    """Sample numbers for a caller that gave none: b consecutive numbers from a random start
    (the default generator, the same on every rank that seeds it alike; recomputation
    restores it, so a recomputed call draws the same)."""
    start = int(torch.randint(2 ** 62, ()))
    return torch.arange(start, start + b, device=device)


def site_key(seed, site, number):
    """The 32-bit key of one site: ``site`` (SITE_*) and its ``number`` (the global layer
    number, or the embedding's MTP depth), the same on every rank."""
    return chain(absorb_64(seed, HIDDEN_START), site, number)


def layer_site_keys(seed, number, device=None):
    """int64 [3]: the keys of layer ``number``'s sites (after attention, after the MLP, the
    router's jitter) as a tensor. A compiled layer reads them as a buffer, an input of its
    graph, so layers of different numbers share one graph: an int key would be a constant
    that Dynamo guards on, one recompilation per layer until its recompile limit (8) leaves
    the deeper layers eager."""
    keys = [site_key(seed, site, number) for site in (SITE_ATTENTION, SITE_MLP, SITE_JITTER)]
    return torch.tensor(keys, dtype=torch.int64, device=device)


def sequence_shard(tp_group, sequence_parallel):
    """(rank, size) of this rank's slice of the local sequence: the TP rank and size under
    sequence parallelism, else (0, 1) (TP ranks hold the whole, replicated)."""
    if not sequence_parallel or tp_group is None or dist.get_world_size(tp_group) == 1:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def token_coordinates(ids, x, shard):
    """The Coordinates of hidden state ``x`` [s_x, b, h]: its rows are slice ``shard`` (rank,
    size) of the local sequence that ``ids`` (a DropoutIds or None) describes."""
    rows, b = x.shape[0], x.shape[1]
    lo, hi = shard[0] * rows, (shard[0] + 1) * rows
    samples = None if ids is None else ids.samples
    positions = None if ids is None else ids.positions
    if samples is None:
        samples = fresh_samples(b, x.device)
    if positions is None:
        positions = torch.arange(lo, hi, device=x.device).expand(b, rows)  # [b, s_x]
    else:
        positions = positions[:, lo:hi]  # [b, s_local] -> [b, s_x]
    return Coordinates(samples, positions)


def token_states(key, coords):
    """int64 [s_x, b] in [0, 2^32): the hash of (key, sample, position) of every token
    (``key`` an int or a 0-d int64 tensor: the same bits)."""
    state = absorb_64(coords.samples, key)  # [b]
    return absorb(coords.positions, state[:, None]).t()  # [b, s_x] -> [s_x, b]


def unit_hash(states, units):
    """int64 [..., units]: ``states`` [...] with each hidden unit's index absorbed last."""
    index = torch.arange(units, device=states.device)  # [h]
    return absorb(index, states[..., None])


# Eager even inside a --torch-compile layer: Inductor's CPU code generation vectorises these
# int64 shifts as float vectors and fails to build (torch 2.13); eager int64 ops are exact.
@torch.compiler.disable
def keep_mask(key, coords, units, p):
    """bool [s_x, b, units]: which elements of the site ``key`` are kept."""
    return unit_hash(token_states(key, coords), units) >= keep_threshold(p)


def hidden_dropout(x, p, training, key, coords):
    """Dropout of ``x`` [s_x, b, h] at the site ``key`` (:func:`site_key`): element (token,
    unit) is kept when its hash clears the threshold, kept ones scaled by 1/(1-p).
    ``coords``: :func:`token_coordinates` of x (unused, and may be None, in eval mode or at
    p == 0)."""
    if not training or p == 0.0:
        return x
    keep = keep_mask(key, coords, x.shape[-1], p)  # [s_x, b, h]
    # where() keeps only the bool mask for backward, as F.dropout does
    return torch.where(keep, x * dropout_scale(p), 0.0)


def uniform_multiplier(states, units, eps, dtype):
    """[..., units] in [1 - eps, 1 + eps) of ``dtype``: each (token, unit) hash's top 24 bits
    as a uniform, exact in fp32 (the router's input jitter)."""
    u = (unit_hash(states, units) >> 8).to(torch.float32) * 2.0 ** -24  # [..., h] in [0, 1)
    return ((1.0 - eps) + (2.0 * eps) * u).to(dtype)
