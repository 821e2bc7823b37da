"""The integration lane's expectations: what jax_fusedar.fuse makes of each model today (sites
found and fused, default and with ``allow_rounding_change=True``, the reasons), and what must
hold where it fuses: bit-identical forward outputs by default, the documented bounds under
``allow_rounding_change`` (forward within 4 eps_T of the largest output, gradients within
16, as for the style models). A change in the pass's reach fails here on purpose: update
EXPECTED and docs/fusion_pass.md's table (``tools/integration.sh table``) together."""

import dataclasses

import jax
import numpy as np
import pytest

from .lane import bits_equal, measure, rel_diff
from .models import MODELS

pytestmark = pytest.mark.integration

FORWARD_BOUND, GRAD_BOUND = 4.0, 16.0

# name -> ((found, fused) with default options, (found, fused) with allow_rounding_change,
#          the reasons with default options); per run of the model (a scan body's sites
#          count its length). Measured 2026-12-03 (docs/fusion_pass.md, the lane's table).
EXPECTED = {
    # Scanned, the loop over the checkpointed layer is rotated; unrolled, the checkpointed
    # layer calls are (fusion/rotation.py, fusion/chain.py).
    "maxtext llama2 scan_layers=true": ((4, 4), (4, 4), {}),
    "maxtext llama2 scan_layers=false": ((4, 4), (4, 4), {}),
    "transformers FlaxLlamaForCausalLM": ((4, 4), (4, 4), {}),
    "flax nnx decoder, Explicit axes, lax.scan": ((4, 4), (4, 4), {}),
    "flax nnx decoder, Explicit axes, unrolled": ((4, 4), (4, 4), {}),
    "equinox decoder (per-token modules under vmap)": (
        (4, 0),
        (4, 4),
        {
            "a bias added to the normalized value before its rounding to bfloat16 (the "
            "fused op has no bias)": 4
        },
    ),
    "jax_fusedar.flax MaxText-style layer, plain twin (nn.scan + nn.remat)": ((4, 4), (4, 4), {}),
}


def test_every_model_has_an_expectation():
    assert sorted(m.name for m in MODELS) == sorted(EXPECTED)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_what_fuse_makes_of_the_model(model):
    row = measure(model)
    print(dataclasses.asdict(row))
    default, flagged, reasons = EXPECTED[model.name]
    assert (row.default.found, row.default.fused) == default, row.default
    assert (row.rounding.found, row.rounding.fused) == flagged, row.rounding
    assert row.default.reasons == reasons
    assert row.counted >= row.default.found  # fuse never finds more than a reader counts
    # Default options: a fused site is bit-identical to the original.
    assert row.default.forward_bits_equal, row.default
    assert row.default.grad_rel <= GRAD_BOUND, row.default
    # allow_rounding_change: within the documented bound.
    assert row.rounding.forward_rel <= FORWARD_BOUND, row.rounding
    assert row.rounding.grad_rel <= GRAD_BOUND, row.rounding
    if not row.rounding.fused:
        assert row.rounding.forward_bits_equal and row.rounding.grad_rel == 0.0


def test_the_module_layer_equals_its_plain_twin():
    """docs/frameworks.md's MaxText-style layer with jax_fusedar.flax's modules computes, on
    the CPU's reference path, what its plain twin (psum + add + RMSNorm in float32) does: the
    same bits forward and in every gradient."""
    from .fusedar_layer import build

    fused, twin = build(twin=False), build(twin=True)
    with fused.context():
        assert jax.tree.structure(fused.params) == jax.tree.structure(twin.params)
        got, want = fused.fn(fused.params, *fused.inputs), twin.fn(twin.params, *twin.inputs)
        assert bits_equal(got, want)
        cot = np.random.default_rng(0).standard_normal(got.shape).astype(np.float32)

        def grad(b):
            return jax.jit(jax.grad(lambda p, x: (b.fn(p, x).astype(np.float32) * cot).sum()))(
                b.params, *b.inputs
            )

        g_fused, g_twin = grad(fused), grad(twin)
        assert rel_diff(g_fused, g_twin, np.float32) == 0.0 and bits_equal(g_fused, g_twin)
