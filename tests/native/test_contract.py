"""The contract between the Python layers and the native module: the pattern table, the result
lists, the workspace sizes, the limits and the FFI target names the Python side uses must equal
what the native module (fusedar/patterns.h, fusedar_workspace_sizes, ffi/xla/handlers.h)
reports. Runs on CPU: nothing here touches a GPU."""

import dataclasses
import itertools

import numpy as np
import pytest

from jax_fusedar.common import limits, moe_limits, native, patterns, results, sizing
from jax_fusedar.common.patterns import TRAITS, AllReduceFusionPattern as Pattern
from tests.skips import needs_native

pytestmark = needs_native

TRAIT_FIELDS = (
    "family has_allreduce_out has_residual has_norm_out quant uses_scale_factor "
    "writes_scale_out needs_sm100"
).split()
BF16, CODES = "bfloat16", native.DTYPE_CODES
DTYPES = (BF16, "float16", "float32")


def test_pattern_tables_are_equal():
    # Every pattern, the dense kernel's and the MoE epilogues', with the family serving it.
    table = native.ext.pattern_table()
    assert sorted(table) == sorted(int(p) for p in TRAITS) == sorted(Pattern)
    for pattern, traits in TRAITS.items():
        row = table[int(pattern)]
        assert row["code"] == int(pattern)
        python = {f: getattr(traits, f) for f in TRAIT_FIELDS}
        assert {f: row[f] for f in TRAIT_FIELDS} == python, pattern.name
        # The dense kernel compiles its family's codes; the MoE codes have their own
        # launcher (fusedar_moe_launch) and handler.
        dense = traits.family == "dense"
        assert row["compiled"] is dense and bool(native.ext.pattern_compiled(int(pattern))) is dense
    for code in range(-1, 20):  # codes outside the table are no patterns
        if code not in TRAITS:
            assert not native.ext.pattern_compiled(code), code
            with pytest.raises(ValueError, match="unknown fusion pattern"):
                patterns.as_pattern(code)
    # The sm100 refusal is one rule: Python refuses exactly the patterns the native table marks
    # as needing sm100+, with the message the native launch uses.
    for pattern in patterns.DENSE_PATTERNS:
        problem = patterns.device_problem(pattern, "cuda:0", 9, 0)
        assert (problem is not None) == table[int(pattern)]["needs_sm100"]
        assert patterns.device_problem(pattern, "cuda:0", 10, 0) is None
    assert patterns.device_problem(3, "cuda:1", 9, 0) == (
        "NVFP4 patterns (3, 5) need an sm100+ GPU (Blackwell); cuda:1 is sm90"
    )


@pytest.mark.parametrize("pattern", patterns.MOE_PATTERNS)
def test_moe_operands_and_results_match_the_handlers_counts(pattern):
    """The MoE handler's counts come from the table: the operands every call has, then the
    finalize's optional ones; the results, then the reduction's optional allreduce_out."""
    row = native.ext.pattern_table()[int(pattern)]
    assert len(patterns.operand_names(pattern)) == row["operands"]
    assert len(results.result_specs(pattern, 5, 1024, BF16)) == row["results"]
    if TRAITS[pattern].family == "moe_finalize":
        full = patterns.operand_names(pattern, expert_scale_factor=True, shared_expert_output=True)
        assert full[row["operands"] :] == patterns.OPTIONAL_OPERANDS
    else:
        specs = results.result_specs(pattern, 5, 1024, BF16, allreduce_out=True)
        assert [s.name for s in specs[row["results"] :]] == ["allreduce_out"]
    # In the table, the MoE rows are no dense rows: the dense handler's result rule (and its
    # launch, fusedar/patterns.h's find_dense_pattern) refuses them.
    with pytest.raises(ValueError, match="unknown fusion pattern"):
        native.ext.expected_results(int(pattern), native.ext.BFLOAT16, 5, 1024)


def _quant_params(pattern):
    """(layout, group size) variations that matter to ``pattern``."""
    quant = TRAITS[pattern].quant
    return {"fp4": [(0, 0), (2, 0)], "group_fp8": [(0, 16), (0, 128)]}.get(quant, [(0, 0)])


