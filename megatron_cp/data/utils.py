"""Shared helpers of the data package: split and blend parsing, the index-array cache.

The cache is built once: on global rank 0, which writes each ``.npy`` atomically; the
other ranks (when torch.distributed is initialized) wait until the files exist and then
memory-map them. The wait polls the file system rather than calling a collective
barrier, so the datasets may be built by any subset of ranks that includes global
rank 0 (the training loop builds them on TP rank 0 only); it gives up after
``MEGATRON_CP_DATA_CACHE_TIMEOUT`` seconds (default 3600).
"""
import hashlib
import json
import logging
import os
import re
import time

import numpy as np

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def parse_and_normalize_split(split):
    """``"949,50,1"`` -> three weights that sum to 1 (missing trailing weights are 0)."""
    text = split if isinstance(split, str) else ",".join(str(s) for s in split)
    try:
        weights = [float(s) for s in re.split(r"[,/]", text) if s.strip()]
    except ValueError as err:
        raise ValueError(f"split {split!r} must be up to three comma-separated non-negative "
                         "numbers, like '949,50,1'") from err
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split {split!r} must be up to three comma-separated non-negative "
                         "numbers with a positive sum, like '949,50,1'")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def get_split_ranges(split, num_documents):
    """Document ranges ``[(begin, end)] * 3`` for train/valid/test, like Megatron's.

    Each boundary adds ``round(weight * num_documents)``; any rounding excess is taken
    off every boundary so the last one lands on ``num_documents``.
    """
    weights = parse_and_normalize_split(split)
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [0] + [b - diff for b in bounds[1:]]
    assert bounds[-1] == num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(3)], weights


def parse_data_path(data_path):
    """``[w1, p1, w2, p2, ...]`` or ``[p1, p2, ...]`` -> (prefixes, normalized weights).

    Plain prefixes get equal weights, like Megatron's ``--data-path A B``.
    """
    if not data_path:
        raise ValueError("--data-path is empty; pass one or more dataset prefixes "
                         "(or --mock-data)")
    items = [str(x) for x in data_path]
    if len(items) == 1:
        return items, [1.0]
    try:
        weights = [float(w) for w in items[0::2]]
    except ValueError:
        weights = None
    if weights is None:
        return items, [1.0 / len(items)] * len(items)
    if len(items) % 2 != 0:
        raise ValueError(f"--data-path {items} mixes weights and prefixes; pass "
                         "'W1 PREFIX1 W2 PREFIX2 ...' or only prefixes")
    prefixes = items[1::2]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data-path weights {weights} must be non-negative with a "
                         "positive sum")
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def config_hash(description):
    """Stable md5 of a JSON-serializable description (the cache key)."""
    text = json.dumps(description, sort_keys=True, indent=1)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def global_rank():
    """Global rank under torch.distributed, 0 when it is not initialized."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def wait_for_files(paths, timeout=None, poll_interval=0.2):
    """Block until every path exists; ValueError naming the missing ones after ``timeout``."""
    if timeout is None:
        timeout = float(os.environ.get("MEGATRON_CP_DATA_CACHE_TIMEOUT", 3600))
    deadline = time.monotonic() + timeout
    while True:
        missing = [p for p in paths if not os.path.isfile(p)]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise ValueError(f"waited {timeout:.0f}s for global rank 0 to write the dataset index "
                             f"cache files {missing}; global rank 0 must build the datasets too, "
                             "and --data-cache-path must be a directory every rank can read "
                             "(raise MEGATRON_CP_DATA_CACHE_TIMEOUT for very large datasets)")
        time.sleep(poll_interval)


def build_or_load_cached(cache_dir, name, description, names, build_fn):
    """Index arrays ``names`` for ``description``: loaded from ``cache_dir`` or built.

    ``build_fn()`` returns a dict name -> numpy array. With ``cache_dir`` None the arrays
    are built in memory on every rank. Otherwise global rank 0 builds and saves any
    missing file, the other ranks wait for the files (no collective call), and every
    rank memory-maps them.
    """
    if cache_dir is None:
        return build_fn()
    key = config_hash(description)
    paths = {n: os.path.join(cache_dir, f"{key}-{name}-{n}.npy") for n in names}
    if global_rank() == 0 and not all(os.path.isfile(p) for p in paths.values()):
        try:
            os.makedirs(cache_dir, exist_ok=True)
            arrays = build_fn()
            with open(os.path.join(cache_dir, f"{key}-{name}-description.json"), "w") as f:
                json.dump(description, f, sort_keys=True, indent=1)
            for n, path in paths.items():
                tmp = f"{path}.tmp{os.getpid()}.npy"
                np.save(tmp, arrays[n], allow_pickle=False)
                os.replace(tmp, path)  # readers never see a half-written file
        except OSError as err:
            raise ValueError(f"cannot write the dataset index cache under {cache_dir} ({err}); "
                             "pass --data-cache-path with a writable directory") from err
        logger.info("built %s index arrays in %s (%s)", name, cache_dir, key)
    wait_for_files(list(paths.values()))
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}
