"""Evaluation tasks on a trained checkpoint, launched like training: ``tasks/main.py``."""
