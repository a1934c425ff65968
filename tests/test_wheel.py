"""The built wheel installs one top-level name, ``specfit``, and ships the proxy checkpoint files.

Builds from a copy of the tracked files (``git ls-files``) so the checkout gets no ``build/`` folder.
By hand: ``pip wheel --no-deps --no-build-isolation -w /tmp/whl .`` and list the zip.
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_has_only_specfit_at_the_top_and_the_shipped_proxy(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to list the tracked files")
    pytest.importorskip("wheel", reason="pip wheel --no-build-isolation needs the wheel package (the test extra)")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    src = tmp_path / "src"
    for rel in filter(None, files.decode().split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path / "whl"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(out), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = out.glob("specfit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"specfit"}, sorted(top)
    for pkg in ("specfit/core/tree.py", "specfit/engine/decoder.py", "specfit/solvers/exact.py",
                "specfit/models/qwen3_moe/model.py", "specfit/eval/run.py", "specfit/cli.py"):
        assert pkg in names
    shipped = [p.relative_to(ROOT).as_posix() for d in ("models/proxy/target", "models/proxy/eagle3")
               for p in (ROOT / d).iterdir() if p.is_file()]
    assert shipped and all(f"specfit/{p}" in names for p in shipped), "proxy files missing from the wheel"
    assert "specfit/eval/data/" in "".join(names)
