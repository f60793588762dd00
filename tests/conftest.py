"""pytest configuration: hypothesis profiles.

`ci` (loaded when the environment variable `CI` is set): derandomized, so a failure in CI is
the same failure on a rerun and on a laptop, with no deadline (shared runners are slow) and the
reproduction blob printed. `dev` otherwise: hypothesis's randomized search, no deadline.
`HYPOTHESIS_PROFILE=<name>` picks a profile explicitly.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo process group and its CPU device mesh, torn down after the test."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
