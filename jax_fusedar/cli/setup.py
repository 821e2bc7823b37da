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


def tp_mesh(world=None):
    """A 1-D mesh, axis "tp", over the first ``world`` devices (default: every device). Fewer
    devices than ``world`` is a SetupError: a TP group never runs at another size than asked
    (the CLI makes the devices first, main.settle_devices; this says why where it could not,
    e.g. JAX already started in this process)."""
    devices = jax.devices()
    world = len(devices) if world is None else world
    if len(devices) < world:
        d = devices[0]
        raise SetupError(
            f"--tp {world} needs {world} devices and this process has {len(devices)} "
            f"({d.device_kind}, platform {d.platform}): {world} > {len(devices)}"
        )
    return jax.make_mesh((world,), (AXIS,), devices=devices[:world])


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


def describe_devices(world: int, backend: str, plan=None) -> str:
    """The devices line of every demo. ``plan`` (cli/ranks.py's Plan) for a
    demo run as one process per rank: where its ranks share GPUs the line says so ("2 ranks
    on 1 x NVIDIA H200"), since ``jax.devices()`` there lists one device per rank."""
    d = jax.devices()[0]
    path = (
        "FlashInfer kernel"
        if backend == "trtllm"
        else "XLA reference path (psum + RMSNorm), not the kernel"
    )
    if plan is not None and plan.shared_gpus:
        gpus = plan.gpus
        where = (
            f"{world} ranks on {gpus} x {d.device_kind} (platform {d.platform}; the ranks "
            f"share {'it' if gpus == 1 else f'them, rank r on GPU r % {gpus}'})"
        )
    else:
        where = f"{world} x {d.device_kind} (platform {d.platform})"
    return f"devices: {where}, world size {world}, backend {backend}: {path}"
