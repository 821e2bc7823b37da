"""tools/wheel_contents.py, the wheel check's rule that a wheel holds the product only: the
two packages and the wheel's metadata pass; the checkout's benchmarks, tools and tests, or a
benchmark module inside a package, are named."""

from tools import wheel_contents

PRODUCT = [
    "jax_fusedar/__init__.py",
    "jax_fusedar/common/plan.py",
    "jax_fusedar/_fusedar.cpython-311-x86_64-linux-gnu.so",
    "jax_fusedar/libfusedar_core.so",
    "torch_compat/ops.py",
    "jax_fusedar-0.1.0.dist-info/METADATA",
    "jax_fusedar.libs/libcudart-1234.so.13",
]


def test_the_product_alone_passes_and_the_checkouts_code_is_named():
    assert wheel_contents.problems(PRODUCT) == []
    checkout = ["benchmarks/jax_bench.py", "tools/flashinfer_anchor.py", "torch_compat/bench.py"]
    found = wheel_contents.problems(
        PRODUCT + checkout + ["jax_fusedar/cli/bench.py", "tests/conftest.py"]
    )
    for folder in ("benchmarks", "tools", "tests"):
        assert f"{folder}/ (not a package of the product)" in found
    for module in ("torch_compat/bench.py", "jax_fusedar/cli/bench.py", "benchmarks/jax_bench.py"):
        assert f"{module} (the checkout's code)" in found
