"""The contract between the Python layers and the native module: the pattern table, the
result lists, the workspace sizes, the limits and the FFI target names the Python side
uses must equal what the native module (fusedar/patterns.h, fusedar_workspace_sizes,
ffi/xla/handlers.h) reports. Runs on CPU: nothing here touches a GPU."""

import dataclasses
import itertools

import numpy as np
import pytest

from jax_fusedar.common import limits, native, patterns, results, sizing
from jax_fusedar.common.patterns import TRAITS, AllReduceFusionPattern
from tests.skips import needs_native

pytestmark = needs_native

TRAIT_FIELDS = (
    "family has_allreduce_out has_residual has_norm_out quant uses_scale_factor "
    "writes_scale_out needs_sm100"
).split()
DENSE_PATTERNS = patterns.DENSE_PATTERNS


def test_pattern_tables_are_equal():
    # Every pattern, the dense kernel's and the MoE epilogues', with the family serving it.
    table = native.ext.pattern_table()
    assert sorted(table) == sorted(int(p) for p in TRAITS) == sorted(AllReduceFusionPattern)
    for pattern, traits in TRAITS.items():
        row = table[int(pattern)]
        assert row["code"] == int(pattern)
        python = {f: getattr(traits, f) for f in TRAIT_FIELDS}
        assert {f: row[f] for f in TRAIT_FIELDS} == python, pattern.name
        # The dense kernel compiles its family's codes; the MoE codes have their own
        # launcher (fusedar_moe_launch) and handler.
        dense = traits.family == "dense"
        assert row["compiled"] is dense and bool(native.ext.pattern_compiled(int(pattern))) is dense


def test_codes_outside_the_table_are_not_patterns():
    for code in range(-1, 20):
        if code not in TRAITS:
            assert not native.ext.pattern_compiled(code), code
            with pytest.raises(ValueError, match="unknown fusion pattern"):
                patterns.as_pattern(code)


@pytest.mark.parametrize("pattern", patterns.MOE_PATTERNS)
def test_moe_operands_and_results_match_the_handlers_counts(pattern):
    """The MoE handler's counts come from the table: the operands every call has, then the
    finalize's optional ones; the results, then the reduction's optional allreduce_out."""
    row = native.ext.pattern_table()[int(pattern)]
    assert len(patterns.operand_names(pattern)) == row["operands"]
    assert len(results.result_specs(pattern, 5, 1024, "bfloat16")) == row["results"]
    if TRAITS[pattern].family == "moe_finalize":
        full = patterns.operand_names(pattern, expert_scale_factor=True, shared_expert_output=True)
        assert full[row["operands"] :] == patterns.OPTIONAL_OPERANDS
    else:
        specs = results.result_specs(pattern, 5, 1024, "bfloat16", allreduce_out=True)
        assert [s.name for s in specs[row["results"] :]] == ["allreduce_out"]


@pytest.mark.parametrize("pattern", patterns.MOE_PATTERNS)
def test_the_dense_handlers_rules_refuse_the_moe_codes(pattern):
    # In the table, the MoE rows are no dense rows: the dense handler's result rule (and its
    # launch, fusedar/patterns.h's find_dense_pattern) refuses them.
    with pytest.raises(ValueError, match="unknown fusion pattern"):
        native.ext.expected_results(int(pattern), native.ext.BFLOAT16, 5, 1024)


@pytest.mark.parametrize("pattern", DENSE_PATTERNS)
def test_result_specs_match_the_handlers_counts(pattern):
    """result_specs gives what the XLA handler checks: its operand and result counts."""
    row = native.ext.pattern_table()[int(pattern)]
    traits = TRAITS[pattern]
    specs = results.result_specs(pattern, 5, 1024, "bfloat16", group_size=128)
    assert len(specs) == row["results"]
    names = [s.name for s in specs]
    first = "allreduce_out" if row["has_allreduce_out"] else "residual_out"
    assert names[0] == first
    assert ("norm_out" in names) == row["has_norm_out"]
    assert ("quant_out" in names) == (row["quant"] is not None)
    assert ("scale_out" in names) == row["writes_scale_out"]
    # x, [residual_in, rms_gamma], [scale_factor]
    operands = 1 + 2 * traits.has_residual + traits.uses_scale_factor
    assert operands == row["operands"] == len(patterns.operand_names(pattern))


