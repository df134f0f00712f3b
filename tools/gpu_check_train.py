"""Sections of tools/gpu_check.py for training paths that landed after its first GPU run (see
tools/gpu_check_paths.py), through the real trainer: each run is ``pretrain_gpt.py`` itself,
the training entry point, started as its own one-rank job (gloo on the CPU, NCCL on CUDA), and
its losses are read from its log (``lm loss`` at --log-interval 1, seven significant digits:
far below the tolerances). Nothing here imports the training loop. The runs a path compares
start together, so their start-ups overlap.

Each path trains a small Llama-style GPT (RMSNorm, SwiGLU, GQA, rotary, packed documents) a
few steps with its flag, three times: fp32 on the device against fp32 on the CPU (the loss
curves within TRAIN_FP32_TOL), and --bf16 (fp32 masters) on the device against fp32 on the
device (within TRAIN_BF16_TOL), as gpu_check's ``train`` section does for the plain model.

- mtp: --mtp-num-layers 1 (the MTP loss reaches the shared embedding and output layer).
- mup: --use-mup (width multiplier 4: scaled init, attention scale 1/d in the kernels,
  embedding and output multipliers, per-group learning rates).
- muon: --optimizer muon; its Newton-Schulz steps run in bf16 on every device (Megatron-LM's
  default --muon-fp32-matmul-prec medium), so even the fp32 runs are held to the bf16 bound.
  Also the orthogonalised update itself (``Orthogonalizer``, three matrix shapes) on the
  device against fp32 on the CPU: medium (bf16 steps) and high (fp32, TF32 on CUDA).
- fsdp2: --use-torch-fsdp2 on one rank (FSDP2's own mixed precision under --bf16).
- sinkhorn: --moe-router-load-balancing-type sinkhorn (4 experts, top-1); also the
  balancing iteration on the device against the CPU (the balanced scores, and the same
  expert choice wherever the CPU's choice is not a near-tie) and one MoE layer with the
  sinkhorn router (top-2, both dispatchers) on the device against the CPU, fp32.
- offload: --cpu-offloading-num-layers 1 (run at the end of the offload section).
"""
import functools
import os
import re
import socket
import subprocess
import sys
import types

import torch

from megatron_cp.moe.balancing import sinkhorn
from megatron_cp.optimizer.muon import Orthogonalizer
from gpu_check_lib import (TF32_TOLERANCE, TOLERANCE, TRAIN_BF16_TOL, TRAIN_FP32_TOL, Series,
                           supported_dtypes)
from gpu_check_fp8 import section_fp8
from gpu_check_moe import check_layer

TRAIN_SECTIONS = ("mtp", "mup", "muon", "fsdp2", "sinkhorn", "fp8")  # offload: gpu_check_layers.py
CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(ROOT, "pretrain_gpt.py")  # the training entry point, run as a program
LOSS = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.* lm loss: (\S+) \|")
BASE = ("--num-layers 2 --hidden-size {hidden} --num-attention-heads 4 --group-query-attention "
        "--num-query-groups 2 --seq-length {seq} --max-position-embeddings {seq} "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters {steps} --lr 3e-3 "
        "--min-lr 3e-4 --lr-warmup-iters 1 --lr-decay-style cosine --clip-grad 1.0 "
        "--hidden-dropout 0 --attention-dropout 0 --mock-data --vocab-size 256 "
        "--make-vocab-size-divisible-by 64 --log-interval 1 --eval-iters 0 --seed 11 "
        "--num-workers 0 --position-embedding-type rope --normalization RMSNorm --swiglu "
        "--disable-bias-linear --untie-embeddings-and-output-weights "
        "--reset-attention-mask --reset-position-ids --eod-mask-loss")
