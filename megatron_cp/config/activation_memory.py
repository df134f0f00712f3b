"""The model's activation-memory savers beyond whole-layer recomputation: which modules
selective recomputation covers (--recompute-modules, --moe-layer-recompute), full
recomputation's checkpoints split over TP (--distribute-saved-activations), and fine-grained
activation offloading (--fine-grained-activation-offloading and its modules, threshold and
fraction). Megatron-LM's flags, defaults and rules (its TransformerConfig and argument
checks); the model code that reads them is in model/transformer.py, model/attention.py,
model/multi_latent_attention.py, moe/ and layers/fine_grained_offload.py.
"""
from dataclasses import dataclass

from megatron_cp.config.setting import resolve, setting

# Megatron-LM's --recompute-modules choices that map onto a module here
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts")
# ... and the ones whose module is not built (refused, one line each)
NOT_BUILT_RECOMPUTE = {
    "gdn_norm_out": "recomputes Gated DeltaNet's output norm with its head-to-sequence "
                    "all-to-all, which is not built as a recomputed unit here",
    "gdp_in_proj": "Gated DeltaProduct is not built",
    "gdp_qkv": "Gated DeltaProduct is not built",
    "mhc": "hyper-connections (--enable-mhc-connections) are not built",
}
# Megatron-LM's --offload-modules choices that map onto a module here
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm",
                   "expert_fc1", "moe_act")
NOT_BUILT_OFFLOAD = {
    "fused_group_mlp": "offloads Transformer Engine's fused grouped MLP (op fuser), which is "
                       "not built; use expert_fc1 and moe_act",
    "gdp_qkv": "Gated DeltaProduct is not built",
}


