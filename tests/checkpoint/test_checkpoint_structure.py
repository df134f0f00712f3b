"""The checkpoint package's shape (megatron_cp/checkpoint/): no import circle, and each on-disk
format knowing nothing of the others nor of the entry (load_save) that picks among them, nor
of the Checkpointer above it.

The import graph is read from the source with ``ast``: every ``import`` of a megatron_cp
module, at the top of a file or inside a function (a lazy import is still a dependency), and
the packages a module import runs first (``megatron_cp.x.y`` runs ``megatron_cp/x/__init__``).
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "megatron_cp.checkpoint"
ENTRY = f"{PACKAGE}.load_save"
CHECKPOINTER = f"{PACKAGE}.checkpointer"  # above the entry: what a run holds
# each on-disk format and the modules only it uses
FORMATS = {
    "torch": ("torch_format", "torch_shards", "torch_full"),
    "torch_dist": ("torch_dist_format", "integrity", "strictness"),
    # Megatron-LM's own formats: its torch_dist (and its conversion to and from our full
    # weights), and Megatron-FSDP's fsdp_dtensor
    "megatron_lm": ("megatron_lm_format", "megatron_lm_load", "megatron_lm_convert",
                    "fsdp_dtensor_format"),
}
# what every format builds on: none of these imports a format or the entry
SHARED = ("__init__", "state", "train_state", "files", "faults", "canonical", "pieces",
          "use_checkpoint_args", "old_defaults", "dcp_files", "fp8_state")


def _module_file(name):
    """The source file of the megatron_cp module or package ``name`` (None: not one)."""
    path = os.path.join(ROOT, *name.split("."))
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _with_parents(name):
    """``name`` and the packages Python initialises before it (``a.b.c``: ``a``, ``a.b``)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imports_of(name):
    """The megatron_cp modules that importing ``name`` runs (anywhere in its file)."""
    path = _module_file(name)
    is_package = path.endswith("__init__.py")
    tree = ast.parse(open(path).read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            # ``from pkg import sub`` imports the submodule when there is one
            targets = [f"{base}.{alias.name}" if _module_file(f"{base}.{alias.name}") else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "megatron_cp" and _module_file(target):
                found.update(t for t in _with_parents(target) if t != name)
    return found


def import_graph(start):
    """``{module: modules it imports}`` of every megatron_cp module reachable from ``start``."""
    graph, todo = {}, list(start)
    while todo:
        name = todo.pop()
        if name not in graph:
            graph[name] = imports_of(name)
            todo += graph[name]
    return graph


def reachable(graph, start):
    """Every module ``graph`` leads to from the modules ``start``."""
    seen, todo = set(), list(start)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, ())
    return seen


def find_cycle(graph):
    """One import circle of ``graph`` as a list of modules (first = last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def package_modules():
    folder = os.path.join(ROOT, *PACKAGE.split("."))
    return sorted(f"{PACKAGE}.{n[:-3]}" if n != "__init__.py" else PACKAGE
                  for n in os.listdir(folder) if n.endswith(".py"))


def _short(name):
    return "__init__" if name == PACKAGE else name[len(PACKAGE) + 1:]


def test_every_module_has_a_place_and_a_docstring():
    placed = ({m for members in FORMATS.values() for m in members} | set(SHARED)
              | {"load_save", "checkpointer"})
    for name in package_modules():
        assert _short(name) in placed, f"{name}: add it to FORMATS or SHARED here"
        tree = ast.parse(open(_module_file(name)).read())
        assert ast.get_docstring(tree), f"{name} has no module docstring"


def test_no_import_circle_through_the_checkpoint_code():
    graph = import_graph(package_modules())
    inside = {name: {t for t in targets if t.startswith(PACKAGE)}
              for name, targets in graph.items() if name.startswith(PACKAGE)}
    assert find_cycle(inside) is None, find_cycle(inside)
    # nor a circle through megatron_cp at large that comes back into the package
    for name in inside:
        assert name not in reachable(graph, graph[name]), f"{name} imports itself back"


def test_formats_know_nothing_of_each_other_nor_of_the_entry():
    family = {f"{PACKAGE}.{m}": fmt for fmt, members in FORMATS.items() for m in members}
    for name in package_modules():
        imported = imports_of(name)
        if name != CHECKPOINTER:
            assert ENTRY not in imported, f"{name} imports the entry {ENTRY}"
            assert CHECKPOINTER not in imported, f"{name} imports {CHECKPOINTER}"
        others = {family[t] for t in imported if t in family} - {family.get(name)}
        if name in family:
            assert not others, f"the {family[name]} format's {name} imports the formats {others}"
        elif name != ENTRY:
            assert not others, f"{name}, shared by every format, imports the formats {others}"
    # the package's __init__ imports nothing: a shared module can be imported alone
    assert not imports_of(PACKAGE)


def test_the_entry_imports_every_format():
    imported = imports_of(ENTRY)
    for fmt, members in FORMATS.items():
        assert imported & {f"{PACKAGE}.{m}" for m in members}, f"{ENTRY} does not load {fmt}"


def test_the_graph_sees_function_level_imports():
    """The checker itself: a lazy import inside a function is an edge, and a circle is found."""
    assert f"{PACKAGE}.faults" in imports_of(f"{PACKAGE}.files")
    assert "megatron_cp.config.layer_pattern" in imports_of(f"{PACKAGE}.megatron_lm_format")  # lazy
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "a" in reachable({"a": {"b"}, "b": {"c"}, "c": {"a"}}, {"b"})
