"""The layers point one way (docs/ARCHITECTURE.md, CONTRIBUTING.md), read from the imports with ast.

    top       specfit (the __init__ facade), specfit.cli, specfit.__main__
    eval      specfit.eval.*
    pipeline  specfit.pipeline
    engine    specfit.engine.*
    solvers   specfit.solvers.*     models   specfit.models.*   (neither imports the other)
    core      specfit.core.*        (no torch, no transformers)

Every import — at module level or inside a function — may only name a layer below its own (or its
own package); there is no package cycle; core and solvers never import torch or transformers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import specfit

ROOT = Path(__file__).resolve().parents[1]
#: Installed package → repository folder (pyproject.toml's package-dir).
FOLDERS = {"specfit": ROOT / "specfit", "specfit.solvers": ROOT / "solvers", "specfit.models": ROOT / "models",
           "specfit.eval": ROOT / "eval"}
#: Layer of each package, bottom (0) to top; the longest matching prefix wins.
LAYERS = {"specfit.core": 0, "specfit.solvers": 1, "specfit.models": 1, "specfit.engine": 2,
          "specfit.pipeline": 3, "specfit.eval": 4, "specfit": 5}
HEAVY = ("torch", "transformers", "safetensors")


def _package(module: str) -> str:
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def _modules():
    """(module name, path) of every Python file of the installed packages."""
    seen = {}
    for pkg, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "specfit" and parts and parts[0] in ("solvers", "models", "eval"):
                continue  # not part of specfit/ (the mapped folders)
            seen[name] = path
    return seen


def _imports(path: Path, module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level?) of every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    is_pkg = path.name == "__init__.py"
    out = []

    def walk(node, level):
        for child in ast.iter_child_nodes(node):
            at_top = level and id(child) in top
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, at_top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                out.append((base, child.lineno, at_top))
                out.extend((f"{base}.{a.name}", child.lineno, at_top) for a in child.names
                           if f"{base}.{a.name}" in MODULES)
            if not isinstance(child, (ast.If,)) or not _is_type_checking(child):
                walk(child, level and isinstance(child, (ast.Try, ast.If)))
    walk(tree, True)
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


MODULES = _modules()


def _edges():
    for module, path in MODULES.items():
        for target, line, at_top in _imports(path, module):
            if target == "specfit" or target.startswith("specfit."):
                yield module, _package(target), target, f"{path.relative_to(ROOT)}:{line}", at_top


def test_the_layout_is_what_the_test_reads():
    assert "specfit.core.tree" in MODULES and "specfit.solvers.exact" in MODULES
    assert "specfit.engine.decoder" in MODULES and "specfit.eval.run" in MODULES and "specfit.cli" in MODULES
    assert Path(specfit.__file__).resolve().parent == FOLDERS["specfit"]


def test_every_import_points_down():
    bad = []
    for module, target_pkg, target, where, _ in _edges():
        own = _package(module)
        if own == target_pkg:
            continue
        if not LAYERS[target_pkg] < LAYERS[own]:
            bad.append(f"{where}: {module} ({own}) imports {target} ({target_pkg})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_solvers_and_models_do_not_import_each_other():
    bad = [f"{where}: {module} imports {target}" for module, pkg, target, where, _ in _edges()
           if {_package(module), pkg} == {"specfit.solvers", "specfit.models"}]
    assert not bad, "\n".join(bad)


def test_no_package_cycle():
    graph: dict[str, set] = {}
    for module, pkg, *_ in _edges():
        graph.setdefault(_package(module), set()).add(pkg)
    for start in graph:
        stack, seen = [n for n in graph[start] if n != start], set()
        while stack:
            node = stack.pop()
            assert node != start, f"package cycle through {start}"
            if node not in seen:
                seen.add(node)
                stack.extend(n for n in graph.get(node, ()) if n != node)


@pytest.mark.parametrize("package", ["specfit.core", "specfit.solvers"])
def test_core_and_solvers_import_no_torch_or_transformers(package):
    bad = []
    for module, path in MODULES.items():
        if _package(module) != package:
            continue
        for target, line, _ in _imports(path, module):
            if target.split(".")[0] in HEAVY:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_importing_core_and_solvers_loads_no_torch():
    import subprocess
    import sys

    code = ("import sys, specfit.core.tree, specfit.core.instance, specfit.core.cost, specfit.core.objective, "
            "specfit.solvers, specfit.solvers.exact, specfit.solvers.greedy; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_checker_catches_an_upward_import(tmp_path):
    """A core module importing the engine, or solvers importing eval, would be reported."""
    own, target = _package("specfit.core.tree"), _package("specfit.engine.decoder")
    assert not LAYERS[target] < LAYERS[own]
    assert not LAYERS[_package("specfit.eval.run")] < LAYERS[_package("specfit.solvers.api")]
    assert LAYERS[_package("specfit.pipeline")] < LAYERS[_package("specfit.eval.run")]
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from specfit.eval.run import run_eval\n")
    assert ("specfit.eval.run", 2, False) in _imports(probe, "specfit.solvers.probe")


#: The engine's modules that decide and learn (no model runs in them): they never import the runtime.
POLICY_MODULES = ("specfit.engine.policy", "specfit.engine.online", "specfit.engine.clock")


@pytest.mark.parametrize("module", POLICY_MODULES)
def test_the_engines_policies_do_not_import_the_runtime(module):
    path = MODULES[module]
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}" for target, line, _ in _imports(path, module)
           if target.split(".")[0] in HEAVY or target == "specfit.models" or target.startswith("specfit.models.")]
    assert not bad, "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports(path: Path, module: str, root: Path = ROOT) -> list[str]:
    """``from specfit.x import _name`` in ``path`` where specfit.x is another module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "specfit":
            if node.module == module:
                continue
            out += [f"{path.relative_to(root)}:{node.lineno} imports {node.module}.{a.name}"
                    for a in node.names if _private(a.name)]
    return out


