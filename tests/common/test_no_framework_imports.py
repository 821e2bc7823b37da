"""The layering: ``jax_fusedar.common`` and the jax-free CLI helpers import without jax or torch,
torch_compat without jax (fresh interpreters); the import graph (read statically) has no
cycles, no import up a layer (``LAYERS``), no import of the extension but common.native's
loading of it, and no use of another module's private names."""

import ast
import graphlib
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jax_fusedar.common

from tests.repo import REPO, run_code

COMMON_MODULES = sorted(
    f"jax_fusedar.common.{m.name}" for m in pkgutil.iter_modules(jax_fusedar.common.__path__)
)
# What python -m jax_fusedar runs before it settles the devices (the entry point, the demo's
# flags, the TP plan): JAX reads the device count when it starts its backends; and the
# benchmarks' shared module, which the torch benchmark uses.
CLI = "argtypes main demo_args ranks doctor".split()
JAX_FREE_CLI = [f"jax_fusedar.cli.{m}" for m in CLI] + ["benchmarks.report"]
FRAMEWORKS = {"jax", "jaxlib", "torch"}


def _imported_after(modules, then=""):
    """The top-level packages a fresh interpreter holds after importing ``modules`` and
    running the code ``then``."""
    code = (
        f"import importlib, json, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
        f"{then}print(json.dumps(sorted({{n.split('.')[0] for n in sys.modules}})))\n"
    )
    r = run_code(code, timeout=300)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_the_common_layer_is_all_there():
    # A module added to common/ is checked below automatically; this guards the listing.
    names = {m.rsplit(".", 1)[1] for m in COMMON_MODULES}
    listed = (
        "arguments backend_choice handshake exchange join launch_mode lifecycle limits "
        "moe_limits native patterns plan quant_layouts results sizing tp_groups"
    )
    assert set(listed.split()) <= names


@pytest.mark.slow
@pytest.mark.parametrize("module", COMMON_MODULES + JAX_FREE_CLI)
def test_module_imports_neither_jax_nor_torch(module):
    roots = _imported_after([module])
    assert module.split(".")[0] in roots  # it did import
    assert not roots & FRAMEWORKS, sorted(roots & FRAMEWORKS)


@pytest.mark.slow
def test_parsing_the_cli_flags_imports_no_jax():
    parse = (
        "from jax_fusedar.cli.main import build_parser\nparser, _ = build_parser()\n"
        "parser.parse_args(['demo', '--tp', '2', '--moe'])\nparser.parse_args(['doctor'])\n"
    )
    roots = _imported_after([], parse)
    assert not roots & FRAMEWORKS, sorted(roots & FRAMEWORKS)


@pytest.mark.slow
def test_torch_compat_imports_no_jax():
    pytest.importorskip("torch")
    roots = _imported_after(["torch_compat", "benchmarks.torch_bench"])
    assert "torch" in roots and not roots & {"jax", "jaxlib"}


# --- the import graph of the packages --------------------------------------------------------
# Read statically (ast), every import in a module, at the top or inside a function: a lazy
# import that closes a loop is still a loop (it only moves the failure to the first call).
# Importing a package does not count as importing its __init__'s own imports of the
# package's modules (those go downwards), so the edges are exactly the import statements.
PACKAGES = ("jax_fusedar", "torch_compat")
# The compiled module: ffi/python builds jax_fusedar/_fusedar*.so, which common/native.py
# loads by path under this name (the layer that wraps it owns it).
NATIVE_MODULE = "jax_fusedar.common._fusedar"


def _module_files():
    """Module name -> source path, for every module of the packages."""
    files = {NATIVE_MODULE: REPO / "ffi" / "python" / "module.cc"}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _absolute(module_name, files, level, target):
    """The absolute name of ``from <level dots><target> import ...`` in ``module_name``."""
    if level == 0:
        return target
    base = module_name.split(".")
    if not (module_name in files and files[module_name].name == "__init__.py"):
        base = base[:-1]  # a module, not a package: its package is the base
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
        where = lambda node: f"{path.relative_to(REPO)}:{node.lineno}"
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
                        bad.append(f"{where(node)}: from {source} import {alias.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and f"{bound[node.value.id]}.{node.attr}" not in files
            ):
                bad.append(f"{where(node)}: {bound[node.value.id]}.{node.attr}")
        edges[name], private[name] = targets - {name}, bad
    return edges, private


