"""Install: JAX is an extra (the package imports without it and says how to get it), the
FlashInfer header fetch (only headers unpacked; offline it says what to do), and ./dev's
package lists (the demo gets the JAX side only). The wheel itself is checked by
tools/wheel_check.sh in CI (.ci/run)."""

import os
import pathlib
import subprocess
import sys
import tomllib
import zipfile

from tests.repo import REPO as ROOT, run_code

FETCH = ROOT / "tools" / "fetch_flashinfer_headers.py"


def run(cmd, timeout=60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_package_imports_without_jax_and_names_the_extra():
    public = ("allreduce_fusion", "create_allreduce_fusion_workspace", "fuse")
    # None in sys.modules makes `import jax` raise ModuleNotFoundError, as if not installed.
    result = run_code(
        "import sys\n"
        "sys.modules['jax'] = None\n"
        "import jax_fusedar as jf\n"
        "print(jf.AllReduceFusionPattern.kARResidualRMSNorm.name)\n"
        f"for name in {public}:\n"
        "    try:\n"
        "        getattr(jf, name)\n"
        "    except ImportError as e:\n"
        "        print('ImportError', name, e)\n"
        "    else:\n"
        "        print('imported', name)\n"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("kARResidualRMSNorm")
    for line, name in zip(lines[1:], public):
        assert line.startswith(f"ImportError {name} "), lines
        assert "pip install 'jax_fusedar[jax]'" in line


def test_too_old_a_jax_is_named_with_the_version_needed():
    # An installed jax older than the minimum (metadata says 0.7.2; nothing is imported).
    result = run_code(
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda name: '0.7.2' if name == 'jax' else real(name)\n"
        "import jax_fusedar as jf\n"
        "try:\n"
        "    jf.allreduce_fusion\n"
        "except ImportError as e:\n"
        "    print('ImportError', e)\n"
    )
    assert result.returncode == 0, result.stderr
    import jax_fusedar

    assert result.stdout.strip() == (
        f"ImportError jax_fusedar's JAX API needs JAX >= {jax_fusedar.MIN_JAX}, found jax 0.7.2: "
        f"pip install -U 'jax>={jax_fusedar.MIN_JAX}'"
    ), result.stdout


def test_the_jax_minimum_is_pyprojects():
    import jax_fusedar

    meta = pyproject()
    extras = meta["project"]["optional-dependencies"]
    assert f"jax>={jax_fusedar.MIN_JAX}" in extras["jax"]
    assert f"jaxlib>={jax_fusedar.MIN_JAX}" in meta["build-system"]["requires"]


def test_other_import_errors_are_not_blamed_on_jax():
    result = run_code(
        "import sys\n"
        "sys.modules['jax_fusedar.api'] = None\n"
        "import jax_fusedar as jf\n"
        "try:\n"
        "    jf.allreduce_fusion\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ModuleNotFoundError"), result.stdout
    assert "jax_fusedar[jax]" not in result.stdout


def fake_flashinfer_wheel(path: pathlib.Path) -> dict:
    headers = {
        "flashinfer/comm/trtllm_allreduce_fusion.cuh": "// kernel\n",
        "flashinfer/utils.cuh": "// utils\n",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in headers.items():
            zf.writestr(f"flashinfer/data/include/{name}", text)
        zf.writestr("flashinfer/jit/core.py", "import torch\n")  # not a header: stays out
        zf.writestr("flashinfer/data/csrc/x.cu", "// source\n")
    return headers


def test_fetch_unpacks_only_the_headers(tmp_path):
    wheel = tmp_path / "flashinfer_python-test-py3-none-any.whl"
    headers = fake_flashinfer_wheel(wheel)
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
    env = {
        **os.environ,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_CACHE_DIR": "1",
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    env.pop("PIP_FIND_LINKS", None)
    result = run([sys.executable, str(FETCH), "--dest", str(tmp_path / "dest")], 120, env=env)
    assert result.returncode != 0
    message = result.stderr
    assert "could not download flashinfer-python==" in message
    assert "--wheel" in message and "FLASHINFER_INCLUDE_DIR" in message
    assert not (tmp_path / "dest" / "VERSION").exists()


def dev_requirements(*extras: str, check=True):
    result = run([str(ROOT / "dev"), "requirements", *extras], cwd=ROOT)
    if not check:
        return result
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
    everything = names(dev_requirements())
    extras = "jax torch transformers pytest pytest-xdist flatbuffers matplotlib tqdm flax equinox"
    assert set(extras.split()) <= everything


def test_dev_oldest_pins_the_minimums_pyproject_declares():
    meta = pyproject()
    extras = meta["project"]["optional-dependencies"]
    minimum = dict(req.split(">=") for req in extras["jax"] + extras["torch"])
    pins = dict(r.split("==") for r in dev_requirements("--oldest", "jax", "torch") if "==" in r)
    assert pins == {"jax": minimum["jax"], "jaxlib": minimum["jax"], "torch": minimum["torch"]}


def build_plan(tmp_path, gpus=None, **env_vars) -> str:
    """./dev build-plan's line, with nvidia-smi reporting these compute capabilities (a
    stand-in on PATH) or absent, and these environment variables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = "/usr/bin:/bin"
    if gpus is not None:
        (bin_dir / "nvidia-smi").write_text(
            "#!/bin/sh\n" + "".join(f"echo '{cap}'\n" for cap in gpus)
        )
        (bin_dir / "nvidia-smi").chmod(0o755)
        path = f"{bin_dir}:{path}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_FUSEDAR_") and k != "PATH"}
    # A checkout without an earlier native build: ./dev decides from the GPUs alone.
    work = tmp_path / "checkout"
    if not work.exists():
        work.mkdir()
        (work / "ffi" / "cmake").mkdir(parents=True)
        for name in ("dev", "pyproject.toml", "ffi/cmake/build_plan.py"):
            (work / name).write_bytes((ROOT / name).read_bytes())
        (work / "dev").chmod(0o755)
    result = run([str(work / "dev"), "build-plan"], env={**env, "PATH": path, **env_vars})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_dev_skips_the_kernels_without_a_gpu(tmp_path):
    assert build_plan(tmp_path).startswith("build=0 ")
    assert build_plan(tmp_path, gpus=[]).startswith("build=0 ")


def test_dev_runs_gpu_tests_one_at_a_time_and_cpu_tests_in_parallel(tmp_path):
    assert build_plan(tmp_path, gpus=["9.0"]).endswith(" test_workers=0")
    workers = int(build_plan(tmp_path).rsplit("test_workers=", 1)[1])
    cpus = len(os.sched_getaffinity(0))  # what nproc counts
    assert workers == (0 if cpus < 2 else min(cpus, 4))
    assert build_plan(tmp_path, JAX_FUSEDAR_TEST_WORKERS="3").endswith(" test_workers=3")


def test_dev_builds_for_the_visible_gpus_only(tmp_path):
    plan = build_plan(tmp_path, gpus=["9.0", "9.0"])
    assert plan.startswith("build=1 archs_arg=-DJAX_FUSEDAR_CUDA_ARCHS=90a "), plan
    plan = build_plan(tmp_path, gpus=["9.0", "10.0"])
    assert "archs_arg=-DJAX_FUSEDAR_CUDA_ARCHS=90a;100a " in plan, plan
    plan = build_plan(tmp_path, gpus=["9.0"], JAX_FUSEDAR_CUDA_ARCHS="100a")
    assert "archs_arg=-DJAX_FUSEDAR_CUDA_ARCHS=100a " in plan, plan  # told otherwise


def test_dev_keeps_an_earlier_native_build_in_step(tmp_path):
    build_plan(tmp_path)  # makes the checkout
    (tmp_path / "checkout" / "build" / "dev" / "ffi" / "core").mkdir(parents=True)
    (tmp_path / "checkout" / "build" / "dev" / "ffi" / "core" / "libfusedar_core.so").touch()
    plan = build_plan(tmp_path)
    assert plan.startswith("build=1 archs_arg= why=built in this build tree before"), plan


def test_dev_builds_the_kernels_when_asked(tmp_path):
    # CI: no GPU, every default architecture (CMake's default, or JAX_FUSEDAR_CUDA_ARCHS).
    plan = build_plan(tmp_path, JAX_FUSEDAR_BUILD_KERNELS="1")
    assert plan.startswith("build=1 archs_arg=-DJAX_FUSEDAR_CUDA_ARCHS=90a;100a "), plan
    plan = build_plan(tmp_path, JAX_FUSEDAR_BUILD_KERNELS="1", JAX_FUSEDAR_CUDA_ARCHS="100a")
    assert plan.startswith("build=1 archs_arg=-DJAX_FUSEDAR_CUDA_ARCHS=100a "), plan
    assert build_plan(tmp_path, gpus=["9.0"], JAX_FUSEDAR_BUILD_KERNELS="off").startswith(
        "build=0 "
    )
    bad = run(
        [str(tmp_path / "checkout" / "dev"), "build-plan"],
        env={**os.environ, "JAX_FUSEDAR_BUILD_KERNELS": "maybe"},
    )
    assert bad.returncode == 2 and "JAX_FUSEDAR_BUILD_KERNELS must be" in bad.stderr


def test_dev_rejects_an_unknown_extra():
    result = dev_requirements("nope", check=False)
    assert result.returncode != 0 and "no extra 'nope'" in result.stderr
