"""The fenced code blocks of the docs/plugins pages, for tests that run a page's examples."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import re
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

#: docs/plugins in a source checkout.
PLUGIN_DOCS = Path(__file__).resolve().parents[5] / "docs" / "plugins"


def code_blocks(page: str | Path, language: str = "python") -> list[str]:
    """Every ```language block of ``page`` (a docs/plugins file name, or a path), in order."""
    path = PLUGIN_DOCS / page if isinstance(page, str) else page
    return [str(b) for b in re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.DOTALL)]


def code_block(page: str | Path, first_line: str, language: str = "python") -> str:
    """The block of ``page`` whose first line is ``first_line``.

    Raises:
        AssertionError: the page has no such block.
    """
    for text in code_blocks(page, language):
        if text.splitlines()[0] == first_line:
            return text
    name = page if isinstance(page, str) else page.name
    raise AssertionError(f"{name} has no {language} block starting with {first_line!r}")


@contextlib.contextmanager
def page_package(root: Path, package: str, modules: Mapping[str, str]) -> Iterator[Path]:
    """Package ``package`` under ``root``, importable while the context lasts.

    Args:
        root: An empty directory (``tmp_path_factory.mktemp(...)``).
        package: The package name, e.g. ``"acme_plugins"``.
        modules: Module name -> source (a page's block), e.g. ``{"policy": code_block(...)}``.

    Yields ``root`` (on ``sys.path``); afterwards ``root`` leaves ``sys.path`` and the
    package's modules leave ``sys.modules``.
    """
    directory = root / package
    directory.mkdir()
    (directory / "__init__.py").write_text("")
    for module, source in modules.items():
        (directory / f"{module}.py").write_text(source)
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
            del sys.modules[name]


def exec_block(source: str, namespace: dict[str, Any] | None = None,
               filename: str = "page_block.py") -> dict[str, Any]:
    """Run a page's block as a module body (in ``namespace``, kept between blocks); returns it.

    The namespace is registered in ``sys.modules`` under its ``__name__`` while the block
    runs, so what needs its module (``@dataclass``, pickling) works as in a real file;
    ``"__main__"`` (a script's ``if __name__ == "__main__":``) is never replaced.
    """
    if namespace is None:
        namespace = {"__name__": filename.removesuffix(".py")}
    name = namespace.setdefault("__name__", "page_block")
    if name == "__main__" or name in sys.modules:
        exec(compile(source, filename, "exec"), namespace)
        return namespace
    module = types.ModuleType(name)
    module.__dict__.update(namespace)
    sys.modules[name] = module
    try:
        exec(compile(source, filename, "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    namespace.update(module.__dict__)
    return namespace


def run_page_tests(source: str, filename: str = "page_tests.py", **fixtures: Any) -> list[str]:
    """Run every ``test_*`` function of a page's test block, as pytest would collect them.

    ``@pytest.mark.parametrize`` cases run once each (stacked marks: every combination);
    ``fixtures`` (e.g. ``tmp_path=...``) are passed to the tests that take them by name.
    Returns the test names run (one per case); a block without tests is an AssertionError.
    """
    namespace = exec_block(source, filename=filename)
    ran: list[str] = []
    for name, test in list(namespace.items()):
        if not (name.startswith("test_") and callable(test)):
            continue
        axes = []
        for mark in getattr(test, "pytestmark", []):
            if mark.name == "parametrize":
                names, values = mark.args[0], mark.args[1]
                names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
                axes.append([dict(zip(names, v if len(names) > 1 else (v,), strict=True))
                             for v in values])
        wanted = inspect.signature(test).parameters
        for combination in itertools.product(*axes):
            kwargs = {k: v for case in combination for k, v in case.items()}
            kwargs.update({k: v for k, v in fixtures.items() if k in wanted})
            test(**kwargs)
            ran.append(name)
    assert ran, f"{filename} has no test_* function"
    return ran
