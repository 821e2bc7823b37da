"""``jax_fusedar.fuse`` in its four steps, each alone: the analysis allocates nothing, the
workspace plan is a pure function of what the sites need, the allocation is the one step
with effects (and a workspace it cannot make leaves its sites unfused with the error), the
rewrite reads the allocated workspaces (fusion/transform.py, fusion/workspaces.py)."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from jax_fusedar import workspace as workspace_module
from jax_fusedar.common import sizing
from jax_fusedar.fusion import workspaces
from jax_fusedar.fusion.matching import Scope
from jax_fusedar.fusion.report import Reject
from jax_fusedar.fusion.scopes import Analyzer
from tests.jax import cpu_helpers
from tests.jax.cpu_helpers import put
from tests.jax.fuse_checks import assert_equal_values, rms_norm

cpu_helpers.require_host_devices()

MESH = jax.make_mesh((8,), ("tp",))
H = 64


def two_sites(x, y, res, g):
    """Two sites of one dtype and hidden size with 4 and 12 tokens."""
    r1 = jax.lax.psum(x[0], "tp") + res[:4]
    r2 = jax.lax.psum(y[0], "tp") + res
    return rms_norm(r1, g), rms_norm(r2, g)


MODEL = cpu_helpers.jit_shard_map(two_sites, MESH, (P("tp"), P("tp"), P(), P()), (P(), P()))


def args(seed=0):
    rng = np.random.default_rng(seed)
    a = lambda *shape, spec=P(): put(
        MESH, spec, jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    )
    return a(8, 4, H, spec=P("tp")), a(8, 12, H, spec=P("tp")), a(12, H), a(H)


@pytest.fixture
def no_creation(monkeypatch):
    """Creating a workspace fails the test."""
    refuse = mock.Mock(side_effect=AssertionError("a workspace was created"))
    monkeypatch.setattr(workspace_module, "create_allreduce_fusion_workspace", refuse)


def test_the_analysis_allocates_nothing(no_creation):
    closed = jax.make_jaxpr(MODEL)(*args())
    admission = workspaces.Admission(mesh=MESH, axis_name="tp", backend="xla")
    analyzer = Analyzer(admission, "tp")
    analyzer.plan(closed.jaxpr, Scope("", None, None, 1))
    assert [s.fused for s in analyzer.sites] == [True, True]
    assert [(n.dtype, n.hidden, n.tokens, n.backend) for n in analyzer.needs] == [
        ("bfloat16", H, 4, "xla"),
        ("bfloat16", H, 12, "xla"),
    ]
    assert all(n.workspace is None and n.match.workspace is None for n in analyzer.needs)


def _need(tokens, hidden=H, dtype="bfloat16", workspace=None):
    sizes = sizing.workspace_sizes(8, max(tokens, 1), hidden, dtype)
    return workspaces.Need(None, dtype, hidden, tokens, "xla", sizes, workspace)


def test_the_plan_is_one_workspace_per_dtype_and_hidden_size_for_all_its_sites():
    served = object()
    needs = [_need(4), _need(12), _need(0, hidden=128), _need(7, dtype="float16")]
    needs.append(_need(99, workspace=served))  # served already: no new workspace
    specs = workspaces.plan_workspaces(needs)
    assert [(s.dtype, s.hidden, s.max_token_num, len(s.needs)) for s in specs] == [
        ("bfloat16", H, 12, 2),
        ("bfloat16", 128, 1, 1),  # a 0-token site gets a workspace of one token
        ("float16", H, 7, 1),
    ]
    assert needs[-1].workspace is served


def test_the_plan_never_shrinks_below_an_earlier_workspace():
    earlier = jf.abstract_workspace(
        MESH, "tp", max_token_num=32, hidden_dim=H, dtype=jnp.bfloat16, backend="xla"
    )
    (spec,) = workspaces.plan_workspaces([_need(4, hidden=2 * H)], existing=[earlier])
    assert spec.max_token_num == 16  # 32 x 64 elements at hidden 128


def test_allocation_hands_out_workspaces_and_names_what_it_could_not_make():
    needs = [_need(4), _need(12), _need(3, hidden=128)]
    made = []

    def create(spec):
        if spec.hidden == 128:
            raise Reject("cannot create a workspace: out of memory")
        made.append(spec)
        return f"ws{len(made)}"

    refused = workspaces.allocate(workspaces.plan_workspaces(needs), create)
    assert refused == {("bfloat16", 128): "cannot create a workspace: out of memory"}
    assert [n.workspace for n in needs] == ["ws1", "ws1", None]
    assert [s.max_token_num for s in made] == [12]


def test_one_workspace_serves_the_sites_of_a_trace():
    with jf.fuse(MODEL, mesh=MESH, backend="xla") as fused:
        got = fused(*args())
        assert [s.fused for s in fused.report.sites] == [True, True]
        assert [(w.max_token_num, w.hidden_dim) for w in fused.workspaces] == [(12, H)]
    want = MODEL(*args())
    assert_equal_values(got, want)


def test_a_workspace_that_cannot_be_made_leaves_its_sites_unfused(monkeypatch):
    fail = mock.Mock(side_effect=RuntimeError("cudaMalloc failed"))
    monkeypatch.setattr(workspace_module, "create_allreduce_fusion_workspace", fail)
    fused = jf.fuse(MODEL, mesh=MESH, backend="xla")
    got = fused(*args())
    assert [s.reason for s in fused.report.sites] == [
        "cannot create a workspace: cudaMalloc failed"
    ] * 2
    assert fused.workspaces == []
    assert_equal_values(got, MODEL(*args()))


def test_a_rotated_scan_allocates_for_the_plan_it_keeps():
    """A scan is analysed as written and rotated, and one of the two is kept: only that
    one's sites get workspaces."""

    def layer(x, p):
        h = rms_norm(x, p["g"])
        return x + jax.lax.psum(h @ p["w"], "tp"), None

    def body(ps, x, g):
        x, _ = jax.lax.scan(layer, x, ps)
        return rms_norm(x, g)

    rng = np.random.default_rng(1)
    ps = dict(
        g=jnp.asarray(1 + 0.1 * rng.standard_normal((3, H)), jnp.bfloat16),
        w=jnp.asarray(rng.standard_normal((3, H, H)) / 8, jnp.bfloat16),
    )
    x = jnp.asarray(rng.standard_normal((4, H)), jnp.bfloat16)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(H), jnp.bfloat16)
    model = cpu_helpers.jit_shard_map(body, MESH, (P(), P(), P()), P(), check_vma=False)
    with jf.fuse(model, mesh=MESH, backend="xla") as fused:
        fused.analyze(ps, x, g)
        assert fused.report.fused and "rotated" in (fused.report.fused[0].note or "")
        assert [(w.max_token_num, w.hidden_dim) for w in fused.workspaces] == [(4, H)]
