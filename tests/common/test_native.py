"""common.native loads the extension by path, under the name of the layer that wraps it: where
it looks, what a missing or broken file gives (no extension, and require() saying why), and
that a built one is the one file the build installed, never a second copy at the package root."""

import importlib.machinery
import sys

import pytest

from jax_fusedar.common import native

from tests.repo import REPO, run_code


def test_the_extension_is_looked_for_where_the_build_installs_it():
    assert native.EXTENSION_DIR == REPO / "jax_fusedar"
    assert native.MODULE_NAME == "jax_fusedar.common._fusedar"
    found = native.extension_path()
    assert (found is None) == (native.ext is None)
    if found is not None:
        assert found.parent == native.EXTENSION_DIR and found.name.startswith("_fusedar.")


@pytest.mark.parametrize("content", [None, b"not an ELF file"], ids=["missing", "broken"])
def test_a_missing_or_broken_extension_is_an_import_error(monkeypatch, tmp_path, content):
    # A file the dynamic loader refuses (as a module built for another interpreter, or one
    # whose libfusedar_core.so is missing, would be): ImportError, which native turns into
    # "not available" with the reason, and no half-made module in sys.modules. A missing
    # one names the folder.
    if content:
        (tmp_path / f"_fusedar{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(content)
    monkeypatch.setattr(native, "EXTENSION_DIR", tmp_path)
    monkeypatch.delitem(sys.modules, native.MODULE_NAME, raising=False)
    with pytest.raises(
        ImportError, match=None if content else f"no _fusedar extension in {tmp_path}"
    ):
        native._load()
    assert native.MODULE_NAME not in sys.modules


def test_none_in_sys_modules_blocks_the_extension(monkeypatch):
    # As for an import: how a test stands in for a build without the extension.
    monkeypatch.setitem(sys.modules, native.MODULE_NAME, None)
    with pytest.raises(ImportError, match="halted; None in sys.modules"):
        native._load()


def test_require_says_why_without_the_extension(monkeypatch):
    monkeypatch.setattr(native, "ext", None)
    monkeypatch.setattr(native, "_IMPORT_ERROR", ImportError("no _fusedar extension in /x"))
    with pytest.raises(RuntimeError, match="not available .no _fusedar extension in /x.; build"):
        native.require()
    assert not native.available() and native.gpu_count() == 0


@pytest.mark.skipif(not native.available(), reason="the native module is not built here")
def test_the_loaded_module_is_the_installed_file_under_the_layers_name():
    assert native.ext.__name__ == native.MODULE_NAME
    assert sys.modules[native.MODULE_NAME] is native.ext
    assert native.ext.__file__ == str(native.extension_path())
    # In a fresh interpreter: both fronts' imports load it once, by this name only.
    code = (
        "import sys, torch_compat, jax_fusedar.ops.family;"
        "from jax_fusedar.common import native;"
        "print(native.available(), 'jax_fusedar._fusedar' in sys.modules,"
        " sys.modules.get(native.MODULE_NAME) is native.ext)"
    )
    r = run_code(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "True"], r.stdout
