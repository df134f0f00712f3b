"""Weights & Biases logging (Megatron-LM's ``--wandb-project``, ``--wandb-exp-name``,
``--wandb-save-dir``, ``--wandb-entity``): the one module that imports ``wandb``, an optional
dependency (``pip install wandb``, or the package's ``wandb`` extra).

As in Megatron-LM, the last rank opens one run of ``--wandb-project`` (under
``--wandb-entity``), named ``--wandb-exp-name`` and written under ``--wandb-save-dir``
(default ``<--save>/wandb``), with the run's settings as its config (every field of its
config sections, under the arguments' names: :func:`run_settings`); the training logger sends it
the scalars it writes to tensorboard, at the same iterations, under Megatron's names
(``lm loss``, ``learning-rate``, ``grad-norm``, ...; the consumed samples are ``samples vs
steps``). Megatron writes them only where a tensorboard writer exists too; here they do
not need ``--tensorboard-dir``.

Offline unless told otherwise: with ``WANDB_MODE`` unset and no API key found (neither
``WANDB_API_KEY`` nor a login in the netrc file where ``wandb login`` keeps it), the run is
written offline, so a machine without network never waits on one; ``wandb sync <run
folder>`` uploads it later. ``WANDB_MODE`` (online, offline, disabled) always wins.
"""
import dataclasses
import importlib.util
import netrc
import os
from urllib.parse import urlsplit

# Where the name megatron_cp's tensorboard uses differs from Megatron's wandb name.
_MEGATRON_NAMES = {"consumed-samples": "samples vs steps"}


def flag_problems(logging, save):
    """The wandb settings' own rules: a line per problem (none: []). ``logging``: the logging
    section (its ``wandb_*`` fields); ``save``: the checkpoint folder (--save, or None)."""
    others = [flag for flag, value in (("--wandb-exp-name", logging.wandb_exp_name),
                                       ("--wandb-save-dir", logging.wandb_save_dir),
                                       ("--wandb-entity", logging.wandb_entity))
              if value is not None]
    project = logging.wandb_project
    if not project:
        return [f"{flag} is for the Weights & Biases run of --wandb-project; add "
                f"--wandb-project NAME (or drop it)" for flag in others]
    problems = []
    if importlib.util.find_spec("wandb") is None:
        problems.append(f"--wandb-project {project} logs to Weights & Biases, but the "
                        f"wandb package is not installed: pip install wandb")
    if logging.wandb_exp_name == "":
        problems.append("--wandb-exp-name is empty; give the run a name, or drop the flag for "
                        "wandb's own")
    if not (logging.wandb_save_dir or save):
        problems.append(f"--wandb-project {project} needs a folder for the run: give "
                        f"--wandb-save-dir DIR (or --save DIR, which puts it in DIR/wandb)")
    return problems


def save_dir(logging, save):
    """Where the run is written: the logging section's ``wandb_save_dir``, else
    ``<save>/wandb`` (``save``: the checkpoint folder, --save)."""
    return logging.wandb_save_dir or os.path.join(save, "wandb")


def run_settings(run):
    """The wandb run's config: every setting of ``run`` (a
    :class:`~megatron_cp.config.run.RunConfig`) under its argument's name, as Megatron-LM
    records its arguments; a name two sections declare (``vocab_size``: the model's, from the
    tokenizer, and the data's --vocab-size) keeps the first, in the sections' order."""
    settings = {}
    for section in dataclasses.fields(run):
        value = getattr(run, section.name)
        if not dataclasses.is_dataclass(value):
            continue  # the compatibility notes
        for f in dataclasses.fields(value):
            settings.setdefault(f.name, getattr(value, f.name))
    return settings


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
    """The run of one job (on the last rank): ``add_scalar`` as tensorboard's writer.
    ``logging``: the logging section (project, entity, run name, folder); ``save``: the
    checkpoint folder (the default place of the run); ``settings``: the run's config
    (:func:`run_settings`)."""

    def __init__(self, logging, save, settings, rank, world_size):
        import wandb
        folder = save_dir(logging, save)
        os.makedirs(folder, exist_ok=True)
        config = {name: _plain(value) for name, value in settings.items()}
        config.update(rank=rank, world_size=world_size,
                      slurm_job_name=os.getenv("SLURM_JOB_NAME", "N/A"))
        options = dict(dir=folder, name=logging.wandb_exp_name, project=logging.wandb_project,
                       config=config)
        if logging.wandb_entity:
            options["entity"] = logging.wandb_entity
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
