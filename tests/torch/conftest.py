"""The torch tests need torch: without it (a JAX-only install) the whole folder skips with
the reason, instead of each module skipping itself before its imports."""

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")
pytest.importorskip("torch.distributed", reason="this torch build has no torch.distributed")
