"""acme-engine-plugins, a third-party package written from docs/plugins and the SDK alone,
installs beside engine-server (no allowlist) and its own test suite passes unchanged.

The package (``packages/testing-fixtures/plugins/acme``) has one plugin for every
extension point in ``engine.sdk.groups.GROUPS``; its tests prove each is reached when
selected and untouched when not. Here it is pip-installed for real (its entry points come
from installed metadata) and its tests run in a subprocess, as its author's CI would.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from engine.sdk.groups import GROUPS
from engine.testing.test_plugins import (
    ACME_DIR,
    ACME_SOURCE,
    env_with_plugins,
    install_test_plugins,
)

DIST = "acme-engine-plugins"


@pytest.fixture(scope="module")
def acme_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package pip-installed into a directory of its own (nothing else there)."""
    return install_test_plugins(tmp_path_factory.mktemp("acme-site"), (ACME_DIR,))


def test_it_declares_only_what_this_environment_satisfies(acme_site: Path) -> None:
    [dist] = importlib.metadata.distributions(path=[str(acme_site)])
    assert dist.metadata["Name"] == DIST
    assert sorted({e.group for e in dist.entry_points}) == sorted(GROUPS)
    runtime = [Requirement(r) for r in dist.requires or [] if "extra ==" not in r]
    assert {r.name for r in runtime} <= {"engine-plugin-sdk", "torch", "pydantic", "regex"}
    for requirement in runtime:
        installed = importlib.metadata.version(requirement.name)
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{requirement} is not satisfied by the installed {installed}")
        if requirement.name in ("engine-plugin-sdk", "torch"):
            assert "<" in str(requirement.specifier), f"{requirement} has no upper bound"


def test_its_own_tests_pass_beside_engine_server(acme_site: Path, tmp_path: Path) -> None:
    env = env_with_plugins(acme_site)  # ENGINE_PLUGINS unset: every plugin allowed
    where = subprocess.run([sys.executable, "-c", "import acme_engine_plugins as m; "
                            "print(m.__file__)"], env=env, capture_output=True, text=True)
    assert where.stdout.strip().startswith(str(acme_site)), where  # the installed copy
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(ACME_SOURCE / "tests"), "-p", "engine.testing",
         "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "basetemp")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert result.returncode == 0, (
        f"acme-engine-plugins' tests failed ({summary[0]}):\n{result.stdout[-8000:]}\n"
        f"{result.stderr[-3000:]}")
    assert " passed" in summary[0], summary[0]  # something ran
