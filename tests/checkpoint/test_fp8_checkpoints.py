"""FP8 delayed scaling's state in checkpoints.

Each FP8 linear's ``fp8_meta.amax_history`` [3, L] and ``fp8_meta.scale`` [3] are persistent
buffers, replicated over TP, CP and DP (their amaxes are reduced over the whole stage), so
every format saves them whole like a norm weight and any layout loads them back. A run of 4
steps straight equals 2 steps, a save, and 2 resumed steps: bitwise in the saving layout,
within the layouts' bound in another (TP2 -> TP1, DP2, PP2), for each of torch_dist, torch
and fsdp_dtensor; the buffers after the load equal the saved ones bitwise.

Switching FP8 on or off across a resume works as Megatron-LM's does (Transformer Engine's
``_extra_state`` missing or unused): a bf16 checkpoint into an FP8 run starts the history
fresh, an FP8 checkpoint into a run without FP8 ignores the buffers; each says so in one
line at start-up.
"""
import pytest
import torch

from dist_harness import run_workers
from training_utils import TINY, max_rel_diff, trained

# a history longer than the run, the max over it: every saved entry matters on resume
# (2 microbatches a step: the CPU's _scaled_mm is slow)
# Llama-style, which the Hugging Face export takes
MODEL = (TINY.replace("--global-batch-size 8", "--global-batch-size 4")
         + " --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights "
           "--disable-bias-linear --fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max")
PLAIN = MODEL.split(" --fp8-format")[0]
TP2 = "--tensor-model-parallel-size 2"
FORMATS = ("torch_dist", "torch", "fsdp_dtensor")
SAVE = {"torch_dist": "", "torch": "--ckpt-format torch",
        "fsdp_dtensor": "--use-megatron-fsdp --ckpt-format fsdp_dtensor "
                        "--data-parallel-sharding-strategy optim_grads_params"}


def _fp8_state(chunks):
    """{canonical name: buffer clone} of every FP8 buffer of the model ``chunks`` (wrapped
    or not) on this rank."""
    from megatron_cp.checkpoint.canonical import canonical_name
    out = {}
    for chunk in chunks:
        while not hasattr(chunk, "decoder"):
            chunk = chunk.module
        layers = list(chunk.decoder.layer_numbers)
        for name, buffer in chunk.named_buffers():
            if name.endswith(("fp8_meta.amax_history", "fp8_meta.scale")):
                out[canonical_name(name, layers)] = buffer.detach().clone()
    return out


def _run(rank, world, argv):
    """Worker: (losses, the FP8 buffers each step ran with, the buffers at the end) of
    ``argv``, or the error line of a refused load."""
    from megatron_cp import fp8
    used, real = [], fp8.end_fp8_step

    def end_step(chunks, groups):  # until this runs, a step's scales are the buffers'
        used.append(_fp8_state(chunks))
        real(chunks, groups)
    fp8.end_fp8_step = end_step
    try:
        losses, trainer = trained(rank, world, argv)
    except ValueError as error:
        return str(error)
    finally:
        fp8.end_fp8_step = real
    return losses, used, _fp8_state(trainer.model_chunks)


def _jobs(rank, world, jobs):
    return {name: _run(rank, world, argv) for name, argv in jobs.items()}


