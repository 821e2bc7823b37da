"""The JAX quantized-epilogue reference (jax_fusedar.ops.quant_reference) against the independent
numpy oracle (tests/oracles/quant_oracle.py): bitwise equality, layouts, error bounds, bad inputs.
A random test names its fresh seed in its failure message; rerun one with QUANT_SEED=<seed>.

Error bounds on dequantized values (float64 truth x = float(y)):
  * e4m3: |x - q*s| <= 2^-4 |x| in the normal range (half an ulp of a 3-bit mantissa), <= 2^-10 s
    in the subnormal one (half the smallest subnormal 2^-9, times s); static FP8's saturation
    excluded. Dynamic and group scales never saturate: s >= amax/448 (dynamic up to the fp32
    rounding of amax/448, so 448*(1+2^-23) may round back to 448).
  * e2m1 per 16-block, SF an e4m3 normal: |x - q*SF/gs| <= max(0.25, |v|/4) * SF/gs (+ fp32
    slack), v = x*gs/SF the value e2m1 rounds (steps 0.5 up to 2, 1 up to 4, 2 up to 6;
    |v| <= 6/(1-2^-4) as SF is rounded from gs*amax/6)."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.oracles import quant_oracle as O
from jax_fusedar.common import quant_layouts
from jax_fusedar.ops import quant_arrays
from jax_fusedar.ops import quant_reference as Q
from jax_fusedar.common.patterns import AllReduceFusionPattern as P

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def seeded():
    """(seed, generator) of a fresh seed: $QUANT_SEED, else from os.urandom."""
    seed = int(os.environ.get("QUANT_SEED") or int.from_bytes(os.urandom(4), "little"))
    return seed, np.random.default_rng(seed)


def make_y(rng, M, H, dtype_name, *, specials=False, extremes=True):
    """Random norm outputs in T with all-zero rows, huge rows, tiny rows and exact 7*2^j
    values (group-scale power-of-two boundary)."""
    big = 6.0e4 if dtype_name == "float16" else 1.0e30
    y = 10.0 ** rng.uniform(-3, 2, size=(M, 1)) * rng.standard_normal((M, H))
    kinds = rng.integers(0, 8, size=M)
    if not extremes:  # one order of magnitude, zero rows only (NVFP4's global scale is shared)
        y = rng.standard_normal((M, H)) * 10.0 ** rng.uniform(-0.5, 0.5, size=(M, 1))
        kinds = np.where(kinds == 0, 0, 7)
    for m, kind in enumerate(kinds):
        if kind == 0:
            y[m] = 0.0
        elif kind == 1:
            y[m] = rng.uniform(-1, 1, H) * big
        elif kind == 2:
            y[m] = rng.standard_normal(H) * 1e-5
        elif kind == 3:  # exact group/row maxima at 7 * 2^j
            top = 7 * 2.0 ** int(rng.integers(-8, 8))
            idx = rng.choice(H, size=max(1, H // 16), replace=False)
            y[m] = rng.uniform(-1, 1, H) * top
            y[m, idx] = top * rng.choice([-1, 1], size=idx.size)
    if M >= 3:
        y[0] = 0.0
    if specials:
        n = max(1, y.size // 50)
        pos = rng.choice(y.size, size=3 * n, replace=False)
        y.reshape(-1)[pos] = np.repeat([np.nan, np.inf, -np.inf], n)
        if H >= 16:
            y[-1, :16] = np.nan  # an all-NaN NVFP4 block / group
    with np.errstate(over="ignore"):
        return y.astype(DTYPES[dtype_name])


bytes_of = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))
f32 = lambda x: jnp.asarray(np.asarray(x, dtype=np.float32))


def assert_e4m3_equal(got, want, msg):
    got, want = np.asarray(got), np.asarray(want)
    nan = lambda b: np.isnan(b.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    bad = (nan(got) != nan(want)) | (~nan(got) & (got != want))
    i = tuple(np.argwhere(bad)[0]) if bad.any() else None
    assert i is None, (
        f"{msg}: {bad.sum()} e4m3 mismatches, first at {i}: got 0x{got[i]:02x} want 0x{want[i]:02x}"
    )


def assert_dynamic_matches(y, q, s, msg, division="ieee"):
    """Dynamic FP8 codes ``q`` and row scales ``s`` of y (scales bit for bit) are the
    oracle's; returns the oracle's scales."""
    wq, ws = O.fp8_dynamic(y, division)
    np.testing.assert_array_equal(np.asarray(s).view(np.uint32), ws.view(np.uint32), err_msg=msg)
    assert_e4m3_equal(bytes_of(q), wq, msg)
    return ws


def assert_group_matches(y, g, msg):
    """Group FP8 of y with group size g is the oracle's: codes and packed scale words."""
    q, buf = _group(jnp.asarray(y), g)
    wq, wbuf = O.fp8_group(y, g)
    assert buf.dtype == jnp.int32 and buf.shape == wbuf.shape
    assert_e4m3_equal(bytes_of(q), wq, f"group fp8 g={g} {msg}")
    np.testing.assert_array_equal(np.asarray(buf), wbuf, err_msg=f"group scales g={g} {msg}")
    return buf