@dataclass(kw_only=True, frozen=True)
class ActivationMemorySettings:
    """Part of :class:`~megatron_cp.config.model.GPTConfig` (see the module docstring)."""
    recompute_modules: tuple[str, ...] | None = setting(
        None, group="training",
        help="With --recompute-granularity selective, the modules recomputed in backward "
             "instead of keeping their activations (default core_attn): core_attn (core "
             "attention), layernorm (the two norms' outputs), mlp (dense MLPs), moe (whole MoE "
             "layers), shared_experts, moe_act (the routed experts' activation output), "
             "mla_up_proj (MLA's up projections and rotary). layernorm, moe_act and "
             "mla_up_proj keep only their inputs and rebuild their outputs when backward "
             "first needs them.")
    moe_layer_recompute: bool = setting(
        False, group="training",
        help="Recompute MoE layers whole (deprecated Megatron-LM spelling of "
             "--recompute-granularity selective --recompute-modules ... moe).")
    distribute_saved_activations: bool = setting(
        False, group="training",
        help="Full recomputation: each recomputed chunk's saved input is split over the "
             "tensor-parallel ranks (each keeps 1/TP of it) and all-gathered before the chunk "
             "is recomputed. Needs TP > 1 and no sequence parallelism (Megatron-LM's rules).")

    fine_grained_activation_offloading: bool = setting(
        False, group="training",
        help="Keep what the --offload-modules save for backward in pinned host memory until "
             "backward needs it (module by module; --cpu-offloading-num-layers moves whole "
             "layers). On a CPU the activations already live in host memory: nothing moves.")
    offload_modules: tuple[str, ...] = setting(
        (), nargs="+", group="training",
        help="The modules whose saved tensors fine-grained offloading moves: attn_norm, "
             "qkv_linear, core_attn, attn_proj (with core_attn), mlp_norm, expert_fc1, "
             "moe_act.")
    min_offloaded_tensor_size: int = setting(
        1024 * 1024, group="training",
        help="Fine-grained offloading moves saved tensors of at least this many elements.")
    activation_offload_fraction: float = setting(
        1.0, group="training",
        help="Fine-grained offloading moves the first this share of the groups that have "
             "bytes to move (a group: one call of one offloaded module), in forward order.")
    delta_offload_bytes_across_pp_ranks: int = setting(
        0, group="training",
        help="Fine-grained offloading: pipeline rank r keeps r x this many bytes of its first "
             "groups on the device (later ranks hold fewer microbatches).")
    fine_grained_offloading_max_inflight_offloads: int | None = setting(
        None, group="training",
        help="Fine-grained offloading: at most this many device-to-host copies of one module "
             "name in flight before the compute stream waits for the oldest (0: after each; "
             "none: never waits).")
    cpu_offloading_retain_pinned_cpu_buffers: bool = setting(
        False, group="training",
        help="--cpu-offloading-num-layers: keep the pinned host buffers after backward and "
             "reuse them in the next steps instead of allocating them anew.")

    def _check_activation_memory(self):
        """Megatron-LM's rules for these settings; resolves recompute_modules's default
        (core_attn) and --moe-layer-recompute (selective, with moe)."""
        if self.recompute_modules is None:
            resolve(self, recompute_modules=("core_attn",))
        resolve(self, recompute_modules=tuple(self.recompute_modules),
                offload_modules=tuple(self.offload_modules))
        if self.moe_layer_recompute:
            if self.recompute_granularity == "full":
                raise ValueError("moe_layer_recompute (True) recomputes MoE layers inside "
                                 "selective recomputation, and recompute_granularity is "
                                 "'full'; drop one (Megatron-LM's rule)")
            resolve(self, recompute_granularity="selective")
            if "moe" not in self.recompute_modules:
                resolve(self, recompute_modules=self.recompute_modules + ("moe",))
        if self.recompute_granularity == "selective":
            self._check_recompute_modules()
        if self.distribute_saved_activations:
            if self.recompute_granularity != "full":
                raise ValueError(f"distribute_saved_activations (True) splits what full "
                                 f"recomputation saves, and recompute_granularity is "
                                 f"{self.recompute_granularity!r}: use recompute_granularity "
                                 f"full with a recompute_method (Megatron-LM's rule)")
            if self.sequence_parallel:
                raise ValueError("distribute_saved_activations (True) must be off with "
                                 "sequence_parallel (True): the saved input is already split "
                                 "over TP (Megatron-LM's rule)")

        if self.fine_grained_activation_offloading:
            self._check_offload_modules()

    def _check_offload_modules(self):
        """Megatron-LM's rules for fine-grained offloading."""
        if self.cpu_offloading_num_layers:
            raise ValueError(f"fine_grained_activation_offloading (True) cannot be combined "
                             f"with cpu_offloading_num_layers ({self.cpu_offloading_num_layers})"
                             f"; use one (Megatron-LM's rule)")
        if self.torch_compile:
            raise ValueError("fine_grained_activation_offloading (True) installs saved-tensor "
                             "hooks around modules inside each layer, which torch_compile's "
                             "compiled layers do not run; drop one")
        if not self.offload_modules:
            raise ValueError(f"fine_grained_activation_offloading (True) needs offload_modules "
                             f"(some of {', '.join(OFFLOAD_MODULES)})")
        for name in self.offload_modules:
            if name in NOT_BUILT_OFFLOAD:
                raise ValueError(f"offload_modules {name}: {NOT_BUILT_OFFLOAD[name]}")
            if name not in OFFLOAD_MODULES:
                raise ValueError(f"offload_modules {name!r} is not one of "
                                 f"{', '.join(OFFLOAD_MODULES)}")
        if "attn_proj" in self.offload_modules and "core_attn" not in self.offload_modules:
            raise ValueError("offload_modules attn_proj needs core_attn too: attn_proj's input "
                             "is core attention's output, which core attention's backward "
                             "reads (Megatron-LM's rule)")
        inside = {"moe_act", "expert_fc1"} & set(self.offload_modules)
        if inside and self.recomputes("moe"):
            raise ValueError(f"offload_modules {' '.join(sorted(inside))} lies inside MoE "
                             f"layers that recompute_modules moe recomputes whole; drop one "
                             f"(Megatron-LM's rule)")
        for name, bad in (("min_offloaded_tensor_size", self.min_offloaded_tensor_size < 0),
                          ("activation_offload_fraction",
                           not 0 <= self.activation_offload_fraction <= 1),
                          ("delta_offload_bytes_across_pp_ranks",
                           self.delta_offload_bytes_across_pp_ranks < 0),
                          ("fine_grained_offloading_max_inflight_offloads",
                           (self.fine_grained_offloading_max_inflight_offloads or 0) < 0)):
            if bad:
                limits = "from 0 to 1" if name == "activation_offload_fraction" else ">= 0"
                raise ValueError(f"{name} ({getattr(self, name)}) must be {limits}")

    def _check_recompute_modules(self):
        for name in self.recompute_modules:
            if name in NOT_BUILT_RECOMPUTE:
                raise ValueError(f"recompute_modules {name}: {NOT_BUILT_RECOMPUTE[name]}; drop "
                                 f"it")
            if name not in RECOMPUTE_MODULES:
                raise ValueError(f"recompute_modules {name!r} is not one of "
                                 f"{', '.join(RECOMPUTE_MODULES)}")
        if "mla_up_proj" in self.recompute_modules and not self.multi_latent_attention:
            raise ValueError("recompute_modules mla_up_proj applies to multi_latent_attention "
                             "only; add --multi-latent-attention or drop mla_up_proj")

    def recomputes(self, module):
        """Whether selective recomputation covers ``module`` (one of RECOMPUTE_MODULES)."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    def check_distributed_activations(self, tp_size):
        """--distribute-saved-activations splits over TP: it needs TP > 1."""
        if self.distribute_saved_activations and tp_size == 1:
            raise ValueError("distribute_saved_activations (True) splits the saved inputs over "
                             "the tensor-parallel ranks, and tensor_model_parallel_size is 1: "
                             "give tensor_model_parallel_size > 1 or drop it (Megatron-LM's "
                             "rule)")
