"""N-D inputs, vmap, and the argument dtypes users have (float32 gamma, float32 residual
stream) of allreduce_fusion on CPU (8 virtual devices), bit for bit against the 2-D call on
the folded rows or one call per batch element; fallback logging per kind, py.typed, dir()."""

import logging
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from tests.jax.cpu_helpers import assert_same_bits, bits, check_outputs, cuda_text, fusedar_warnings
from tests.jax.cpu_helpers import jdtype, jit_shard_map, n_outputs, new_rng, pattern_call
from tests.jax.cpu_helpers import pattern_outputs, random_gamma, random_partials, random_values
from tests.jax.cpu_helpers import require_host_devices, tp_mesh, xla_workspace
from jax_fusedar.common.patterns import TRAITS
from jax_fusedar.ops.dense import FFI_TARGET

require_host_devices()

Q = jf.AllReduceFusionPattern
AR_NORM = Q.kARResidualRMSNorm
HIDDEN = 256
MESH = tp_mesh()


# Environment and once-per-kind logging reset per test (conftest.py).
pytestmark = pytest.mark.usefixtures("hermetic")


SF40 = {"scale_factor": np.full(1, 40.0, np.float32)}
QUANT_CASES = [
    (Q.kAllReduce, {}),
    (Q.kARResidualRMSNorm, {}),
    (Q.kARResidualRMSNormOutFP8Quant, {"scale_factor": np.full(1, 0.05, np.float32)}),
    (Q.kARResidualRMSNormOutDynamicFP8Quant, {}),
    (Q.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant, {"block_quant_group_size": 64}),
    (Q.kARResidualRMSNormOutFP4Quant, {**SF40, "layout_code": jf.QuantizationSFLayout.LINEAR}),
    (Q.kARResidualRMSNormOutFP4Quant, SF40),
]
case_ids = [f"p{int(p)}" + ("_linear" if "layout_code" in k else "") for p, k in QUANT_CASES]


def inputs(rng, lead, dtype="bfloat16"):
    """(x per rank [8, *lead, H], residual, gamma)."""
    x, r = random_values(rng, (8, *lead, HIDDEN), dtype), random_values(rng, (*lead, HIDDEN), dtype)
    return x, r, random_gamma(rng, HIDDEN, dtype)


# jit(shard_map(body)) of (x [8, ...] split per rank, residual, gamma) on MESH
sharded = lambda body, n_out: jit_shard_map(body, MESH, (P("tp"), P(), P()), (P(),) * n_out)


def vmapped_and_per_element(one, n_out, x, r, g):
    """``one`` vmapped over rank 0's x and residual (gamma not batched), and called per
    batch element: both results."""
    vmapped = sharded(lambda x, r, g: jax.vmap(one, in_axes=(0, 0, None))(x[0], r, g), n_out)
    looped = sharded(lambda x, r, g: per_element(lambda a, b: one(a, b, g), x[0], r), n_out)
    return vmapped(x, r, g), looped(x, r, g)


def norm_body(ws, **kw):
    """Per shard: pattern 1 on rank 0's slice of x, returning (residual_out, norm_out)."""
    return lambda x, r, g: tuple(pattern_call(ws, 1, x[0], r, g, kw)[1:3])


def abstract_ws(max_token_num):
    kw = dict(max_token_num=max_token_num, hidden_dim=HIDDEN, dtype=jnp.bfloat16)
    return jf.abstract_workspace(MESH, "tp", backend="trtllm", **kw)


def per_element(f, *batched):
    """Stacked results of f on each batch element (no vmap)."""
    outs = [f(*(b[i] for b in batched)) for i in range(batched[0].shape[0])]
    return tuple(jnp.stack(o) for o in zip(*outs))


def count_calls(f, *args):
    """Primitive calls in the jaxpr, and whether one sits in a loop (lax.map)."""
    text = str(jax.make_jaxpr(f)(*args))
    return text.count("jax_fusedar_allreduce_fusion"), "scan" in text