def _cycles(edges):
    """A loop of imports, as its sorted modules (graphlib names one loop if there are any)."""
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as e:
        return [sorted(set(e.args[1]))]
    return []


def test_no_import_cycles():
    edges, _ = _imports(_module_files())
    # Guards the reader: the graph has the modules and edges everyone knows of.
    assert "jax_fusedar.common.patterns" in edges["torch_compat.ops"]
    assert "jax_fusedar.api" in edges["jax_fusedar.fusion.rewriting"]  # a lazy import counts
    assert "jax_fusedar.cli.setup" in edges["jax_fusedar.cli.demo"]
    # And the cycle finder finds a cycle.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    cycles = _cycles(edges)
    assert not cycles, "modules that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


# --- the layers -----------------------------------------------------------------------------
# Bottom up: the native extension; the framework-free rules (common); the JAX workspace; the
# op family (ops/: every FFI op, its plan, checks and reference math); the two front ends, the
# JAX API's public face (the package root, with its fuse pass in fusion/) and torch_compat,
# which never import each other; the models written on the JAX API; the command-line tools.
# A module imports modules of its own layer and of the layers its entry lists, never one
# above. common lists nothing: it reaches the extension by path (common/native.py), not by
# import.
LAYERS = {
    "native": (),
    "common": (),
    "workspace": ("common",),
    "ops": ("workspace", "common"),
    "jax": ("ops", "workspace", "common"),
    "torch": ("common",),
    "models": ("jax", "ops", "workspace", "common"),
    "cli": ("models", "jax", "ops", "workspace", "torch", "common"),
}


def layer_of(module: str) -> str:
    if module == NATIVE_MODULE:
        return "native"
    if module == "jax_fusedar.__main__" or module.startswith("jax_fusedar.cli"):
        return "cli"
    for prefix, layer in (
        ("jax_fusedar.common", "common"),
        ("jax_fusedar.workspace", "workspace"),
        ("jax_fusedar.ops", "ops"),
        ("jax_fusedar.models", "models"),
        ("torch_compat", "torch"),
        ("jax_fusedar", "jax"),
    ):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} is in no layer")


def _upward(edges) -> list:
    """Every import of a module from a layer its importer's layer does not list."""
    return sorted(
        (a, b)
        for a, targets in edges.items()
        for b in targets
        if layer_of(b) != layer_of(a) and layer_of(b) not in LAYERS[layer_of(a)]
    )


def test_no_import_runs_up_a_layer():
    files = _module_files()
    # Guards the rule: every module has a layer, and an import up is found.
    assert {layer_of(m) for m in files} == set(LAYERS)
    assert layer_of("jax_fusedar.fusion.matching") == layer_of("jax_fusedar.api") == "jax"
    assert layer_of("jax_fusedar.ops.family") == "ops"
    up = ("jax_fusedar.common.limits", "jax_fusedar.api")
    assert _upward({up[0]: {up[1]}}) == [up]
    assert _upward({"torch_compat.ops": {"jax_fusedar.api"}})  # the fronts stay apart
    assert _upward({"jax_fusedar.api": {"jax_fusedar.models.llama"}})
    assert _upward({"jax_fusedar.ops.dense": {"jax_fusedar.api"}})  # the family sits below
    assert _upward({"jax_fusedar.workspace": {"jax_fusedar.ops.plan"}})
    assert not _upward({"jax_fusedar.api": {"jax_fusedar.ops.dense"}})
    assert not _upward({"jax_fusedar.cli.demo": {"jax_fusedar.models.llama"}})
    upward = _upward(_imports(files)[0])
    assert not upward, "imports from a layer up to one above it:\n" + "\n".join(
        f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})" for a, b in upward
    )


# An import statement of the extension (by its installed name or its loaded one), in any
# Python source or shell script of the checkout.
_NATIVE_IMPORT = re.compile(
    r"\bimport\s+[^\n]*\bjax_fusedar(\.common)?\._fusedar\b"
    r"|\bfrom\s+jax_fusedar(\.common)?\s+import\s+(\([^)]*|[^\n]*?)\b_fusedar\b"
    r"|import_module\(\s*[\"']jax_fusedar(\.common)?\._fusedar\b"
    # The extension by its installed name in sys.modules (a stand-in that blocks it there
    # blocks nothing: common.native loads it as jax_fusedar.common._fusedar).
    r"|sys\.modules\[\s*[\"']jax_fusedar\._fusedar\b"
)


