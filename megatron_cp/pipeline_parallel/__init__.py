"""Pipeline parallelism: stage split (layouts), fixed-shape P2P, microbatch padding and the
forward-backward schedules (none, 1F1B, interleaved 1F1B)."""
from megatron_cp.pipeline_parallel.layout import PipelineLayout, parse_layout  # noqa: F401
from megatron_cp.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: F401
from megatron_cp.pipeline_parallel.schedules import (  # noqa: F401
    forward_backward_no_pipelining, forward_backward_pipelining_without_interleaving,
    get_forward_backward_func)
from megatron_cp.pipeline_parallel.stages import (  # noqa: F401
    build_model_chunks, layout_from_config, pipeline_layout, pipeline_tensor_shape,
    validate_interleaved_microbatches)