def _private_attributes(path: Path, root: Path = ROOT) -> list[str]:
    """``x._name`` in ``path`` where ``x`` is not ``self`` or ``cls``: a private member of another object."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"{path.relative_to(root)}:{node.lineno} reads {ast.unparse(node)}")
    return out


def test_nothing_imports_a_private_name_across_modules():
    bad = [line for module, path in MODULES.items() for line in _private_imports(path, module)]
    assert not bad, "\n".join(bad)


def test_the_engine_reads_no_private_member_of_another_object():
    bad = [line for module, path in MODULES.items() if module.startswith("specfit.engine")
           for line in _private_attributes(path)]
    assert not bad, "\n".join(bad)


def test_the_private_name_checks_catch_a_violation(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from specfit.solvers.stop import _bound, ok\n\n\n"
                     "def f(self, tree):\n    return tree._append(1), self._own, tree.__len__()\n")
    imports = [line.split(" imports ")[1] for line in _private_imports(probe, "specfit.engine.probe", tmp_path)]
    assert imports == ["specfit.solvers.stop._bound"]
    reads = [line.split(" reads ")[1] for line in _private_attributes(probe, tmp_path)]
    assert reads == ["tree._append"]


#: Most instance attributes (set on ``self``, plus dataclass fields) a class under specfit/engine holds, and
#: most lines a function there spans: a newcomer reads each in one pass (docs/ARCHITECTURE.md, "Read first").
MAX_ATTRIBUTES, MAX_FUNCTION_LINES = 15, 100
#: Classes allowed more attributes, each with its reason.
ATTRIBUTE_EXEMPT = {
    "specfit.engine.decoder.CycleRecord": "a flat output record: one column per field of the per-cycle JSON that "
                                          "results.jsonl, eval/modeled.py and the golden cycle records read",
}


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "dataclass")
               or (isinstance(d, ast.Call) and getattr(d.func, "id", None) == "dataclass") for d in node.decorator_list)


def _attributes(node: ast.ClassDef) -> set[str]:
    """The instance attributes of a class: its dataclass fields (annotated class-level names, ClassVar
    excluded) and every ``self.x`` assigned in its methods."""
    names = set()
    if _is_dataclass(node):
        names |= {st.target.id for st in node.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                  and "ClassVar" not in ast.unparse(st.annotation)}
    for sub in ast.walk(node):
        targets = (sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                   if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else [])
        names |= {e.attr for t in targets for e in ast.walk(t)
                  if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"}
    return names


def _oversized(path: Path, module: str) -> list[str]:
    """Classes of ``path`` with more than MAX_ATTRIBUTES attributes (unless exempt), functions longer than
    MAX_FUNCTION_LINES lines."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ClassDef) and f"{module}.{node.name}" not in ATTRIBUTE_EXEMPT:
            names = _attributes(node)
            if len(names) > MAX_ATTRIBUTES:
                out.append(f"{module}.{node.name} holds {len(names)} attributes: {sorted(names)}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{module}:{node.lineno} {node.name} spans {lines} lines")
    return out


def test_engine_classes_and_functions_are_small():
    engine = {m: p for m, p in MODULES.items() if m.startswith("specfit.engine.")}
    assert "specfit.engine.decoder" in engine
    bad = [line for module, path in engine.items() for line in _oversized(path, module)]
    assert not bad, "\n".join(bad)
    exempt = {name.rsplit(".", 1)[1] for name in ATTRIBUTE_EXEMPT}
    found = {n.name for p in engine.values() for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)}
    assert exempt <= found, f"an exemption names no class: {sorted(exempt - found)}"


def test_the_size_check_catches_a_large_class_and_a_long_function(tmp_path):
    probe = tmp_path / "probe.py"
    fields = "\n".join(f"    f{i}: int = 0" for i in range(10))
    sets = "\n".join(f"        self.a{i} = 0" for i in range(4))
    probe.write_text(f"from dataclasses import dataclass\n\n\n@dataclass\nclass Big:\n{fields}\n    K = 1\n\n"
                     f"    def __post_init__(self):\n{sets}\n        self.a0 += 1\n        self.b, self.c = 1, 2\n\n\n"
                     "def long():\n" + "    x = 1\n" * 100 + "    return x\n")
    assert _attributes(next(n for n in ast.walk(ast.parse(probe.read_text())) if isinstance(n, ast.ClassDef))) == (
        {f"f{i}" for i in range(10)} | {f"a{i}" for i in range(4)} | {"b", "c"})
    bad = _oversized(probe, "specfit.engine.probe")
    assert len(bad) == 2 and "Big holds 16 attributes" in bad[0] and "long spans 102 lines" in bad[1]
