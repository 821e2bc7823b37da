"""CPU run of the JAX quantization GPU workers (tests/gpu/workers/jax_quant.py, jax_nvfp4.py) on the
reference path, so that their plumbing and checks are proven before a GPU runs them (the
NVFP4 one needs a Blackwell GPU, which the project's machines do not have).

One process, 2 virtual CPU devices standing in for the two `jax.distributed` processes: the
workers draw each rank's partial sums and pass rank 0's to ``glob``; here every rank draws
the same partial sums (``draw_case`` patched), so rank 0's, repeated, is the global array
and the float64 oracle of the workers sees the same data as the op.
"""

import json

import pytest

from tests.jax.child_process import cpu_env, run_script


PRELUDE = """
import json
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_fusedar as jf
mesh = Mesh(np.array(jax.devices()), ("tp",))
"""

SCRIPT = """
from tests.gpu import harness
from tests.gpu.workers import {module}

real_draw = harness.draw_case
def same_partials(seed, world, m, hidden, dtype=None):
    xs, res, gam = real_draw(seed, world, m, hidden, dtype)
    return [xs[0]] * world, res, gam
harness.draw_case = same_partials

def glob(spec, a):
    a = np.asarray(a)
    if spec == P("tp"):
        a = np.concatenate([a, a])
    return jax.device_put(a, NamedSharding(mesh, spec))
stats = {module}.run(jax, jnp, jf, mesh, P, 0, 2, 11, tokens=(1, 17, 129),
                     hiddens={hiddens}, glob=glob, local=None)
"""


def _stats(script: str) -> dict:
    """``stats`` of ``script`` (after PRELUDE: its imports and a 2-device mesh) run on 2 CPU
    devices."""
    script = PRELUDE + script + 'print("STATS", json.dumps(stats))\n'
    r = run_script(script, env=cpu_env(2), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("STATS ")][-1]
    return json.loads(line[len("STATS ") :])


@pytest.mark.slow
def test_nvfp4_worker_on_the_reference_path():
    q = _stats(SCRIPT.format(module="jax_nvfp4", hiddens=(1024, 1040)))
    # 2 dtypes x 2 layouts x 2 hiddens x 5 (tokens 1, 17, 129; two-shot too above 2 tokens).
    assert q["cases"] == 2 * 2 * 2 * 5, q
    assert q["nan_outputs"] == 0 and q["residual"] <= 1.0 and q["norm"] <= 3.0, q
    # The reference lowering is the oracle's twin: codes and scales equal everywhere.
    assert q["worse"] == 0 and q["steps1"] == 0 and q["scale_mismatch"] == 0, q
    assert q["scale_bytes"] > 0, q
    assert q["twin_residual_diffs"] == q["twin_code_diffs"] == q["twin_scale_diffs"] == 0, q


@pytest.mark.slow
def test_fp8_worker_on_the_reference_path():
    q = _stats(SCRIPT.format(module="jax_quant", hiddens=(1024,)))
    assert q["cases"] == 2 * 5, q
    assert q["worse"] == 0 and q["twin_other_diffs"] == 0 and q["twin_code_steps1"] == 0, q
    assert q["group_scale_mismatch"] == 0 and q["dequant_violations"] == 0, q
    assert q["residual"] <= 1.0 and q["norm"] <= 3.0, q
    assert q["rerun_diffs"] == 0, q


GRAD_SCRIPT = """
from tests.gpu.workers import jax_grad
stats = jax_grad.run(jax, jnp, jf, mesh, P, 7, hidden=256, ffn=512, tokens=8)
"""


@pytest.mark.slow
def test_grad_worker_on_the_reference_path():
    """The gradient worker on 2 CPU devices: fused and unfused gradients agree bit for bit
    (the reference path), and both are within a few ulps of scale of the float64 oracle's
    hand-written backpropagation (which a wrong oracle would miss by orders of magnitude)."""
    stats = _stats(GRAD_SCRIPT)
    assert set(stats) == {"bfloat16", "float32"}
    for dtype, s in stats.items():
        assert s["backend"] == "xla" and s["custom_calls"] == 0, s
        for name, e in s["grads"].items():
            assert e["finite"] and e["fused_vs_unfused_diffs"] == 0, (dtype, name, e)
            assert e["fused_ulps"] == e["unfused_ulps"], (dtype, name, e)
            assert e["fused_ulps"] <= {"bfloat16": 4.0, "float32": 32.0}[dtype], (dtype, name, e)
