"""A setting lives in one place: GPTConfig's fields give the flags, the config built from the
arguments, the checkpoint resume check and the flag names in errors; the Megatron-LM flag
table accepts, rewrites, notes or refuses every flag it lists."""
import argparse
import dataclasses
import os
import re

import pytest
import torch

from dist_harness import run_workers
from megatron_cp import startup
from megatron_cp.cli import arguments, checks
from megatron_cp.checkpoint import files as checkpoint_files
from megatron_cp.cli.arguments import build_parser, parse_args
from megatron_cp.cli.megatron_flags import COMPAT_FLAGS, IGNORED, MAP, REFUSE, SAME, all_entries
from megatron_cp.config.checkpoint import NOT_BUILT_FORMATS
from megatron_cp.config.setting import arg_of, checkpoint_args, flag_of, setting
from megatron_cp.config.model import GPTConfig
from megatron_cp.optimizer import OptimizerParamScheduler
from megatron_cp.startup import config_from_args

_PARSER = build_parser()
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --train-iters 5 --lr 1e-3 --mock-data --vocab-size 100")


def _parse(extra="", world=1):
    return parse_args(f"{BASE} {extra}".split(), world_size=world)


# ----- one field, everything derived -------------------------------------------------------
@dataclasses.dataclass(kw_only=True, frozen=True)
class _WithNewSetting(GPTConfig):
    """GPTConfig plus one hyper-parameter, declared once, the way a new one is added."""
    attention_temperature: float = setting(1.0, shapes=True,
                                           help="Divide the attention logits by this.")

    def __post_init__(self):
        super().__post_init__()
        if self.attention_temperature <= 0:
            raise ValueError(f"attention_temperature ({self.attention_temperature}) must be > 0")


def test_a_new_field_is_one_edit(monkeypatch):
    monkeypatch.setattr(checks, "GPTConfig", _WithNewSetting)
    monkeypatch.setattr(arguments, "SECTIONS", (_WithNewSetting,) + arguments.SECTIONS[1:])
    monkeypatch.setattr(startup, "GPTConfig", _WithNewSetting)
    help_text = build_parser().format_help()
    assert "--attention-temperature" in help_text and "Divide the attention logits" in help_text
    args = _parse("--attention-temperature 2.5")
    assert args.attention_temperature == 2.5
    config = config_from_args(args, 100)
    assert isinstance(config, _WithNewSetting) and config.attention_temperature == 2.5
    assert "attention_temperature" in checkpoint_args(_WithNewSetting)
    # its rule runs at argument time, and the message names the flag
    with pytest.raises(ValueError, match=r"^--attention-temperature \(-1.0\) must be > 0$"):
        _parse("--attention-temperature -1")


def test_every_field_has_help_a_flag_or_a_source_and_reaches_the_config():
    parser = build_parser()
    options = {o for action in parser._actions for o in action.option_strings}
    args = _parse()
    config = config_from_args(args, 100)
    for section in arguments.SECTIONS:
        for f in dataclasses.fields(section):
            assert f.metadata.get("help"), f"{section.__name__}.{f.name} has no help"
            if flag_of(f) is not None:
                assert flag_of(f) in options, f.name
            if arg_of(f) is not None:
                assert hasattr(args, arg_of(f)), f.name
    assert config.vocab_size == 100 and config.params_dtype == torch.float32
    # Megatron-LM's defaults for the flags, where they differ from the config's own
    assert config.position_embedding_type == "learned_absolute"
    assert config.max_position_embeddings == 32 and config.num_query_groups == 4
    assert config.recompute_num_layers is None and config.num_moe_experts == 0


def test_shape_args_are_the_shaping_fields_and_never_the_layout():
    shaping = [arg_of(f) for f in dataclasses.fields(GPTConfig) if f.metadata.get("shapes")]
    assert set(checkpoint_files.SHAPE_ARGS) == set(shaping) and "params_dtype" in shaping
    # the names tools/checkpoint_convert.py and megatron_cp/checkpoint/hf/llama.py read from saved args
    for name in ("swiglu", "disable_bias_linear", "untie_embeddings_and_output_weights",
                 "num_query_groups", "kv_channels", "normalization", "position_embedding_type"):
        assert name in checkpoint_files.SHAPE_ARGS, name
    assert "rotary_base" not in checkpoint_files.SHAPE_ARGS  # does not shape a saved tensor
    # a checkpoint loads into any layout: no layout argument is a shape argument
    assert not set(checkpoint_files.SHAPE_ARGS) & set(checkpoint_files.RANK_LAYOUT_ARGS)
    args = _parse()
    for name in checkpoint_files.SHAPE_ARGS + checkpoint_files.RANK_LAYOUT_ARGS:
        assert hasattr(args, name), name


