"""Sessions for the monorepo.

Two ways to run them:

* ``nox -s tests`` builds a fresh virtualenv per session and installs the packages into it;
* ``nox --no-venv -s tests`` runs in the current environment (the ``.venv`` made by
  ``scripts/setup.sh``) and installs nothing: what CI and README command (2) use.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ["plugin-sdk", "engine-core", "engine-kernels", "server", "testing-fixtures"]
# engine-kernels with triton (its [cuda] extra): its tests run the kernels in Triton's
# interpreter, though a CPU install of engine-server never gets triton.
EXTRAS = {"engine-kernels": "[cuda]"}
EDITABLE = [arg for pkg in PACKAGES for arg in ("-e", f"packages/{pkg}{EXTRAS.get(pkg, '')}")]
TORCH = "torch>=2.6,<2.14"
# The API snapshots in packages/plugin-sdk/api/ are read with this griffe (see scripts/sdkapi).
GRIFFE = "griffe==2.4.1"
# The dependency linter of `lint` (each package's [tool.deptry] in its pyproject.toml).
DEPTRY = "deptry==0.25.1"

nox.options.sessions = ["tests", "lint", "typecheck"]


def _in_place(session: nox.Session) -> bool:
    return isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv)


def _python(session: nox.Session) -> str:
    """The interpreter to run: this one in --no-venv mode, the session's otherwise."""
    return sys.executable if _in_place(session) else "python"


def _install(session: nox.Session, *args: str) -> None:
    if not _in_place(session):
        session.install(*args)


@nox.session
@nox.parametrize("package", [*PACKAGES, "integration", "tooling"])
def tests(session: nox.Session, package: str) -> None:
    """Run one package's tests (``integration``, ``tooling``: the tests in tests/)."""
    _install(session, TORCH)
    _install(session, *EDITABLE, "-e", "packages/testing-fixtures[test]", GRIFFE)
    path = f"tests/{package}" if package in ("integration", "tooling") else \
        f"packages/{package}/tests"
    if not any((ROOT / path).glob("test_*.py")):
        session.skip(f"{path} has no tests yet")
    # Exit code 5 means "no tests collected": fine for a package whose tests are still to come.
    session.run(_python(session), "-m", "pytest", path, "-p", "engine.testing",
                *session.posargs, success_codes=[0, 5], external=True)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff over every package, tests, benchmarks and this file; deptry over each package.

    deptry checks that each package declares (in its pyproject.toml) every distribution its
    ``src`` imports, and uses what it declares. It reads which modules a distribution
    provides from the installed packages, so the packages are installed first.
    """
    _install(session, "ruff", DEPTRY)
    _install(session, TORCH)
    _install(session, *EDITABLE, "-e", "packages/testing-fixtures[test]")
    paths = [p for p in ("packages", "tests", "benchmarks", "scripts", "noxfile.py")
             if (ROOT / p).exists()]
    session.run(_python(session), "-m", "ruff", "check", *paths, external=True)
    for package in PACKAGES:
        with session.chdir(ROOT / "packages" / package):
            session.run(_python(session), "-m", "deptry", "src", external=True)


@nox.session
def api_compat(session: nox.Session) -> None:
    """The SDK's API gate against its released baseline (docs/plugins/versioning.md)."""
    _install(session, GRIFFE)
    session.run(_python(session), "scripts/sdk_api.py", "check", *session.posargs,
                external=True)


@nox.session
def release_sdk(session: nox.Session) -> None:
    """Cut an SDK release: ``nox -s release_sdk -- X.Y.Z`` (checks, then writes the files)."""
    if not session.posargs:
        session.error("give the release: nox -s release_sdk -- X.Y.Z")
    _install(session, GRIFFE)
    session.run(_python(session), "scripts/sdk_api.py", "release", *session.posargs,
                external=True)


@nox.session
def typecheck(session: nox.Session) -> None:
    """Mypy: strict on the SDK, default strictness elsewhere."""
    _install(session, TORCH)
    _install(session, "mypy", GRIFFE, *EDITABLE)
    session.run(_python(session), "-m", "mypy", "packages/plugin-sdk/src/engine/sdk",
                "packages/engine-core/src/engine/core", "packages/server/src/engine/server",
                "packages/engine-kernels/src/engine/kernels", "scripts/sdkapi", external=True)


# The grpcio-tools release the committed code in engine.core.rpc._gen comes from (its version
# is stamped into the generated files): see scripts/gen_proto.py.
GRPC_TOOLS = "grpcio-tools==1.85.1"


@nox.session
def proto(session: nox.Session) -> None:
    """Regenerate engine.core.rpc._gen from proto/engine/v1 (commit the result)."""
    _install(session, GRPC_TOOLS)
    session.run(_python(session), "scripts/gen_proto.py", external=True)


@nox.session
def proto_check(session: nox.Session) -> None:
    """Regenerate into a temp dir and fail if the committed generated code differs."""
    _install(session, GRPC_TOOLS)
    session.run(_python(session), "scripts/gen_proto.py", "--check", external=True)
