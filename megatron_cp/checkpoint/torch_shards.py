"""The ``--ckpt-format torch`` file names: which files a layout has and which rank writes each.

The torch format has one file per (TP, PP, EP, ETP) rank combination (Megatron's layout)::

    <dir>/iter_0000020/mp_rank_00/model_optim_rng.pt         (PP = 1)
    <dir>/iter_0000020/mp_rank_01_003/model_optim_rng.pt     (TP rank 1, PP rank 3)
    <dir>/iter_0000020/mp_rank_01_003_002/model_optim_rng.pt (... and EP rank 2, EP > 1)
    <dir>/iter_0000020/mp_rank_00_001_etp01/...              (TP 0, EP 1, ETP rank 1)

Shard names (:func:`shard_name`): ``mp_rank_TT`` (TP rank), then ``_PPP`` (PP rank) when
PP > 1, then ``_EEE`` (EP rank) when EP > 1, then ``_etpXX`` (ETP rank) when ETP > 1 and
ETP != TP. The parts present follow from the saved sizes, so a name is unambiguous given
the arguments (``_PPP`` and ``_EEE`` are both 3 digits, as in Megatron-LM). The ETP rank is
left out when it is implied: with ETP = TP the expert mesh gives every rank ETP rank = TP
rank, and with ETP = 1 it is 0. A dense model (no ``--num-experts``) names files by TP and
PP only, whatever the expert sizes say. Which combinations exist depends on the sizes only,
not on DP or CP (:func:`shard_names`): with TP = 2, EP = 2, ETP = 1 the expert mesh pairs TP
rank t with EP rank t, so the files are ``mp_rank_00_000`` and ``mp_rank_01_001``.
"""
import math
import os

SHARD_FILE = "model_optim_rng.pt"


def shard_name(tp_rank, pp_rank, pp_size, ep_rank=0, ep_size=1, etp_rank=0, etp_in_name=False):
    """The folder of one torch-format shard (the scheme is in the module docstring)."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp_size > 1:
        name += f"_{pp_rank:03d}"
    if ep_size > 1:
        name += f"_{ep_rank:03d}"
    if etp_in_name:
        name += f"_etp{etp_rank:02d}"
    return name


def _sizes(tp, pp, num_experts, ep, etp):
    """``(TP, PP, EP, ETP)``: a dense model has EP 1 and ETP = TP, whatever the flags say."""
    if not num_experts:
        return tp, pp, 1, tp
    return tp, pp, ep or 1, etp or tp


def file_layout(args):
    """``(TP, PP, EP, ETP)`` sizes that name the files of a checkpoint saved with ``args``
    (its saved arguments, a dict: the file format's names; a namespace reads the same)."""
    values = args if isinstance(args, dict) else vars(args)
    return _sizes(values["tensor_model_parallel_size"], values["pipeline_model_parallel_size"],
                  values.get("num_experts"), values.get("expert_model_parallel_size"),
                  values.get("expert_tensor_parallel_size"))


def run_file_layout(parallel, model):
    """``(TP, PP, EP, ETP)`` sizes that name the files of a run with the parallel section
    ``parallel`` (a ParallelConfig) and the model ``model`` (a GPTConfig: its experts)."""
    return _sizes(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                  model.num_moe_experts, parallel.expert_model_parallel_size,
                  parallel.expert_tensor_parallel_size)


def shard_names(tp, pp, ep=1, etp=None):
    """``{(tp rank, pp rank, ep rank, etp rank): shard folder name}`` of every combination
    that exists under these sizes. Inside a stage, rank ``i`` (in rank order over DP x CP x
    TP) has TP rank ``i % TP``, ETP rank ``i % ETP`` and EP rank ``(i // ETP) % EP``
    (initialize.rank_layout), which repeats with period lcm(TP, EP x ETP): every stage size
    that the sizes allow holds the same combinations."""
    etp = tp if etp is None else etp
    combos = sorted({(i % tp, (i // etp) % ep, i % etp) for i in range(math.lcm(tp, ep * etp))})
    in_name = etp > 1 and etp != tp
    return {(t, p, e, x): shard_name(t, p, pp, e, ep, x, in_name)
            for p in range(pp) for t, e, x in combos}


def _shard_coords(sizes, tp_rank, pp_rank, ep_rank, etp_rank):
    """A rank's key in :func:`shard_names` (EP / ETP ranks that the sizes imply are folded)."""
    tp, _, ep, etp = sizes
    etp_key = tp_rank if etp == tp else etp_rank if etp > 1 else 0
    return tp_rank, pp_rank, ep_rank if ep > 1 else 0, etp_key


def own_shard_name(state, sizes):
    """The shard folder this rank's state goes to (and loads from) under the file sizes
    ``sizes`` (:func:`run_file_layout`, or :func:`file_layout` of saved arguments)."""
    key = _shard_coords(sizes, state.rank("tp"), state.rank("pp"), state.rank("ep"),
                        state.rank("etp"))
    names = shard_names(*sizes)
    assert key in names, (key, sorted(names))
    return names[key]


def is_shard_writer(state, sizes):
    """True on the lowest global rank of this rank's shard combination under the file sizes
    ``sizes`` (as :func:`own_shard_name`): the one that writes it (every rank of a
    combination holds the same weights and optimizer state)."""
    names = ("tp", "pp", "ep", "etp")
    group_rank = {name: {} for name in names}  # {group name: {global rank: rank in group}}
    for name in names:
        for ranks in state.layout[name]:
            group_rank[name].update((rank, i) for i, rank in enumerate(ranks))

    def key(rank):
        return _shard_coords(sizes, *(group_rank[name][rank] for name in names))

    mine = key(state.global_rank)
    return next(r for r in range(state.world_size) if key(r) == mine) == state.global_rank


def first_file(folder):
    """The (TP 0, PP 0) file of the torch-format iteration folder ``folder``: every file
    holds the arguments, this one always exists."""
    # mp_rank_00, mp_rank_00_000 or mp_rank_00_000_000 (PP, EP) sort first
    for name in sorted(n for n in os.listdir(folder) if n.startswith("mp_rank_")):
        path = os.path.join(folder, name, SHARD_FILE)
        if os.path.exists(path):
            return path
    raise ValueError(f"{folder} holds no mp_rank_00 shard: not a megatron_cp checkpoint, or a "
                     f"partial copy of one")