@pytest.mark.slow
@pytest.mark.oldest
@pytest.mark.parametrize("pattern,kw", QUANT_CASES, ids=case_ids)
def test_nd_input_equals_the_2d_call_on_folded_rows(pattern, kw):
    """x/residual [B, S, H]: every output equals the 2-D call on the B*S rows; row-wise
    outputs keep [B, S, ...], the packed scale buffers are those of the B*S rows."""
    ws = xla_workspace(MESH, max_token_num=256)
    lead = (2, 8)
    x, r, g = inputs(new_rng(), lead)
    n = n_outputs(pattern)
    nd = lambda x, r, g: pattern_outputs(ws, pattern, x[0], r, g, kw)
    rows = lambda a: a.reshape(-1, HIDDEN)
    flat = lambda x, r, g: pattern_outputs(ws, pattern, rows(x[0]), rows(r), g, kw)
    got, want = sharded(nd, n)(x, r, g), sharded(flat, n)(x, r, g)
    quant = TRAITS[pattern].quant
    packed = quant == "group_fp8" or (quant == "fp4" and "layout_code" not in kw)
    for i, (a, b) in enumerate(zip(got, want)):
        if not (packed and i == n - 1):
            assert a.shape[:2] == lead, (i, a.shape)
            a = np.asarray(a).reshape(b.shape)
        assert_same_bits(a, b, f"pattern {int(pattern)} output {i}")


@pytest.mark.slow
@pytest.mark.oldest
@pytest.mark.parametrize("pattern,kw", QUANT_CASES, ids=case_ids)
@pytest.mark.parametrize("tokens", [4, 5])
def test_vmap_inside_shard_map_equals_per_element_calls(pattern, kw, tokens):
    """vmap over x and residual folds into tokens (one call); layouts that do not split back
    by a reshape for this token count (group FP8 with tokens % 4, swizzled NVFP4 with
    tokens % 128) run per element. Either way: the per-element results, bit for bit."""
    ws = xla_workspace(MESH, max_token_num=256)
    x, r, g = inputs(new_rng(), (3, tokens))
    one = lambda x, r, g: pattern_outputs(ws, pattern, x, r, g, kw)
    got, want = vmapped_and_per_element(one, n_outputs(pattern), x, r, g)
    assert_same_bits(got, want, f"vmap pattern {int(pattern)}, {tokens} tokens")


def test_nd_against_the_oracle_and_one_dim():
    ws = xla_workspace(MESH, "float32", max_token_num=256)
    rng = new_rng()
    xs = random_partials(rng, (8, 3, 5, HIDDEN), "float32")
    r = random_values(rng, (3, 5, HIDDEN), "float32")
    g = random_gamma(rng, HIDDEN, "float32")
    res, norm = sharded(norm_body(ws), 2)(xs, r, g)
    rows = lambda a: np.asarray(a).reshape(15, HIDDEN)
    outs = dict(residual_out=rows(res), norm_out=rows(norm), residual=rows(r), gamma=g)
    check_outputs("float32", xs.reshape(8, 15, HIDDEN), what="[3, 5, H]", **outs)
    # A 1-D x is one token.
    body = lambda x, r, g: tuple(pattern_call(ws, AR_NORM, x[0, 0, 0], r[0, 0], g, {})[1:3])
    one = sharded(body, 2)(xs, r, g)
    assert one[0].shape == (HIDDEN,)
    want = [np.asarray(res)[0, 0], np.asarray(norm)[0, 0]]
    assert_same_bits([np.asarray(o) for o in one], want, "1-D x")