def _convert(ck, hf, back, mlm):
    """Export ``ck`` to Hugging Face (``hf``, imported back as ``back``) and to Megatron-LM
    (``mlm``); the tensor names of the two exports."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp
    from tools import checkpoint_convert as convert
    convert.main(["--load-dir", ck, "--to-hf", hf, "--hf-skip-tokenizer"])
    convert.main(["--load-dir", ck, "--to-megatron", mlm])
    convert.main(["--from-hf", hf, "--save-dir", back])
    return (list(safetensors.torch.load_file(f"{hf}/model.safetensors")),
            list(dcp.FileSystemReader(f"{mlm}/iter_0000002").read_metadata().state_dict_metadata))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8ck")
    ck = {fmt: str(tmp / fmt) for fmt in FORMATS}
    plain = str(tmp / "plain")
    r2 = run_workers(_jobs, 2, {  # the straight run saves its torch_dist checkpoint
        "straight": f"{MODEL} {TP2} --train-iters 4 --save {ck['torch_dist']} --save-interval 2",
        **{f"first:{fmt}": f"{MODEL} {TP2} --train-iters 4 --exit-interval 2 --save {ck[fmt]} "
                           f"{SAVE[fmt]}" for fmt in FORMATS[1:]},
        "same:torch_dist": f"{MODEL} {TP2} --train-iters 4 --load {ck['torch_dist']} --ckpt-step 2",
        "dp2:torch_dist": f"{MODEL} --train-iters 4 --load {ck['torch_dist']} --ckpt-step 2 "
                          f"--use-distributed-optimizer",
        "pp2:torch": f"{MODEL} --train-iters 4 --load {ck['torch']} "
                     f"--pipeline-model-parallel-size 2"}, timeout=400)
    exported = _convert(ck["torch"], str(tmp / "hf"), str(tmp / "back"), str(tmp / "mlm"))
    r1 = run_workers(_jobs, 1, {
        "from_hf": f"{MODEL} --train-iters 4 --load {tmp / 'back'} --finetune",
        "from_megatron_lm": f"{MODEL} --train-iters 4 --load {tmp / 'mlm'}",
        **{f"tp1:{fmt}": f"{MODEL} --train-iters 4 --load {ck[fmt]} --ckpt-step 2"
           for fmt in FORMATS},
        "plain": f"{PLAIN} --train-iters 4 --exit-interval 2 --save {plain}",
        "plain_to_fp8": f"{MODEL} --train-iters 4 --load {plain}",
        "fp8_to_plain": f"{PLAIN} --train-iters 4 --load {ck['torch']}",
        "other_history": f"{MODEL.replace('len 4', 'len 2')} --train-iters 4 --load {ck['torch']}"},
        timeout=400)[0]
    return {"exported": exported, "tp2": r2[0], "tp2_rank1": r2[1], **r2[0], **r1}


@pytest.mark.parametrize("resumed", ["same:torch_dist", "dp2:torch_dist", "pp2:torch",
                                     "tp1:torch_dist", "tp1:torch", "tp1:fsdp_dtensor"])
def test_delayed_state_resumes_exactly(runs, resumed):
    """The loaded buffers are the saved ones bitwise (the straight run's before its third
    update; every rank holds whole copies) and the resumed losses are the straight run's:
    here bitwise in every layout (each amax is the whole tensor's, so every layout quantizes
    as one process; the bound of another layout would be the fp32 layouts' 1e-5)."""
    losses, straight_used, _ = runs["straight"]
    saved = straight_used[2]
    assert len(saved) == 16  # 2 layers x 4 linears x (history, scale)
    assert all(t.shape == ((3, 4) if n.endswith("history") else (3,)) for n, t in saved.items())
    assert any(t.count_nonzero() > 1 for n, t in saved.items() if n.endswith("history"))
    got, used, _ = runs[resumed]
    if resumed.startswith("same"):
        assert got == losses[2:]
    assert max_rel_diff(got, losses[2:]) <= (0 if resumed.startswith("same") else 1e-5)
    loaded = used[0]
    assert loaded and set(loaded) <= set(saved)  # PP2: stage 0's half
    assert all(torch.equal(loaded[n], saved[n]) for n in loaded)
    for name in ("first:torch", "first:fsdp_dtensor"):  # the other formats saved the same
        assert runs[name][0] == losses[:2]


def test_replicated_over_tp(runs):
    last = runs["tp2_rank1"]["straight"][2]
    assert all(torch.equal(last[n], runs["straight"][2][n]) for n in last)


def test_fp8_switched_on_or_off_across_a_resume(runs):
    """A bf16 checkpoint into an FP8 run: fresh histories (zeros, scales 1, as step 0);
    an FP8 checkpoint into a run without FP8: the buffers ignored; another history length:
    refused in one line."""
    _, used, _ = runs["plain_to_fp8"]
    assert len(used[0]) == 16
    assert _fresh(used[0])
    losses, used, _ = runs["fp8_to_plain"]
    assert len(losses) == 2 and used == [{}, {}]
    assert runs["other_history"] == ("--fp8-amax-history-len (2) differs from the checkpoint's "
                                     "(4): its amax histories do not fit; give "
                                     "--fp8-amax-history-len 4")


def test_a_switch_says_so_in_one_line():
    from megatron_cp.checkpoint.fp8_state import carries
    delayed = {"fp8_format": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 4}
    tensorwise = {**delayed, "fp8_recipe": "tensorwise"}
    for saved, now, loads, note in [
            (delayed, delayed, True, None),
            ({}, delayed, False, "every FP8 linear's amax history starts fresh"),
            (tensorwise, delayed, False, "every FP8 linear's amax history starts fresh"),
            (delayed, {}, False, "is not used: this run has no --fp8-format"),
            (delayed, tensorwise, False, "is not used"), ({}, tensorwise, False, None)]:
        said = []
        assert carries(saved, now, said.append) is loads
        assert len(said) == (note is not None) and (note is None or note in said[0])


def _fresh(state):
    return all(t.count_nonzero() == 0 if n.endswith("history") else torch.equal(t, torch.ones(3))
               for n, t in state.items())



def test_converters_drop_fp8_state_and_an_import_starts_fresh(runs):
    """The FP8 checkpoint exported to Hugging Face and to Megatron-LM (whose FP8 state would
    be Transformer Engine's _extra_state, not written): no fp8_meta key in either; the
    Hugging Face import and the Megatron-LM checkpoint each train in an FP8 run from fresh
    histories."""
    hf_keys, mlm_keys = runs["exported"]
    assert hf_keys and not [k for k in hf_keys if "fp8" in k]
    assert mlm_keys and not [k for k in mlm_keys if "fp8" in k]
    for name in ("from_hf", "from_megatron_lm"):
        losses, used, last = runs[name]
        assert len(used[0]) == 16 and _fresh(used[0]) and not _fresh(last), name
        assert all(0 < x < 6 for x in losses), (name, losses)
