"""The command line, derived from :mod:`megatron_cp.config`: the parser and its checks
(arguments.py), Megatron-LM's flag table (megatron_flags.py, with the census of its parser),
and the one-line error printer run before a launch (check_args.py)."""
