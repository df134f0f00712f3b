"""tools/gpu_check.py on the CPU: the suite's logic runs and has teeth.

- ``--device cpu --quick`` exits 0, every section prints rows, every row passes, and the
  rows cover every block kind, both kernels, fp32 and bf16, ring / Ulysses / hybrid at
  CP 2 and 4, and every path of tools/gpu_check_paths.py (the table is parsed).
- The one-process simulation the suite's CP rows rest on IS the distributed algorithm: its
  outputs and gradients equal, bit for bit, those of 4 gloo ranks running
  context_parallel_attention (ring, Ulysses with dummy heads and repeated KV, hybrid).
- Deliberately broken code makes it exit 1, on the rows that exercise the broken piece only:
  bf16 document-masked gradients 10% off (the class of bug the suite was built for), a ring
  merge that forgets to update the log-sum-exp, a kernel that raises, a hidden-dropout mask
  drawn from a rank's local token positions, an activation offload that loses what it
  saved, and a Gated DeltaNet rule that drops its state between chunks.
- A section past its time budget prints its remaining checks CAPPED (exit status 2 when
  nothing failed) and the summary lists them; the flash section's cuDNN bypass is undone.

One compute thread: the box has 2 cores shared with other jobs, where two OpenMP threads
spinning against each other made the same run 30x slower.
"""
import collections
import os
import re
import subprocess
import sys

import pytest
import torch

from dist_harness import run_workers
import gpu_check  # tools/ is on pytest's path (pytest.ini), as gpu_check.py's siblings are on its own
import gpu_check_layers
import gpu_check_lib
import gpu_check_paths
from gpu_check_lib import Randn, microbatch
from megatron_cp.layers.activation_offload import ActivationOffloader, _OnHost
from megatron_cp.context_parallel import (blockwise, context_parallel_attention, cuda_kernels,
                                          kernels, ring)
from megatron_cp.context_parallel.simulate import simulated_attention
from megatron_cp.data.microbatch import prepare_microbatch
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.layers import gated_delta_rule, hidden_dropout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROW = re.compile(r"^(?P<name>[a-z]\S*)\s+(?P<worst>\S+)\s+(?P<abs>\S+)\s+(?P<rel>\S+)\s+"
                 r"(?P<tol>\S+)\s+(?P<status>PASS|FAIL|SKIP|CAPPED)$")


def _rows(text):
    """{check name: status} of the table rows in the suite's output."""
    return {m["name"]: m["status"] for m in map(ROW.match, text.splitlines()) if m}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run_in_process(capsys, *flags):
    """main() with --device cpu --quick and ``flags`` -> (exit status, {name: status})."""
    status = gpu_check.main(["--device", "cpu", "--quick", *flags])
    return status, _rows(capsys.readouterr().out)


