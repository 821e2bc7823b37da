"""Tests find the repository through tests/repo.py only. The GPU tests start their workers
with ``python -m tests.gpu...`` in the repository's root; when the tests moved into layer
folders, four GPU test modules still computed the root as their own grandparent (then
tests/), and their workers could not start. CPU runs skip those tests, so this rule is
checked here instead."""

import re

from tests.repo import REPO

# A root computed from a module's own path: Path(__file__)...parent(s), or nested dirnames.
OWN_PATH_ROOT = re.compile(
    r"__file__\)[^\n]*\.(parents\[|parent\.parent)"
    r"|dirname\(os\.path\.dirname\("
)


def test_repo_is_the_checkout_root():
    assert (REPO / "pyproject.toml").is_file() and (REPO / "tests" / "repo.py").is_file()
    assert (REPO / "jax_fusedar" / "__init__.py").is_file()


def test_no_test_module_computes_the_root_from_its_own_path():
    offenders = [
        f"{path.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 1}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        if path.name != "repo.py"
        for text in [path.read_text()]
        for m in OWN_PATH_ROOT.finditer(text)
    ]
    assert not offenders, (
        "use tests.repo.REPO instead of a path computed from __file__: " + ", ".join(offenders)
    )