def assert_nvfp4_matches(packed, sf, y, gs, msg, division="ieee"):
    """NVFP4 codes and (linear) scale bytes of y at global scale gs are the oracle's."""
    wp, wsf = O.nvfp4(y, gs, division)
    np.testing.assert_array_equal(np.asarray(packed), wp, err_msg=msg)
    assert_e4m3_equal(bytes_of(sf), wsf, msg)


def assert_nvfp4_layouts_match(y, gs32, msg):
    """NVFP4 of y at global scale gs32 in both scale layouts is the oracle's: the codes,
    every scale byte written and (our documented fill) zeros in the padding."""
    M, H = y.shape
    wp, wsf = O.nvfp4(y, float(gs32))
    both = _nvfp4_both(jnp.asarray(y), f32(np.full((1,), gs32)))
    for layout in (0, 2):
        packed, sf = both[layout]
        assert packed.dtype == jnp.uint8 and packed.shape == (M, H // 2)
        assert sf.dtype == jnp.float8_e4m3fn
        assert sf.shape == quant_layouts.nvfp4_scale_shape(M, H, layout)
        np.testing.assert_array_equal(np.asarray(packed), wp, err_msg=f"nvfp4 values {msg}")
        buf, written = O.nvfp4_scale_buffer(wsf, H, layout)
        assert sf.size == quant_layouts.nvfp4_scale_buffer_size(M, H, layout) == buf.size
        got = bytes_of(sf).reshape(-1)
        assert_e4m3_equal(got[written], buf[written], f"nvfp4 scales layout={layout} {msg}")
        assert not got[~written].any()


def assert_fp8_paths_match(y, scale, groups, seed):
    """Static FP8 at ``scale``, dynamic, and group FP8 for each of ``groups`` (only 32 takes
    the warp-shuffle max) of y are the oracle's."""
    yj = jnp.asarray(y)
    want = O.fp8_static(y, float(np.float32(scale)))
    assert_e4m3_equal(bytes_of(_static(yj, f32(scale))), want, f"static seed={seed}")
    assert_dynamic_matches(y, *_dynamic(yj), f"dynamic seed={seed}")
    for g in groups:
        assert Q.group_uses_warp_shuffle(g, y.dtype) == (g == 32)
        assert_group_matches(y, g, f"seed={seed}")


_static = jax.jit(Q.quantize_fp8_static)
_dynamic = jax.jit(Q.quantize_fp8_dynamic)
_group = jax.jit(Q.quantize_fp8_group, static_argnums=1)
_nvfp4 = jax.jit(Q.quantize_nvfp4, static_argnums=2)
# both layouts in one compilation (compile time dominates these tests)
_nvfp4_both = jax.jit(lambda y, gs: {0: Q.quantize_nvfp4(y, gs, 0), 2: Q.quantize_nvfp4(y, gs, 2)})
_unpack = jax.jit(quant_arrays.unpack_ue8m0_scales, static_argnums=(1, 2, 3))
_deq_fp8 = jax.jit(quant_arrays.dequantize_fp8, static_argnames="group_size")
_deq_fp4 = jax.jit(quant_arrays.dequantize_nvfp4, static_argnums=(3, 4, 5))
_block_scales = jax.jit(quant_arrays.nvfp4_block_scales, static_argnums=(1, 2, 3))

# every token count and hidden size for each dtype (not the full product: compile time)
SHAPES = [("bfloat16", M, H) for M, H in ((1, 64), (17, 1024), (130, 80), (130, 7168))]
SHAPES += [("float16", M, H) for M, H in ((1, 80), (17, 64), (130, 1024), (17, 7168))]
assert {(d, M) for d, M, _ in SHAPES} == {(d, M) for d in DTYPES for M in (1, 17, 130)}
assert {(d, H) for d, _, H in SHAPES} == {(d, H) for d in DTYPES for H in (64, 80, 1024, 7168)}
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kind",
    ["static", "dynamic", pytest.param("group", marks=SLOW), pytest.param("nvfp4", marks=SLOW)],
)
@pytest.mark.parametrize("dtype,M,H", SHAPES)
def test_matches_oracle(kind, dtype, M, H):
    seed, rng = seeded()
    y = make_y(rng, M, H, dtype)
    amax = float(np.max(np.abs(y.astype(np.float64))))
    if kind == "static":
        scales = [2.0 ** int(rng.integers(-10, 10)), float(np.float32(rng.uniform(0.01, 3.0)))]
        # a power of two, an arbitrary one, some saturation, everything saturated
        scales += [max(amax, 1.0) / 448 * float(rng.uniform(0.05, 1.5)), 1e-30]
        shape = () if rng.integers(2) else (1,)
        for s32 in map(np.float32, scales):
            got = bytes_of(_static(jnp.asarray(y), f32(np.full(shape, s32))))
            assert_e4m3_equal(
                got, O.fp8_static(y, float(s32)), f"static fp8 seed={seed} scale={s32!r}"
            )
    elif kind == "dynamic":
        q, s = _dynamic(jnp.asarray(y))
        assert s.shape == (M, 1) and s.dtype == jnp.float32 and q.dtype == jnp.float8_e4m3fn
        assert_dynamic_matches(y, q, s, f"dynamic seed={seed}")
        if M >= 3:  # the all-zero row gets the minimum scale 2^-9/448 and zeros
            assert np.asarray(s)[0, 0] == np.float32(2.0**-9) / np.float32(448)
            assert not bytes_of(q)[0].any()
    elif kind == "group":
        # All of 32/64/128 that divide H for bf16, one of them for fp16 (compile time); 16 for
        # H = 80 (5 groups: a partial last pack).
        groups = (16,) if H == 80 else tuple(g for g in (32, 64, 128) if H % g == 0)
        for g in groups if dtype == "bfloat16" else (int(rng.choice(groups)),):
            buf = assert_group_matches(y, g, f"seed={seed}")
            assert buf.shape == quant_layouts.group_scale_buffer_shape(M, H, g)
            # the exponents, unpacked, are the oracle's powers of two
            s = np.asarray(_unpack(buf, M, H, g))
            assert np.all(s >= 2.0**-33) and np.all(np.log2(s) == np.round(np.log2(s))), seed
    else:
        # SFs from subnormal to saturated; then all SF zero / all saturated
        gss = [
            448 * 6 / max(amax, 1e-30) * float(rng.uniform(0.5, 2.0)),
            float(rng.uniform(1, 1000)),
        ]
        for gs32 in map(np.float32, gss + ([1e-30, 1e30] if M * H <= 20000 else [])):
            assert_nvfp4_layouts_match(y, gs32, f"gs={gs32!r} seed={seed}")


