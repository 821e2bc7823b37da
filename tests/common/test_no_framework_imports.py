"""The layering: the framework-neutral layer stays neutral (every ``jax_fusedar.common``
module, and the jax-free command-line helpers, imports in a fresh interpreter without
importing jax or torch, and ``import torch_compat`` brings in torch but never jax; checked in
subprocesses, because a test process has usually imported both already), and the import
graph of ``jax_fusedar`` and ``torch_compat`` has no cycles and no module uses another
module's private names (read statically)."""

import ast
import json
import os
import pkgutil
import subprocess
import sys

import pytest

import jax_fusedar.common

from tests.repo import REPO


COMMON_MODULES = sorted(
    f"jax_fusedar.common.{m.name}" for m in pkgutil.iter_modules(jax_fusedar.common.__path__)
)
# The command-line pieces the torch benchmark shares, and what python -m jax_fusedar runs
# before it settles the devices (the entry point, the demo's flags, the TP plan): JAX reads
# the device count when it starts its backends.
JAX_FREE_CLI = [
    "jax_fusedar.cli.argtypes",
    "jax_fusedar.cli.report",
    "jax_fusedar.cli.main",
    "jax_fusedar.cli.demo_args",
    "jax_fusedar.cli.ranks",
    "jax_fusedar.cli.doctor",
]


def _imported_after(modules):
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_the_common_layer_is_all_there():
    # A module added to common/ is checked below automatically; this guards the listing.
    names = {m.rsplit(".", 1)[1] for m in COMMON_MODULES}
    assert {
        "arguments",
        "backend_choice",
        "call_check",
        "exchange",
        "join",
        "launch_mode",
        "lifecycle",
        "limits",
        "moe_limits",
        "native",
        "patterns",
        "quant_layouts",
        "results",
        "sizing",
        "tp_groups",
    } <= names


@pytest.mark.slow
@pytest.mark.parametrize("module", COMMON_MODULES + JAX_FREE_CLI)
def test_module_imports_neither_jax_nor_torch(module):
    roots = _imported_after([module])
    assert module.split(".")[0] in roots  # it did import
    assert not roots & {"jax", "jaxlib", "torch"}, sorted(roots & {"jax", "jaxlib", "torch"})


@pytest.mark.slow
def test_parsing_the_cli_flags_imports_no_jax():
    code = (
        "import json, sys\n"
        "from jax_fusedar.cli.main import build_parser\n"
        "parser, _ = build_parser()\n"
        "parser.parse_args(['demo', '--tp', '2', '--moe'])\n"
        "parser.parse_args(['bench', '--tokens', '1'])\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    roots = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert not roots & {"jax", "jaxlib", "torch"}, sorted(roots & {"jax", "jaxlib", "torch"})


@pytest.mark.slow
def test_torch_compat_imports_no_jax():
    pytest.importorskip("torch")
    roots = _imported_after(["torch_compat", "torch_compat.bench"])
    assert "torch" in roots
    assert not roots & {"jax", "jaxlib"}


# --- the import graph of the packages --------------------------------------------------------
# Read statically (ast), every import in a module, at the top or inside a function: a lazy
# import that closes a loop is still a loop (it only moves the failure to the first call).
# Importing a package does not count as importing its __init__'s own imports of the
# package's modules (those go downwards), so the edges are exactly the import statements.

PACKAGES = ("jax_fusedar", "torch_compat")
# Compiled modules (ffi/python builds jax_fusedar/_fusedar*.so; common/native.py loads it).
NATIVE_MODULES = {"jax_fusedar._fusedar": REPO / "ffi" / "python" / "module.cc"}


def _module_files():
    """Module name -> source path, for every module of the packages."""
    files = dict(NATIVE_MODULES)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _is_package(name, files) -> bool:
    return name in files and files[name].name == "__init__.py"


def _absolute(module_name, files, level, target):
    """The absolute name of ``from <level dots><target> import ...`` in ``module_name``."""
    if level == 0:
        return target
    base = module_name.split(".")
    if not _is_package(module_name, files):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(files):
    """Per module: the modules of ours it imports (edges) and the private names of other
    modules it uses (``from m import _x``, or ``m._x`` on a module bound by an import)."""
    edges, private = {}, {}
    for name, path in files.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        targets, bad, bound = set(), [], {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PACKAGES and alias.name in files:
                        targets.add(alias.name)
                        if alias.asname:
                            bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(name, files, node.level, node.module)
                if source.split(".")[0] not in PACKAGES:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in files:  # a module of the package
                        targets.add(sub)
                        bound[alias.asname or alias.name] = sub
                        continue
                    targets.add(source)
                    if alias.name.startswith("_") and source != name:
                        bad.append(
                            f"{path.relative_to(REPO)}:{node.lineno}: from {source} "
                            f"import {alias.name}"
                        )
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and f"{bound[node.value.id]}.{node.attr}" not in files
            ):
                bad.append(
                    f"{path.relative_to(REPO)}:{node.lineno}: {bound[node.value.id]}.{node.attr}"
                )
        edges[name] = targets - {name}
        private[name] = bad
    return edges, private


def _cycles(edges):
    """Every strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_read_whole():
    # Guards the reader: the graph has the modules and edges everyone knows of.
    edges, _ = _imports(_module_files())
    assert "jax_fusedar.common.patterns" in edges["torch_compat.ops"]
    assert "jax_fusedar.api" in edges["jax_fusedar.fusion.rewriting"]  # a lazy import counts
    assert "jax_fusedar.cli.setup" in edges["jax_fusedar.cli.demo"]
    # And the cycle finder finds a cycle.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    cycles = _cycles(_imports(_module_files())[0])
    assert not cycles, "modules that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_packages_import_nothing_of_the_checkout():
    # tools/ and tests/ are not installed: a wheel's modules must not import them (the torch
    # bench loads the checkout's anchor loader only when present, and runs without it).
    files = _module_files()
    bad = []
    for name, path in files.items():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            bad += [
                f"{path.relative_to(REPO)}:{node.lineno}: {m}"
                for m in modules
                if m.split(".")[0] in ("tools", "tests")
            ]
    assert not bad, "\n".join(bad)


def test_no_module_uses_another_modules_private_names():
    _, private = _imports(_module_files())
    bad = [b for found in private.values() for b in found]
    assert not bad, (
        "private names used across modules (give them a public name in the "
        "module that owns them):\n" + "\n".join(bad)
    )