PATH_FLAGS = {
    "mtp": "--mtp-num-layers 1",
    "mup": "--use-mup --mup-base-hidden-size {base} --mup-embedding-mult 2",
    "muon": "--optimizer muon",
    "fsdp2": "--use-torch-fsdp2",
    "sinkhorn": "--num-experts 4 --moe-router-topk 1 --moe-router-load-balancing-type sinkhorn",
    "offload": "--cpu-offloading-num-layers 1",
    "fp8/tensorwise": "--fp8-format hybrid --fp8-recipe tensorwise",
    "fp8/delayed": "--fp8-format hybrid --fp8-recipe delayed",
}


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TrainingRun:
    """``pretrain_gpt.py`` with ``argv`` on ``device`` as a one-rank job, started now (a
    process of its own: the CPU through gloo, a CUDA device through NCCL, as torchrun would
    start rank 0 there); :meth:`losses` waits for it."""

    def __init__(self, argv, device):
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the training rows run on the CPU or CUDA, not {device}")
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()),
               "LOCAL_RANK": str(device.index or 0) if device.type == "cuda" else "0"}
        backend = "nccl" if device.type == "cuda" else "gloo"
        command = [sys.executable, ENTRY, *argv.split(), "--distributed-backend", backend]
        self.argv, self.device = argv, device
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.result = None

    def losses(self):
        """The per-iteration losses (float64 [n]); RuntimeError with the end of its log when
        the run failed or logged no loss."""
        if self.result is None:
            out, _ = self.process.communicate()
            found = {int(it): float(loss) for it, loss in LOSS.findall(out)}
            if self.process.returncode != 0 or not found:
                tail = "\n".join(out.strip().splitlines()[-15:])
                raise RuntimeError(f"pretrain_gpt.py on {self.device} ended with status "
                                   f"{self.process.returncode} ({len(found)} losses logged):"
                                   f"\n{tail}")
            self.result = torch.tensor([found[it] for it in sorted(found)], dtype=torch.float64)
        return self.result

    def stop(self):
        """End it if it still runs (its row was not needed)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def section_train_path(report, device, path, plan):
    """The path's two loss-curve rows (see the module docstring)."""
    hidden, seq, steps = plan
    argv = f"{BASE} {PATH_FLAGS[path]}".format(hidden=hidden, seq=seq, steps=steps,
                                                base=hidden // 4)
    bf16 = torch.bfloat16 in supported_dtypes(device)
    runs = {}
    for where, low in ((device, False), (CPU, False)) + (((device, True),) if bf16 else ()):
        if (where, low) not in runs:  # on the CPU, its own reference
            runs[(where, low)] = TrainingRun(argv + (" --bf16" if low else ""), where)
    # Newton-Schulz in bf16; FP8 roundings that last-bit differences flip
    tol = TRAIN_BF16_TOL if path == "muon" or path.startswith("fp8") else TRAIN_FP32_TOL
    tag = f"{steps}-steps/s={seq}/loss"
    try:
        report.run(f"{path}/train/fp32/{device.type}-vs-cpu/{tag}", lambda: Series(
            runs[(device, False)].losses(), runs[(CPU, False)].losses(), tol))
        name = f"{path}/train/bf16-vs-fp32/{device.type}/{tag}"
        if not bf16:
            report.skip(name, f"{device} has no bf16 support")
            return
        report.run(name, lambda: Series(runs[(device, True)].losses(),
                                        runs[(device, False)].losses(), TRAIN_BF16_TOL))
    finally:
        for run in runs.values():
            run.stop()


# ----------------------------------------------------------------------------- muon
def orthogonalizer(precision):
    """Muon's update of a whole matrix (no TP), Megatron-LM's default settings otherwise."""
    return Orthogonalizer(types.SimpleNamespace(
        muon_num_ns_steps=5, muon_coefficient_type="quintic", muon_fp32_matmul_prec=precision,
        muon_scale_mode="spectral", muon_extra_scale_factor=1.0, muon_tp_mode="blockwise",
        muon_split_qkv=True))


def check_orthogonalize(shape, precision, device):
    """The orthogonalised, scaled update on the device against fp32 on the CPU."""
    update = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    got = orthogonalizer(precision)(update.to(device), update.to(device))
    want = orthogonalizer("high")(update, update)  # the CPU keeps fp32 matmuls at "high"
    if precision == "medium":  # the steps in bf16
        tol = TOLERANCE[torch.bfloat16]
    else:  # fp32: on CUDA torch's "high" precision runs TF32
        tol = TF32_TOLERANCE if device.type == "cuda" else TOLERANCE[torch.float32]
    return {"update": (got, want, tol)}


def section_muon(report, device, quick, train):
    shapes = ((32, 32), (48, 16)) if quick else ((1024, 1024), (2048, 512), (384, 1536))
    for shape in shapes:
        for precision in ("medium", "high"):
            report.run(f"muon/orthogonalize/{shape[0]}x{shape[1]}/{precision}/"
                       f"{device.type}-vs-cpu", check_orthogonalize, shape, precision, device)
    train("muon")


# ----------------------------------------------------------------------------- sinkhorn
def check_sinkhorn(tokens, experts, topk, device):
    """The balanced scores of skewed logits (padding tokens weighted 0) on the device
    against the CPU; the device's top-k experts are the CPU's for every token whose k-th
    and (k+1)-th balanced scores are more than 1e-3 apart (relative)."""
    gen = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=gen) - torch.arange(experts) * 0.5
    weights = (torch.rand(tokens, generator=gen) > 0.1).float()
    got = sinkhorn(logits.to(device), weights.to(device), ())  # one rank: no groups
    want = sinkhorn(logits, weights, ())
    top = want.topk(topk + 1, dim=-1).values  # [T, k + 1]
    clear = (top[:, -2] - top[:, -1]) > 1e-3 * top[:, -2]
    chosen = got.topk(topk, dim=-1).indices.sort(-1).values.cpu()
    wanted = want.topk(topk, dim=-1).indices.sort(-1).values
    differ = ((chosen != wanted).any(-1) & clear).float()  # [T]
    return {"scores": (got, want, TOLERANCE[torch.float32]),
            "choice": (differ, torch.zeros_like(differ), 0.0)}


def section_sinkhorn(report, device, quick, train):
    tokens, seq = (64, 16) if quick else (8192, 256)
    for topk in (1, 2):
        report.run(f"sinkhorn/balance/T={tokens}/E=8/top{topk}/fp32/{device.type}-vs-cpu",
                   check_sinkhorn, tokens, 8, topk, device)
    overrides = dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0)
    for dispatcher in ("alltoall", "allgather"):
        report.run(f"sinkhorn/layer/{dispatcher}/top2/s={seq}/fp32/{device.type}-vs-cpu",
                   check_layer, dispatcher, None, seq, device, overrides)
    train("sinkhorn")


def train_sections(report, device, quick):
    """{section: run} of :data:`TRAIN_SECTIONS` and "offload" (its training rows only)."""
    plan = (32, 32, 2) if quick else (128, 512, 8)  # hidden, seq, steps
    train = functools.partial(section_train_path, report, device, plan=plan)
    sections = {path: functools.partial(train, path) for path in ("mtp", "mup", "fsdp2",
                                                                   "offload")}
    sections["muon"] = lambda: section_muon(report, device, quick, train)
    sections["fp8"] = lambda: section_fp8(report, device, quick, train)
    sections["sinkhorn"] = lambda: section_sinkhorn(report, device, quick, train)
    return sections