def _positive_values(dtype_name):  # every positive finite value of T, as float64
    bits = np.arange(1, 0x7C00 if dtype_name == "float16" else 0x7F80, dtype=np.uint16)
    return bits.view(DTYPES[dtype_name]).astype(np.float64)


def test_reciprocal_division_mode():
    """division="reciprocal" (fl(a * fl(1/b))) against the oracle's, and it does differ."""
    seed, rng = seeded()
    y = make_y(rng, 130, 1024, "bfloat16")
    yj = jnp.asarray(y)
    q, s = jax.jit(lambda y: Q.quantize_fp8_dynamic(y, division="reciprocal"))(yj)
    ws = assert_dynamic_matches(y, q, s, f"dynamic reciprocal seed={seed}", "reciprocal")
    assert (ws != O.fp8_dynamic(y, "ieee")[1]).any(), f"seed={seed}"
    nvfp4 = jax.jit(lambda y, g: Q.quantize_nvfp4(y, g, 2, division="reciprocal"))
    for gs in (3.0 * 2.0 ** int(rng.integers(-3, 4)), float(np.float32(rng.uniform(1, 100)))):
        assert_nvfp4_matches(*nvfp4(yj, f32(gs)), y, gs, f"gs={gs} seed={seed}", "reciprocal")
    with pytest.raises(ValueError, match="division"):
        Q.quantize_fp8_dynamic(yj, division="fast")


