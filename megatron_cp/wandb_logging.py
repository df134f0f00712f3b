"""Weights & Biases logging (Megatron-LM's ``--wandb-project``, ``--wandb-exp-name``,
``--wandb-save-dir``, ``--wandb-entity``): the one module that imports ``wandb``, an optional
dependency (``pip install wandb``, or the package's ``wandb`` extra).

As in Megatron-LM, the last rank opens one run of ``--wandb-project`` (under
``--wandb-entity``), named ``--wandb-exp-name`` and written under ``--wandb-save-dir``
(default ``<--save>/wandb``), with the arguments as its config; the training logger sends it
the scalars it writes to tensorboard, at the same iterations, under Megatron's names
(``lm loss``, ``learning-rate``, ``grad-norm``, ...; the consumed samples are ``samples vs
steps``). Megatron writes them only where a tensorboard writer exists too; here they do
not need ``--tensorboard-dir``.

Offline unless told otherwise: with ``WANDB_MODE`` unset and no API key found (neither
``WANDB_API_KEY`` nor a login in the netrc file where ``wandb login`` keeps it), the run is
written offline, so a machine without network never waits on one; ``wandb sync <run
folder>`` uploads it later. ``WANDB_MODE`` (online, offline, disabled) always wins.
"""
import importlib.util
import netrc
import os
from urllib.parse import urlsplit

# Where the name megatron_cp's tensorboard uses differs from Megatron's wandb name.
_MEGATRON_NAMES = {"consumed-samples": "samples vs steps"}


def flag_problems(args):
    """The wandb flags' own rules: a line per problem (none: [])."""
    others = [flag for flag, value in (("--wandb-exp-name", args.wandb_exp_name),
                                       ("--wandb-save-dir", args.wandb_save_dir),
                                       ("--wandb-entity", args.wandb_entity)) if value is not None]
    if not args.wandb_project:
        return [f"{flag} is for the Weights & Biases run of --wandb-project; add "
                f"--wandb-project NAME (or drop it)" for flag in others]
    problems = []
    if importlib.util.find_spec("wandb") is None:
        problems.append(f"--wandb-project {args.wandb_project} logs to Weights & Biases, but the "
                        f"wandb package is not installed: pip install wandb")
    if args.wandb_exp_name == "":
        problems.append("--wandb-exp-name is empty; give the run a name, or drop the flag for "
                        "wandb's own")
    if not (args.wandb_save_dir or args.save):
        problems.append(f"--wandb-project {args.wandb_project} needs a folder for the run: give "
                        f"--wandb-save-dir DIR (or --save DIR, which puts it in DIR/wandb)")
    return problems


def save_dir(args):
    """Where the run is written: ``--wandb-save-dir``, else ``<--save>/wandb``."""
    return args.wandb_save_dir or os.path.join(args.save, "wandb")


def has_login():
    """Whether wandb would find an API key: ``WANDB_API_KEY``, or an entry for its server
    (``WANDB_BASE_URL``, default api.wandb.ai) in the netrc file (``NETRC`` or ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _plain(value):
    return value if isinstance(value, (bool, int, float, str, list, tuple, type(None))) \
        else str(value)


class WandbWriter:
    """The run of one job (on the last rank): ``add_scalar`` as tensorboard's writer."""

    def __init__(self, args, rank, world_size):
        import wandb
        folder = save_dir(args)
        os.makedirs(folder, exist_ok=True)
        config = {name: _plain(value) for name, value in vars(args).items()}
        config.update(rank=rank, world_size=world_size,
                      slurm_job_name=os.getenv("SLURM_JOB_NAME", "N/A"))
        options = dict(dir=folder, name=args.wandb_exp_name, project=args.wandb_project,
                       config=config)
        if args.wandb_entity:
            options["entity"] = args.wandb_entity
        self.offline = "WANDB_MODE" not in os.environ and not has_login()
        if self.offline:
            options["mode"] = "offline"
            print(f"> wandb: no WANDB_API_KEY or login found: the run is written offline under "
                  f"{folder} (upload it with 'wandb sync')", flush=True)
        self.run = wandb.init(**options)

    def add_scalar(self, name, value, step):
        if name.endswith(" vs samples"):  # tensorboard's samples axis; Megatron's wandb has none
            return
        self.run.log({_MEGATRON_NAMES.get(name, name): value}, step=step)

    def flush(self):
        """Nothing to do: the run records each scalar as it is logged."""

    def close(self):
        self.run.finish()