@pytest.mark.parametrize("pattern", patterns.DENSE_PATTERNS)
def test_the_dense_handler_checks_result_specs(pattern):
    """result_specs gives what the XLA handler checks (ffi/xla/result_check.h): its operand
    and result counts, and each result's element type and dense storage count."""
    row, traits = native.ext.pattern_table()[int(pattern)], TRAITS[pattern]
    expected_results = native.ext.expected_results
    specs = results.result_specs(pattern, 5, 1024, BF16, group_size=128)
    names = [s.name for s in specs]
    assert len(specs) == row["results"]
    assert names[0] == ("allreduce_out" if row["has_allreduce_out"] else "residual_out")
    assert ("norm_out" in names) == row["has_norm_out"]
    assert ("quant_out" in names) == (row["quant"] is not None)
    assert ("scale_out" in names) == row["writes_scale_out"]
    # x, [residual_in, rms_gamma], [scale_factor]
    operands = 1 + 2 * traits.has_residual + traits.uses_scale_factor
    assert operands == row["operands"] == len(patterns.operand_names(pattern))
    # The handler's list is results.result_specs, the list the JAX primitive builds.
    for tokens, hidden, dtype in itertools.product((1, 5, 130), (256, 1024), DTYPES):
        if traits.quant == "fp4" and dtype == "float32":
            continue
        for layout, group in _quant_params(pattern):
            specs = results.result_specs(pattern, tokens, hidden, dtype, layout, group or None)
            want = [(s.name, s.dtype, int(np.prod(s.storage_shape))) for s in specs]
            got = expected_results(int(pattern), CODES[dtype], tokens, hidden, layout, group)
            assert [tuple(r) for r in got] == want, (pattern, tokens, hidden, dtype, layout)
    # Each result, not only the first: a wrong count or element type in any position is
    # reported naming that result; the right list is accepted.
    layout, group = _quant_params(pattern)[-1]
    call = (int(pattern), CODES[BF16], 5, 1024, layout, group)
    expected = expected_results(*call)
    right, names = [(d, n) for _, d, n in expected], [name for name, _, _ in expected]
    assert native.ext.results_problem(*call, right) == ""
    for i, (d, n) in enumerate(right):
        other = "float32" if d != "float32" else "int32"
        for wrong in ((d, n + 1), (d, n - 1), (other, n), ("float64", n)):
            text = native.ext.results_problem(*call, right[:i] + [wrong] + right[i + 1 :])
            assert f"result {i} ({names[i]})" in text, (i, wrong, text)
    assert "writes" in native.ext.results_problem(*call, right[:-1])
    assert "writes" in native.ext.results_problem(*call, right + [right[0]])


