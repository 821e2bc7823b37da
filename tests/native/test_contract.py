"""The contract between the Python layers and the native module: the pattern table, the
result lists, the workspace sizes, the limits and the FFI target names the Python side
uses must equal what the native module (fusedar/patterns.h, fusedar_workspace_sizes,
ffi/xla/handlers.h) reports. Runs on CPU: nothing here touches a GPU."""
import itertools

import pytest

from jax_fusedar.common import limits, native, patterns, results, sizing
from jax_fusedar.common.patterns import TRAITS, AllReduceFusionPattern
from tests.skips import needs_native

pytestmark = needs_native

TRAIT_FIELDS = ("has_allreduce_out", "has_residual", "has_norm_out", "quant",
                "uses_scale_factor", "writes_scale_out", "needs_sm100")


def _python_traits(traits):
    return {field: getattr(traits, field) for field in TRAIT_FIELDS}


def test_pattern_tables_are_equal():
    table = native.ext.pattern_table()
    assert sorted(table) == sorted(int(p) for p in TRAITS)
    for pattern, traits in TRAITS.items():
        row = table[int(pattern)]
        assert row["code"] == int(pattern)
        assert {f: row[f] for f in TRAIT_FIELDS} == _python_traits(traits), pattern.name
        assert row["compiled"] is True and native.ext.pattern_compiled(int(pattern))


# The codes of the dense kernel's table; the MoE codes (6, 7) have their own launcher and
# handler (tests/jax/test_moe.py, tests/torch/test_moe.py).
DENSE_PATTERNS = [p for p in AllReduceFusionPattern if p not in patterns.MOE_PATTERNS]


def test_codes_outside_the_table_are_not_compiled():
    served = {int(p) for p in TRAITS}
    moe = {int(p) for p in patterns.MOE_PATTERNS}
    for code in range(-1, 20):
        if code not in served:
            # The dense kernel compiles only the table's codes; the MoE codes are valid
            # patterns served by their own launcher (fusedar_moe_launch), not by this one.
            assert not native.ext.pattern_compiled(code), code
            if code in moe:
                assert int(patterns.as_pattern(code)) == code
            else:
                with pytest.raises(ValueError, match="unknown fusion pattern"):
                    patterns.as_pattern(code)


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
    assert operands == row["operands"]


def test_result_specs_shapes():
    """Spot values of the layouts quant_layouts.py documents (FlashInfer's shapes)."""
    P = AllReduceFusionPattern
    m, h = 5, 4096
    assert results.result_specs(P.kAllReduce, m, h, "float32") == (
        results.ResultSpec("allreduce_out", (m, h), "float32"),)
    fp4 = {s.name: s for s in results.result_specs(P.kARResidualRMSNormOutFP4Quant, m, h,
                                                   "bfloat16", layout=0)}
    assert fp4["quant_out"] == results.ResultSpec("quant_out", (m, h // 2), "uint8")
    assert fp4["scale_out"] == results.ResultSpec("scale_out", (128, h // 16), "float8_e4m3fn")
    linear = results.result_spec(P.kARResidualRMSNormFP4Quant, "scale_out", m, h, "float16",
                                 layout=2)
    assert linear.shape == (m, h // 16)
    dyn = results.result_spec(P.kARResidualRMSNormDynamicFP8Quant, "scale_out", m, h, "float16")
    assert (dyn.shape, dyn.dtype) == ((m, 1), "float32")
    group = results.result_spec(P.kARResidualRMSNormPerTokenGroupFP8PackedQuant, "scale_out",
                                m, h, "bfloat16", group_size=128)
    assert (group.shape, group.strides, group.storage_shape) == ((m, 8), (1, 8), (8, 8))
    assert results.result_spec(P.kARResidualRMSNormFP8Quant, "scale_out", m, h,
                               "bfloat16") is None


def test_dtype_codes_are_the_native_ones():
    assert native.DTYPE_CODES == {"float32": native.ext.FLOAT32,
                                  "float16": native.ext.FLOAT16,
                                  "bfloat16": native.ext.BFLOAT16}


@pytest.mark.parametrize("world_size,tokens,hidden,dtype", [
    *itertools.product((2, 8), (1, 7, 4096), (128, 7168), ("bfloat16", "float32")),
    # Past the Lamport cap (MAX_COMM_SIZE): the stride is capped, the two-shot buffer is not.
    (16, 8192, 16384, "float32"), (8, 65536, 8192, "bfloat16"),
])
def test_workspace_sizes_are_the_cores(world_size, tokens, hidden, dtype):
    mine = sizing.workspace_sizes(world_size, tokens, hidden, dtype)
    theirs = native.ext.workspace_sizes(world_size, tokens, hidden, native.DTYPE_CODES[dtype])
    for field in ("world_size", "max_token_num", "hidden_dim", "two_shot_buffer_bytes",
                  "flag_bytes", "lamport_comm_bytes", "lamport_buffer_bytes"):
        assert getattr(mine, field) == theirs[field], field
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
        assert info["two_shot_buffer_bytes"] == 2 * 3 * 128 * size == \
            2 * 3 * 128 * limits.element_size(name)


def test_ffi_target_names_are_the_handlers():
    assert native.ext.ffi_target_names() == native.FFI_TARGETS
    assert set(native.ext.registrations()) == set(native.FFI_TARGETS.values())
    from jax_fusedar import moe, primitive, timing
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
        "NVFP4 patterns (3, 5) need an sm100+ GPU (Blackwell); cuda:1 is sm90")
