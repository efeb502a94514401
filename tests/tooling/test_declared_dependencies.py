"""Each package declares what its code imports: deptry, as ``nox -s lint`` runs it.

``engine serve --config FILE.yaml`` imported PyYAML, which no package declared (it came
only through transformers); a package installed on its own would fail at that import.
deptry reads each package's ``[tool.deptry]`` and reports an import with no declaration
(or only a transitive one) and a declaration nothing imports.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir()
                  if (p / "pyproject.toml").exists() and (p / "src").is_dir())

pytest.importorskip("deptry", reason="deptry is installed by scripts/setup.sh")


@pytest.mark.parametrize("package", PACKAGES)
def test_the_package_declares_what_it_imports(package: str) -> None:
    result = subprocess.run([sys.executable, "-m", "deptry", "src", "--no-ansi"],
                            cwd=ROOT / "packages" / package, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_server_declares_pyyaml() -> None:
    text = (ROOT / "packages" / "server" / "pyproject.toml").read_text()
    assert '"pyyaml>=' in text
