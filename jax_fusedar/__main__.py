"""``python -m jax_fusedar {demo,bench}``: see ``jax_fusedar.cli.main``."""

import sys

from jax_fusedar.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
