"""The logging section: the log line, tensorboard, Weights & Biases and Python's logging."""
from dataclasses import dataclass

from megatron_cp.config.setting import setting


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    log_interval: int = setting(100, group="checkpointing and logging",
        help="Print a log line every this many iterations.")
    tensorboard_dir: str | None = setting(None, group="checkpointing and logging",
        help="Write tensorboard logs here.")
    log_loss_scale_to_tensorboard: bool = setting(True,
        flag="--no-log-loss-scale-to-tensorboard", arg="log_loss_scale_to_tensorboard",
        aliases=("--disable-log-loss-scale-to-tensorboard",), store_false=True,
        group="checkpointing and logging",
        help="Do not write the loss scale to tensorboard (written by default).")
    log_timers_to_tensorboard: bool = setting(False, group="checkpointing and logging",
        help="Write the iteration time (s), TFLOP/s per GPU and tokens per second to "
             "tensorboard.")
    log_memory_to_tensorboard: bool = setting(False, group="checkpointing and logging",
        help="Write the tensor memory in bytes to tensorboard (mem-allocated-bytes, "
             "mem-max-allocated-bytes: megatron_cp.observability.memory_peak's meter, on "
             "GPUs and on CPU), "
             "with the memory report after the first iterations (on GPUs that report is always "
             "printed; on CPU, whose meter is the profiler, only with this flag).")
    log_validation_ppl_to_tensorboard: bool = setting(False, group="checkpointing and logging",
        help="Write the validation perplexity to tensorboard.")
    log_world_size_to_tensorboard: bool = setting(False, group="checkpointing and logging",
        help="Write the world size to tensorboard.")
    log_num_zeros_in_grad: bool = setting(False, group="checkpointing and logging",
        help="Count the zero entries of the gradient (after the data-parallel reduction and "
             "unscaling, before clipping; each parameter once) and log them: 'num zeros:' in the"
             " log line, 'num-zeros' in tensorboard.")
    logging_level: int | None = setting(None, group="checkpointing and logging",
        help="Level of Python's logging for the run (10 debug, 20 info, 30 warning, 40 error); "
             "by default Python's own (warnings and errors).")
    wandb_project: str | None = setting(None, group="checkpointing and logging",
        help="Log the run's scalars (the tensorboard ones) to this Weights & Biases project, "
             "from the last rank. Needs the wandb package. Offline (a run folder to upload later"
             " with 'wandb sync') unless WANDB_MODE is set or a WANDB_API_KEY or wandb login is "
             "found.")
    wandb_exp_name: str | None = setting(None, group="checkpointing and logging",
        help="Name of the Weights & Biases run (default: wandb's own).")
    wandb_save_dir: str | None = setting(None, group="checkpointing and logging",
        help="Where the Weights & Biases run is written (default: <--save>/wandb).")
    wandb_entity: str | None = setting(None, group="checkpointing and logging",
        help="The Weights & Biases entity (user or team) of --wandb-project.")
    moe_per_layer_logging: bool = setting(False, group="checkpointing and logging",
        help="Log the MoE balancing losses and token counts of every MoE layer, not only their "
             "mean.")
    log_params_norm: bool = setting(False, group="checkpointing and logging", help="Log the norm of the parameters.")
    tensorboard_log_interval: int = setting(1, group="checkpointing and logging",
        help="Write tensorboard scalars every this many iterations.")
    # profiling (megatron_cp/observability/profiling.py)
    profile: bool = setting(False, group="training",
        help="Profile iterations --profile-step-start up to (not including) --profile-step-end "
             "on the ranks in --profile-ranks: with --use-pytorch-profiler a torch.profiler "
             "trace under --tensorboard-dir (and a table of the costliest operators on stdout), "
             "else cudaProfilerStart/Stop for an outside nsys.")
    use_pytorch_profiler: bool = setting(False, group="training",
        help="With --profile: use torch.profiler.")
    profile_step_start: int = setting(10, group="training",
        help="First profiled iteration (with --profile).")
    profile_step_end: int = setting(12, group="training",
        help="Iteration at which profiling stops (with --profile).")
    profile_ranks: tuple[int, ...] = setting((), group="training",
        help="Global ranks that profile (with --profile; by default, as in Megatron-LM, every "
             "rank).")
