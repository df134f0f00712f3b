"""Layout planning: what a training run will hold in memory and how long a step takes, for a
command line and a parallel layout, without starting it.

- :mod:`~megatron_cp.planning.memory`: predicted peak tensor bytes of the most loaded rank.
- :mod:`~megatron_cp.planning.step_time`: predicted seconds per iteration from the device's
  measured matmul / attention throughput and each collective's volume.
- :mod:`~megatron_cp.planning.search`: the layouts the flags leave open that the argument
  validation accepts, ranked (``tools/plan_layout.py`` prints them).
- :mod:`~megatron_cp.planning.plan_layout`: the planner's command line (``tools/plan_layout.py``
  is its front): the machine's flags, the layouts to try, the printed table or JSON.
"""
