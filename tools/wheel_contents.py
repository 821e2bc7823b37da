"""Checks what a jax_fusedar wheel holds: the two packages (``jax_fusedar``, ``torch_compat``),
the wheel's metadata and auditwheel's ``jax_fusedar.libs``, and no code of the checkout's
benchmarks, tools or tests (those stay in the repository; tools/wheel_check.sh runs this).

    python tools/wheel_contents.py WHEEL
"""

from __future__ import annotations

import re
import sys
import zipfile

ALLOWED_TOP = re.compile(r"(jax_fusedar|torch_compat)$|jax_fusedar(\.libs|-[^/]+\.dist-info)$")
# The checkout's own folders, and a benchmark module by its name anywhere in the packages.
CHECKOUT_CODE = re.compile(r"(^|/)(benchmarks|tools|tests)(/|$)|(^|/)bench[^/]*\.py$")


def problems(names) -> list:
    """What in a wheel of these file names is not product code."""
    top = sorted({n.split("/")[0] for n in names})
    return [f"{t}/ (not a package of the product)" for t in top if not ALLOWED_TOP.match(t)] + [
        f"{n} (the checkout's code)" for n in sorted(names) if CHECKOUT_CODE.search(n)
    ]


def main(argv) -> int:
    names = zipfile.ZipFile(argv[1]).namelist()
    found = problems(names)
    if found:
        print("wheel_contents: the wheel holds more than the product:", *found, sep="\n  ")
        return 1
    top = sorted({n.split("/")[0] for n in names})
    print(f"{len(names)} files, top level: {', '.join(top)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