def test_nd_rows_all_count_against_the_workspace_and_residual_must_have_x_shape():
    x, r, g = inputs(new_rng(), (3, 6))  # 18 rows > 16
    match = r"18x256 tokens exceed the workspace \(max_token_num=16 x hidden 256\); every row"
    with pytest.raises(ValueError, match=match + " of an N-D or vmapped call counts"):
        sharded(norm_body(xla_workspace(MESH, max_token_num=16), strict=True), 2)(x, r, g)
    ws = xla_workspace(MESH, max_token_num=256)
    x, r, g = inputs(new_rng(), (2, 4))
    body = lambda x, r, g: tuple(pattern_call(ws, 1, x[0], r.reshape(8, HIDDEN), g, {})[1:3])
    match = r"residual must have shape \(2, 4, 256\) and dtype bfloat16, got \(8, 256\) bfloat16"
    with pytest.raises(ValueError, match=match):
        sharded(body, 2)(x, r, g)


def test_vmap_folds_swizzled_nvfp4_scales_of_whole_tiles():
    """128 tokens per element: the swizzled scales are whole 128-row tiles, stored tile after
    tile, so the folded call splits back by a reshape (one call, no loop)."""
    ws = xla_workspace(MESH, max_token_num=512)
    x, r, g = inputs(new_rng(), (2, 128))
    one = lambda x, r, g: pattern_outputs(ws, Q.kARResidualRMSNormOutFP4Quant, x, r, g, SF40)
    body = lambda x, r, g: jax.vmap(one, in_axes=(0, 0, None))(x[0], r, g)
    assert count_calls(sharded(body, 4), x, r, g) == (1, False)
    got, want = vmapped_and_per_element(one, 4, x, r, g)
    assert_same_bits(got, want, "swizzled NVFP4 scales under vmap")


@pytest.mark.oldest
def test_vmap_folds_into_one_call_or_maps():
    ws = xla_workspace(MESH, max_token_num=256)
    x, r, g = inputs(new_rng(), (3, 4))
    gs = random_gamma(new_rng(), HIDDEN, "bfloat16", leading=(3,))
    one = lambda x, r, g: pattern_call(ws, 1, x, r, g, {})[1:3]
    run = lambda in_axes: sharded(lambda x, r, g: jax.vmap(one, in_axes=in_axes)(x[0], r, g), 2)
    assert count_calls(run((0, 0, None)), x, r, g) == (1, False)
    assert count_calls(run((0, None, None)), x, r[0], g) == (1, False)
    assert count_calls(run((0, 0, 0)), x, r, gs) == (1, True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "in_axes",
    [(0, None, None), (None, 0, None), (1, 1, None), (0, 0, 0)],
    ids=["x_only", "residual_only", "axis1", "gamma_too"],
)
def test_vmap_axes_and_batched_gamma(in_axes):
    ws = xla_workspace(MESH, max_token_num=256)
    rng = new_rng()
    B = 3
    x, r = inputs(rng, (B, 4))[:2]
    g = random_gamma(rng, HIDDEN, "bfloat16", leading=(B,))
    one = lambda x, r, g: tuple(pattern_call(ws, 1, x, r, g, {})[1:3])
    pick = lambda a, ax, i: a if ax is None else jnp.take(a, i, axis=ax)

    def body(x, r, g):
        # an argument that is not mapped is its first element
        xa, ra, ga = (a[0] if ax is None else a for a, ax in zip((x[0], r, g), in_axes))
        if in_axes == (1, 1, None):
            xa, ra = jnp.swapaxes(xa, 0, 1), jnp.swapaxes(ra, 0, 1)
        got = jax.vmap(one, in_axes=in_axes)(xa, ra, ga)
        want = [
            one(pick(xa, in_axes[0], i), pick(ra, in_axes[1], i), pick(ga, in_axes[2], i))
            for i in range(B)
        ]
        return (*got, *(jnp.stack(w) for w in zip(*want)))

    outs = sharded(body, 4)(x, r, g)
    assert_same_bits(outs[:2], outs[2:], f"vmap in_axes={in_axes}")


