"""Every setting of a run, declared once: the foot of the house (it imports nothing else of
megatron_cp).

A setting is a typed dataclass field declared with :func:`~megatron_cp.config.setting.setting`,
which carries its help, its Megatron-LM flag and default; each section checks its own rules.
The sections: the model (model.py, with its MoE / MLA / Gated DeltaNet / MTP parts), the
optimizer (optimizer.py), the parallel layout's rules (parallel.py), muP (mup.py). The command
line is derived from them in :mod:`megatron_cp.cli`.
"""