def test_result_specs_shapes():
    """Spot values of the layouts quant_layouts.py documents (FlashInfer's shapes)."""
    P = AllReduceFusionPattern
    m, h = 5, 4096
    assert results.result_specs(P.kAllReduce, m, h, "float32") == (
        results.ResultSpec("allreduce_out", (m, h), "float32"),
    )
    fp4 = {
        s.name: s
        for s in results.result_specs(P.kARResidualRMSNormOutFP4Quant, m, h, "bfloat16", layout=0)
    }
    assert fp4["quant_out"] == results.ResultSpec("quant_out", (m, h // 2), "uint8")
    assert fp4["scale_out"] == results.ResultSpec("scale_out", (128, h // 16), "float8_e4m3fn")
    linear = results.result_spec(
        P.kARResidualRMSNormFP4Quant, "scale_out", m, h, "float16", layout=2
    )
    assert linear.shape == (m, h // 16)
    dyn = results.result_spec(P.kARResidualRMSNormDynamicFP8Quant, "scale_out", m, h, "float16")
    assert (dyn.shape, dyn.dtype) == ((m, 1), "float32")
    group = results.result_spec(
        P.kARResidualRMSNormPerTokenGroupFP8PackedQuant,
        "scale_out",
        m,
        h,
        "bfloat16",
        group_size=128,
    )
    assert (group.shape, group.strides, group.storage_shape) == ((m, 8), (1, 8), (8, 8))
    assert results.result_spec(P.kARResidualRMSNormFP8Quant, "scale_out", m, h, "bfloat16") is None


def test_dtype_codes_are_the_native_ones():
    assert native.DTYPE_CODES == {
        "float32": native.ext.FLOAT32,
        "float16": native.ext.FLOAT16,
        "bfloat16": native.ext.BFLOAT16,
    }


@pytest.mark.parametrize(
    "world_size,tokens,hidden,dtype",
    [
        *itertools.product((2, 8), (1, 7, 4096), (128, 7168), ("bfloat16", "float32")),
        # Past the Lamport cap (MAX_COMM_SIZE): the stride is capped, the two-shot buffer is not.
        (16, 8192, 16384, "float32"),
        (8, 65536, 8192, "bfloat16"),
    ],
)
def test_workspace_sizes_are_the_cores(world_size, tokens, hidden, dtype):
    mine = dataclasses.asdict(sizing.workspace_sizes(world_size, tokens, hidden, dtype))
    theirs = native.ext.workspace_sizes(world_size, tokens, hidden, native.DTYPE_CODES[dtype])
    assert mine.pop("dtype_name") == dtype  # the core's is the code, below
    for field, value in mine.items():
        assert theirs[field] == value, field
    assert theirs["dtype"] == native.DTYPE_CODES[dtype]


def test_limits_are_the_cores():
    """The world sizes the core accepts, its Lamport cap and its barrier flag count are the
    Python constants (read back through the one sizing function, fusedar_workspace_sizes)."""
    accepted = []
    for n in range(0, 33):
        try:
            native.ext.workspace_sizes(n, 1, 128, native.DTYPE_CODES["bfloat16"])
            accepted.append(n)
        except ValueError:
            pass
    assert tuple(accepted) == limits.SUPPORTED_WORLD_SIZES
    big = native.ext.workspace_sizes(16, 1 << 20, 8192, native.DTYPE_CODES["float32"])
    assert big["lamport_comm_bytes"] == sizing.MAX_COMM_SIZE
    small = native.ext.workspace_sizes(4, 1, 128, native.DTYPE_CODES["float16"])
    assert small["flag_bytes"] == 4 * sizing.BARRIER_FLAG_COUNT * 4
    for name, size in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
        info = native.ext.workspace_sizes(2, 3, 128, native.DTYPE_CODES[name])
        assert (
            info["two_shot_buffer_bytes"]
            == 2 * 3 * 128 * size
            == 2 * 3 * 128 * limits.element_size(name)
        )


def test_ffi_target_names_are_the_handlers():
    assert native.ext.ffi_target_names() == native.FFI_TARGETS
    assert set(native.ext.registrations()) == set(native.FFI_TARGETS.values())
    from jax_fusedar.ops import dense as primitive, moe, timing

    assert primitive.FFI_TARGET == native.FFI_TARGETS["allreduce_fusion"]
    assert timing.TARGET == native.FFI_TARGETS["device_timestamp"]
    assert moe.FFI_TARGET == native.FFI_TARGETS["moe_allreduce_fusion"]
    assert set(native.ext.host_registrations()) == {primitive.FFI_TARGET, moe.FFI_TARGET}


def test_sm100_refusal_is_one_rule():
    """Python refuses exactly the patterns the native table marks as needing sm100+, with
    the message the native launch uses."""
    table = native.ext.pattern_table()
    for pattern in DENSE_PATTERNS:
        problem = patterns.device_problem(pattern, "cuda:0", 9, 0)
        assert (problem is not None) == table[int(pattern)]["needs_sm100"]
        assert patterns.device_problem(pattern, "cuda:0", 10, 0) is None
    assert patterns.device_problem(3, "cuda:1", 9, 0) == (
        "NVFP4 patterns (3, 5) need an sm100+ GPU (Blackwell); cuda:1 is sm90"
    )


# --- the XLA handler's result rule (ffi/xla/result_check.h) --------------------------------------


def _quant_params(pattern):
    """(layout, group size) variations that matter to ``pattern``."""
    quant = TRAITS[pattern].quant
    if quant == "fp4":
        return [(0, 0), (2, 0)]
    if quant == "group_fp8":
        return [(0, 16), (0, 128)]
    return [(0, 0)]


@pytest.mark.parametrize("pattern", DENSE_PATTERNS)
def test_the_handlers_result_list_is_result_specs(pattern):
    """What the handler checks each result against (element type and count of its dense
    storage) is results.result_specs, the list the JAX primitive builds."""
    for tokens, hidden, dtype in itertools.product(
        (1, 5, 130), (256, 1024), ("bfloat16", "float16", "float32")
    ):
        if TRAITS[pattern].quant == "fp4" and dtype == "float32":
            continue
        for layout, group in _quant_params(pattern):
            specs = results.result_specs(pattern, tokens, hidden, dtype, layout, group or None)
            want = [(s.name, s.dtype, int(np.prod(s.storage_shape))) for s in specs]
            got = native.ext.expected_results(
                int(pattern), native.DTYPE_CODES[dtype], tokens, hidden, layout, group
            )
            assert [tuple(r) for r in got] == want, (pattern, tokens, hidden, dtype, layout)


@pytest.mark.parametrize("pattern", DENSE_PATTERNS)
def test_the_handler_checks_every_result(pattern):
    """Each result, not only the first: a wrong count or element type in any position is
    reported naming that result; the right list is accepted."""
    tokens, hidden, dtype = 5, 1024, "bfloat16"
    layout, group = _quant_params(pattern)[-1]
    code = native.DTYPE_CODES[dtype]
    expected = native.ext.expected_results(int(pattern), code, tokens, hidden, layout, group)
    right = [(d, n) for _, d, n in expected]
    names = [name for name, _, _ in expected]

    def problem(given):
        return native.ext.results_problem(int(pattern), code, tokens, hidden, layout, group, given)

    assert problem(right) == ""
    for i, (d, n) in enumerate(right):
        for wrong in (
            (d, n + 1),
            (d, n - 1),
            ("float32" if d != "float32" else "int32", n),
            ("float64", n),
        ):
            text = problem(right[:i] + [wrong] + right[i + 1 :])
            assert f"result {i} ({names[i]})" in text, (i, wrong, text)
    assert "writes" in problem(right[:-1])
    assert "writes" in problem(right + [right[0]])


def test_the_handlers_quantization_parameters_are_checked():
    P = AllReduceFusionPattern
    code = native.DTYPE_CODES["bfloat16"]
    fp4 = int(P.kARResidualRMSNormOutFP4Quant)
    group = int(P.kARResidualRMSNormOutPerTokenGroupFP8PackedQuant)
    for layout in (1, 3, -1):
        with pytest.raises(ValueError, match="unknown NVFP4 scale layout"):
            native.ext.expected_results(fp4, code, 4, 1024, layout, 0)
    with pytest.raises(ValueError, match="NVFP4 needs hidden_dim divisible by 16"):
        native.ext.expected_results(fp4, code, 4, 1032, 0, 0)
    for g in (0, -8, 48):
        with pytest.raises(ValueError, match="does not divide hidden_dim"):
            native.ext.expected_results(group, code, 4, 1024, 0, g)
    with pytest.raises(ValueError, match="unknown fusion pattern 6"):
        native.ext.expected_results(6, code, 4, 1024, 0, 0)


# --- error statuses (ffi/xla/errors.h) -----------------------------------------------------------

# (XLA FFI error code of a handler, Python exception of the module) per core status.
STATUS_RULE = {
    "INVALID_ARGUMENT": ("INVALID_ARGUMENT", ValueError),
    "UNSUPPORTED": ("UNIMPLEMENTED", ValueError),
    "CUDA_ERROR": ("INTERNAL", RuntimeError),
    "INTERNAL": ("INTERNAL", RuntimeError),
}


def test_every_status_maps_to_its_ffi_code_and_exception():
    codes = native.ext.status_codes()
    assert codes["OK"] == 0 and set(codes) == {"OK", *STATUS_RULE}
    assert native.ext.ffi_error_code(codes["OK"]) == "OK"
    native.ext.raise_status(codes["OK"], "not raised")
    for name, (ffi_code, exception) in STATUS_RULE.items():
        assert native.ext.ffi_error_code(codes[name]) == ffi_code, name
        with pytest.raises(exception, match=f"^the {name} message$"):
            native.ext.raise_status(codes[name], f"the {name} message")
    # A status this build does not know is nobody's argument error.
    assert native.ext.ffi_error_code(99) == "UNKNOWN"
    with pytest.raises(RuntimeError, match="from the future"):
        native.ext.raise_status(99, "from the future")


def test_a_core_status_reaches_python_as_its_exception():
    """Through a real core call: an unsupported world size is the core's UNSUPPORTED and an
    unknown dtype its INVALID_ARGUMENT, both ValueError."""
    with pytest.raises(ValueError, match="world size 3"):
        native.ext.workspace_sizes(3, 1, 128, native.DTYPE_CODES["bfloat16"])
    with pytest.raises(ValueError):
        native.ext.workspace_sizes(2, 1, 128, 7)


# --- the MoE kernels' rule ------------------------------------------------------------------------
# One rule for JAX (jax_fusedar.ops.moe), torch (torch_compat.moe, its fake implementations too) and
# the native launch (fusedar_moe_shape_check, which fusedar_moe_launch runs): the Python side is
# common.moe_limits.kernel_problem. Every call one side accepts, the other accepts.

MOE_HIDDENS = (128, 256, 2880, 4096, 7168, 8192, 8448, 12288, 16384, 24576, 32768, 33024)
MOE_HIDDENS += (65536, 65792)


@pytest.mark.parametrize("world_size", limits.SUPPORTED_WORLD_SIZES)
def test_moe_kernel_rule_is_the_cores(world_size):
    from jax_fusedar.common import moe_limits

    checked = 0
    codes = native.DTYPE_CODES
    for ws_dtype, dtype, hidden, tokens in itertools.product(
        ("bfloat16", "float16", "float32"),
        ("bfloat16", "float16", "float32"),
        MOE_HIDDENS,
        (1, 3, 64, 1024, 65536),
    ):
        ws_hidden = 7168
        sizes = sizing.workspace_sizes(world_size, 1024, ws_hidden, ws_dtype)
        ours = moe_limits.kernel_problem(tokens, hidden, dtype, sizes)
        for pattern in patterns.MOE_PATTERNS:
            workspace = (world_size, 1024, ws_hidden, codes[ws_dtype])
            call = (int(pattern), codes[dtype], tokens, hidden)
            theirs = native.ext.moe_shape_problem(*workspace, *call)
            why = (pattern, ws_dtype, dtype, hidden, tokens, ours, theirs)
            assert (ours is None) == (theirs is None), why
            checked += 1
    assert checked == 2 * 9 * len(MOE_HIDDENS) * 5


def test_moe_kernel_rule_refuses_what_flashinfers_launcher_cannot_place():
    """hidden 8448 = 33 warps: no cluster of 2, 4 or 8 divides them, so one CTA would need
    1056 threads (FlashInfer's launcher refuses above 1024); 8192 = 32 warps fits."""
    from jax_fusedar.common import moe_limits

    sizes = sizing.workspace_sizes(2, 16, 8448, "bfloat16")
    kind, why = moe_limits.kernel_problem(4, 8448, "bfloat16", sizes)
    assert kind == "unsupported shape" and "1056 threads per block" in why
    assert moe_limits.kernel_problem(4, 8192, "bfloat16", sizes) is None
    assert "1056 threads per block" in native.ext.moe_shape_problem(
        2, 16, 8448, native.DTYPE_CODES["bfloat16"], 7, native.DTYPE_CODES["bfloat16"], 4, 8448
    )
