"""A setting lives in one place: the typed config's dataclass field.

Each field of a config (e.g. :class:`~megatron_cp.config.model.GPTConfig`) is declared with
:func:`setting`, which records its help, its Megatron-LM flag and how the flag maps onto the
field. From the fields this module derives everything else, so a new hyper-parameter is one
new field:

- :func:`add_config_flags`: the argparse flags (name, type, default, choices, help);
- :func:`build_config`: the config built from the parsed arguments;
- :func:`fill_args`: derived values written back to the arguments (saved in checkpoints);
- :func:`checkpoint_args`: the argument names a resumed checkpoint must match;
- :func:`config_flag_names` and :func:`name_flags`: error messages, which the config writes
  with field names, rewritten to name the flags the user typed.
"""
import dataclasses
import functools
import re
import types
import typing

_AUTO = object()  # "derive it from the field"
_UNSET = object()  # "the command line leaves this field at the config's default"


def setting(default=dataclasses.MISSING, *, help, flag=_AUTO, arg=None, when_set=_AUTO,
            cli_default=_AUTO, choices=None, group="model", gate=None, shapes=False,
            fill_arg=False, default_factory=dataclasses.MISSING, aliases=(), store_false=False,
            negative=None, nargs=None):
    """A dataclass field that also describes its command-line flag.

    ``help``: what the setting means (also the flag's help). ``flag``: the flag's name
    (default ``--field-name``; None: no flag of its own). ``arg``: the argument attribute read
    when it is not the flag's dest (e.g. a value another flag derives, like ``params_dtype``).
    A bool field, or one with ``when_set``, gets a ``store_true`` flag that sets the field to
    ``when_set`` (default: the opposite of the field's default), e.g. ``--swiglu`` sets
    ``activation="swiglu"``. ``cli_default``: the flag's default where Megatron-LM's differs from
    the field's; a None argument means "the config's default". ``choices``: allowed values,
    checked by the config (see :func:`check_choices`) and by argparse. ``group``: the argparse
    group. ``gate``: ``(flag, help)`` of a ``store_true`` flag without which the value is ignored
    (``--group-query-attention`` for ``--num-query-groups``). ``shapes``: the setting changes the
    shape, dtype or meaning of saved weights, so a resume must match it. ``fill_arg``: the
    config's derived value is written back to the arguments (saved checkpoints and tools read it).
    ``aliases``: Megatron-LM's other spellings of the flag (``--disable-x`` for ``--no-x``).
    ``store_false``: the flag is Megatron-LM's ``store_false`` switch: the argument ``arg`` holds
    the field's value itself, True unless the flag is given (``--no-bias-gelu-fusion`` ->
    ``bias_gelu_fusion``), so a saved checkpoint records Megatron-LM's name and meaning.
    ``negative``: ``(flag, help)`` of a second switch that sets a bool field to False, beside
    the ``store_true`` flag that sets it to True (``--overlap-p2p-comm`` and
    ``--no-overlap-p2p-communication``; the field's default is either). ``nargs``: argparse's
    ``nargs`` where the annotation's (``"+"`` for a tuple) is not it (``"*"``).
    """
    metadata = {"help": help, "flag": flag, "arg": arg, "when_set": when_set,
                "cli_default": cli_default, "choices": choices, "group": group, "gate": gate,
                "shapes": shapes, "fill_arg": fill_arg, "aliases": tuple(aliases),
                "store_false": store_false, "negative": negative, "nargs": nargs}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def resolve(config, **values):
    """Fill derived ``values`` into a frozen ``config`` while its ``__post_init__`` builds it
    (e.g. ffn_hidden_size from hidden_size); nothing changes a config once built."""
    for name, value in values.items():
        object.__setattr__(config, name, value)


def _dest(flag):
    return flag.lstrip("-").replace("-", "_")


def flag_of(f):
    """The flag of field ``f`` (None when it has none)."""
    flag = f.metadata.get("flag", _AUTO)
    return "--" + f.name.replace("_", "-") if flag is _AUTO else flag


def arg_of(f):
    """The argument attribute that field ``f`` is read from (None: the caller passes it)."""
    if f.metadata.get("arg"):
        return f.metadata["arg"]
    flag = flag_of(f)
    return _dest(flag) if flag else None


def _is_switch(f):
    return (flag_of(f) is not None and not f.metadata.get("negative")
            and (f.type is bool or f.metadata.get("when_set", _AUTO) is not _AUTO))


def _when_set(f):
    value = f.metadata.get("when_set", _AUTO)
    return (not f.default) if value is _AUTO else value


def _flag_type(annotation):
    """(element type, nargs) of a field annotation: ``int | None`` -> (int, None),
    ``tuple[int, ...] | None`` -> (int, "+")."""
    if typing.get_origin(annotation) in (types.UnionType, typing.Union):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is tuple:
        return typing.get_args(annotation)[0], "+"
    return annotation, None


