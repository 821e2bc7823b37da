"""Checks an installed jax_fusedar wheel on a machine without GPUs (tools/wheel_check.sh runs
it in a fresh venv, from a folder outside the checkout):

1. the package and both native libraries are imported from the venv, not a checkout;
2. the native module loads (a wheel that fell back to the reference-only package fails);
3. the fused op on 8 virtual CPU devices matches a float64 numpy oracle;
4. lowering the same call for CUDA GPUs emits exactly one call of the kernel's FFI target.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_fusedar as jf  # noqa: E402

TP, TOKENS, HIDDEN, EPS = 8, 4, 256, 1e-6
# float32 inputs, float32 accumulation over 8 ranks and one RMS reduction over 256 values:
# a few float32 ulps of relative error; 1e-5 leaves room without hiding a wrong formula.
RTOL = ATOL = 1e-5


def check_installed_from_venv() -> None:
    site = pathlib.Path(sysconfig.get_paths()["platlib"]).resolve()
    package = pathlib.Path(jf.__file__).resolve().parent
    assert package.parent == site, f"jax_fusedar imported from {package}, not {site}"
    libs = sorted(p.name for p in package.glob("*.so"))
    assert "libfusedar_core.so" in libs and any(n.startswith("_fusedar.") for n in libs), libs
    # Through its loader (common.native), which keeps why the module failed to load (a
    # missing core, a wrong interpreter tag): require() raises it here instead of the
    # package quietly selecting the reference path.
    from jax_fusedar.common import native

    ext = native.require()
    assert pathlib.Path(ext.__file__).resolve().parent == package, ext.__file__
    print(f"installed: {package} ({', '.join(libs)})")


def oracle(partials: np.ndarray, residual: np.ndarray, gamma: np.ndarray):
    summed = partials.astype(np.float64).sum(axis=0) + residual.astype(np.float64)
    rms = np.sqrt(np.mean(summed * summed, axis=-1, keepdims=True) + EPS)
    return summed, summed / rms * gamma.astype(np.float64)


def fused(ws):
    def layer(partial, residual, gamma):
        out = jf.allreduce_fusion(
            partial, axis_name="tp", workspace=ws, residual=residual, rms_gamma=gamma, rms_eps=EPS
        )
        return out.residual_out, out.norm_out

    return jax.jit(
        jax.shard_map(layer, mesh=ws.mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P()))
    )


def check_cpu_results(mesh) -> None:
    rng = np.random.default_rng(0)
    partials = rng.standard_normal((TP, TOKENS, HIDDEN), dtype=np.float32)
    residual = rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32)
    gamma = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    ws = jf.create_allreduce_fusion_workspace(
        mesh, "tp", max_token_num=TOKENS, hidden_dim=HIDDEN, dtype=jnp.float32
    )
    args = [
        jax.device_put(a, NamedSharding(mesh, s))
        for a, s in (
            (partials.reshape(TP * TOKENS, HIDDEN), P("tp")),
            (residual, P()),
            (gamma, P()),
        )
    ]
    residual_out, norm_out = (np.asarray(x) for x in fused(ws)(*args))
    want_residual, want_norm = oracle(partials, residual, gamma)
    np.testing.assert_allclose(residual_out, want_residual, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(norm_out, want_norm, rtol=RTOL, atol=ATOL)
    print(f"cpu: {TP} devices, residual + RMSNorm within {RTOL} of the float64 oracle")


def check_cuda_lowering(mesh) -> None:
    ws = jf.abstract_workspace(
        mesh, "tp", max_token_num=TOKENS, hidden_dim=HIDDEN, dtype=jnp.bfloat16, backend="trtllm"
    )
    shapes = (
        jax.ShapeDtypeStruct(
            (TP * TOKENS, HIDDEN), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp"))
        ),
        jax.ShapeDtypeStruct((TOKENS, HIDDEN), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
        jax.ShapeDtypeStruct((HIDDEN,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
    )
    text = fused(ws).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    targets = re.findall(r"custom_call @(\w+)", text) + re.findall(
        r'call_target_name = "(\w+)"', text
    )
    kernel_calls = [t for t in targets if t.startswith("jax_fusedar_allreduce_fusion")]
    assert len(kernel_calls) == 1, f"expected one fused-kernel custom call, got {targets}"
    print(f"cuda lowering: custom call {kernel_calls[0]}")


def main() -> int:
    check_installed_from_venv()
    mesh = jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP])
    check_cpu_results(mesh)
    check_cuda_lowering(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
