"""``--verify-integrity``: Megatron-LM's SHA-256 manifest of a torch_dist checkpoint.

A save writes ``integrity.json`` into the iteration folder once every rank has written:
``{"algorithm": "sha256", "files": {relative path: hex digest}}`` for every file of the
checkpoint (Megatron-LM lists the folder's files; here that includes the ``rng/`` states,
which Megatron-LM keeps inside its .distcp files). A load with the flag re-hashes every
listed file on rank 0 before reading any, and every rank stops with one line naming each
file that is missing or whose bytes changed since the save.
"""
import hashlib
import json
import os

import torch.distributed as dist

MANIFEST = "integrity.json"
ALGORITHM = "sha256"
_CHUNK = 1 << 20  # bytes read at a time


def file_hash(path):
    """SHA-256 hex digest of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder):
    """Hash every file under ``folder`` (but the manifest) into ``folder/integrity.json``."""
    files = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, folder).replace(os.sep, "/")
            if relative != MANIFEST:
                files[relative] = file_hash(path)
    with open(os.path.join(folder, MANIFEST), "w") as file:
        json.dump({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, file, indent=2)


def problems(folder):
    """What is wrong with ``folder`` against its manifest, in words (empty: it is intact)."""
    manifest = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest):
        return [f"--verify-integrity: {folder} has no {MANIFEST} (it was saved without "
                f"--verify-integrity); load it without the flag"]
    try:
        with open(manifest) as file:
            saved = json.load(file)
        algorithm, files = saved.get("algorithm", ALGORITHM), saved["files"]
    except (ValueError, KeyError, TypeError) as error:
        return [f"--verify-integrity: {manifest} cannot be read ({type(error).__name__}); "
                f"the checkpoint's hashes are lost"]
    if algorithm != ALGORITHM:
        return [f"--verify-integrity: {manifest} uses the hash {algorithm!r}, not "
                f"{ALGORITHM!r}; load it without the flag"]
    found = []
    for relative, expected in files.items():
        path = os.path.join(folder, relative)
        if not os.path.isfile(path):
            found.append(f"checkpoint file {path} (listed in {manifest}) is missing")
            continue
        actual = file_hash(path)
        if actual != expected:
            found.append(f"checkpoint file {path} does not match its SHA-256 in {manifest} "
                         f"(expected {expected[:16]}..., got {actual[:16]}...): its bytes "
                         f"changed after the save")
    return found


def verify(folder, group, earlier):
    """Global rank 0 checks ``folder`` against its manifest and every rank of ``group`` (a
    group of every rank) raises the same ValueError when anything is wrong (``earlier``: how
    to resume from another checkpoint, appended)."""
    found = [problems(folder) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0, group=group)
    if found[0]:
        raise ValueError("; ".join(found[0]) + f"; {earlier}")