def test_megatron_flags_map_onto_config_fields():
    args = _parse("--swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
                  "--group-query-attention --num-query-groups 2 --kv-channels 16 "
                  "--ffn-hidden-size 96 --normalization RMSNorm --norm-epsilon 1e-6 "
                  "--position-embedding-type rope --rotary-base 500000 --rotary-percent 0.5 "
                  "--hidden-dropout 0.2 --attention-dropout 0.3 --init-method-std 0.01 "
                  "--make-vocab-size-divisible-by 64 --max-position-embeddings 64 --seed 7 "
                  "--bf16 --recompute-granularity full --recompute-method block "
                  "--recompute-num-layers 2 --cp-comm-type a2a --no-cp-dummy-heads "
                  "--tensor-model-parallel-size 2 --sequence-parallel", world=2)
    config = config_from_args(args, 100)
    expected = dict(activation="swiglu", add_bias_linear=False,
                    untie_embeddings_and_output_weights=True, num_query_groups=2, kv_channels=16,
                    ffn_hidden_size=96, normalization="RMSNorm", norm_epsilon=1e-6,
                    position_embedding_type="rope", rotary_base=500000.0, rotary_percent=0.5,
                    hidden_dropout=0.2, attention_dropout=0.3, init_method_std=0.01,
                    make_vocab_size_divisible_by=64, max_position_embeddings=64, seed=7,
                    params_dtype=torch.bfloat16, recompute_granularity="full",
                    recompute_method="block", recompute_num_layers=2, cp_comm_type="a2a",
                    allow_dummy_heads=False, sequence_parallel=True)
    assert {k: getattr(config, k) for k in expected} == expected
    # saved-argument names stay those Megatron-LM and the tools use
    assert args.swiglu and args.disable_bias_linear and args.num_query_groups == 2
    assert _parse("--num-query-groups 2").num_query_groups == 4  # ignored without GQA
    sizes = _parse("--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a+p2p "
                   "--hierarchical-context-parallel-sizes 2 2", world=4)
    assert config_from_args(sizes, 100).hierarchical_context_parallel_sizes == (2, 2)
    # --cp-comm-type per layer (Megatron-LM's list; its arguments keep the list)
    per_layer = _parse("--context-parallel-size 2 --attention-dropout 0 --cp-comm-type "
                       "allgather a2a", world=2)
    config = config_from_args(per_layer, 100)
    assert per_layer.cp_comm_type == ["allgather", "a2a"]
    assert config.cp_comm_type == ("all_gather", "a2a")
    assert [config.layer_cp_comm_type(n) for n in range(3)] == ["all_gather", "a2a", "all_gather"]
    assert config_from_args(_parse("--cp-comm-type allgather"), 100).cp_comm_type == "all_gather"


