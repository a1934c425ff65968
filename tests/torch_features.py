"""What the installed torch runs, for the tests of paths that need it."""

from __future__ import annotations

import pytest
import torch

from specfit.models.qwen3_moe.model import cpu_grouped_mm_available

#: The CPU's grouped resident forwards (the static verifies, a verify without host routing): torch's CPU
#: ``grouped_mm`` kernel, in torch 2.9 and later (2.8 has the function without a CPU kernel).
needs_cpu_grouped_mm = pytest.mark.skipif(not cpu_grouped_mm_available(torch.float32, 128, 64),
                                          reason="this torch has no CPU grouped_mm kernel (torch >= 2.9)")
