"""List every flag Megatron-LM's pretraining parser defines, as a JSON census.

    python tools/megatron_flag_census.py /path/to/Megatron-LM > megatron_cp/cli/megatron_lm_flags.json

The census is a fact about one Megatron-LM commit: for each argparse action of
``megatron.training.arguments.add_megatron_arguments``, its option strings, its kind
(``store``, ``store_true``, ``store_false``, ``boolean_optional``), nargs, value type,
choices and default. megatron_cp's flag table (megatron_cp/cli/megatron_flags.py) must place
every one of them; tests/cli/test_megatron_flag_census.py holds the two together.

Megatron-LM's parser is built by importing it, so its imports must resolve: the modules named
in STUBS (GPU kernels such as triton, which the parser never calls) are replaced by inert
stand-ins while the parser is built. Python 3.11 lacks ``typing.override``, which the
Megatron-LM sources use as a decorator; an identity function stands in for it.
"""
import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types
import typing
from unittest import mock

# Imported by Megatron-LM at module level, never used to build its parser.
STUBS = ("triton", "megatron.core.transformer.moe.ops")
KINDS = {argparse._StoreAction: "store", argparse._StoreTrueAction: "store_true",
         argparse._StoreFalseAction: "store_false",
         argparse.BooleanOptionalAction: "boolean_optional"}


class _StubModule(types.ModuleType):
    """A module whose every attribute exists: classes for capitalised names, mocks otherwise."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = (type(name, (), {"__init__": lambda self, *a, **k: None}) if name[:1].isupper()
                 else mock.MagicMock(name=name))
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == stub or name.startswith(stub + ".") for stub in STUBS):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__, module.__version__ = [], "3.0.0"
        return module

    def exec_module(self, module):
        pass


def _plain(value):
    """``value`` as JSON holds it, or its repr when JSON cannot (an enum, a function)."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _import_checkout(megatron_root):
    """Import the ``megatron`` package of the checkout at ``megatron_root``, not an installed
    megatron-core's: found in that folder only, and in sys.modules before its submodules
    (``megatron.training``, ``megatron.core``) are imported from its own folder."""
    spec = importlib.machinery.PathFinder.find_spec("megatron", [megatron_root])
    if spec is None:
        raise SystemExit(f"error: {megatron_root} holds no megatron/ package: not a Megatron-LM "
                         f"checkout")
    module = importlib.util.module_from_spec(spec)
    sys.modules["megatron"] = module
    if spec.loader is not None:
        spec.loader.exec_module(module)


def census(megatron_root):
    """The census of the Megatron-LM checkout at ``megatron_root`` (a dict, JSON-ready)."""
    sys.meta_path.insert(0, _StubFinder())
    _import_checkout(megatron_root)
    typing.override = getattr(typing, "override", lambda function: function)
    sys.argv = [sys.argv[0]]
    from megatron.training.arguments import add_megatron_arguments
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    actions = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        kind = KINDS.get(type(action))
        if kind is None:
            raise SystemExit(f"unknown argparse action {type(action).__name__} for "
                             f"{action.option_strings}: teach tools/megatron_flag_census.py")
        value_type = getattr(action.type, "__name__", None) if action.type else None
        actions.append({
            "flags": list(action.option_strings), "dest": action.dest, "kind": kind,
            "nargs": action.nargs, "type": value_type if value_type in ("int", "float") else "str",
            "choices": [_plain(c) for c in action.choices] if action.choices else None,
            "default": _plain(action.default), "group": group_of.get(id(action))})
    commit = subprocess.run(["git", "-C", megatron_root, "rev-parse", "HEAD"], text=True,
                            capture_output=True).stdout.strip() or None
    return {"source": "megatron/training/arguments.py: add_megatron_arguments",
            "commit": commit, "flag_count": sum(len(a["flags"]) for a in actions),
            "actions": actions}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("megatron_root", help="a Megatron-LM checkout")
    parser.add_argument("--commit", default=None,
                        help="the checkout's commit, when it is not a git work tree")
    args = parser.parse_args()
    result = census(os.path.abspath(args.megatron_root))
    result["commit"] = args.commit or result["commit"]
    actions = result.pop("actions")  # one action per line: reviewable diffs
    head = json.dumps(result, indent=1)[:-2]
    lines = ",\n".join("  " + json.dumps(action) for action in actions)
    print(f'{head},\n "actions": [\n{lines}\n ]\n}}')


if __name__ == "__main__":
    main()
