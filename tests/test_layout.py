"""The house rules of the library's layout, read from the source (no imports run):

- imports run one way: the entry scripts -> engine / tasks -> datapipe / observe -> settings,
  with networks/ and distributed/ as libraries that import none of the rooms (distributed/
  uses networks/: it turns the serial ViT into its sharded form);
- no module imports itself back through others (no cycles, function-level imports included);
- the data and observe rooms never see a Trainer;
- train.py takes its project imports from at most five packages and twelve modules, and reads
  in functions of at most 60 lines;
- only the checkpointer's package uses torch's distributed checkpoint, and no module outside
  distributed/'s model-parallel layers sends point-to-point messages.
"""
import ast
import os

from conftest import ROOT

# What each room may import (besides itself, the standard library and third-party packages).
ALLOWED = {
    "engine": {"datapipe", "observe", "settings", "distributed"},
    "tasks": {"datapipe", "observe", "settings", "networks"},
    "datapipe": {"settings"},
    "observe": {"settings"},
    "settings": set(),
    "distributed": {"networks"},
    "networks": set(),
}
ENTRIES = ("train.py", "train_mp.py", "train_graph.py")


def modules():
    """(module name, path) of every library module."""
    for room in ALLOWED:
        for folder, _, names in sorted(os.walk(os.path.join(ROOT, room))):  # packages included
            package = os.path.relpath(folder, ROOT).replace(os.sep, ".")
            for name in sorted(n for n in names if n.endswith(".py")):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                yield module, os.path.join(folder, name)


def imported(path):
    """Project modules a file imports, anywhere in it (``from a.b import c`` gives a.b.c when
    that is a module, else a.b)."""
    names = {m for m, _ in modules()}
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            candidates = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for c in candidates:
            if c in names:
                out.add(c)
                if isinstance(node, ast.ImportFrom):
                    break  # the imported names were modules, or the package itself counts
    return out


def test_imports_run_one_way():
    wrong = []
    for module, path in modules():
        room = module.split(".")[0]
        for target in imported(path):
            other = target.split(".")[0]
            if other != room and other not in ALLOWED[room]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_no_import_cycles():
    graph = {m: imported(p) - {m} for m, p in modules()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_data_and_observe_rooms_never_see_a_trainer():
    seen = []
    for module, path in modules():
        if module.split(".")[0] not in ("datapipe", "observe"):
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs:
                    note = ast.unparse(a.annotation) if a.annotation else ""
                    if "trainer" in a.arg.lower() or "Trainer" in note:
                        seen.append(f"{module}.{node.name}({a.arg})")
    assert not seen, seen


def test_train_py_imports_from_at_most_five_packages():
    rooms = set()
    for entry in ENTRIES:
        tree = ast.parse(open(os.path.join(ROOT, entry)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                top = node.module.split(".")[0]
                if top in ALLOWED and entry == "train.py":
                    rooms.add(top)
    assert 0 < len(rooms) <= 5, sorted(rooms)


def test_train_py_is_the_recipe_and_the_loop():
    tree = ast.parse(open(os.path.join(ROOT, "train.py")).read())
    names = {m for m, _ in modules()}
    imported_modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module \
                and node.module.split(".")[0] in ALLOWED:
            # ``from engine import throughput_report``: the module counts, not the package
            subs = [f"{node.module}.{a.name}" for a in node.names
                    if f"{node.module}.{a.name}" in names]
            imported_modules.update(subs or [node.module])
    assert len(imported_modules) <= 12, sorted(imported_modules)
    long = [f"{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


def test_one_package_checkpoints_and_only_the_sharded_layers_send_messages():
    dcp, p2p = [], []
    for module, path in modules():
        text = open(path).read()
        if "torch.distributed.checkpoint" in text and not module.startswith("engine.checkpoint"):
            dcp.append(module)
        if any(f"{op}(" in text for op in ("isend", "irecv", "dist.send", "dist.recv")) \
                and not module.startswith("distributed."):
            p2p.append(module)
    assert not dcp and not p2p, (dcp, p2p)


def test_the_rule_tests_see_real_imports(tmp_path):
    """The reader finds imports at any depth, in both forms."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from engine import checkpoint\n    import settings.errors\n"
                 "from observe.run_log import Progress\n")
    assert imported(str(f)) == {"engine.checkpoint", "settings.errors", "observe.run_log"}


def test_nothing_outside_the_tasks_branches_on_the_model_family():
    """The engine, the data and observe rooms and the entry scripts ask the task (or the data set
    registered for the config's class); they never test which family a config is."""
    import re

    family = re.compile(r"isinstance\([^)]*(ViTConfig|UNetConfig)|\.model\s*[!=]=|\[\s*\w*cfg\.model\s*\]"
                        r"|\[\s*config\.model\s*\]")
    found = []
    paths = [p for m, p in modules() if not m.startswith("tasks")]
    paths += [os.path.join(ROOT, e) for e in ENTRIES]
    for path in paths:
        for n, line in enumerate(open(path), 1):
            if family.search(line):
                found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not found, found


def runtime_imports(path):
    """Modules a file imports when it runs: ``if TYPE_CHECKING:`` blocks (annotations) skipped."""
    tree = ast.parse(open(path).read(), path)
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                   "typing.TYPE_CHECKING"):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_few_library_files_depend_on_the_settings_schema():
    """Outside settings/, the schema (settings.config) is imported by at most 8 library files:
    those that declare or register a config family, or read all settings of one. The rest get
    the config as an object, or the values they use."""
    users = sorted(os.path.relpath(p, ROOT) for m, p in modules()
                   if not m.startswith("settings") and "settings.config" in runtime_imports(p))
    assert len(users) <= 8, users


def test_every_library_module_imports():
    """Every module of the rooms imports on its own (the quick tier touches each of them)."""
    import importlib

    for module, _ in modules():
        importlib.import_module(module)