def test_only_common_native_loads_the_extension():
    # Loaded twice (once as jax_fusedar._fusedar by an import statement, once here), the
    # module would initialise twice; everyone takes common.native's ext instead.
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.sh"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    bad = [
        f"{name}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for name in tracked
        if (REPO / name).is_file() and REPO / name != Path(__file__).resolve()
        for text in [(REPO / name).read_text()]
        for m in _NATIVE_IMPORT.finditer(text)
    ]
    assert not bad, "import the extension through jax_fusedar.common.native:\n" + "\n".join(bad)
    for found in (  # the pattern finds them
        "import jax_fusedar._fusedar as ext",
        "from jax_fusedar import _fusedar",
        "import jax_fusedar, jax_fusedar._fusedar as ext",
        'importlib.import_module("jax_fusedar._fusedar")',
        "sys.modules['jax_fusedar._fusedar'] = None",
    ):
        assert _NATIVE_IMPORT.search(found), found
    assert not _NATIVE_IMPORT.search("from jax_fusedar.common import native")
    assert not _NATIVE_IMPORT.search("sys.modules['jax_fusedar.common._fusedar'] = None")


def _absolute_imports(path):
    """(line, module) of every absolute import in ``path``, at the top or in a function."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)


# What the benchmarks may use of the product: its public API, as any user's script would.
PUBLIC_API = {
    "jax_fusedar",  # the names it exports (__all__); the JAX API itself is loaded lazily
    "jax_fusedar.timing",  # device clocks (public: jax_fusedar.timing, jax_fusedar/ops/timing.py)
    "jax_fusedar.common.plan",  # what a call runs, the one decision of both fronts
    "jax_fusedar.common.sizing",  # workspace sizes, as FlashInfer computes them
    "torch_compat",
}


def _public_use(module: str) -> bool:
    """Whether ``module`` (``package.name`` of an import) is the public API or a name it
    exports: ``from jax_fusedar import allreduce_fusion`` is, ``jax_fusedar.api`` is not."""
    import jax_fusedar
    import torch_compat  # noqa: F401 (only its __all__ is read)

    if module in PUBLIC_API:
        return True
    package, _, name = module.rpartition(".")
    if package == "jax_fusedar":
        return name in jax_fusedar.__all__
    if package == "torch_compat":
        return name in sys.modules["torch_compat"].__all__
    return package in PUBLIC_API and package != "jax_fusedar"


def test_the_benchmarks_use_only_the_public_api():
    pytest.importorskip("torch")
    bad = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted((REPO / "benchmarks").rglob("*.py"))
        for line, module in _absolute_imports(path)
        if module.split(".")[0] in PACKAGES
        and not _public_use(module)
        or module.split(".")[0] == "tools"
        and not module.startswith("tools.flashinfer_anchor")  # the anchor they are given
    ]
    assert not bad, "the benchmarks use the product's internals:\n" + "\n".join(bad)
    # The rule finds internals, and lets the public names through.
    internal = "jax_fusedar.api jax_fusedar.cli.report torch_compat.ops jax_fusedar.common.limits"
    public = (
        "jax_fusedar.allreduce_fusion jax_fusedar.timing jax_fusedar.common.plan torch_compat.moe"
    )
    assert [_public_use(m) for m in f"{internal} {public}".split()] == [False] * 4 + [True] * 4


def test_the_packages_import_nothing_of_the_checkout_nor_private_names():
    # tools/, tests/ and benchmarks/ are not installed: a wheel's modules must not import
    # them (tools/wheel_check.sh checks the wheel holds none of them).
    files = _module_files()
    bad = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in files.values()
        if path.suffix == ".py"
        for line, module in _absolute_imports(path)
        if module.split(".")[0] in ("tools", "tests", "benchmarks")
    ]
    assert not bad, "\n".join(bad)
    bad = [b for found in _imports(files)[1].values() for b in found]
    assert not bad, (
        "private names used across modules (give them a public name in the "
        "module that owns them):\n" + "\n".join(bad)
    )