def add_config_flags(config_cls, groups):
    """Add one flag per field of ``config_cls`` that has one, to ``groups[field's group]``."""
    for f in dataclasses.fields(config_cls):
        flag, meta = flag_of(f), f.metadata
        if flag is None:
            continue
        group = groups[meta.get("group", "model")]
        text = meta["help"].replace("%", "%%")  # argparse %-formats help strings
        if meta.get("gate"):
            gate_flag, gate_help = meta["gate"]
            group.add_argument(gate_flag, action="store_true", help=gate_help)
        names = (flag,) + meta.get("aliases", ())
        if meta.get("store_false"):
            group.add_argument(*names, action="store_false", dest=arg_of(f), help=text)
            continue
        if meta.get("negative"):
            negative, negative_help = meta["negative"]
            group.add_argument(*names, action="store_true", dest=arg_of(f), default=f.default,
                               help=text)
            group.add_argument(negative, action="store_false", dest=arg_of(f),
                               help=negative_help.replace("%", "%%"))
            continue
        if _is_switch(f):
            group.add_argument(*names, action="store_true", dest=arg_of(f), help=text)
            continue
        kwargs = {"help": text, "dest": arg_of(f)}
        element, nargs = _flag_type(f.type)
        kwargs["type"] = element
        nargs = meta.get("nargs") or nargs
        if nargs:
            kwargs["nargs"] = nargs
        if meta.get("choices"):
            kwargs["choices"] = [c for c in meta["choices"] if c is not None]
        default = meta.get("cli_default", _AUTO)
        if default is _AUTO:
            default = f.default
        if default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = list(default) if isinstance(default, tuple) else default
        group.add_argument(*names, **kwargs)


def _value_from_args(f, args):
    name = arg_of(f)
    if name is None:
        return _UNSET
    values = vars(args)  # a namespace without the name (an old checkpoint's): the field's default
    gate = f.metadata.get("gate")
    if gate and not values.get(_dest(gate[0])):
        return _UNSET
    value = values.get(name)
    if f.metadata.get("store_false") or f.metadata.get("negative"):
        return _UNSET if value is None else bool(value)
    if _is_switch(f):
        return _when_set(f) if value else _UNSET
    if value is None:
        return _UNSET
    return tuple(value) if isinstance(value, list) else value


def build_config(config_cls, args, **given):
    """``config_cls`` built from the parsed ``args``; ``given`` supplies fields with no flag."""
    kwargs = {}
    for f in dataclasses.fields(config_cls):
        value = _value_from_args(f, args)
        if value is not _UNSET:
            kwargs[f.name] = value
    kwargs.update(given)
    return config_cls(**kwargs)


def fill_args(config, args):
    """Write the config's derived value of every ``fill_arg`` field back onto ``args``."""
    for f in dataclasses.fields(config):
        if f.metadata.get("fill_arg"):
            setattr(args, arg_of(f), getattr(config, f.name))


def checkpoint_args(config_cls):
    """Argument names of the fields that shape saved weights (a resume must match them)."""
    return tuple(arg_of(f) for f in dataclasses.fields(config_cls)
                 if f.metadata.get("shapes") and arg_of(f))


@functools.lru_cache(maxsize=None)
def _fields_with_choices(config_cls):
    """``((name, choices), ...)`` of the fields of ``config_cls`` that declare choices (once
    per class: the planner builds configs by the hundred thousand)."""
    return tuple((f.name, f.metadata["choices"]) for f in dataclasses.fields(config_cls)
                 if f.metadata.get("choices") is not None)


def check_choices(config):
    """Raise ValueError for a field whose value (each entry of a tuple) is not one of its
    ``choices``."""
    for name, allowed in _fields_with_choices(type(config)):
        value = getattr(config, name)
        for entry in value if isinstance(value, tuple) else (value,):
            if entry not in allowed:
                raise ValueError(f"{name} ({entry!r}) must be one of {tuple(allowed)}")


def config_flag_names(config_cls):
    """``{field name: flag}`` for the fields of ``config_cls`` that have a flag."""
    return {f.name: flag_of(f) for f in dataclasses.fields(config_cls) if flag_of(f)}


def name_flags(message, names):
    """``message`` with each Python name of ``names`` (``{name: flag}``) replaced by its flag.

    Names with an underscore are replaced wherever they stand; one-word names (``seed``,
    ``normalization``) only in the ``name (value)`` form, so ordinary words stay words.
    """
    if not names:
        return message
    pattern = "|".join(
        (rf"\b{re.escape(name)}\b" if "_" in name else rf"\b{re.escape(name)}(?= \()")
        for name in sorted(names, key=len, reverse=True))
    return re.sub(pattern, lambda match: names[match.group(0)], message)