def test_vmap_of_a_batched_scale_factor_runs_per_element():
    ws = xla_workspace(MESH, max_token_num=256)
    x, r, g = inputs(new_rng(), (2, 4))
    sf = np.asarray([[0.05], [0.5]], np.float32)
    p = Q.kARResidualRMSNormOutFP8Quant

    def body(x, r, g, sf):
        one = lambda x, r, s: tuple(pattern_call(ws, p, x, r, g, {"scale_factor": s})[1:4])
        return (*jax.vmap(one)(x[0], r, sf), *per_element(one, x[0], r, sf))

    outs = jit_shard_map(body, MESH, (P("tp"), P(), P(), P()), (P(),) * 6)(x, r, g, sf)
    assert_same_bits(outs[:3], outs[3:], "batched scale_factor")
    assert not np.array_equal(bits(outs[2][0]), bits(outs[2][1]))


def test_vmap_outside_shard_map_and_grad():
    """vmap of a jit(shard_map) program (shard_map batches its body) and grad through the
    vmapped op equal the unfused math's."""
    from jax_fusedar.ops import reference

    ws = xla_workspace(MESH, "float32", max_token_num=256)
    rng = new_rng()
    x = random_values(rng, (3, 8 * 4, HIDDEN), "float32")
    r = random_values(rng, (3, 4, HIDDEN), "float32")
    g = random_gamma(rng, HIDDEN, "float32")
    kw = dict(axis_name="tp", pattern=1, rms_eps=1e-6, weight_bias=0.0)
    fused = lambda x, r, g: pattern_call(ws, 1, x, r, g, {})[2]
    unfused = lambda x, r, g: reference.allreduce_fusion_reference(x, r, g, **kw)[2]
    results = []
    for body in (fused, unfused):
        f = jax.shard_map(body, mesh=MESH, in_specs=(P("tp"), P(), P()), out_specs=P())
        vf = jax.vmap(f, in_axes=(0, 0, None))
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(vf(*a))), argnums=(0, 1, 2)))(x, r, g)
        results.append((jax.jit(vf)(x, r, g), grads))
    assert_same_bits(results[0], results[1], "vmap outside shard_map, value and grad")


def test_vmapped_batch_beyond_the_workspace_runs_per_element():
    """The folded batch (12 rows) exceeds the workspace but one element (4 rows) fits: one
    call per element in a loop (the kernel still serves them), even in strict mode; when an
    element does not fit either, strict mode raises as for the unbatched call."""
    ws = xla_workspace(MESH, max_token_num=8)
    x, r, g = inputs(new_rng(), (3, 4))
    one = lambda x, r, g: tuple(pattern_call(ws, 1, x, r, g, {"strict": True})[1:3])
    body = lambda x, r, g: jax.vmap(one, in_axes=(0, 0, None))(x[0], r, g)
    assert count_calls(sharded(body, 2), x, r, g) == (1, True)
    got, want = vmapped_and_per_element(one, 2, x, r, g)
    assert_same_bits(got, want, "per-element loop")
    with pytest.raises(ValueError, match=r"9x256 tokens exceed the workspace"):
        sharded(body, 2)(*inputs(new_rng(), (2, 9)))


def test_cuda_lowering_of_vmapped_and_nd_calls():
    """The kernel serves the folded rows: one custom call on [B*T, H]."""
    ws = abstract_ws(16)
    one = lambda x, r, g: tuple(pattern_call(ws, 1, x, r, g, {})[1:3])
    vmapped = lambda x, r, g: jax.vmap(one, in_axes=(0, 0, None))(x[0], r, g)
    lowered = lambda body, args: cuda_text(sharded(body, 2), *args)
    args = inputs(new_rng(), (3, 4))
    for text in (lowered(vmapped, args), lowered(norm_body(ws), args)):
        assert text.count(f"@{FFI_TARGET}") == 1 and "tensor<12x256xbf16>" in text
    # 20 rows > 16: a vmapped batch runs the kernel per element in a loop; an N-D call,
    # one call by definition, falls back.
    args = inputs(new_rng(), (5, 4))
    text = lowered(vmapped, args)
    assert text.count(f"@{FFI_TARGET}") == 1 and "tensor<4x256xbf16>" in text
    assert "stablehlo.while" in text
    assert FFI_TARGET not in lowered(norm_body(ws), args)