def _nvfp4_order_blocks(dtype_name, gs):
    """16-element blocks on which the kernel's operation order matters: the block max where
    gs * (vmax * fl(1/6)) and (gs * vmax) * fl(1/6) give different e4m3 SFs, and (vmax, x)
    pairs where x * fl(gs / SF) and x * (gs * fl(1 / SF)) give different e2m1 codes."""
    vals = _positive_values(dtype_name)
    r6 = float(O.fl(1.0 / 6.0))
    sf_kernel = O.e4m3_bytes_sat(O.fl(gs * O.fl(vals * r6)))
    sf_other = O.e4m3_bytes_sat(O.fl(O.fl(gs * vals) * r6))
    blocks = [np.pad([v], (0, 15)) for v in vals[sf_kernel != sf_other][:64]]
    n_sf = len(blocks)
    for sf in np.unique(sf_kernel[(sf_kernel > 0) & (sf_kernel < 0x7F)]):
        q = float(O.e4m3_value(sf))
        o1, o2 = O.fl(gs / q), O.fl(gs * O.fl(1.0 / q))
        if o1 == o2:
            continue
        differ = O.e2m1_codes(O.fl(vals * o1)) != O.e2m1_codes(O.fl(vals * o2))
        owners = vals[sf_kernel == sf]
        for x in vals[differ][:4]:
            vmax = owners[owners >= x]
            if vmax.size:
                blocks.append(np.pad([vmax[0], x, -x], (0, 13)))
    return np.array(blocks, dtype=np.float64).reshape(-1, 16), n_sf, len(blocks) - n_sf


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernels_order_of_operations(dtype):
    """Constructed inputs that tell the kernel's order of operations from plausible others
    (random data hits these only by chance), plus the exact e2m1 ties. Static FP8: the kernel
    multiplies by fl(1/scale); y / scale rounds differently exactly when the product sits near
    an e4m3 midpoint, which scale = 7 * 2^k produces for some 30 y (13 and 15 do for fewer;
    3, 5, 9, 11 and 0.1 for none)."""
    seed, rng = seeded()
    vals = _positive_values(dtype)
    for k in rng.choice(np.arange(-6, 6), 2, replace=False):
        s = 7.0 * 2.0 ** int(k)
        kernel = O.e4m3_bytes_sat(O.fl(vals * O.fl(1.0 / s)))
        divided = O.e4m3_bytes_sat(O.fl(vals / s))
        y = vals[kernel != divided]
        assert y.size, (s, seed)
        y = np.concatenate([y, -y])[None, :].astype(DTYPES[dtype])
        got = bytes_of(_static(jnp.asarray(y), f32([s])))
        assert_e4m3_equal(got, O.fp8_static(y, s), f"scale={s} seed={seed}")
        assert_e4m3_equal(got[0, : y.shape[1] // 2], kernel[kernel != divided], f"scale={s}")
    found_sf = found_q = 0
    # gs = 3 * 2^k makes both orderings land on e4m3 / e2m1 midpoints (found for every k);
    # a random gs rarely does
    gss = [3.0 * 2.0 ** int(k) for k in rng.choice(np.arange(-4, 5), 2, replace=False)]
    for gs in gss + [float(np.float32(rng.uniform(0.5, 500)))]:
        blocks, n_sf, n_q = _nvfp4_order_blocks(dtype, gs)
        found_sf, found_q = found_sf + n_sf, found_q + n_q
        if len(blocks):
            y = blocks.reshape(-1, 64 if len(blocks) % 4 == 0 else 16).astype(DTYPES[dtype])
            packed, sf = _nvfp4(jnp.asarray(y), f32(gs), 2)
            assert_nvfp4_matches(packed, sf, y, gs, f"gs={gs} seed={seed}")
    assert found_sf > 0 and found_q > 0, (found_sf, found_q, seed)
    # with gs = 1 and a block max of 6, SF = 1 and oscale = 1: v = x, so the e2m1 ties show
    half = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # the positive e2m1 midpoints
    ties = [6.0, *half, *(-v for v in half), -0.1]
    packed, sf = _nvfp4(jnp.asarray(np.array([ties], DTYPES[dtype])), f32(1.0), 2)
    codes = np.stack([np.asarray(packed)[0] & 0xF, np.asarray(packed)[0] >> 4], -1).reshape(-1)
    np.testing.assert_array_equal(codes, [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 8])
    assert float(sf[0, 0].astype(jnp.float32)) == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_semantics(dtype):
    """Also T = float (VEC_SIZE 4) on the FP8 paths: g=24 takes the shared-memory max (24/4 = 6
    vectors, not a power of two), g=32 the warp shuffle."""
    seed, rng = seeded()
    y = make_y(rng, 17, 96, dtype, specials=True)
    # 32: warp-shuffle max (NaN ignored); 24 and 4: shared-memory atomicMax (NaN wins)
    assert_fp8_paths_match(y, 0.75, (32, 24, 4), seed)
    assert_nvfp4_layouts_match(y, np.float32(3.0), f"seed={seed}")
    y32 = y.astype(np.float32)
    y32[3] *= np.float32(1 + 2.0**-20)  # bits a 16-bit type would not have
    assert_fp8_paths_match(y32, 0.3, (24, 32), seed)
    # documented specifics: NaN -> NaN (static), NaN -> -448 (dynamic clamp via fmaxf),
    # all-NaN NVFP4 block -> NaN SF and +6 codes (0x77)
    nan_static = _static(f32([[np.nan]]).astype(jnp.bfloat16), f32(1.0))
    assert np.isnan(np.asarray(nan_static).astype(np.float32)).all()
    qd, _ = _dynamic(jnp.asarray([[np.nan, 1.0]], jnp.bfloat16))
    assert float(qd[0, 0].astype(jnp.float32)) == -448.0
    p, sf = _nvfp4(jnp.full((1, 16), jnp.nan, jnp.bfloat16), f32(1.0), 2)
    assert np.all(np.asarray(p) == 0x77) and np.isnan(float(sf[0, 0].astype(jnp.float32)))


def test_e2m1_rounding_table():
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    vals = []
    for t in ties:  # every tie and its two float32 neighbours
        vals += [t, *(float(np.nextafter(np.float32(t), np.float32(to))) for to in (0, 9))]
    vals += [0.0, -0.0, -0.1, 6.0, 7.0, 1e30, np.inf, -np.inf, np.nan, 0.5, 3.0, -4.0]
    v = np.array(vals, np.float32)
    got = np.asarray(Q.e2m1_codes(jnp.asarray(v)))
    np.testing.assert_array_equal(got, O.e2m1_codes(v.astype(np.float64)))
    code = lambda x: int(Q.e2m1_codes(jnp.float32(x)))
    for t, c in ties.items():
        assert code(t) == c and code(-t) == c | 8
    # sign kept on underflow, NaN -> +6, satfinite
    assert (code(-0.1), code(np.nan), code(-np.inf)) == (8, 7, 15)


def test_e4m3_conversion_is_rne_satfinite():
    """XLA's f32 -> e4m3 (after the clamp) agrees with ml_dtypes and with a table RNE at every
    midpoint and its neighbours, subnormals included; the constants and fast-math claims."""
    t = np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    m32 = ((t[:-1] + t[1:]) / 2).astype(np.float32)
    extra = [448.0, 460.0, 464.0, 470.0, 1e9, np.inf, 2.0**-10, 3 * 2.0**-11]
    v = np.concatenate(
        [m32, np.nextafter(m32, np.float32(1e9)), np.nextafter(m32, np.float32(0)), extra]
    )
    v = np.concatenate([v, -v]).astype(np.float32)
    got = bytes_of(Q.e4m3_satfinite(jnp.asarray(v)))
    np.testing.assert_array_equal(got, O.e4m3_bytes_sat(v))
    # table RNE: nearest, ties to even mantissa (= even code)
    a = np.minimum(np.abs(v.astype(np.float64)), 448.0)
    d = np.abs(t[None, :] - a[:, None])
    best = np.argmin(d, axis=1)
    nxt = np.minimum(best + 1, t.size - 1)
    tie = (best % 2 == 1) & (d[np.arange(a.size), nxt] == d[np.arange(a.size), best])
    code = np.where(tie, best + 1, best) | np.where(np.signbit(v), 0x80, 0)
    np.testing.assert_array_equal(got, code.astype(np.uint8))
    assert hex(np.float32(1e-10).view(np.uint32)) == "0x2edbe6ff"
    assert Q._DYN_MIN_SCALE == np.float32(2.0**-9 / 448)
    # a multiply by fl(1/448) lands exactly on the power of two for every amax = 7 * 2^j
    r = np.float32(1) / np.float32(448)
    for j in range(-30, 30):
        assert np.float32(np.float32(7 * 2.0**j) * r) == np.float32(2.0 ** (j - 6))


@pytest.mark.parametrize(
    "M,H", [(1, 16), (1, 64), (17, 80), (130, 80), (130, 1024), (257, 48), (130, 7168)]
)
def test_swizzled_offsets(M, H):
    k = H // 16
    size = quant_layouts.nvfp4_scale_buffer_size(M, H, 0)
    assert size == -(-M // 128) * 128 * -(-k // 4) * 4
    mm, kk = np.meshgrid(np.arange(M), np.arange(k), indexing="ij")
    off = quant_layouts.swizzled_128x4_offset(mm, kk, H)
    for m, j in np.ndindex(M, k):
        assert (
            off[m, j] == O.swizzle_offset(m, j, H) == quant_layouts.swizzled_128x4_offset(m, j, H)
        )
    off = off.reshape(-1)
    assert off.min() >= 0 and off.max() < size
    assert np.unique(off).size == off.size  # distinct
    # the array form writes exactly those bytes, padding untouched (zero)
    vals = (np.arange(M * k) % 250 + 1).astype(np.uint8).reshape(M, k)
    buf = np.asarray(quant_arrays.swizzle_128x4(jnp.asarray(vals))).reshape(-1)
    expect = np.zeros(size, np.uint8)
    expect[off] = vals.reshape(-1)
    np.testing.assert_array_equal(buf, expect)
    np.testing.assert_array_equal(
        np.asarray(quant_arrays.unswizzle_128x4(jnp.asarray(buf), M, H)), vals
    )
    # LINEAR
    assert quant_layouts.nvfp4_scale_buffer_size(M, H, 2) == M * k
    assert quant_layouts.linear_offset(M - 1, k - 1, H) == M * k - 1


def test_group_buffer_layout_and_views():
    M, H, g = 5, 80, 16  # 5 groups -> 2 packs, T = 8
    assert quant_layouts.group_scale_buffer_shape(M, H, g) == (2, 8)
    assert quant_layouts.group_scale_min_storage_words(M, H, g) == 8 + 5
    exps = (np.arange(M * 5).reshape(M, 5) + 100).astype(np.uint8)
    buf = np.asarray(Q.pack_group_scales(jnp.asarray(exps), M, H, g))
    b = np.frombuffer(buf.astype("<i4").tobytes(), np.uint8)
    used = {
        (p * 8 + m) * 4 + q: (m, j) for m in range(M) for j in range(5) for p, q in [divmod(j, 4)]
    }
    assert all(b[i] == exps[m, j] for i, (m, j) in used.items())
    # padding: K padding of each token's last pack and all padding tokens are zero
    assert all(b[i] == 0 for i in range(b.size) if i not in used)
    np.testing.assert_array_equal(
        np.asarray(quant_arrays.unpack_ue8m0_scales(jnp.asarray(buf), M, H, g)),
        np.ldexp(1.0, exps.astype(int) - 127).astype(np.float32),
    )
    # FlashInfer's (M, K) tensor with strides (1, T) is buf[:, :M].T
    np.testing.assert_array_equal(buf[:, :M].T.shape, (M, 2))


def test_nvfp4_scale_views_roundtrip():
    b = seeded()[1].integers(0, 256, size=(256, 12), dtype=np.uint8)
    x = jax.lax.bitcast_convert_type(jnp.asarray(b), jnp.float8_e4m3fn)
    w = quant_arrays.nvfp4_scales_as_int32(x)
    assert w.shape == (256, 3) and w.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(w), b.view("<i4"))  # little-endian words
    back = quant_arrays.nvfp4_scales_as_fp8(w)
    assert back.shape == (256, 12) and back.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(bytes_of(back), b)
    with pytest.raises(ValueError):
        quant_arrays.nvfp4_scales_as_int32(x[:, :5])
    with pytest.raises(ValueError):
        quant_arrays.nvfp4_scales_as_fp8(x)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,M,H", [("bfloat16", 17, 1024), ("float16", 130, 1024)])
def test_dequantized_error_bounds(dtype, M, H):
    seed, rng = seeded()
    y = make_y(rng, M, H, dtype)
    x = y.astype(np.float64)

    def assert_fp8_within(xh, s, what, slack=1.0):
        err = np.abs(x - np.asarray(xh).astype(np.float64))
        assert np.all(err <= np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * s) * slack), what

    # static: scale large enough not to saturate
    s = np.float32(max(np.max(np.abs(x)), 1e-3) / 448 * 1.01)
    assert_fp8_within(
        _deq_fp8(_static(jnp.asarray(y), f32(s)), f32([s])), s, f"static seed={seed}", 1.0001
    )
    q, sc = _dynamic(jnp.asarray(y))
    assert_fp8_within(_deq_fp8(q, sc), np.asarray(sc), f"dynamic seed={seed}", 1.0001)
    # group (power-of-two scales >= amax/448: the products q*s are exact)
    for g in (32, 64, 128):
        q, buf = _group(jnp.asarray(y), g)
        s = np.repeat(np.asarray(_unpack(buf, M, H, g)), g, axis=1)
        assert_fp8_within(_deq_fp8(q, buf, group_size=g), s, f"group g={g} seed={seed}")
    # NVFP4 (blocks whose SF is an e4m3 normal), on data of one order of magnitude
    y = make_y(rng, M, H, dtype, extremes=False)
    x = y.astype(np.float64)
    for layout in (0, 2):
        gs = np.float32(448 * 6 / max(float(np.max(np.abs(x))), 1e-30) * rng.uniform(0.5, 1.0))
        packed, sf = _nvfp4_both(jnp.asarray(y), f32(gs))[layout]
        xh = np.asarray(_deq_fp4(packed, sf, f32(gs), layout, M, H))
        sfv = np.repeat(np.asarray(_block_scales(sf, M, H, layout)), 16, axis=1)
        ok = (sfv >= 2.0**-6) & (sfv <= 448)
        unit = sfv / float(gs)
        bound = np.maximum(0.25, np.abs(x / np.where(ok, unit, 1.0)) / 4) * unit * (1 + 2.0**-20)
        err = np.abs(x - xh.astype(np.float64))
        assert np.all((err <= bound + 1e-30) | ~ok), f"nvfp4 layout={layout} seed={seed}"
        zero_rows = ~x.any(axis=1)
        assert ok[~zero_rows].mean() > 0.9, f"seed={seed}"
        assert not xh[zero_rows].any()
        # int32 view of the scales dequantizes identically (swizzled: always viewable)
        if layout == 0:
            xi = _deq_fp4(packed, quant_arrays.nvfp4_scales_as_int32(sf), f32(gs), layout, M, H)
            np.testing.assert_array_equal(np.asarray(xi), xh)


def test_jit_scale_is_an_operand():
    """The scale is a runtime operand: one compilation serves different scales."""
    y = jnp.asarray(np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32), jnp.bfloat16)
    traces = []
    f = jax.jit(lambda y, s: traces.append(1) or Q.quantize_fp8_static(y, s))
    a, b = f(y, f32([1.0])), f(y, f32([0.5]))
    assert len(traces) == 1
    assert not np.array_equal(bytes_of(a), bytes_of(b))
    np.testing.assert_array_equal(bytes_of(b), O.fp8_static(np.asarray(y), 0.5))


