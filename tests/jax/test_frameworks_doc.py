"""docs/frameworks.md's python blocks (a MaxText-style Linen layer, an NNX layer, an Equinox
layer, each built from jax_fusedar's modules) run, verbatim, in order and in one namespace,
in a fresh process on 8 CPU devices, as tests/test_readme.py runs the README's."""

import json

import pytest

from tests.test_readme import RUNNER, cpu_blocks, run_blocks
from tests.repo import REPO

PAGE = REPO / "docs" / "frameworks.md"
OUTS = ("out", "stream", "norm", "eqx_stream", "eqx_norm")
FACTS = f"""
facts = {{name: [list(ns[name].shape), str(ns[name].dtype)] for name in {OUTS} if name in ns}}
facts["grads_finite"] = bool(all(np.isfinite(np.asarray(g, np.float32)).all()
                                 for g in __import__("jax").tree.leaves(ns["grads"])))
print("PAGE " + json.dumps(facts))
"""


@pytest.mark.slow
def test_frameworks_page_blocks_run_on_8_cpu_devices(monkeypatch):
    pytest.importorskip("flax")
    pytest.importorskip("equinox")
    blocks = cpu_blocks(PAGE)
    assert len(blocks) == 3, "the page lost its Linen, NNX or Equinox layer"
    monkeypatch.setattr("tests.test_readme.RUNNER", RUNNER + FACTS)
    out = run_blocks("docs/frameworks.md", blocks)
    facts = json.loads(out.split("PAGE ", 1)[1])
    assert facts == {**dict.fromkeys(OUTS, [[4, 16, 256], "bfloat16"]), "grads_finite": True}