@pytest.mark.oldest
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float32_gamma_is_rounded_and_a_float32_residual_names_the_alternatives(dtype):
    ws = xla_workspace(MESH, dtype, max_token_num=256)
    rng = new_rng()
    x, r, g = inputs(rng, (4,), dtype)
    g32 = rng.uniform(-2, 2, HIDDEN).astype(np.float32)
    body = norm_body(ws)
    want = sharded(body, 2)(x, r, g32.astype(jdtype(dtype)))
    assert_same_bits(sharded(body, 2)(x, r, g32), want, "float32 gamma")
    # A float32 residual stream is refused, naming what to do instead.
    body = lambda x, r, g: tuple(pattern_call(ws, 1, x[0], r.astype(jnp.float32), g, {})[1:3])
    match = re.escape(f"residual has dtype float32 but x is {dtype}") + ".*residual.astype"
    match += r"\(x.dtype\).*x=x.astype\(jnp.float32\) with a float32 workspace"
    with pytest.raises(ValueError, match=match):
        sharded(body, 2)(x, r, g)


def test_float32_residual_stream_with_the_float32_alternative():
    """The alternative the error names: x cast to float32 with a float32 workspace keeps a
    float32 stream (against the oracle)."""
    ws = xla_workspace(MESH, "float32", max_token_num=256)
    rng = new_rng()
    xs = random_partials(rng, (8, 4, HIDDEN), "bfloat16")
    r = random_values(rng, (4, HIDDEN), "float32")
    g = random_gamma(rng, HIDDEN, "float32")
    body = lambda x, r, g: tuple(pattern_call(ws, 1, x[0].astype(jnp.float32), r, g, {})[1:3])
    res, norm = sharded(body, 2)(xs, r, g)
    outs = dict(residual_out=res, norm_out=norm, residual=r, gamma=g)
    check_outputs("float32", xs.astype(np.float32), what="float32 stream", **outs)


def test_dir_lists_the_lazy_exports_and_py_typed_ships():
    names = dir(jf)
    assert not set(jf.__all__) - set(names), set(jf.__all__) - set(names)
    assert "allreduce_fusion" in names and "__version__" in names
    assert (pathlib.Path(jf.__file__).parent / "py.typed").is_file()


def test_fallback_is_logged_once_per_kind_not_per_shape(caplog):
    caplog.set_level(logging.WARNING, logger="jax_fusedar")
    trace = lambda ws, args: sharded(norm_body(ws), 2).trace(*args)
    ws = abstract_ws(8)
    for lead in [(9,), (10,), (3, 4), (2, 2, 5)]:
        trace(ws, inputs(new_rng(), lead))
    msgs = fusedar_warnings(caplog)
    assert len(msgs) == 1 and "9x256 tokens exceed the workspace" in msgs[0], msgs
    # Another kind of reason (a hidden size the kernel cannot launch: 8200 / 8 = 1025 vectors,
    # odd, so one CTA of 1025 threads) is logged once too, whatever the token count.
    big = abstract_ws(256)
    rng = new_rng()
    for tokens in (2, 3):
        x = random_values(rng, (8, tokens, 8200), "bfloat16")
        r = random_values(rng, (tokens, 8200), "bfloat16")
        trace(big, (x, r, random_gamma(rng, 8200, "bfloat16")))
    msgs = fusedar_warnings(caplog)
    assert len(msgs) == 2 and "hidden_dim=8200 cannot be launched" in msgs[1], msgs
    caplog.clear()
    for lead in [(9,), (12,)]:
        trace(xla_workspace(MESH, max_token_num=8), inputs(new_rng(), lead))
    assert not fusedar_warnings(caplog), "the xla backend never uses the kernel"