# ----- errors name the flags ---------------------------------------------------------------
@pytest.mark.parametrize("extra,world,message", [
    ("--tensor-model-parallel-size 8", 8,
     "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (8)"),
    ("--ffn-hidden-size 30 --tensor-model-parallel-size 4", 4,
     "--ffn-hidden-size (30) must be divisible by --tensor-model-parallel-size (4)"),
    ("--hidden-size 30", 1,
     "--hidden-size (30) must be divisible by --num-attention-heads (4), or set --kv-channels"),
    ("--group-query-attention --num-query-groups 3", 1,
     "--num-attention-heads (4) must be divisible by --num-query-groups (3)"),
    ("--recompute-granularity full", 1,
     "--recompute-granularity 'full' needs --recompute-method uniform or block (got None)"),
    ("--attention-dropout -0.1", 1, "--attention-dropout (-0.1) is a probability: give a "
     "value from 0 to 1"),
    ("--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a+p2p", 4,
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes U R"),
    ("--context-parallel-size 2 --attention-dropout 0 --cp-comm-type p2p a2a p2p", 2,
     "--cp-comm-type (p2p a2a p2p) lists 3 types, and a per-layer list needs one per layer: "
     "--num-layers (2) (Megatron-LM's rule); give 2 types, or one for every layer"),
    ("--context-parallel-size 4 --attention-dropout 0 --cp-comm-type p2p a2a+p2p", 4,
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes U R"),
    ("--context-parallel-size 4 --attention-dropout 0 --group-query-attention "
     "--num-query-groups 2 --cp-comm-type auto a2a+p2p --hierarchical-context-parallel-sizes "
     "1 4", 4, "--cp-comm-type (auto a2a+p2p) needs a2a+p2p sub-groups of two sizes "
               "[(1, 4), (2, 2)]"),
    ("--context-parallel-size 2 --attention-dropout 0 --hierarchical-context-parallel-sizes 2 3",
     2, "--hierarchical-context-parallel-sizes [2, 3] multiply to 6, not --context-parallel-size (2)"),
    ("--max-position-embeddings 16", 1, "--max-position-embeddings (16) must be at least "
     "--seq-length (32) with learned absolute positions; raise --max-position-embeddings to at "
     "least 32 or use --position-embedding-type rope"),
])
def test_config_rules_fire_at_argument_time_and_name_flags(extra, world, message):
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError) as err:
        _parse(extra, world)
    assert message in str(err.value)
    assert not re.search(r"\b[a-z]+_[a-z_]+\b", str(err.value)), str(err.value)  # no field names
    assert not torch.distributed.is_initialized()


# ----- the Megatron-LM flag table ----------------------------------------------------------
def _given(entry):
    """Command-line words that give ``entry``'s flag with a value other than its default."""
    kwargs = entry.argparse
    if not kwargs or kwargs.get("action") in ("store_true", "store_false"):
        return [entry.flag]
    if kwargs.get("action") is argparse.BooleanOptionalAction:
        return [entry.flag if not kwargs.get("default") else "--no-" + entry.flag[2:]]
    if "choices" in kwargs:  # a value other than the default, or the default when the
        # others are all refused (--optimizer adam, --ckpt-format torch)
        others = [c for c in kwargs["choices"] if c != kwargs.get("default") and c not in entry.refuse]
        value = others[0] if others else kwargs.get("default")
        return [entry.flag, str(value)]
    nargs = kwargs.get("nargs")
    count = nargs if isinstance(nargs, int) else 1
    value = str(kwargs.get("type", str)(3))
    if value == str(kwargs.get("default")):
        value = str(kwargs.get("type", str)(4))
    return [entry.flag] + [value] * count


@pytest.mark.parametrize("entry", [e for e in all_entries() if e.kind == REFUSE],
                         ids=lambda e: e.flag)
def test_refused_flags_say_why(entry):
    with pytest.raises(ValueError) as err:
        parse_args(BASE.split() + _given(entry))
    assert str(err.value) == f"{' '.join(_given(entry))}: {entry.why}"


def _companion(entry):
    """The words that meet ``entry.needs`` (a flag accepted only beside another value)."""
    if not entry.needs:
        return []
    name, allowed, _ = entry.needs
    flag = "--" + name.replace("_", "-")
    if isinstance(allowed[0], bool):
        return [flag] if allowed[0] else []
    return [flag, allowed[0]]


def _breaking(entry):
    """The words that break ``entry.needs`` (nothing when the defaults already do)."""
    name, allowed, _ = entry.needs
    return ["--" + name.replace("_", "-")] if allowed == (False,) else []


@pytest.mark.parametrize("entry", [e for e in all_entries() if e.kind == SAME],
                         ids=lambda e: e.flag)
def test_flags_that_select_what_we_do_anyway_leave_a_note(entry):
    args = parse_args(BASE.split() + _companion(entry) + _given(entry))
    given = getattr(_PARSER.parse_known_args(BASE.split() + _given(entry))[0], entry.dest)
    at_default = given == _PARSER.get_default(entry.dest)
    assert args.compat_notes == ([] if at_default else [f"{' '.join(_given(entry))}: {entry.why}"])


@pytest.mark.parametrize("entry", [e for e in COMPAT_FLAGS if e.needs], ids=lambda e: e.flag)
def test_flags_with_a_condition_say_what_is_missing(entry):
    with pytest.raises(ValueError) as err:
        parse_args(BASE.split() + _breaking(entry) + _given(entry))
    assert str(err.value).startswith(entry.flag) and entry.needs[2] in str(err.value)


@pytest.mark.parametrize("flag,value,why", [(e.flag, value, why) for e in COMPAT_FLAGS
                                            for value, why in e.refuse.items()]
                         + [("--ckpt-format", value, why)
                            for value, why in NOT_BUILT_FORMATS.items()])
def test_refused_values_of_accepted_flags(flag, value, why):
    with pytest.raises(ValueError) as err:
        _parse(f"{flag} {value}")
    assert str(err.value) == f"{flag} {value}: {why}"


@pytest.mark.parametrize("argv,message", [
    ("--ckpt-format zarr", "--ckpt-format zarr: not built; use --ckpt-format torch_dist"),
    ("--cp-comm-type p2p ring", "--cp-comm-type (ring) is not a context-parallel communication "
                                "type; give p2p, a2a, a2a+p2p, all_gather (allgather) or auto"),
    ("--overlap-param-gather", "--overlap-param-gather overlaps the distributed optimizer's "
                               "parameter all-gather: add --use-distributed-optimizer"),
    ("--async-save --save ck --ckpt-format torch", "--async-save writes --ckpt-format "
                                                   "torch_dist or fsdp_dtensor checkpoints, not "
                                                   "torch; add --ckpt-format torch_dist"),
    ("--optimizer sgd", "--optimizer ('sgd'): SGD is not built; use adam or muon"),
    ("--dataloader-type cyclic", "--dataloader-type cyclic: the cyclic"),
    ("--rampup-batch-size 8 8 100", "--rampup-batch-size 8 8 100: Megatron-LM deprecated it "
                                    "and ignores it (the batch stays --global-batch-size); give "
                                    "the ramp-up as --step-batch-size-schedule"),
    ("--no-position-embedding", "--no-position-embedding: is Megatron-LM's deprecated spelling, "
                                "accepted only beside --position-embedding-type rope"),
    ("--no-position-embedding --position-embedding-type yarn",
     "--no-position-embedding: is Megatron-LM's deprecated spelling, accepted only beside "
     "--position-embedding-type rope"),
    ("--recompute-activations --recompute-granularity full --recompute-method uniform",
     "--recompute-activations means --recompute-granularity selective"),
])
def test_refused_values(argv, message):
    with pytest.raises(ValueError) as err:
        _parse(argv)
    assert message in str(err.value)


def test_distributed_optimizer_and_checkpoint_flags_parse():
    args = _parse("--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce "
                  "--ckpt-format torch_dist --async-save --save ck")
    assert (args.use_distributed_optimizer, args.overlap_param_gather, args.ckpt_format,
            args.async_save, args.compat_notes) == (True, True, "torch_dist", True, [])


def test_accepted_values_and_aliases():
    args = _parse("--ckpt-format torch --optimizer adam --dataloader-type single --vocab-extra-ids 0 "
                  "--transformer-impl transformer_engine --attention-backend auto")
    assert args.compat_notes == [] and args.ckpt_format == "torch"
    args = _parse("--recompute-activations")
    assert args.recompute_granularity == "selective"
    assert config_from_args(args, 100).recompute_granularity == "selective"
    args = _parse("--use-rotary-position-embeddings --max-position-embeddings 16")
    assert config_from_args(args, 100).position_embedding_type == "rope"
    args = _parse("--use-flash-attn --transformer-impl local")
    assert args.compat_notes == [
        "--use-flash-attn: Megatron-LM reads it nowhere at this commit; attention kernels are "
        "chosen per device (cuDNN or flash SDPA on CUDA)",
        "--transformer-impl local: ignored (speed): in Megatron-LM it selects Transformer "
        "Engine's or the local layer implementation (here megatron_cp's own PyTorch layers run "
        "either way; norms use Transformer Engine when it is installed)"]
    assert _parse("--ddp-bucket-size 1000").ddp_bucket_size_mb * 2 ** 20 / 4 == 1000


def test_every_table_flag_is_in_the_parser_with_help():
    parser = build_parser()
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    for entry in COMPAT_FLAGS:
        assert entry.kind in (SAME, IGNORED, MAP, REFUSE) and entry.why
        assert by_flag[entry.flag].help, entry.flag
    assert "Refused: Megatron-LM deprecated it and ignores it" in parser.format_help()


# ----- schedules in samples and weight-decay increments ------------------------------------
class _Groups:
    def __init__(self):
        self.param_groups = [{"wd_mult": 1.0}]


def test_sample_based_schedule_matches_megatron():
    with pytest.raises(ValueError, match="goes with --train-samples alone"):
        _parse("--lr-decay-samples 80")
    base = BASE.replace("--train-iters 5", "--train-samples 100")
    with pytest.raises(ValueError, match="not both"):
        parse_args(f"{base} --lr-decay-samples 80 --lr-warmup-iters 1".split())
    args = parse_args(f"{base} --global-batch-size 8 --lr-decay-samples 80 --lr-warmup-samples 12 "
                      f"--lr-decay-style cosine --min-lr 1e-4 --lr-warmup-init 1e-5".split())
    assert args.train_iters == 13 and args.lr_decay_iters == 10 and args.lr_warmup_iters == 1.5
    ours = OptimizerParamScheduler(_Groups(), max_lr=1e-3, min_lr=1e-4, init_lr=1e-5,
                                   lr_warmup_steps=args.lr_warmup_iters,
                                   lr_decay_steps=args.lr_decay_iters, lr_decay_style="cosine")
    # Megatron-LM counts the schedule in samples and steps it by the global batch size
    megatron = OptimizerParamScheduler(_Groups(), max_lr=1e-3, min_lr=1e-4, init_lr=1e-5,
                                       lr_warmup_steps=12, lr_decay_steps=80,
                                       lr_decay_style="cosine")
    for _ in range(args.train_iters):
        assert ours.get_lr() == pytest.approx(megatron.get_lr(), rel=1e-12)
        ours.step(1)
        megatron.step(8)


def test_weight_decay_increment_flags():
    with pytest.raises(ValueError, match="--start-weight-decay and --end-weight-decay need "
                                         "--weight-decay-incr-style linear or cosine"):
        _parse("--start-weight-decay 0 --end-weight-decay 0.1")
    with pytest.raises(ValueError, match="--weight-decay-incr-style cosine needs both"):
        _parse("--weight-decay-incr-style cosine --end-weight-decay 0.1")
    with pytest.raises(ValueError, match=r"need 0 <= --start-weight-decay \(0.2\)"):
        _parse("--weight-decay-incr-style linear --start-weight-decay 0.2 --end-weight-decay 0.1")


def _trainer_schedule(rank, world, argv):
    from megatron_cp.distributed.initialize import initialize_model_parallel
    from megatron_cp.training import Trainer

    args = parse_args(argv.split(), world_size=world)
    trainer = Trainer(args, initialize_model_parallel(device=torch.device("cpu")))
    sched = trainer.scheduler
    first = [g["weight_decay"] for g in trainer.optimizer.param_groups]
    sched.step(args.train_iters)
    last = [g["weight_decay"] for g in trainer.optimizer.param_groups]
    return sched.init_lr, sched.wd_incr_style, sched.wd_incr_steps, first, last, \
        [len(chunk.buckets) for chunk in trainer.model_chunks]


def test_trainer_gets_warmup_init_weight_decay_increment_and_bucket_size():
    argv = (f"{BASE} --lr-warmup-iters 2 --lr-warmup-init 1e-4 --weight-decay-incr-style linear "
            f"--start-weight-decay 0.0 --end-weight-decay 0.1 --ddp-bucket-size 1000")
    init_lr, style, steps, first, last, buckets = run_workers(_trainer_schedule, 1, argv)[0]
    assert (init_lr, style, steps) == (1e-4, "linear", 5)
    assert sorted(first) == [0.0, 0.0] and sorted(last) == [0.0, pytest.approx(0.1)]
    assert buckets[0] > 5  # ~10k params in buckets of 1000 gradient elements


def test_hugging_face_tokenizer_flag_needs_its_model():
    with pytest.raises(ValueError, match="--tokenizer-type HuggingFaceTokenizer needs "
                                         "--tokenizer-model"):
        _parse("--tokenizer-type HuggingFaceTokenizer")
    args = _parse("--tokenizer-type HuggingFaceTokenizer --tokenizer-model /some/folder")
    assert args.tokenizer_model == "/some/folder"


def test_megatron_mixtral_position_flags_are_accepted():
    """Megatron's own Mixtral example: --no-position-embedding beside rope (a rope model has
    no learned table, so the flag only confirms it)."""
    args = _parse("--no-position-embedding --position-embedding-type rope")
    assert args.position_embedding_type == "rope"
    assert args.compat_notes == ["--no-position-embedding: no learned position table: rotary "
                                 "embeddings (--position-embedding-type rope) have none"]


def test_fp8_routed_experts_run_in_fp8_under_every_recipe_without_a_note():
    """The routed experts' grouped GEMMs run in FP8 under every recipe (fp8/grouped.py,
    fp8/grouped_blocks.py): no start-up note says otherwise."""
    moe = "--num-experts 4 --no-bias-gelu-fusion"
    for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8"):
        notes = _parse(f"--bf16 --fp8-format hybrid --fp8-recipe {recipe} {moe}").compat_notes
        assert not [n for n in notes if "FP8" in n or "precision" in n], (recipe, notes)


@pytest.mark.parametrize("argv,message", [
    ("--fp8-recipe blockwise --context-parallel-size 2",
     "--fp8-recipe blockwise with --num-experts and --context-parallel-size 2: the experts' "
     "wgrad token blocks would follow CP's zigzag chunks"),
    ("--fp8-recipe mxfp8 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 "
     "--moe-ffn-hidden-size 96",
     "--fp8-recipe mxfp8: --moe-ffn-hidden-size (96) is split over "
     "--expert-tensor-parallel-size 2 into pieces of 48, not a multiple of the 32-element"),
])
def test_block_recipe_expert_layouts_that_cut_blocks_are_refused(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _parse(f"--bf16 --fp8-format hybrid --num-experts 4 --no-bias-gelu-fusion {argv}", world=4)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8", "delayed"])
def test_no_fp8_wgrad_acts_under_the_delayed_recipe_only(recipe):
    """Megatron-LM hands --no-fp8-wgrad to Transformer Engine's DelayedScaling only: under
    the other recipes the wgrad GEMM stays in FP8 and a start-up note says the flag changes
    nothing."""
    args = _parse(f"--bf16 --fp8-format hybrid --fp8-recipe {recipe} --no-fp8-wgrad")
    config = startup.config_from_args(args, vocab_size=1)
    noted = [n for n in args.compat_notes if n.startswith("--no-fp8-wgrad")]
    assert config.wgrad_in_fp8 == (recipe != "delayed")
    assert len(noted) == (recipe != "delayed")


def test_delayed_settings_with_tensorwise_scaling_are_noted_as_ignored():
    """--fp8-margin and the amax history's settings shape delayed scaling only; given with
    tensorwise scaling (which Megatron-LM's current scaling also leaves them out of) they are
    accepted with a start-up note each, and not noted with the delayed recipe."""
    delayed = "--fp8-margin 1 --fp8-amax-history-len 4 --fp8-amax-compute-algo max"
    notes = _parse(f"--bf16 --fp8-format hybrid --fp8-recipe tensorwise {delayed}").compat_notes
    noted = [n.split(" ")[0] for n in notes if "ignores it" in n]
    assert noted == ["--fp8-margin", "--fp8-amax-history-len", "--fp8-amax-compute-algo"], notes
    notes = _parse(f"--bf16 --fp8-format hybrid --fp8-recipe delayed {delayed}").compat_notes
    assert not [n for n in notes if "ignores it" in n], notes


@pytest.mark.parametrize("argv,message", [
    ("--micro-batch-size 0", "--micro-batch-size (0) must be at least 1"),
    ("--global-batch-size 0", "--global-batch-size (0) must be at least 1"),
    ("--log-interval 0", "--log-interval (0) must be at least 1"),
    ("--train-iters 0 --train-samples 80", "--train-iters (0) and --train-samples (80) both give "
                                           "the training length; give one"),
    ("--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model /no/such/tok.model",
     "--tokenizer-model /no/such/tok.model: no such file"),
    ("--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.vocab",
     "--tokenizer-model tok.vocab is sentencepiece's vocabulary listing; give the model file "
     "(tok.model)"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-file /no/vocab.json --merge-file /no/merges.txt",
     "--vocab-file /no/vocab.json: no such file"),
])
def test_mistakes_that_crashed_later_get_one_line_at_argument_time(argv, message):
    """Each of these used to end in a traceback (ZeroDivisionError, a sentencepiece
    RuntimeError, a misleading schedule message) after start-up."""
    with pytest.raises(ValueError) as err:
        _parse(argv)
    assert str(err.value) == message
    assert not torch.distributed.is_initialized()


def test_save_directory_must_be_writable_before_training(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("")
    _parse(f"--save {tmp_path / 'new' / 'run'}")  # creatable: accepted, nothing created
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match=r"is a file, not a directory"):
        _parse(f"--save {a_file / 'run'}")
    # A read-only mount as the filesystem reports it (root may write anywhere else).
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(checks.os, "access",
                        lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    with pytest.raises(ValueError) as err:
        _parse(f"--save {locked / 'run'}")
    assert str(err.value) == (f"--save {locked / 'run'}: {locked} is not writable (read-only or "
                              f"another user's); give a directory you can write")
