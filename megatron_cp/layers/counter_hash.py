"""A counter-based integer hash: random bits that are a pure function of coordinates.

Every random draw of the model that must be the same under every parallel layout (attention
dropout, hidden dropout, the MoE router's input jitter) hashes where the element sits in the
run (seed, site, sample number, position, unit, ...) instead of reading an RNG stream, whose
state would depend on how the work is split over ranks. The words are chained through
murmur3's 32-bit finaliser (:func:`absorb`). It runs in int64 torch ops on values below 2^32,
multiplying by 16-bit halves of its constants, so no product reaches 2^63 (no signed
overflow) and every shift is of a non-negative value (arithmetic and logical shifts agree):
exact, and the same bits on CPU and CUDA, eager or compiled. No float.
"""
MASK32 = 0xFFFFFFFF


def _mul32(x, c):
    """(x * c) mod 2^32 for x in [0, 2^32) (an int64 tensor or an int) and a 32-bit constant:
    by the 16-bit halves of c, so every intermediate stays below 2^49."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix(x):
    """murmur3's 32-bit finaliser: a bijection of [0, 2^32) in which every input bit flips
    each output bit with probability about 1/2."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def absorb(word, state):
    """Hash ``word`` (its low 32 bits; negative ints in two's complement) into ``state``
    (ints or int64 tensors in [0, 2^32), broadcast together)."""
    return mix((word & MASK32) ^ state)


def absorb_64(word, state):
    """Hash a non-negative 64-bit ``word`` (e.g. a seed or a sample number): both halves."""
    return absorb(word >> 32, absorb(word, state))


def chain(state, *words):
    """``state`` with each of ``words`` absorbed in turn (ints: a key built once, on the host)."""
    for word in words:
        state = absorb(word, state)
    return state


def keep_threshold(p):
    """Hash values at or above this are kept: P(keep) = 1 - p up to 2^-32."""
    return min(int(round(p * 2.0 ** 32)), 2 ** 32)


def dropout_scale(p):
    """Megatron's scale of the kept elements, 1/(1-p); p = 1 drops everything."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
