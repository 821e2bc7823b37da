"""Rewriting: the program is evaluated again, equation by equation, under JAX's tracing, with
each planned site's equations replaced by one fused call; sub-jaxprs with sites are re-traced
in their own context and their primitive bound again with the new jaxpr. Every other
equation is bound unchanged, so a program with nothing to fuse is the same program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from . import graph as G
from .jax_internals import (
    axis_name_effects,
    bind_params,
    debug_info,
    eqn_context,
    jaxpr_inliner,
    shard_map_body_context,
    trace_to_jaxpr,
)


# What a fused site computes where no kernel serves it (ops/plan.py's FALLBACKS): the
# original's psum, its residual add and norm written as the code it replaced writes them, so
# that the rewritten program compiles like the original (no reduce_precision).
FALLBACK = "xla_plain"


def _fix_vma(val, aval):
    """Marks ``val`` varying over the axes the original value varied over (under check_vma
    the fused op's outputs may vary over fewer axes than the values they replace)."""
    want = frozenset(getattr(aval, "vma", frozenset()) or ())
    have = frozenset(getattr(jax.typeof(val), "vma", frozenset()) or ())
    missing = tuple(sorted(want - have))
    return jax.lax.pcast(val, missing, to="varying") if missing else val


def _write(write, var, val):
    if var is None or val is None:  # (norm_out of the FP8 patterns without it: unused)
        return
    if G.dtype(var) != jnp.dtype(val.dtype).name:
        val = val.astype(var.aval.dtype)
    write(var, _fix_vma(val.reshape(G.shape(var)), var.aval))


def _norm_out(m, read, y):
    """The site's norm output from the fused op's: with the program's bias added to it
    (``m.norm.bias``, in the program's dtype of that addition: a declared rounding change
    when the program adds it before its rounding to T)."""
    norm = m.norm
    if norm.bias is None or y is None:
        return y
    b = jnp.asarray(read(norm.bias)).reshape(m.hidden)
    for op in norm.bias_ops:
        b = b.astype(op[1])
    dt = norm.bias_dtype
    return (y.astype(dt) + b.astype(dt)).astype(norm.out_var.aval.dtype)


def _gamma(m, value):
    """gamma as the fused op takes it: [H] in T, computed from gamma's array by the
    program's own steps (its casts, a constant added: norm_proof.GammaFeed), so the kernel's
    ``weight_bias + float32(gamma)`` is the value the program multiplies; the cast to T
    rounds only where the proof declared it (a rounding change)."""
    if value is None:
        return jnp.ones((m.hidden,), m.dtype)
    g = jnp.asarray(value).reshape(m.hidden)
    T = jnp.dtype(m.dtype)
    if g.dtype == T and all(
        op[0] == "cast" and jnp.promote_types(T, op[1]) == jnp.dtype(op[1])
        for op in m.norm.gamma_ops
    ):
        return g  # widening casts only (exact), back to T: gamma's own array
    for op in m.norm.gamma_ops:
        if op[0] == "cast":
            g = g.astype(op[1])
        elif op[0] == "add":  # ("add", c, dtype): the program's addition, in its dtype
            g = jnp.add(g.astype(op[2]), jnp.asarray(op[1], op[2]))
        else:
            g = jax.lax.stop_gradient(g)
    return g.astype(m.dtype)


def _call(m, fuser, x, residual, gamma, scale, axis):
    from ..api import allreduce_fusion

    kwargs = {}
    if scale is not None:
        kwargs["scale_factor"] = jnp.asarray(scale, jnp.float32).reshape(())
    return allreduce_fusion(
        x.reshape(-1, m.hidden),
        axis_name=axis,
        workspace=m.workspace,
        pattern=m.norm.pattern,
        residual=residual.reshape(-1, m.hidden),
        rms_gamma=gamma,
        rms_eps=m.norm.eps,
        weight_bias=m.norm.weight_bias,
        use_oneshot=fuser.use_oneshot,
        strict=fuser.strict,
        fallback=FALLBACK,
        **kwargs,
    )


class _Outputs:
    """The fused call's outputs (AllReduceFusionOutputs' fields that the site reads)."""

    def __init__(self, residual_out, norm_out, quant_out=None, scale_out=None):
        self.residual_out, self.norm_out = residual_out, norm_out
        self.quant_out, self.scale_out = quant_out, scale_out


def bind_all(eqns, env):
    def read(a):
        return a.val if isinstance(a, jcore.Literal) else env[a]

    for e in eqns:
        subfuns, params = bind_params(e, e.params)
        with eqn_context(e):
            ans = e.primitive.bind(*subfuns, *[read(a) for a in e.invars], **params)
        for v, val in zip(e.outvars, ans if e.primitive.multiple_results else [ans]):
            env[v] = val


def _with_tail_derivative(m, r, gamma, scale, quant, scale_out):
    """The fused FP8 outputs (``quant``, ``scale_out``) given the derivative of the program's
    own tail: a cast to float8 passes tangents through, which the fused op's quant_out (like
    jnp.round) does not. Primal: the fused op's outputs; tangent: the tail's equations
    differentiated at the norm's value, the norm's tangent taken at residual_out ``r`` as
    the fused op takes it. Called where the tail's equations were (their scope's shapes and
    mesh: outside the shard_map for a per-linear site)."""
    from ..ops import reference

    norm = m.norm
    T = jnp.dtype(m.dtype)
    static = norm.scale is not None
    tail_outs = [norm.quant_var] + ([norm.scale_out_var] if norm.scale_out_var is not None else [])
    fp8 = [quant.reshape(G.shape(norm.quant_var))]
    if norm.scale_out_var is not None:
        fp8.append(scale_out.reshape(G.shape(norm.scale_out_var)))
    y_shape = G.shape(norm.out_var)

    def tail(y, s):
        env = {norm.out_var: y.reshape(y_shape)}
        if static and G.is_var(norm.scale):
            env[norm.scale] = s.reshape(G.shape(norm.scale)).astype(norm.scale.aval.dtype)
        bind_all(norm.tail_eqns, env)
        return tuple(env[v] for v in tail_outs)

    @jax.custom_jvp
    def outputs(r, gamma, s, *fp8):
        return tuple(fp8)

    @outputs.defjvp
    def outputs_jvp(primals, tangents):
        r, gamma, s, *fp8 = primals
        dr, dgamma, ds = tangents[:3]
        y, dy = jax.jvp(
            lambda r_, g_: reference.rms_norm(
                r_,
                g_,
                rms_eps=norm.eps,
                weight_bias=norm.weight_bias,
                out_dtype=T,
                rounding=reference.roundings(FALLBACK)[0],
            ),
            (r, gamma),
            (dr, dgamma),
        )
        _, dtail = jax.jvp(tail, (y, s), (dy, ds))
        return tuple(fp8), tuple(
            _fix_vma(t.reshape(o.shape).astype(o.dtype), jax.typeof(o)) for t, o in zip(dtail, fp8)
        )

    s = jnp.asarray(scale, jnp.float32).reshape(()) if static else jnp.zeros((), jnp.float32)
    outs = outputs(r.reshape(y_shape), gamma, s, *fp8)
    return outs[0], (outs[1] if len(outs) > 1 else None)


def _partial_input(m, x):
    """The fused op's input: the partial sum, in T (a float32 partial rounded, under
    allow_rounding_change), reduced first over the reduction's size-1 axes (no change in
    value; the varying-axes type then matches the all-reduce's)."""
    src = m.source
    if x.dtype != jnp.dtype(m.dtype):
        x = x.astype(m.dtype)
    if src.size_one_axes:
        x = jax.lax.psum(x, src.size_one_axes)
    return x


def _fused_keeping_vjp(m, fuser, x, residual, gamma):
    """The fused op for a psum that sat in a custom_vjp: its forward, with the custom rule
    as the all-reduce's backward (the rest of the backward is the fused op's own math)."""
    from ..ops import reference

    parts = m.source.custom_vjp
    shape = x.shape
    x_aval = jax.typeof(x)

    @jax.custom_vjp
    def site(x, residual, gamma):
        out = _call(m, fuser, x, residual, gamma, None, m.source.axis)
        return out.residual_out.reshape(shape), out.norm_out.reshape(shape)

    def fwd(x, residual, gamma):
        r, y = site(x, residual, gamma)
        return (r, y), (r, gamma)

    def bwd(saved, cts):
        r, gamma = saved

        def epilogue(s, res, g):
            _, r_out, y = reference.epilogue(
                s,
                res,
                g,
                pattern=1,
                rms_eps=m.norm.eps,
                weight_bias=m.norm.weight_bias,
                rounding=reference.roundings(FALLBACK)[0],
            )
            return r_out, y

        # The residual add's tangent map is linear: linearize the norm at r itself.
        _, vjp = jax.vjp(epilogue, r, jnp.zeros_like(r), gamma)
        ct_s, ct_res, ct_gamma = vjp(tuple(cts))
        (ct_x,) = parts.backward([], [ct_s.reshape(m.source.out.aval.shape)])
        return _fix_vma(ct_x.reshape(shape), x_aval), ct_res, ct_gamma

    site.defvjp(fwd, bwd)

    return _Outputs(*site(x, residual, gamma))


def _write_fp8(write, m, r, gamma, scale, out):
    """Writes the fused FP8 outputs, with the program's derivative (_with_tail_derivative);
    ``gamma`` as the program holds it (``_gamma`` applied here, only where a tail is)."""
    if m.norm.quant_var is None:
        return
    q, s = _with_tail_derivative(m, r, _gamma(m, gamma), scale, out.quant_out, out.scale_out)
    _write(write, m.norm.quant_var, q)
    _write(write, m.norm.scale_out_var, s)


class InScopeEmit:
    """psum (or a custom-rule psum) + add + norm in one scope."""

    def __init__(self, m):
        self.m = m

    def inputs(self, read, extra_in):
        m = self.m
        gamma = None if m.norm.gamma is None else read(m.norm.gamma)
        scale = None if m.norm.scale is None else read(m.norm.scale)
        return read(m.residual), gamma, scale

    def fused(self, read, fuser, residual, gamma, scale):
        m = self.m
        x = _partial_input(m, read(m.source.x))
        g = _gamma(m, gamma)
        if m.source.custom_vjp is not None:
            return _fused_keeping_vjp(m, fuser, x, residual.reshape(x.shape), g)
        return _call(m, fuser, x, residual, g, scale, m.source.axis)

    def __call__(self, read, write, fuser, extra_in, extra_out):
        m = self.m
        residual, gamma, scale = self.inputs(read, extra_in)
        out = self.fused(read, fuser, residual, gamma, scale)
        _write(write, m.r, out.residual_out)
        _write(write, m.norm.out_var, _norm_out(m, read, out.norm_out))
        _write_fp8(write, m, out.residual_out, gamma, scale, out)


def _extra_outputs(m) -> tuple:
    """The norm's outputs a shard_map body returns for a site fused across its boundary:
    norm_out (unless the pattern has none: an FP8 tail whose norm output is unused), the
    FP8 codes, the dynamic scale."""
    from ..common.patterns import TRAITS, AllReduceFusionPattern

    names = ["norm"] if TRAITS[AllReduceFusionPattern(m.norm.pattern)].has_norm_out else []
    if m.norm.quant_var is not None:
        names.append("quant")
    if m.norm.scale_out_var is not None:
        names.append("scale_out")
    return tuple(names)


class BodyEmit(InScopeEmit):
    """The psum of a shard_map body whose add and norm were outside it: the residual (unless
    the body computes it: ``m.residual_body``), gamma (and scale) come in as extra inputs of
    the body, the body's output that carried the sum becomes residual_out and the norm's
    outputs leave as extra outputs (BoundaryEmit lays them out)."""

    def __init__(self, m, slot):
        super().__init__(m)
        self.slot = slot

    def __call__(self, read, write, fuser, extra_in, extra_out):
        m = self.m
        residual, gamma, scale = extra_in[self.slot]
        if m.residual_body is not None:
            residual = read(m.residual_body)
        out = self.fused(read, fuser, residual, gamma, scale)
        _write(write, m.body_out, out.residual_out)
        field = {"norm": out.norm_out, "quant": out.quant_out, "scale_out": out.scale_out}
        shape = {
            "norm": residual.shape,
            "quant": residual.shape,
            "scale_out": residual.shape[:-1] + (1,),
        }
        extra_out[self.slot] = [field[n].reshape(shape[n]) for n in _extra_outputs(m)]


def _reshard(val, spec):
    """``val`` laid out as ``spec`` when its mesh has Explicit axes (shard_map then requires
    it); on Auto axes shard_map's in_specs place it. The sharding names the value's own mesh,
    so no mesh need be set (a program called without ``jax.set_mesh`` runs as written)."""
    sharding = getattr(jax.typeof(val), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    types = set(getattr(mesh, "axis_types", ()) or ())
    if jax.sharding.AxisType.Explicit in types and tuple(sharding.spec) != tuple(spec):
        return jax.sharding.reshard(val, jax.sharding.NamedSharding(mesh, spec))
    return val


class BoundaryEmit:
    """A shard_map whose output is a psum, with the residual add and the norm after it: the
    shard_map again, with the residual and gamma as extra inputs (laid out like the sum) and
    the norm's outputs as extra outputs; inside it the psum is the fused op."""

    def __init__(self, sm_eqn, matches, body_plan):
        self.eqn = sm_eqn
        self.matches = matches
        self.body_plan = body_plan

    def __call__(self, read, write, fuser, extra_in, extra_out):
        e = self.eqn
        p = e.params
        mesh = p["mesh"]
        out_specs = list(p["out_specs"])
        in_specs = list(p["in_specs"])
        extra_args, extra_specs, extra_out_specs, layout = [], [], [], []
        for m in self.matches:
            k = m.boundary[1]
            spec = out_specs[k]
            ins, specs = [], []
            if m.residual_body is None:
                ins.append(_reshard(read(m.residual), spec))
                specs.append(spec)
            for atom in (m.norm.gamma, m.norm.scale):
                if atom is not None:
                    ins.append(_reshard(read(atom), P()))
                    specs.append(P())
            extra_args += ins
            extra_specs += specs
            outs = [spec] * len(_extra_outputs(m))
            extra_out_specs += outs
            layout.append((len(ins), len(outs)))
        consts = getattr(p["jaxpr"], "consts", ())
        n_in = len(e.invars)
        plan = self.body_plan

        def body_fn(*args):
            xin = []
            pos = n_in
            for m, (n_extra, _) in zip(self.matches, layout):
                vals = list(args[pos : pos + n_extra])
                pos += n_extra
                residual = None if m.residual_body is not None else vals.pop(0)
                gamma = vals.pop(0) if m.norm.gamma is not None else None
                scale = vals.pop(0) if m.norm.scale is not None else None
                xin.append((residual, gamma, scale))
            return tuple(evaluate(plan.jaxpr, consts, args[:n_in], plan, fuser, extra_in=xin))

        manual = p.get("newly_manual_axes", p.get("manual_axes"))
        outs = jax.shard_map(
            body_fn,
            mesh=mesh,
            in_specs=tuple(in_specs) + tuple(extra_specs),
            out_specs=tuple(out_specs) + tuple(extra_out_specs),
            axis_names=set(manual),
            check_vma=p.get("check_vma", True),
        )(*[read(a) for a in e.invars], *extra_args)
        n_out = len(e.outvars)
        for k, v in enumerate(e.outvars):
            if not isinstance(v, jcore.DropVar):
                write(v, outs[k])
        pos = n_out
        for m, (_, n_extra_out) in zip(self.matches, layout):
            vals = outs[pos : pos + n_extra_out]
            pos += n_extra_out
            _write(write, m.r, outs[m.boundary[1]])
            got = dict(zip(_extra_outputs(m), vals))
            _write(write, m.norm.out_var, got.get("norm"))
            if m.norm.quant_var is not None:  # the tail's derivative, where the tail was
                scale = None if m.norm.scale is None else read(m.norm.scale)
                gamma = None if m.norm.gamma is None else read(m.norm.gamma)
                fp8 = _Outputs(None, None, got["quant"], got.get("scale_out"))
                _write_fp8(write, m, read(m.r), gamma, scale, fp8)


class SequenceParallelEmit:
    """psum_scatter + add + all_gather + norm (or norm on the shard, then all_gather): the
    residual shard gathered, one fused all-reduce on every token, the shards sliced out."""

    def __init__(self, m):
        self.m = m

    def __call__(self, read, write, fuser, extra_in, extra_out):
        m = self.m
        src = m.source
        dim = src.scatter_dim
        res_shard = read(m.residual)
        res_full = jax.lax.all_gather(res_shard, src.axis, axis=dim, tiled=True)
        x = _partial_input(m, read(src.x))
        gamma = None if m.norm.gamma is None else read(m.norm.gamma)
        scale = None if m.norm.scale is None else read(m.norm.scale)
        out = _call(m, fuser, x, res_full, _gamma(m, gamma), scale, src.axis)
        full_shape = res_full.shape
        r_full = out.residual_out.reshape(full_shape)
        n = res_shard.shape[dim]
        start = jax.lax.axis_index(src.axis) * n

        def shard(v):
            return jax.lax.dynamic_slice_in_dim(v, start, n, axis=dim)

        _write(write, m.r, shard(r_full))
        if m.r_full is not None:
            _write(write, m.r_full, r_full)
        y_full = out.norm_out.reshape(full_shape)
        if m.gather_norm is not None:
            _write(write, m.gather_norm, y_full)
            _write(write, m.norm.out_var, shard(y_full))
        else:
            _write(write, m.norm.out_var, y_full)
            _write_fp8(write, m, r_full, gamma, scale, out)


class PlainJitEmit:
    """dot_general + add + norm under plain jit: the custom-partitioned entry, which reduces
    over whatever mesh axis the partitioner shards the contraction along. Where the
    workspace has no kernel (the xla backend: CPU, TP across hosts) the entry's fallback is
    written out instead (``row_parallel_without_kernel``): the same values and the same
    all-reduce, without a custom_partitioning op that would only add compile time."""

    def __init__(self, m):
        self.m = m

    def __call__(self, read, write, fuser, extra_in, extra_out):
        from ..ops import partitioning

        m = self.m
        e = m.dot
        (hc, wc), _ = e.params["dimension_numbers"]
        h, w = e.invars
        if m.weight_first:
            h, w, hc, wc = w, h, wc, hc
        gamma = _gamma(m, None if m.norm.gamma is None else read(m.norm.gamma))
        if m.workspace.backend != "trtllm":
            # The original's own dot_general (its shardings, precision and collective).
            subfuns, params = bind_params(e, e.params)
            with eqn_context(e):
                summed = e.primitive.bind(*subfuns, *[read(v) for v in e.invars], **params)
            if m.weight_first:
                summed = jnp.moveaxis(summed, 0, -1)
            eps, bias = m.norm.eps, m.norm.weight_bias

            def epilogue(summed, residual, gamma):
                out = partitioning.row_parallel_without_kernel(
                    summed,
                    residual=residual,
                    rms_gamma=gamma,
                    rms_eps=eps,
                    weight_bias=bias,
                    fallback=FALLBACK,
                )
                return out.residual_out, out.norm_out

            res, norm = traced_once(
                fuser,
                ("row_parallel_without_kernel", eps, bias),
                epilogue,
                (summed.astype(m.dtype), read(m.residual), jnp.asarray(gamma)),
            )
            out = partitioning.AllReduceFusionOutputs(None, res, norm, None, None)
        else:
            out = partitioning.row_parallel_allreduce_fusion(
                read(h),
                read(w),
                residual=read(m.residual),
                rms_gamma=gamma,
                workspace=[m.workspace],
                rms_eps=m.norm.eps,
                weight_bias=m.norm.weight_bias,
                use_oneshot=fuser.use_oneshot,
                strict=fuser.strict,
                precision=e.params.get("precision"),
                contracting_dims=(tuple(hc), tuple(wc)),
                weight_first=m.weight_first,
                fallback=FALLBACK,
            )
        _write(write, m.r, out.residual_out)
        _write(write, m.norm.out_var, _norm_out(m, read, out.norm_out))


# --- evaluation -----------------------------------------------------------------------------


def traced_once(fuser, key, fn, args):
    """``fn(*args)`` (a tuple of arrays), its jaxpr traced once per ``key`` and argument
    types in ``fuser``'s trace and recorded again at each further call: a decoder's sites
    share their epilogue, and tracing its jnp code for each cost as much as the rest of
    their rewrite. ``key`` holds what ``fn`` reads besides ``args``."""
    inline = jaxpr_inliner()
    if inline is None:
        return fn(*args)
    cache = fuser.traced
    avals = tuple(jax.typeof(a) for a in args)
    if (key, avals) not in cache:
        info = debug_info(f"<{key[0]}>")
        cache[(key, avals)] = trace_to_jaxpr(lambda *a: list(fn(*a)), avals, info)
    jaxpr, consts = cache[(key, avals)]
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(a):
        return a.val if isinstance(a, jcore.Literal) else env[a]

    if not inline(jaxpr.eqns, read, env.__setitem__):
        return fn(*args)
    return tuple(read(v) for v in jaxpr.outvars)


def _needed(jaxpr, plan, outvars=None) -> set:
    """The equations ``jaxpr``'s outputs need, with the plan applied: every equation a site
    replaces (``plan.skip``: the site reads some of its inputs) and every one with effects,
    then what those read. The rest is dead code, which JAX drops when it lowers a program
    but which the rewritten program would otherwise hold where JAX does not look (inside a
    custom_jvp's function: a rotated, checkpointed scan body; a model's unused random keys
    are such code)."""
    live = {v for v in (jaxpr.outvars if outvars is None else outvars) if isinstance(v, jcore.Var)}
    needed = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        e = jaxpr.eqns[i]
        if i in plan.skip or e.effects or any(v in live for v in e.outvars):
            needed.add(i)
            live.update(a for a in e.invars if isinstance(a, jcore.Var))
    return needed


def _signature(jaxpr) -> tuple:
    """A (closed) jaxpr's input and output types, with their effects."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
    return (
        tuple(v.aval for v in inner.invars),
        tuple(a.aval for a in inner.outvars),
        inner.effects,
    )


def _kept(plan, i) -> bool:
    """Whether the plan keeps equation ``i`` as it is (a dead one too: it is left out)."""
    return i not in plan.skip and i not in plan.children


def needed_inputs(jaxpr, plan, outvars) -> set:
    """The inputs of ``jaxpr`` that ``outvars`` (some of its outputs) need with the plan
    applied (``_needed``)."""
    eqns = jaxpr.eqns
    read = [a for i in _needed(jaxpr, plan, outvars) for a in eqns[i].invars] + list(outvars)
    read = {a for a in read if isinstance(a, jcore.Var)}
    return {v for v in jaxpr.invars if v in read}


def evaluate(jaxpr, consts, args, plan, fuser, extra_in=()):
    """``jaxpr``'s outputs (then a shard_map body's extra outputs) with the plan applied;
    dead equations are left out (``_needed``)."""
    env = {}
    extra_out = {}
    needed = _needed(jaxpr, plan)

    def read(a):
        return a.val if isinstance(a, jcore.Literal) else env[a]

    def write(v, val):
        env[v] = val

    for v, c in zip(jaxpr.constvars, consts):
        write(v, c)
    for v, a in zip(jaxpr.invars, args):
        write(v, a)
    eqns = jaxpr.eqns
    # Runs of equations the plan leaves as they are (no emission before them, not skipped,
    # no sub-jaxpr rewritten) are recorded as they are: re-binding each one would cost as
    # much as the user's own trace did.
    inline = jaxpr_inliner()
    run_end = -1
    for i, eqn in enumerate(eqns):
        for em in plan.emit.get(i, ()):
            em(read, write, fuser, extra_in, extra_out)
        if i in plan.skip or i not in needed or i < run_end:
            continue
        if inline is not None and i not in plan.children:
            end = i + 1
            while end < len(eqns) and end not in plan.emit and _kept(plan, end):
                end += 1
            if inline([eqns[k] for k in range(i, end) if k in needed], read, write):
                run_end = end
                continue
        params = eqn.params
        if i in plan.children:
            params, same_types = dict(params), True
            for (k, j), sub in plan.children[i].items():
                orig = params[k] if j is None else params[k][j]
                new = rewrite(orig, sub, fuser)
                same_types = same_types and _signature(new) == _signature(orig)
                if j is None:
                    params[k] = new
                else:
                    seq = list(params[k])
                    seq[j] = new
                    params[k] = type(params[k])(seq)
            # Its sub-jaxprs rewritten with their types kept, the equation is recorded with
            # them as it is: binding it would trace them once more (a shard_map does).
            if inline is not None and same_types:
                if inline([eqn.replace(params=params)], read, write):
                    continue
        subfuns, bind = bind_params(eqn, params)
        with eqn_context(eqn):
            ans = eqn.primitive.bind(*subfuns, *[read(a) for a in eqn.invars], **bind)
        if eqn.primitive.multiple_results:
            for v, a in zip(eqn.outvars, ans):
                write(v, a)
        else:
            write(eqn.outvars[0], ans)
    for em in plan.emit.get(len(jaxpr.eqns), ()):
        em(read, write, fuser, extra_in, extra_out)
    outs = [read(a) for a in jaxpr.outvars]
    for slot in sorted(extra_out):
        outs.extend(extra_out[slot])
    return outs


def rewrite(orig, plan, fuser):
    """``orig`` (Jaxpr or ClosedJaxpr) with the plan applied, same signature."""
    import contextlib

    closed = isinstance(orig, jcore.ClosedJaxpr)
    consts = orig.consts if closed else ()
    jaxpr = plan.jaxpr
    in_avals = [v.aval for v in jaxpr.invars]
    context = shard_map_body_context(*plan.context) if plan.context else contextlib.nullcontext()
    with context:
        new, new_consts = trace_to_jaxpr(
            lambda *a: evaluate(jaxpr, consts, a, plan, fuser), in_avals, jaxpr.debug_info
        )
    for a, b in zip(jaxpr.outvars, new.outvars):
        if a.aval.shape != b.aval.shape or a.aval.dtype != b.aval.dtype:
            raise AssertionError(f"jax_fusedar.fuse changed an output type: {a.aval} -> {b.aval}")
    # Traced here, the body records the named axes it reads, which the original (traced by
    # the shard_map that binds them) does not: the same program, so it keeps its effects.
    if new.effects != jaxpr.effects and (
        new.effects - axis_name_effects(new.effects)
        == jaxpr.effects - axis_name_effects(jaxpr.effects)
    ):
        new = new.replace(effects=jaxpr.effects)
    if closed:
        return jcore.ClosedJaxpr(new, new_consts)
    if new_consts:
        raise AssertionError(
            "jax_fusedar.fuse: a rewritten open jaxpr captured constants "
            f"({len(new_consts)}); please report this form"
        )
    return new
