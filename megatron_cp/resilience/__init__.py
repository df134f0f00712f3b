"""What keeps a long job alive or ends it with one clear line: ``faults.py`` (a lost peer, a
NaN, a file one rank could not read, each a single line and an exit status), ``rerun.py``
(Megatron-LM's rerun state machine, with ``rerun_outcomes.py``'s exits and verdicts and
``rerun_records.py``'s log lines) and ``weight_hash.py`` (DP replicas hold the same weights)."""
