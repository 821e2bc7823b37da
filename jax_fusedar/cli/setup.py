"""What the demos (dense and MoE, in one process or one process per rank) set up alike: the
1-D mesh over every local device, the model preset the flags pick, the check that the fused
op supports the configuration, the workspace, the line that describes the devices and the
backend, and ``SetupError``, which the CLI prints without a traceback."""

from __future__ import annotations

import dataclasses

import jax

from ..common import limits
from ..workspace import create_allreduce_fusion_workspace

AXIS = "tp"
RMS_EPS = 1e-6


class SetupError(ValueError):
    """A configuration this machine cannot run; the CLI prints it without a traceback."""


def require_fuse_jax() -> None:
    """The demos' fused model is ``jax_fusedar.fuse``'s: on a JAX older than the pass needs,
    a SetupError naming the JAX needed, before anything runs."""
    from ..fusion.jax_internals import UnsupportedJax, require_supported_jax

    try:
        require_supported_jax()
    except UnsupportedJax as e:
        raise SetupError(str(e)) from None


def tp_mesh():
    """A 1-D mesh over every local device, axis "tp"."""
    devices = jax.devices()
    return jax.make_mesh((len(devices),), (AXIS,), devices=devices)


def check_supported(world: int, hiddens, dtype: str) -> None:
    """Refuse up front what the fused op would refuse, on every backend alike."""
    for hidden in hiddens:
        problem = limits.kernel_support_problem(world, hidden, dtype)
        if problem:
            raise SetupError(
                f"{problem} (this machine has {world} device(s) of kind "
                f"{jax.devices()[0].device_kind!r})"
            )


def llama_preset(args, world: int):
    """(name, config) of the dense demo's model: ``--preset`` (auto: llama3-8b on GPUs, tiny
    elsewhere) with ``--layers``, refused up front where it cannot split over ``world``
    ranks or the fused op does not support it."""
    from ..models import llama

    name = args.preset
    if name == "auto":
        name = "llama3-8b" if jax.devices()[0].platform == "gpu" else "tiny"
    cfg = llama.PRESETS[name]
    if args.layers:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    try:
        cfg.check(world)
    except ValueError as e:
        raise SetupError(f"preset {name}: {e}") from None
    check_supported(world, [cfg.hidden], args.dtype)
    return name, cfg


def moe_preset(args, world: int, on_gpu: bool):
    """(name, config) of the MoE demo's model (``--moe``): tiny on CPUs, small on GPUs (picked
    by ``--preset auto``), with ``--layers``, refused up front where it cannot split over
    ``world`` ranks."""
    from ..models import moe_llama

    name = {"auto": "small" if on_gpu else "tiny", "tiny": "tiny"}.get(args.preset)
    if name is None:
        raise SetupError(
            f"--moe has the presets tiny (CPUs) and small (GPUs, picked by "
            f"--preset auto), not {args.preset}"
        )
    cfg = moe_llama.PRESETS[name]
    if args.layers:
        cfg = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, layers=args.layers))
    try:
        cfg.check(world)
    except ValueError as e:
        raise SetupError(f"preset {name}: {e}") from None
    return name, cfg


def open_workspace(mesh, *, max_token_num: int, hidden_dim: int, dtype, backend: str):
    """The workspace, with the reasons it cannot be built (e.g. --backend trtllm without a
    GPU) reported as SetupError."""
    try:
        return create_allreduce_fusion_workspace(
            mesh,
            AXIS,
            max_token_num=max_token_num,
            hidden_dim=hidden_dim,
            dtype=dtype,
            backend=backend,
        )
    except ValueError as e:
        raise SetupError(str(e)) from None


def describe_devices(world: int, backend: str) -> str:
    d = jax.devices()[0]
    path = (
        "FlashInfer kernel"
        if backend == "trtllm"
        else "XLA reference path (psum + RMSNorm), not the kernel"
    )
    return (
        f"devices: {world} x {d.device_kind} (platform {d.platform}), world size {world}, "
        f"backend {backend}: {path}"
    )