def test_quantize_for_pattern():
    y = jax.ShapeDtypeStruct((3, 64), jnp.bfloat16)
    one = jax.ShapeDtypeStruct((1,), jnp.float32)
    e4m3, fp4 = ((3, 64), "float8_e4m3fn"), ((3, 32), "uint8")
    cases = [  # (pattern, options, (quant_out, scale_out) as (shape, dtype))
        (P.kARResidualRMSNorm, {}, (None, None)),
        (P.kAllReduce, {}, (None, None)),
        (P.kARResidualRMSNormOutFP8Quant, {}, (e4m3, None)),
        (P.kARResidualRMSNormFP4Quant, {"layout": 2}, (fp4, ((3, 4), "float8_e4m3fn"))),
        (P.kARResidualRMSNormOutFP4Quant, {}, (fp4, ((128, 4), "float8_e4m3fn"))),
        (P.kARResidualRMSNormDynamicFP8Quant, {}, (e4m3, ((3, 1), "float32"))),
        (9, {"group_size": 32}, (e4m3, ((1, 4), "int32"))),
        (8, {"group_size": 16}, (e4m3, ((1, 4), "int32"))),
    ]
    for pattern, kw, want in cases:
        out = jax.eval_shape(
            lambda y, s: Q.quantize_for_pattern(y, pattern, scale_factor=s, **kw), y, one
        )
        assert jax.tree.map(lambda a: (a.shape, a.dtype.name), out) == want, pattern


