"""The repository speaks of the product, not of how it was made: no work sessions, no machines
that were lent, no remote-run tools or the folders they carried, no tracker issue numbers.
Measurements carry their date, commit, hardware and versions instead (docs/testing.md).

The patterns are precise on purpose: JAX's scan ``carry``, a Python or torch.distributed
session, or "helpers" of a module are ordinary words and stay allowed."""

import re
import subprocess

import pytest

from tests.repo import REPO

# (pattern, what it is); case-insensitive.
FORBIDDEN = [
    (r"\bsessions?[\s-]*\d", "a numbered work session"),
    (
        r"\b(this|next|previous|prior|last|later|earlier|current|work|device|gpu)\s+sessions?\b",
        "a work session",
    ),
    (r"\blent\b|\blending\b|\bloaned\b", "lent machines"),
    (r"\bnvidia-h200(-x\d+)?\b|\bkind=nvidia", "a machine kind of the remote-run tool"),
    (
        r"\bremote[- ]run\b|\bdevice machine\b|\bdevice tool\b|\bgive_back\b|\bbudget_left",
        "the remote-run tool",
    ),
    (
        r"(^|[\s/`'\"(=\[])\.carry\b|\bcarry=\[|\bcarried\s+(core|library|binary|wheels?)\b",
        "a folder carried to a remote machine",
    ),
    (r"\bissues?\s*#?\d+|\bthe issue's\b", "an issue number"),
    (r"\bowed\b", "results still owed (say what is not measured, as a fact)"),
]
SELF = "tests/test_product_language.py"
TEXT_SUFFIXES = {
    "",
    *".py .md .txt .toml .cfg .sh .cmake .cu .cuh .h .cc .cpp .in .map .yml .yaml .json".split(),
}


def tracked_files():
    try:
        cmd = ["git", "ls-files", "-z"]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    names = [n for n in out.decode().split("\0") if n and n != SELF]
    return [n for n in names if (REPO / n).is_file() and (REPO / n).suffix in TEXT_SUFFIXES]


def findings(text: str):
    for pattern, what in FORBIDDEN:
        for m in re.finditer(pattern, text, re.IGNORECASE | re.MULTILINE):
            line = text.count("\n", 0, m.start()) + 1
            yield line, m.group(0).strip(), what


def test_no_history_words_in_the_repository():
    found = []
    for name in tracked_files():
        text = (REPO / name).read_text(errors="replace")
        found += [f"{name}:{line}: {word!r} ({what})" for line, word, what in findings(text)]
    assert not found, "history words in the repository:\n" + "\n".join(found)


CAUGHT = [
    "measured in session 6 on one H200",
    "(session-3 model)",
    "Session 4: where it went",
    "after the session's device time was spent in this session",
    "no 2-GPU machine was lent",
    'run kind=nvidia-h200-x2 carry=[".carry"]',
    "copy CORE to .carry/ first",
    "the carried core",
    "the issue's 210 us target",
    "(issue 17)",
    "Issue 4's layout",
    "a longer measurement is still owed",
    "run on the device machine",
]
ORDINARY = [
    "def step(carry, xs): x, h = carry",
    "the residual error carried through the norm",
    "a torch.distributed session",
    "paste them into one Python session",
    "shared helpers of the tests",
    "lends itself to",
    "issues a warning",
    "2 x H200 (NVLink)",
]


@pytest.mark.parametrize(
    "text, caught", [(t, True) for t in CAUGHT] + [(t, False) for t in ORDINARY]
)
def test_the_patterns_catch_history_words_and_leave_ordinary_ones_alone(text, caught):
    assert bool(list(findings(text))) is caught, text
