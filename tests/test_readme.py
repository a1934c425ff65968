"""Every ```python block of README.md runs: each in a fresh interpreter, from the repository root, so
the documented API cannot drift from the code."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.M | re.S)


def test_the_readme_has_python_snippets():
    assert len(BLOCKS) >= 3
    assert any("specfit.select(" in b for b in BLOCKS) and any("SpecFit.from_pretrained(" in b for b in BLOCKS)
    assert any("specfit.evaluate(" in b for b in BLOCKS)
    for block in BLOCKS:  # "under ten lines": the code, imports and blank lines aside
        code = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith(("import ", "from "))]
        assert len(code) < 10, block


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_snippet_runs(block):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # a shared CI machine
    res = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"README snippet failed:\n{block}\n--- stderr ---\n{res.stderr[-3000:]}"
    assert res.stdout.strip(), "every snippet prints its result"