def test_quick_cpu_suite_passes_every_section():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}  # as docs/gpu.md runs it
    result = subprocess.run([sys.executable, "tools/gpu_check.py", "--device", "cpu", "--quick"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    rows = _rows(out)
    assert {name.split("/")[0] for name in rows} == set(gpu_check.SECTIONS)
    assert set(rows.values()) == {"PASS"}, [n for n, s in rows.items() if s != "PASS"]
    summary = re.search(r"^(\d+) checks: (\d+) PASS, 0 FAIL, 0 SKIP, 0 CAPPED in", out, re.M)
    assert summary and int(summary[1]) == int(summary[2]) == len(rows)

    def covered(*parts):
        return any(all(part in name for part in parts) for name in rows)

    for kind in ("causal", "full", "empty", "segments"):
        for dtype in ("fp32", "bf16"):
            for kernel in ("auto", "torch"):
                assert covered(f"blocks/{kind}/", f"/{dtype}/{kernel}"), (kind, dtype, kernel)
    assert covered("blocks/", "/sbhd/") and covered("blocks/", "/bhsd/")
    assert covered("blocks/", "/s=40/") and covered("blocks/", "/s=512/")
    assert covered("local/packed/", "/auto") and covered("local/packed/", "/torch")
    assert covered("local/plain/")
    for comm in ("cp/p2p/", "cp/a2a/", "cp/a2a+p2p("):
        for dtype in ("fp32", "bf16"):
            assert covered(comm, "/packed/", f"/{dtype}") and covered(comm, "/plain/", f"/{dtype}")
    for cp_size in (2, 4):
        assert covered("cp/p2p/", f"/P={cp_size}/") and covered("cp/a2a/", f"/P={cp_size}/")
    assert covered("cp/a2a/", "/h6:2/")  # 6 heads over 4 ranks: dummy heads
    assert covered("train/fp32/") and covered("train/bf16-vs-fp32/")
    assert rows["blocks/kinds-covered"] == "PASS"
    # the paths after the first GPU run (tools/gpu_check_paths.py and its two siblings)
    for kind in ("causal", "full", "segments"):
        assert covered(f"flash/blocks/{kind}/", "/bf16/auto")
    assert covered("flash/local/packed/") and rows["flash/route"] == "PASS"
    for kind in ("plain/", "packed/", "plain+state/", "packed+state/"):
        for dtype in ("fp32", "bf16"):
            assert covered("gdn/rule/torch/" + kind, dtype)
    assert covered("gdn/layer/torch/packed/") and rows["gdn/routes"] == "PASS"
    for part in ("block/causal/", "block/full/", "local/packed/", "local/plain/"):
        assert covered("mla/" + part, "/d24:16/", "/bf16")
    assert covered("mla/layer/packed/")
    assert covered("dropout/hidden/P=4/sp/", "/bf16/") and covered("dropout/attention/mask/")
    assert covered("dropout/attention/packed/", "/bf16/")
    for part in ("logits/", "mlp/"):
        assert covered("tiled/" + part, "/bf16") and covered("tiled/" + part, "/fp32")
    assert covered("tiled/model/")
    for kind in ("column", "row"):
        for setting in gpu_check_layers.OVERLAP_SETTINGS:
            assert covered(f"tp_overlap/{kind}/{setting}/", "/bf16")
    assert covered("offload/model/recompute/") and covered("offload/model/plain/", "/bf16/")
    assert rows["offload/hooks"] == "PASS"
    for path in ("mtp", "mup", "muon", "fsdp2", "sinkhorn", "offload"):
        assert covered(f"{path}/train/fp32/cpu-vs-cpu/") and covered(f"{path}/train/bf16-vs-fp32/")
    assert covered("muon/orthogonalize/", "/medium/") and covered("muon/orthogonalize/", "/high/")
    assert covered("sinkhorn/balance/", "/top2/") and covered("sinkhorn/layer/allgather/")
    for section in gpu_check.SECTIONS:
        assert re.search(rf"^    \[{section}: [\d.]+ s\]$", out, re.M), section  # wall time


def test_wrong_bf16_document_gradients_fail(monkeypatch, capsys, one_thread):
    real = blockwise.segments_backward

    def broken(dout, q, *args):
        dq, dk, dv = real(dout, q, *args)
        return (dq, dk * 1.1, dv) if q.dtype == torch.bfloat16 else (dq, dk, dv)

    monkeypatch.setattr(blockwise, "segments_backward", broken)
    status, rows = _run_in_process(capsys, "--sections", "blocks,local", "--max-seq", "128")
    assert status == 1
    failed = {name for name, s in rows.items() if s == "FAIL"}
    # every bf16 segments block and packed local run fails; nothing else does
    expected = {name for name in rows if "/bf16/" in name and
                (name.startswith("blocks/segments/") or name.startswith("local/packed/"))}
    assert expected and failed == expected


def test_ring_merge_that_keeps_a_stale_lse_fails(monkeypatch, capsys, one_thread):
    def stale_lse(out_acc, lse_acc, out_blk, lse_blk):
        saved = lse_acc.clone()
        blockwise.merge_partial(out_acc, lse_acc, out_blk, lse_blk)
        lse_acc.copy_(saved)  # out merged right, lse not updated: the backward goes wrong

    monkeypatch.setattr(ring, "merge_partial", stale_lse)
    status, rows = _run_in_process(capsys, "--sections", "cp")
    assert status == 1
    failed = {name for name, s in rows.items() if s == "FAIL"}
    assert any(n.startswith("cp/p2p/") for n in failed)
    assert any(n.startswith("cp/a2a+p2p(") for n in failed)
    assert not any(n.startswith("cp/a2a/") for n in failed)  # Ulysses merges nothing


def test_a_kernel_that_raises_is_a_failed_row(monkeypatch, capsys, one_thread):
    def raising(self, q, k, v, scale, causal):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(kernels.CpuBackend, "dense_forward", raising)
    status, rows = _run_in_process(capsys, "--sections", "reference,local", "--max-seq", "40")
    assert status == 1
    assert rows["reference/chunked-vs-reference_attention/s=40/fp32"] == "PASS"
    assert rows["local/packed/h8:2/sbhd/s=40/fp32/auto"] == "FAIL"
    assert rows["local/packed/h8:2/sbhd/s=40/fp32/torch"] == "PASS"  # the torch kernel


def _failed(rows):
    return {name for name, status in rows.items() if status == "FAIL"}


def test_hidden_dropout_from_local_positions_fails(monkeypatch, capsys, one_thread):
    """A mask keyed by the rank's own row numbers instead of the tokens' places in their
    samples: every hidden-dropout row fails (a CP rank's or SP slice's rows are never the
    sample's first ones), the attention-dropout rows do not."""
    real = hidden_dropout.token_coordinates

    def local(ids, x, shard):
        return real(ids._replace(positions=None), x, shard)

    monkeypatch.setattr(hidden_dropout, "token_coordinates", local)
    status, rows = _run_in_process(capsys, "--sections", "dropout")
    assert status == 1
    expected = {name for name in rows if name.startswith("dropout/hidden/")}
    assert expected and _failed(rows) == expected


def test_an_offload_that_loses_what_it_saved_fails(monkeypatch, capsys, one_thread):
    """Every fifth activation comes back from host memory as zeros: the offloaded models'
    gradients are wrong; the hook count and the CPU training rows (the trainer offloads
    nothing on a CPU) still pass."""
    real, restored = ActivationOffloader.unpack, []

    def lossy(self, packed):
        tensor = real(self, packed)
        if isinstance(packed, _OnHost):
            restored.append(1)
            if len(restored) % 5 == 0:
                return torch.zeros_like(tensor)
        return tensor

    monkeypatch.setattr(ActivationOffloader, "unpack", lossy)
    status, rows = _run_in_process(capsys, "--sections", "offload")
    assert status == 1
    expected = {name for name in rows if name.startswith("offload/model/")}
    assert len(expected) == 3 and _failed(rows) == expected


def test_a_gated_delta_rule_that_drops_its_state_between_chunks_fails(monkeypatch, capsys,
                                                                      one_thread):
    """Each 64-token chunk starts from a zero state: every rule row (80 tokens) fails."""
    real = gated_delta_rule.chunk_gated_delta_rule

    def per_chunk(q, k, v, g, beta, initial_state=None, output_final_state=False,
                  document_ids=None):
        outs = [real(*(x[:, i:i + 64] for x in (q, k, v, g, beta)),
                     initial_state if i == 0 else None, False,
                     None if document_ids is None else document_ids[:, i:i + 64])[0]
                for i in range(0, q.shape[1], 64)]
        final = real(q, k, v, g, beta, initial_state, output_final_state, document_ids)[1]
        return torch.cat(outs, dim=1), final

    monkeypatch.setattr(gated_delta_rule, "chunk_gated_delta_rule", per_chunk)
    status, rows = _run_in_process(capsys, "--sections", "gdn")
    assert status == 1
    expected = {name for name in rows if name.startswith("gdn/rule/")}
    assert len(expected) == 8 and _failed(rows) == expected


def test_a_section_past_its_budget_prints_the_rest_capped(monkeypatch, capsys):
    """A budget of 3 ticks of a clock that ticks once a look: three checks run, the others
    are CAPPED, listed after the summary, and the exit status is 2 (nothing failed, not
    everything ran). Budget 0: nothing runs."""
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(gpu_check_lib.Report, "clock", lambda self: float(next(ticks)))
    status = gpu_check.main(["--device", "cpu", "--quick", "--sections", "tp_overlap",
                             "--section-seconds", "3"])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert status == gpu_check.EXIT_CAPPED == 2
    assert list(rows.values()) == ["PASS"] * 3 + ["CAPPED"] * (len(rows) - 3)
    assert "the section used its 3 s budget: the checks below are not run" in out
    assert re.search(rf"\[tp_overlap: [\d.]+ s, over its 3 s budget: {len(rows) - 3} checks "
                     rf"CAPPED\]", out)
    assert re.search(rf"^{len(rows)} checks: 3 PASS, 0 FAIL, 0 SKIP, {len(rows) - 3} CAPPED",
                     out, re.M)
    listed = re.findall(r"^CAPPED \(not run, not passed\): (\S+)$", out, re.M)
    assert listed == [name for name, status in rows.items() if status == "CAPPED"]
    monkeypatch.undo()
    status, rows = _run_in_process(capsys, "--sections", "tiled,mla", "--section-seconds", "0")
    assert status == 2 and rows and set(rows.values()) == {"CAPPED"}


def test_the_default_budgets_fit_the_suite_in_five_minutes():
    """Every section has a budget on CUDA, and together with start-up they fit the suite's
    5 minutes (a section may run one check past its budget: the budgets leave room)."""
    assert set(gpu_check.SECTION_SECONDS) == set(gpu_check.SECTIONS)
    total = sum(gpu_check.SECTION_SECONDS.values()) + gpu_check.START_UP_SECONDS
    assert total <= gpu_check.SUITE_SECONDS - 10, total


def test_the_flash_section_bypasses_cudnn_only_inside():
    """Inside, cudnn_eligible is False and the kernels are counted; after (also after an
    exception), the module's own functions are back."""
    saved = {name: getattr(cuda_kernels, name)
             for name in gpu_check_paths.COUNTED + ("cudnn_eligible",)}
    calls = collections.Counter()
    with pytest.raises(RuntimeError):
        with gpu_check_paths.cudnn_bypassed(calls):
            assert cuda_kernels.cudnn_eligible(None, None, None) is False
            assert cuda_kernels.flash_forward is not saved["flash_forward"]
            q = torch.empty(1, 1, 8, 8, dtype=torch.bfloat16, device="meta")
            cuda_kernels.flash_forward(q, q, q, 1.0, True)
            raise RuntimeError("a section that fails")
    assert calls["flash_forward"] == 1
    assert {name: getattr(cuda_kernels, name) for name in saved} == saved


def test_a_comparison_that_cannot_be_made_is_a_failed_row_not_an_aborted_section(capsys):
    """On the H200 the MoE layer check (device result against the CPU truth) raised inside
    the comparison, outside the check, and took the whole MoE section down with it. Now such
    a row fails on its own and the next check still runs."""
    from gpu_check_lib import Report, errors
    report = Report()
    report.run("broken", lambda: {"out": (torch.zeros(2), "not a tensor", 1e-4)})
    report.run("fine", lambda: {"out": (torch.ones(2), torch.ones(2), 1e-4)})
    assert report.rows == [("broken", "FAIL"), ("fine", "PASS")]
    assert "AttributeError" in capsys.readouterr().out
    # the truth is moved to the device of the result before comparing
    assert errors(torch.ones(3, dtype=torch.float64), torch.full((3,), 2.0)) == (1.0, 0.5)


# ----------------------------------------------------------------------------- simulation == ranks
SIM_CASES = [("p2p", None, 4, 2, True), ("a2a", None, 6, 2, False), ("a2a", None, 8, 2, True),
             ("a2a+p2p", (2, 2), 8, 2, True), ("a2a+p2p", (2, 2), 4, 1, False)]


def _sim_inputs(case, cp_size):
    """Per-rank shards (q, k, v, dout: lists of [b, h, s/P, d]) and metadata of one case."""
    _, _, nh, nkv, packed = case
    parts = [prepare_microbatch(microbatch(64, 2, packed, seed=5), r, cp_size)
             for r in range(cp_size)]
    index = [p["token_index"] for p in parts]
    docs = [p["document_ids"] for p in parts] if packed else None
    total = cp_size * index[0].shape[1]
    rand = Randn(11, torch.float32, torch.device("cpu"))
    full = [rand.bhsd(2, h, total, d=16) for h in (nh, nkv, nkv, nh)]  # q, k, v, dout
    shards = [[gpu_check._take(x, idx) for idx in index] for x in full]
    return shards, index, docs


def _distributed_worker(rank, world_size):
    state = initialize_model_parallel(context_parallel_size=world_size,
                                      hierarchical_context_parallel_sizes=(2, 2))
    results = []
    for case in SIM_CASES:
        (qs, ks, vs, douts), index, docs = _sim_inputs(case, world_size)
        leaves = [x[rank].clone().requires_grad_() for x in (qs, ks, vs)]
        out = context_parallel_attention(
            *leaves, index[rank], None if docs is None else docs[rank], state.group("cp"),
            case[0], hierarchical_groups=(state.group("hcp_inner"), state.group("hcp_outer")))
        out.backward(douts[rank])
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    return results


def test_simulation_is_the_distributed_algorithm(one_thread):
    per_rank = run_workers(_distributed_worker, 4, timeout=240)
    for n, case in enumerate(SIM_CASES):
        (qs, ks, vs, douts), index, docs = _sim_inputs(case, 4)
        leaves = [[x.clone().requires_grad_() for x in shards] for shards in (qs, ks, vs)]
        outs = simulated_attention(case[0], *leaves, index, docs, case[1])
        torch.autograd.backward(outs, douts)
        for rank in range(4):
            simulated = [outs[rank].detach()] + [shards[rank].grad for shards in leaves]
            for what, got, want in zip(("out", "dq", "dk", "dv"), simulated, per_rank[rank][n]):
                assert torch.equal(got, want), (case, rank, what, (got - want).abs().max())
