"""CPU run of the JAX quantization and gradient GPU workers (tests/gpu/workers/jax_quant.py,
jax_nvfp4.py, jax_grad.py) on the reference path, so that their plumbing and checks are proven
before a GPU runs them (the NVFP4 one needs a Blackwell GPU, which the project's machines do
not have). Two CPU devices stand in for the two `jax.distributed` processes; every rank draws
rank 0's partial sums (``draw_case`` patched), so that ``glob``'s global array and the
workers' float64 oracle see the same data as the op."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fusedar as jf
from tests.gpu import harness
from tests.jax.cpu_helpers import make_mesh, require_host_devices

require_host_devices()

pytestmark = pytest.mark.slow

# module, hidden sizes, cases, what must be zero. NVFP4: 2 dtypes x 2 layouts x 2 hiddens x 5
# (tokens 1, 17, 129; two-shot too above 2 tokens); the reference lowering is the oracle's
# twin: codes and scales equal everywhere.
NVFP4_ZERO = ["nan_outputs", "worse", "steps1", "scale_mismatch", "twin_residual_diffs"]
NVFP4_ZERO += ["twin_code_diffs", "twin_scale_diffs"]
FP8_ZERO = ["worse", "twin_other_diffs", "twin_code_steps1", "group_scale_mismatch"]
FP8_ZERO += ["dequant_violations", "rerun_diffs"]
QUANT = [("jax_nvfp4", (1024, 1040), 2 * 2 * 2 * 5, NVFP4_ZERO)]
QUANT += [("jax_quant", (1024,), 2 * 5, FP8_ZERO)]


@pytest.mark.parametrize("module, hiddens, cases, zero", QUANT, ids=["nvfp4", "fp8"])
def test_quant_worker_on_the_reference_path(monkeypatch, module, hiddens, cases, zero):
    mesh, real_draw = make_mesh((2,), ("tp",)), harness.draw_case

    def same_partials(seed, world, m, hidden, dtype=None):
        xs, res, gam = real_draw(seed, world, m, hidden, dtype)
        return [xs[0]] * world, res, gam

    def glob(spec, a):
        a = np.asarray(a)
        return jax.device_put(
            np.concatenate([a, a]) if spec == P("tp") else a, NamedSharding(mesh, spec)
        )

    monkeypatch.setattr(harness, "draw_case", same_partials)
    worker = importlib.import_module(f"tests.gpu.workers.{module}")
    kw = dict(tokens=(1, 17, 129), hiddens=hiddens, glob=glob, local=None)
    q = worker.run(jax, jnp, jf, mesh, P, 0, 2, 11, **kw)
    assert q["cases"] == cases, q
    assert q["residual"] <= 1.0 and q["norm"] <= 3.0, q
    assert {k: q[k] for k in zero} == dict.fromkeys(zero, 0), q
    if module == "jax_nvfp4":
        assert q["scale_bytes"] > 0, q


def test_grad_worker_on_the_reference_path():
    """Fused and unfused gradients agree bit for bit, within a few ulps of the float64 oracle's
    hand-written backpropagation (which a wrong oracle would miss by orders of magnitude)."""
    from tests.gpu.workers import jax_grad

    stats = jax_grad.run(
        jax, jnp, jf, make_mesh((2,), ("tp",)), P, 7, hidden=256, ffn=512, tokens=8
    )
    assert set(stats) == {"bfloat16", "float32"}
    for dtype, s in stats.items():
        assert s["backend"] == "xla" and s["custom_calls"] == 0, s
        for name, e in s["grads"].items():
            assert e["finite"] and e["fused_vs_unfused_diffs"] == 0, (dtype, name, e)
            assert e["fused_ulps"] == e["unfused_ulps"], (dtype, name, e)
            assert e["fused_ulps"] <= {"bfloat16": 4.0, "float32": 32.0}[dtype], (dtype, name, e)
