"""Pipeline parallelism: stage split, fixed-shape P2P, and the forward-backward schedules."""
from megatron_cp.pipeline_parallel.schedules import get_forward_backward_func  # noqa: F401
