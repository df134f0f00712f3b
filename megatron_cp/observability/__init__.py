"""What a run tells its user: the periodic training log line (training_log.py, with its
TensorBoard and Weights & Biases sinks: wandb_logging.py), the start-up report printed once
(run_report.py), the profiler window (profiling.py) and the peak-memory meter (memory_peak.py).
"""
