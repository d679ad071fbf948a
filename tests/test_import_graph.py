"""The import graph of ``ulysses``, ``arctic`` and ``offload`` (imports inside functions
included, and each package's ``__init__`` that importing a module runs first): no cycle,
nothing imported upward (``ulysses`` and ``offload`` are torch only: they import neither
``arctic`` nor transformers, and ``ulysses`` not DeepSpeed), no module importing another
module's ``_private`` name, and no import of our modules inside a function except of one that
imports an optional package (transformers, DeepSpeed) when imported.

The checks run on the repository, and on small trees written here that break each rule, so
that each check is seen to fail."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("ulysses", "arctic", "offload")
FORBIDDEN = {"ulysses": ("arctic", "offload", "transformers", "deepspeed", "accelerate"),
             "offload": ("arctic", "ulysses", "transformers", "accelerate")}
"""What each torch-only package must not import (offload may import DeepSpeed's AIO, optional,
and the :data:`SHARED` modules of ``ulysses``)."""
OPTIONAL = ("transformers", "deepspeed", "accelerate", "trl")
"""Packages that ``import arctic`` does not need (``pip install ".[hf]"``): only an import of
one of our modules that imports them at its top may stand inside a function."""
SHARED = ("ulysses.torch_internals", "ulysses.trace_shortcuts", "ulysses.patching")
"""The modules of ``ulysses`` below the engine that ``offload`` shares."""


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _function_imports(tree: ast.Module) -> set[int]:
    """The ids of the import nodes inside a function (or a class's method)."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import,
                                                                       ast.ImportFrom)))
    return inside


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """``(imported module, name or None, line, in a function)`` for every import in the
    file, at any depth; an imported module is resolved to the longest known module it
    names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    lazy = _function_imports(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno, id(node) in lazy
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    yield full, None, node.lineno, id(node) in lazy
                else:
                    yield base, alias.name, node.lineno, id(node) in lazy


def _ours(target: str, modules: dict[str, Path]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _optional_at_import(modules: dict[str, Path], eager: dict[str, set[str]],
                        direct: set[str]) -> set[str]:
    """The modules whose import (their module-level imports, followed) imports one of the
    :data:`OPTIONAL` packages."""
    found = set(direct)
    grew = True
    while grew:
        grew = False
        for m in modules:
            if m not in found and eager[m] & found:
                found.add(m)
                grew = True
    return found


def check(root: Path) -> dict[str, list[str]]:
    """The rule breaks of the tree at ``root``: ``cycles``, ``upward``, ``private``, and
    ``lazy``: an import inside a function of one of our modules that imports no optional
    package (it could stand at the top; inside a function it would only hide a cycle)."""
    modules = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    eager: dict[str, set[str]] = {m: set() for m in modules}
    direct, lazy_imports = set(), []
    upward, private = [], []
    for name, path in modules.items():
        top = name.split(".")[0]
        for target, imported, line, in_function in _imports(name, path, modules):
            if target.split(".")[0] in OPTIONAL and not in_function:
                direct.add(name)
            where = f"{path.relative_to(root)}:{line}"
            if target.split(".")[0] in FORBIDDEN.get(top, ()) and \
                    not target.startswith(SHARED):
                upward.append(f"{where} imports {target}")
            ours = _ours(target, modules)
            if ours is None or ours == name:
                continue
            edges[name].add(ours)
            if in_function:
                lazy_imports.append((f"{path.relative_to(root)}:{line} imports {ours}", ours))
            else:
                eager[name].add(ours)
            # importing a.b.c runs a/b/__init__.py first: an edge to each package above the
            # target that is not one of this module's own (those are already importing)
            package = ours.rpartition(".")[0]
            while package:
                if package not in modules or name == package or \
                        name.startswith(package + "."):
                    break
                edges[name].add(package)
                if not in_function:
                    eager[name].add(package)
                package = package.rpartition(".")[0]
            if imported and imported.startswith("_") and not imported.startswith("__"):
                private.append(f"{where} imports {ours}.{imported}")
    optional = _optional_at_import(modules, eager, direct)
    lazy = [where for where, target in lazy_imports if target not in optional]
    return {"cycles": _cycles(edges), "upward": upward, "private": private, "lazy": lazy}


def _cycles(edges: dict[str, set[str]]) -> list[str]:
    """Each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[str] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(" <-> ".join(sorted(component)))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_the_repository_keeps_every_rule():
    broken = check(REPO)
    assert len(_modules(REPO)) > 80
    assert broken == {"cycles": [], "upward": [], "private": [], "lazy": []}, broken


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    root = _tree(tmp_path, {"ulysses/a.py": "from ulysses.b import f\n",
                            "ulysses/b.py": "def f():\n    from ulysses import a\n"})
    assert check(root)["cycles"] == ["ulysses.a <-> ulysses.b"]


def test_a_cycle_through_a_package_init_is_found(tmp_path):
    """``ulysses.a`` imports ``ulysses.p.b``, which runs ``ulysses/p/__init__.py`` first; that
    imports ``ulysses.p.c``, which imports ``ulysses.a``: a cycle no module-to-module edge
    shows."""
    root = _tree(tmp_path, {"ulysses/a.py": "from ulysses.p.b import f\n",
                            "ulysses/p/__init__.py": "from ulysses.p.c import g\n",
                            "ulysses/p/b.py": "def f():\n    pass\n",
                            "ulysses/p/c.py": "from ulysses.a import h\n"})
    assert check(root)["cycles"] == ["ulysses.a <-> ulysses.p <-> ulysses.p.c"]


def test_an_upward_import_is_found(tmp_path):
    root = _tree(tmp_path, {"ulysses/a.py": "def f():\n    import arctic.loss\n",
                            "offload/b.py": "from transformers import AutoModel\n",
                            "offload/c.py": "from ulysses.torch_internals import is_fake\n",
                            "offload/d.py": "from ulysses.attention import local_attention\n",
                            "arctic/loss.py": ""})
    assert sorted(check(root)["upward"]) == ["offload/b.py:1 imports transformers",
                                             "offload/d.py:1 imports ulysses.attention",
                                             "ulysses/a.py:2 imports arctic.loss"]


def test_a_private_import_is_found(tmp_path):
    root = _tree(tmp_path, {"arctic/a.py": "from .b import _helper, public\n",
                            "arctic/b.py": "def _helper(): pass\ndef public(): pass\n"})
    assert check(root)["private"] == ["arctic/a.py:1 imports arctic.b._helper"]


def test_an_import_inside_a_function_is_for_optional_packages_only(tmp_path):
    """An import of one of our modules inside a function is a break unless that module
    imports transformers (or DeepSpeed, ...) when it is imported."""
    root = _tree(tmp_path, {"arctic/a.py": "def f():\n    from arctic.b import g\n"
                                           "def h():\n    from arctic.c import k\n",
                            "arctic/b.py": "import torch\ndef g():\n    pass\n",
                            "arctic/c.py": "from arctic.d import k\n",
                            "arctic/d.py": "import transformers\ndef k():\n    pass\n"})
    assert check(root)["lazy"] == ["arctic/a.py:2 imports arctic.b"]
