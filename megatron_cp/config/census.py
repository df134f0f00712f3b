"""Megatron-LM's flag census: every flag of its pretraining parser at one commit, with its
argparse spec and default (``megatron_cp/cli/megatron_lm_flags.json``, written from that parser
by tools/megatron_flag_census.py). Read by the command line (cli/megatron_flags.py) and by the
Megatron-LM checkpoint format (its argument defaults); a leaf, as the rest of config/."""
import functools
import json
import os

CENSUS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cli",
                           "megatron_lm_flags.json")


@functools.lru_cache(maxsize=None)
def megatron_census():
    """The census: ``{"commit": ..., "flag_count": ..., "actions": [...]}``."""
    with open(CENSUS_FILE) as file:
        return json.load(file)