def test_result_specs_shapes():
    """Spot values of the layouts quant_layouts.py documents (FlashInfer's shapes)."""
    m, h, spec = 5, 4096, results.result_spec
    assert results.result_specs(Pattern.kAllReduce, m, h, "float32") == (
        results.ResultSpec("allreduce_out", (m, h), "float32"),
    )
    fp4 = results.result_specs(Pattern.kARResidualRMSNormOutFP4Quant, m, h, BF16, layout=0)
    fp4 = {s.name: s for s in fp4}
    assert fp4["quant_out"] == results.ResultSpec("quant_out", (m, h // 2), "uint8")
    assert fp4["scale_out"] == results.ResultSpec("scale_out", (128, h // 16), "float8_e4m3fn")
    linear = spec(Pattern.kARResidualRMSNormFP4Quant, "scale_out", m, h, "float16", layout=2)
    assert linear.shape == (m, h // 16)
    dyn = spec(Pattern.kARResidualRMSNormDynamicFP8Quant, "scale_out", m, h, "float16")
    assert (dyn.shape, dyn.dtype) == ((m, 1), "float32")
    group = spec(
        Pattern.kARResidualRMSNormPerTokenGroupFP8PackedQuant,
        "scale_out",
        m,
        h,
        BF16,
        group_size=128,
    )
    assert (group.shape, group.strides, group.storage_shape) == ((m, 8), (1, 8), (8, 8))
    assert spec(Pattern.kARResidualRMSNormFP8Quant, "scale_out", m, h, BF16) is None


def test_dtype_codes_and_ffi_target_names_are_the_native_ones():
    ext = native.ext
    assert CODES == {"float32": ext.FLOAT32, "float16": ext.FLOAT16, "bfloat16": ext.BFLOAT16}
    assert ext.ffi_target_names() == native.FFI_TARGETS
    assert set(ext.registrations()) == set(native.FFI_TARGETS.values())
    from jax_fusedar.ops import dense as primitive, moe, timing

    assert primitive.FFI_TARGET == native.FFI_TARGETS["allreduce_fusion"]
    assert timing.TARGET == native.FFI_TARGETS["device_timestamp"]
    assert moe.FFI_TARGET == native.FFI_TARGETS["moe_allreduce_fusion"]
    assert set(ext.host_registrations()) == {primitive.FFI_TARGET, moe.FFI_TARGET}


@pytest.mark.parametrize(
    "world_size,tokens,hidden,dtype",
    [
        *itertools.product((2, 8), (1, 7, 4096), (128, 7168), (BF16, "float32")),
        # Past the Lamport cap (MAX_COMM_SIZE): the stride is capped, the two-shot buffer is not.
        (16, 8192, 16384, "float32"),
        (8, 65536, 8192, BF16),
    ],
)
def test_workspace_sizes_are_the_cores(world_size, tokens, hidden, dtype):
    mine = dataclasses.asdict(sizing.workspace_sizes(world_size, tokens, hidden, dtype))
    theirs = native.ext.workspace_sizes(world_size, tokens, hidden, CODES[dtype])
    assert mine.pop("dtype_name") == dtype  # the core's is the code, below
    for field, value in mine.items():
        assert theirs[field] == value, field
    assert theirs["dtype"] == CODES[dtype]


def test_limits_are_the_cores():
    """The world sizes the core accepts, its Lamport cap and its barrier flag count are the
    Python constants (read back through the one sizing function, fusedar_workspace_sizes)."""
    sizes = native.ext.workspace_sizes

    def accepts(n):
        try:
            sizes(n, 1, 128, CODES[BF16])
        except ValueError:
            return False
        return True

    assert tuple(n for n in range(0, 33) if accepts(n)) == limits.SUPPORTED_WORLD_SIZES
    assert sizes(16, 1 << 20, 8192, CODES["float32"])["lamport_comm_bytes"] == sizing.MAX_COMM_SIZE
    small = sizes(4, 1, 128, CODES["float16"])
    assert small["flag_bytes"] == 4 * sizing.BARRIER_FLAG_COUNT * 4
    for name, size in (("float32", 4), ("float16", 2), (BF16, 2)):
        got = sizes(2, 3, 128, CODES[name])["two_shot_buffer_bytes"]
        assert got == 2 * 3 * 128 * size == 2 * 3 * 128 * limits.element_size(name)


def test_the_handlers_quantization_parameters_are_checked():
    expected = native.ext.expected_results
    code = CODES[BF16]
    fp4 = int(Pattern.kARResidualRMSNormOutFP4Quant)
    group = int(Pattern.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant)
    for layout in (1, 3, -1):
        with pytest.raises(ValueError, match="unknown NVFP4 scale layout"):
            expected(fp4, code, 4, 1024, layout, 0)
    with pytest.raises(ValueError, match="NVFP4 needs hidden_dim divisible by 16"):
        expected(fp4, code, 4, 1032, 0, 0)
    for g in (0, -8, 48):
        with pytest.raises(ValueError, match="does not divide hidden_dim"):
            expected(group, code, 4, 1024, 0, g)
    with pytest.raises(ValueError, match="unknown fusion pattern 6"):
        expected(6, code, 4, 1024, 0, 0)


# (XLA FFI error code of a handler, Python exception of the module) per core status
# (ffi/xla/errors.h).
STATUS_RULE = {
    "INVALID_ARGUMENT": ("INVALID_ARGUMENT", ValueError),
    "UNSUPPORTED": ("UNIMPLEMENTED", ValueError),
    "CUDA_ERROR": ("INTERNAL", RuntimeError),
    "INTERNAL": ("INTERNAL", RuntimeError),
}


def test_every_status_maps_to_its_ffi_code_and_exception():
    ext = native.ext
    codes = ext.status_codes()
    assert codes["OK"] == 0 and set(codes) == {"OK", *STATUS_RULE}
    assert ext.ffi_error_code(codes["OK"]) == "OK"
    ext.raise_status(codes["OK"], "not raised")
    for name, (ffi_code, exception) in STATUS_RULE.items():
        assert ext.ffi_error_code(codes[name]) == ffi_code, name
        with pytest.raises(exception, match=f"^the {name} message$"):
            ext.raise_status(codes[name], f"the {name} message")
    # A status this build does not know is nobody's argument error.
    assert ext.ffi_error_code(99) == "UNKNOWN"
    with pytest.raises(RuntimeError, match="from the future"):
        ext.raise_status(99, "from the future")
    # Through a real core call: an unsupported world size is the core's UNSUPPORTED and an
    # unknown dtype its INVALID_ARGUMENT, both ValueError.
    with pytest.raises(ValueError, match="world size 3"):
        ext.workspace_sizes(3, 1, 128, CODES[BF16])
    with pytest.raises(ValueError):
        ext.workspace_sizes(2, 1, 128, 7)


# --- the MoE kernels' rule ------------------------------------------------------------------------
# One rule for JAX (jax_fusedar.ops.moe), torch (torch_compat.moe, its fake implementations too) and
# the native launch (fusedar_moe_shape_check, which fusedar_moe_launch runs): the Python side is
# common.moe_limits.kernel_problem. Every call one side accepts, the other accepts.
MOE_HIDDENS = (128, 256, 2880, 4096, 7168, 8192, 8448, 12288, 16384, 24576, 32768, 33024)
MOE_HIDDENS += (65536, 65792)


@pytest.mark.parametrize("world_size", limits.SUPPORTED_WORLD_SIZES)
def test_moe_kernel_rule_is_the_cores(world_size):
    checked = 0
    for ws_dtype, dtype, hidden, tokens in itertools.product(
        DTYPES, DTYPES, MOE_HIDDENS, (1, 3, 64, 1024, 65536)
    ):
        sizes = sizing.workspace_sizes(world_size, 1024, 7168, ws_dtype)
        ours = moe_limits.kernel_problem(tokens, hidden, dtype, sizes)
        for pattern in patterns.MOE_PATTERNS:
            workspace = (world_size, 1024, 7168, CODES[ws_dtype])
            theirs = native.ext.moe_shape_problem(
                *workspace, int(pattern), CODES[dtype], tokens, hidden
            )
            why = (pattern, ws_dtype, dtype, hidden, tokens, ours, theirs)
            assert (ours is None) == (theirs is None), why
            checked += 1
    assert checked == 2 * 9 * len(MOE_HIDDENS) * 5


def test_moe_kernel_rule_refuses_what_flashinfers_launcher_cannot_place():
    """hidden 8448 = 33 warps: no cluster of 2, 4 or 8 divides them, so one CTA would need
    1056 threads (FlashInfer's launcher refuses above 1024); 8192 = 32 warps fits."""
    sizes = sizing.workspace_sizes(2, 16, 8448, BF16)
    kind, why = moe_limits.kernel_problem(4, 8448, BF16, sizes)
    assert kind == "unsupported shape" and "1056 threads per block" in why
    assert moe_limits.kernel_problem(4, 8192, BF16, sizes) is None
    code = CODES[BF16]
    assert "1056 threads per block" in native.ext.moe_shape_problem(
        2, 16, 8448, code, 7, code, 4, 8448
    )
