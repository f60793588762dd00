"""pytest configuration: hypothesis profiles.

`ci` (loaded when the environment variable `CI` is set): derandomized, so a failure in CI is
the same failure on a rerun and on a laptop, with no deadline (shared runners are slow) and the
reproduction blob printed. `dev` otherwise: hypothesis's randomized search, no deadline.
`HYPOTHESIS_PROFILE=<name>` picks a profile explicitly.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)
