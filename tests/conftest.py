"""Test configuration: under CI (CI=true), hypothesis draws the same examples on every run so that a
submission's result does not depend on luck; locally it keeps exploring new ones."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
