"""Inference on a trained checkpoint: the pieces that evaluation (``tasks/``) and text
generation (``tools/run_text_generation.py``) share.

- :mod:`~megatron_cp.inference.launch`: parse a script's flags (``--use-checkpoint-args``),
  start its process groups and turn its arguments into the run's sections (a
  :class:`~megatron_cp.config.run.RunConfig`), which the rest of the package takes.
- :mod:`~megatron_cp.inference.model`: build this rank's model chunks from the run's sections
  and load their weights from ``--load`` (torch or torch_dist).
- :mod:`~megatron_cp.inference.logits`: full-vocabulary logits and the argmax of
  vocab-parallel logits.
- :mod:`~megatron_cp.inference.kv_cache`: incremental decoding that reuses the model's own
  modules and weights, with a key/value cache per layer.
- :mod:`~megatron_cp.inference.stages`: one forward through the pipeline stages, step by step.
- :mod:`~megatron_cp.inference.sampling`: greedy, temperature, top-k and top-p.
- :mod:`~megatron_cp.inference.generation`: the generation loop.
"""