def test_bad_inputs_raise():
    y = jnp.zeros((4, 64), jnp.bfloat16)
    e4m3 = jnp.zeros((4, 64), jnp.float8_e4m3fn)
    words, codes = jnp.zeros((1, 4), jnp.int32), jnp.zeros((4, 32), jnp.uint8)
    cases = [
        (lambda: Q.quantize_fp8_static(y, None), "required"),
        (lambda: Q.quantize_fp8_static(y, 1.0), "Python constant"),
        (lambda: Q.quantize_fp8_static(y, f32([1.0, 2.0])), "shape"),
        (lambda: Q.quantize_fp8_static(y, jnp.ones((1,), jnp.float16)), "float32"),
        (lambda: Q.quantize_nvfp4(y, None), "required"),
        (lambda: Q.quantize_nvfp4(y, np.ones((1,), np.float64)), "float32"),
        (lambda: Q.quantize_fp8_group(y, 48), "divisible by group_size"),
        (lambda: Q.quantize_fp8_group(y, None), "required"),
        (lambda: Q.quantize_fp8_group(y, 0), "> 0"),
        (lambda: Q.quantize_nvfp4(jnp.zeros((4, 72), jnp.bfloat16), f32(1.0)), "divisible by 16"),
        (lambda: Q.quantize_nvfp4(y, f32(1.0), 1), "SWIZZLED_8x4"),
        (lambda: Q.quantize_nvfp4(y, f32(1.0), 7), "layout"),
        (lambda: Q.quantize_nvfp4(y.astype(jnp.float32), f32(1.0)), "must be one of"),
        (lambda: Q.quantize_fp8_dynamic(jnp.zeros((64,), jnp.bfloat16)), "2-D"),
        (lambda: Q.quantize_fp8_dynamic(jnp.zeros((2, 64), jnp.int32)), "must be one of"),
        (lambda: quant_layouts.group_scale_buffer_shape(4, 80, 32), "divisible"),
        (lambda: quant_layouts.nvfp4_scale_buffer_size(4, 72, 0), "divisible by 16"),
        (lambda: quant_layouts.nvfp4_scale_shape(4, 64, 1), "SWIZZLED_8x4"),
        (lambda: quant_arrays.dequantize_fp8(e4m3, f32(np.ones((3, 1)))), None),
        (lambda: quant_arrays.dequantize_fp8(e4m3, None), None),
        (lambda: quant_arrays.unpack_ue8m0_scales(words, 5, 64, 32), "need shape"),
        (lambda: quant_arrays.dequantize_nvfp4(codes, codes[:, :4], f32(1.0), 0, 4, 64), "shape"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
