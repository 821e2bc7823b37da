"""``torch.compile`` of the custom ops with a dynamic token count (``mark_dynamic``, as vLLM
compiles) and with ``dynamic=True``, on CPU: the fake implementations keep sizes symbolic
and fix only what decides the outputs' structure (the pattern, the NVFP4 layout), with a
guard. The graphs run tests/torch/test_library.py's world-size-1 CPU stand-ins."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tests.torch.fakes import AR, FUSED, QUANT
from tests.torch.test_library import EPS, QUANT_CASES, _expected_quant_meta, _inputs, _meta
from tests.torch.test_library import _quant_args, _same

# Fixtures of test_library.py, used here by name: pytest finds them through this import.
from tests.torch.test_library import cpu_kernels, cpu_quant_kernel  # noqa: F401

# Also in the oldest-versions lane (./dev oldest), with torch_compat's other CPU paths.
pytestmark = [pytest.mark.oldest, pytest.mark.usefixtures("fresh_dynamo")]


def _dynamic_tokens(*tensors):
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("pattern, extra", QUANT_CASES)
def test_dynamic_token_count(cpu_quant_kernel, handle, backend, pattern, extra):
    """One graph serves 8, 12 and 20 tokens (the NVFP4 and per-token-group scale buffers'
    sizes stay formulas of the token count), each equal to the eager op's. Used to raise
    ConstraintViolationError for patterns 3, 5, 8 and 9."""
    counter = CompileCounterWithBackend(backend)
    base = _quant_args(pattern, extra, handle=handle)

    def f(x, res, g, sf):
        return QUANT(x, res, g, *base[3:6], sf, *base[7:])

    compiled = torch.compile(f, fullgraph=True, backend=counter)
    for m in (8, 12, 20):
        x, res, g, *_ = _quant_args(pattern, extra, m=m, handle=handle)
        _dynamic_tokens(x, res)
        got = compiled(x, res, g, base[6])
        assert _meta(got) == _expected_quant_meta(pattern, extra, m=m)
        for a, b in zip(got, f(x, res, g, base[6])):
            _same(a, b)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dynamic_token_count_plain_ops(cpu_kernels, handle, backend):
    counter = CompileCounterWithBackend(backend)

    def f(x, res, g):
        a = AR(x, None, False, handle)
        return FUSED(a, res, g, EPS, 0.0, None, False, handle)

    compiled = torch.compile(f, fullgraph=True, backend=counter)
    for m in (8, 12):
        x, res, g = _inputs(m=m)
        _dynamic_tokens(x, res)
        for a, b in zip(compiled(x, res, g), f(x, res, g)):
            _same(a, b)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dynamic_true_with_pattern_and_group_size_as_arguments(cpu_quant_kernel, handle, backend):
    """dynamic=True traces ints as SymInts: a guard fixes the pattern (and layout), so another
    pattern compiles again rather than reuse a graph of the wrong outputs; the group size
    stays symbolic. Used to fail with "unknown fusion pattern ... not a SymInt"."""
    counter = CompileCounterWithBackend(backend)

    def f(x, res, g, pattern, group):
        return QUANT(x, res, g, EPS, 0.0, pattern, None, group, None, None, False, handle)

    compiled = torch.compile(f, fullgraph=True, backend=counter, dynamic=True)
    cases = [(9, 128, 8), (9, 128, 12), (9, 64, 12), (8, 64, 16), (11, None, 8)]
    compiles = []
    for pattern, group, m in cases:
        x, res, g = _inputs(m=m)
        got = compiled(x, res, g, pattern, group)
        assert _meta(got) == _expected_quant_meta(pattern, group, m=m)
        for a, b in zip(got, f(x, res, g, pattern, group)):
            _same(a, b)
        compiles.append(counter.frame_count)
    # Another token count or group size reuses the graph; another pattern compiles again
    # (aot_eager's first call compiles twice: AOT's guard on the pattern restarts it).
    assert compiles[0] == compiles[1] == compiles[2] < compiles[3] < compiles[4]


def test_symbolic_tokens_still_refuse_what_is_concrete(handle):
    """A concrete bad group size is refused while tracing even with a dynamic token count."""
    x, res, g = _inputs(m=8)
    _dynamic_tokens(x, res)

    def f(x, res, g):
        return QUANT(x, res, g, EPS, 0.0, 9, None, 4, None, None, False, handle)

    with pytest.raises(Exception, match="block_quant_group_size must be a power of two"):
        torch.compile(f, fullgraph=True, backend="eager")(x, res, g)
