"""Install: JAX is an extra (the package imports without it and says how to get it), the
FlashInfer header fetch (only headers unpacked; offline it says what to do), and ./dev's
package lists and build plan. The wheel itself is checked by tools/wheel_check.sh in CI."""

import os
import subprocess
import sys
import tomllib
import zipfile

import pytest

from tests.repo import REPO as ROOT, run_code

FETCH = ROOT / "tools" / "fetch_flashinfer_headers.py"


def run(cmd, timeout=60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def getattr_errors(setup: str, names=("allreduce_fusion",)) -> list:
    """Lines of a fresh process that runs ``setup``, imports jax_fusedar and gets ``names``
    from it: "imported NAME" or "ERROR_TYPE NAME MESSAGE" each."""
    result = run_code(
        f"{setup}\nimport jax_fusedar as jf\n"
        f"for name in {tuple(names)}:\n"
        "    try:\n        getattr(jf, name)\n"
        "    except ImportError as e:\n        print(type(e).__name__, name, e)\n"
        "    else:\n        print('imported', name)\n"
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_package_imports_without_jax_and_names_the_extra():
    public = ("allreduce_fusion", "create_allreduce_fusion_workspace", "fuse")
    # None in sys.modules makes `import jax` raise ModuleNotFoundError, as if not installed.
    setup = "import sys\nsys.modules['jax'] = None\nimport jax_fusedar as jf\n"
    lines = getattr_errors(
        setup + "print(jf.AllReduceFusionPattern.kARResidualRMSNorm.name)", public
    )
    assert lines[0].endswith("kARResidualRMSNorm"), lines
    for line, name in zip(lines[1:], public):
        assert line.startswith(f"ImportError {name} "), lines
        assert "pip install 'jax_fusedar[jax]'" in line


def test_too_old_a_jax_is_named_with_the_version_needed():
    # An installed jax older than the minimum (metadata says 0.7.2; nothing is imported).
    import jax_fusedar

    lines = getattr_errors(
        "import importlib.metadata as m\nreal = m.version\n"
        "m.version = lambda name: '0.7.2' if name == 'jax' else real(name)"
    )
    assert lines == [
        f"ImportError allreduce_fusion jax_fusedar's JAX API needs JAX >= {jax_fusedar.MIN_JAX}, "
        f"found jax 0.7.2: pip install -U 'jax>={jax_fusedar.MIN_JAX}'"
    ], lines


def test_other_import_errors_are_not_blamed_on_jax():
    [line] = getattr_errors("import sys\nsys.modules['jax_fusedar.api'] = None")
    assert line.startswith("ModuleNotFoundError"), line
    assert "jax_fusedar[jax]" not in line


def test_the_jax_minimum_is_pyprojects():
    import jax_fusedar

    meta = pyproject()
    assert f"jax>={jax_fusedar.MIN_JAX}" in meta["project"]["optional-dependencies"]["jax"]
    assert f"jaxlib>={jax_fusedar.MIN_JAX}" in meta["build-system"]["requires"]


def test_fetch_unpacks_only_the_headers(tmp_path):
    wheel = tmp_path / "flashinfer_python-test-py3-none-any.whl"
    headers = {
        "flashinfer/comm/trtllm_allreduce_fusion.cuh": "// kernel\n",
        "flashinfer/utils.cuh": "// utils\n",
    }
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in headers.items():
            zf.writestr(f"flashinfer/data/include/{name}", text)
        zf.writestr("flashinfer/jit/core.py", "import torch\n")  # not a header: stays out
        zf.writestr("flashinfer/data/csrc/x.cu", "// source\n")
    dest = tmp_path / "dest"
    cmd = [sys.executable, str(FETCH), "--wheel", str(wheel), "--dest", str(dest)]
    first = run(cmd)
    assert first.returncode == 0, first.stderr
    unpacked = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert unpacked == sorted(["VERSION", *(f"include/{n}" for n in headers)])
    for name, text in headers.items():
        assert (dest / "include" / name).read_text() == text
    # The VERSION marker makes a second run (every re-configure) a no-op.
    (dest / "include" / "flashinfer" / "utils.cuh").write_text("// edited\n")
    second = run(cmd)
    assert second.returncode == 0 and "already in" in second.stdout
    assert (dest / "include" / "flashinfer" / "utils.cuh").read_text() == "// edited\n"


def test_fetch_offline_says_what_to_do(tmp_path):
    # An index on a closed loopback port and no pip configuration: pip fails at once.
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_RETRIES="0")
    env.update(PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_TIMEOUT="2")
    env.pop("PIP_FIND_LINKS", None)
    result = run([sys.executable, str(FETCH), "--dest", str(tmp_path / "dest")], 120, env=env)
    assert result.returncode != 0
    assert "could not download flashinfer-python==" in result.stderr
    assert "--wheel" in result.stderr and "FLASHINFER_INCLUDE_DIR" in result.stderr
    assert not (tmp_path / "dest" / "VERSION").exists()


def dev_requirements(*extras: str) -> set:
    """The requirements ./dev requirements lists for ``extras``."""
    result = run([str(ROOT / "dev"), "requirements", *extras], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def names(requirements):
    return {r.split(">")[0].split("=")[0].split("[")[0] for r in requirements}


def test_dev_demo_installs_the_jax_side_only():
    demo = names(dev_requirements("jax"))
    assert {"jax", "numpy"} <= demo
    assert not demo & {"torch", "transformers", "pytest", "matplotlib"}, demo
    # The build's own requirements only where it builds the native libraries.
    assert not demo & {"nanobind", "scikit-build-core", "cmake", "ninja"}, demo
    built = names(dev_requirements("--build", "jax"))
    assert {"jax", "jaxlib", "numpy", "nanobind", "scikit-build-core", "cmake", "ninja"} <= built


def test_dev_test_installs_every_extra():
    extras = "jax torch transformers pytest pytest-xdist flatbuffers matplotlib tqdm flax equinox"
    assert set(extras.split()) <= names(dev_requirements())


def test_dev_oldest_pins_the_minimums_pyproject_declares():
    extras = pyproject()["project"]["optional-dependencies"]
    minimum = dict(req.split(">=") for req in extras["jax"] + extras["torch"])
    pins = dict(r.split("==") for r in dev_requirements("--oldest", "jax", "torch") if "==" in r)
    assert pins == {"jax": minimum["jax"], "jaxlib": minimum["jax"], "torch": minimum["torch"]}


def test_dev_rejects_an_unknown_extra():
    result = run([str(ROOT / "dev"), "requirements", "nope"], cwd=ROOT)
    assert result.returncode != 0 and "no extra 'nope'" in result.stderr


def build_plan(tmp_path, gpus=None, check=True, **env_vars):
    """./dev build-plan's line, with nvidia-smi reporting these compute capabilities (a
    stand-in on PATH) or absent, and these environment variables; the process with check
    False."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = "/usr/bin:/bin"
    if gpus is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + "".join(f"echo '{cap}'\n" for cap in gpus))
        smi.chmod(0o755)
        path = f"{bin_dir}:{path}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_FUSEDAR_") and k != "PATH"}
    # A checkout without an earlier native build: ./dev decides from the GPUs alone.
    work = tmp_path / "checkout"
    if not work.exists():
        (work / "ffi" / "cmake").mkdir(parents=True)
        for name in ("dev", "pyproject.toml", "ffi/cmake/build_plan.py"):
            (work / name).write_bytes((ROOT / name).read_bytes())
        (work / "dev").chmod(0o755)
    result = run([str(work / "dev"), "build-plan"], env={**env, "PATH": path, **env_vars})
    if not check:
        return result
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


ARCHS = "archs_arg=-DJAX_FUSEDAR_CUDA_ARCHS="


@pytest.mark.parametrize(
    "gpus, env, want",
    [
        (None, {}, "^build=0 "),  # without a GPU, the kernels are skipped
        ([], {}, "^build=0 "),
        (["9.0"], {}, " test_workers=0$"),  # GPU tests one at a time
        (None, {"JAX_FUSEDAR_TEST_WORKERS": "3"}, " test_workers=3$"),
        # For the visible GPUs only, unless told otherwise.
        (["9.0", "9.0"], {}, f"^build=1 {ARCHS}90a "),
        (["9.0", "10.0"], {}, f"{ARCHS}90a;100a "),
        (["9.0"], {"JAX_FUSEDAR_CUDA_ARCHS": "100a"}, f"{ARCHS}100a "),
        # Asked for (CI: no GPU), every default architecture or JAX_FUSEDAR_CUDA_ARCHS.
        (None, {"JAX_FUSEDAR_BUILD_KERNELS": "1"}, f"^build=1 {ARCHS}90a;100a "),
        (
            None,
            {"JAX_FUSEDAR_BUILD_KERNELS": "1", "JAX_FUSEDAR_CUDA_ARCHS": "100a"},
            f"^build=1 {ARCHS}100a ",
        ),
        (["9.0"], {"JAX_FUSEDAR_BUILD_KERNELS": "off"}, "^build=0 "),
    ],
    ids=[
        "no_gpu",
        "no_gpu_listed",
        "gpu_tests_alone",
        "workers_asked",
        "visible_gpus",
        "two_archs",
        "archs_asked",
        "kernels_asked",
        "kernels_asked_one_arch",
        "kernels_off",
    ],
)
def test_dev_build_plan(tmp_path, gpus, env, want):
    """``want``: the start of the plan's line (^...), its end (...$), or a part of it."""
    plan = build_plan(tmp_path, gpus, **env)
    if want.startswith("^"):
        assert plan.startswith(want[1:]), plan
    elif want.endswith("$"):
        assert plan.endswith(want[:-1]), plan
    else:
        assert want in plan, plan


def test_dev_runs_cpu_tests_in_parallel_and_refuses_a_bad_build_setting(tmp_path):
    workers = int(build_plan(tmp_path).rsplit("test_workers=", 1)[1])
    cpus = len(os.sched_getaffinity(0))  # what nproc counts
    assert workers == (0 if cpus < 2 else min(cpus, 4))
    bad = build_plan(tmp_path, check=False, JAX_FUSEDAR_BUILD_KERNELS="maybe")
    assert bad.returncode == 2 and "JAX_FUSEDAR_BUILD_KERNELS must be" in bad.stderr


def test_dev_keeps_an_earlier_native_build_in_step(tmp_path):
    build_plan(tmp_path)  # makes the checkout
    core = tmp_path / "checkout" / "build" / "dev" / "ffi" / "core"
    core.mkdir(parents=True)
    (core / "libfusedar_core.so").touch()
    plan = build_plan(tmp_path)
    assert plan.startswith("build=1 archs_arg= why=built in this build tree before"), plan
