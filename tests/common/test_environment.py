"""``common.environment``: every JAX_FUSEDAR_* variable the package reads is checked by one
call, with the parser that reads it later, each problem naming its variable (the CLI runs it
before any work: tests/cli/test_environment.py)."""

import re
import subprocess

import pytest

from jax_fusedar.common import environment

from tests.repo import REPO, run_code


@pytest.fixture
def clean_env(monkeypatch):
    for var, _ in environment.READERS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_every_variable_the_package_reads_is_checked():
    read = set()
    for path in [*(REPO / "jax_fusedar").rglob("*.py"), *(REPO / "torch_compat").rglob("*.py")]:
        if path.name != "environment.py":  # the list of every name, read or not
            read |= set(re.findall(r'"(JAX_FUSEDAR_[A-Z0-9_]+)"', path.read_text()))
    # JAX_FUSEDAR_ANCHOR: read by the torch bench as a folder path (any text names a folder;
    # the bench reports a missing one): nothing to parse.
    assert read - {"JAX_FUSEDAR_ANCHOR"} == {var for var, _ in environment.READERS}


# (variable, bad value, what its problem says); the CLI's tests run them too.
HANDSHAKE_RANGE = "$JAX_FUSEDAR_HANDSHAKE_TIMEOUT_S must be in (0, 3600]"
UNKNOWN_BACKEND = "unknown all-reduce backend 'fast' (from the $JAX_FUSEDAR_ALLREDUCE_BACKEND)"
BAD = [
    ("JAX_FUSEDAR_STRICT", "maybe", "$JAX_FUSEDAR_STRICT='maybe' is not a boolean"),
    ("JAX_FUSEDAR_HANDSHAKE", "sometimes", "$JAX_FUSEDAR_HANDSHAKE='sometimes' is not a boolean"),
    ("JAX_FUSEDAR_TIMEOUT_S", "abc", "$JAX_FUSEDAR_TIMEOUT_S='abc' is not a number of seconds"),
    ("JAX_FUSEDAR_TIMEOUT_S", "-1", "$JAX_FUSEDAR_TIMEOUT_S must be in [0, 3600] seconds"),
    ("JAX_FUSEDAR_HANDSHAKE_TIMEOUT_S", "0", HANDSHAKE_RANGE),
    ("JAX_FUSEDAR_HANDSHAKE_TIMEOUT_S", "-3", HANDSHAKE_RANGE),
    ("JAX_FUSEDAR_ALLREDUCE_BACKEND", "fast", UNKNOWN_BACKEND),
]


@pytest.mark.parametrize("var,value,message", BAD)
def test_a_bad_value_is_named(clean_env, var, value, message):
    clean_env.setenv(var, value)
    found = environment.problems()
    assert len(found) == 1 and message in found[0], found


def test_unset_good_and_all_bad_values(clean_env):
    assert environment.problems() == []
    good = dict(STRICT="on", HANDSHAKE="0", TIMEOUT_S="0", HANDSHAKE_TIMEOUT_S="2.5")
    for var, value in dict(good, ALLREDUCE_BACKEND="xla").items():
        clean_env.setenv(f"JAX_FUSEDAR_{var}", value)
    assert environment.problems() == []
    # All bad values are reported together.
    one_each = {var: value for var, value, _ in BAD}
    for var, value in one_each.items():
        clean_env.setenv(var, value)
    assert len(environment.problems()) == len(one_each) == 5


# A CMake variable of ffi/CMakeLists.txt, never read from the environment; the misspelling
# the docs show as an example.
NOT_VARIABLES = {"JAX_FUSEDAR_HAVE_CORE", "JAX_FUSEDAR_STICT"}


def test_every_variable_named_in_the_repository_is_known():
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    )
    named = set()
    for name in files.stdout.split():
        path = REPO / name
        if path.is_file() and name != "tests/common/test_environment.py":  # its misspellings
            try:
                named |= set(re.findall(r"JAX_FUSEDAR_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
            except UnicodeDecodeError:
                continue
    assert named - NOT_VARIABLES == set(environment.KNOWN)


def test_an_unknown_variable_is_named_with_the_nearest_known_one():
    env = {"JAX_FUSEDAR_STICT": "1", "JAX_FUSEDAR_TIMEOUT": "5", "JAX_FUSEDAR_STRICT": "1"}
    env.update({"JAX_FUSEDAR_XYZZY": "1", "PATH": "/bin"})  # STRICT is known: not named
    found = environment.unknown(env)
    assert found[0] == (
        "$JAX_FUSEDAR_STICT is set but jax_fusedar reads no such variable: did you mean "
        "$JAX_FUSEDAR_STRICT?"
    )
    assert found[1].startswith("$JAX_FUSEDAR_TIMEOUT is set")
    assert found[1].endswith("did you mean $JAX_FUSEDAR_TIMEOUT_S?")
    # Nothing close: the known names are listed.
    assert found[2].startswith("$JAX_FUSEDAR_XYZZY is set") and "JAX_FUSEDAR_STRICT" in found[2]
    assert "did you mean" not in found[2] and len(found) == 3
    assert environment.unknown({v: "1" for v in environment.KNOWN}) == []


@pytest.mark.parametrize("module", ["jax_fusedar", "jax_fusedar.common.patterns"])
def test_importing_the_package_warns_about_an_unknown_variable(monkeypatch, module):
    monkeypatch.setenv("JAX_FUSEDAR_STICT", "1")
    r = run_code(f"import {module}", timeout=120)
    assert r.returncode == 0, r.stderr
    assert (
        "UnknownVariableWarning: $JAX_FUSEDAR_STICT is set but jax_fusedar reads no such "
        "variable: did you mean $JAX_FUSEDAR_STRICT?"
    ) in r.stderr, r.stderr
    assert r.stderr.count("UnknownVariableWarning") == 1


def test_the_handshakes_earlier_names_are_still_read(clean_env):
    # Until 0.1.0 the handshake was "check_calls": its variables and arguments still work,
    # and a variable's new name wins over its earlier one.
    from jax_fusedar.common import handshake

    clean_env.setenv("JAX_FUSEDAR_CHECK_CALLS", "1")
    clean_env.setenv("JAX_FUSEDAR_CHECK_TIMEOUT_S", "7")
    assert handshake.resolve_handshake(None) is True
    assert handshake.resolve_handshake_timeout_s(None) == 7.0
    assert environment.unknown() == []
    clean_env.setenv("JAX_FUSEDAR_HANDSHAKE", "0")
    assert handshake.resolve_handshake(None) is False
    clean_env.setenv("JAX_FUSEDAR_CHECK_TIMEOUT_S", "never")
    assert environment.problems() == [
        "$JAX_FUSEDAR_CHECK_TIMEOUT_S='never' is not a number of seconds"
    ]
    assert handshake.earlier_name(None, True, "handshake") is True
    assert handshake.earlier_name(False, None, "handshake") is False
    with pytest.raises(TypeError, match="pass handshake or its earlier name check_calls"):
        handshake.earlier_name(True, True, "handshake")
