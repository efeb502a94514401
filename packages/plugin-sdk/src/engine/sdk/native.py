"""Building a plugin's C or C++ code on first use, cached by everything it depends on.

A kernel with native code (a linear kernel's product, an op, an attention kernel) ships
its sources in its package and builds them where it runs, for that CPU: the engine's own
CPU kernels (engine-kernels) are built this way, and so is a plugin's. The library is
compiled with the system C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) at
``-O3 -march=<target_arch()> -fopenmp``, plus each source's own flags, into
:func:`cache_dir` under a name derived from the sources, the headers, the compiler and
its version, the flags and the CPU's features, so a later process (a worker, the next
start) loads the built file in milliseconds and a changed source or another CPU builds
anew. The build writes a temporary file and renames it, so processes building the same
library at once never load half of it.

OpenMP regions run on the runtime torch already loaded (the same ``libgomp.so.1``), with
the threads torch has; a function of the CPU step graph's ABI gets the most it may use as
``max_threads`` (:mod:`engine.sdk.graph_calls`). Load the library with
:func:`load_library` and wrap its functions with
:meth:`GraphFunction.from_library <engine.sdk.graph_calls.GraphFunction.from_library>`
(or ``ctypes``)::

    from pathlib import Path
    from engine.sdk.native import load_library

    lib = load_library("acme_kernels", {Path(__file__).with_name("acme.cpp"): ("-ffast-math",)})

Where the library cannot be built (no compiler, torch without OpenMP, a compile error,
an unwritable cache) the call raises :class:`NativeBuildError` saying why; a kernel
answers ``is_supported`` with that reason so the engine picks another.

.. versionadded:: 1.1
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from engine.sdk.errors import EngineSDKError

# -ffast-math only when compiling (a source may ask for it): linked with it, GCC < 13 adds
# crtfastmath.o, whose constructor turns on flush-to-zero for the whole process.
COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
#: The C++ standard C++ sources are compiled with (``.c`` sources are compiled as C).
CXX_STANDARD = "-std=c++17"
INCLUDE_DIR = Path(__file__).with_name("include")
"""On every build's include path: ``engine_graph_call.h``, the CPU step graph's ABI for C++.

``ENGINE_GRAPH_ENTRY(name, count) { ... }`` defines ``engine_graph_<name>`` with the
signature of :mod:`engine.sdk.graph_calls` and gives its body the arguments as ``x``.

.. versionadded:: 1.1
"""

Sources = Mapping[Path, Sequence[str]] | Sequence[Path]


class NativeBuildError(EngineSDKError, RuntimeError):
    """A native library cannot be built or loaded here; the message says why.

    .. versionadded:: 1.1
    """


def cache_dir() -> Path:
    """Where the engine keeps what it builds or measures once.

    ``$ENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/engine`` or ``~/.cache/engine``.

    .. versionadded:: 1.1
    """
    root = os.environ.get("ENGINE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "engine"


def target_arch() -> str:
    """The ``-march`` native code is built for: ``$ENGINE_CPU_KERNELS_MARCH``, else ``native``.

    Another value (``haswell``: AVX2 and FMA, no AVX-512) builds the code paths of an older
    CPU on this one; tests run an AVX2 build that way on AVX-512 machines. It must be a
    subset of this CPU's instructions, or the code dies with SIGILL when called.

    .. versionadded:: 1.1
    """
    return os.environ.get("ENGINE_CPU_KERNELS_MARCH") or "native"


def cpu_flags() -> str:
    """The first CPU's feature flags (``/proc/cpuinfo``), space-separated; "" if unknown.

    .. versionadded:: 1.1
    """
    return _cpuinfo_field("flags")


def cpu_model() -> str:
    """The first CPU's model name (``/proc/cpuinfo``); "" if unknown.

    .. versionadded:: 1.1
    """
    return _cpuinfo_field("model name")


def _cpuinfo_field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip() if ":" in line else ""
    except OSError:
        pass
    return ""


def find_compiler() -> str | None:
    """The C++ compiler builds use: ``$CXX``, else ``c++``, ``g++`` or ``clang++``; or None.

    .. versionadded:: 1.1
    """
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_library(name: str, sources: Sources, headers: Sequence[Path] = ()) -> Path:
    """The built ``{cache_dir}/native/{name}-{hash}.so`` of ``sources``, built if not cached.

    Args:
        name: The library's name (letters, digits, ``_``, ``-``); name it after your
            package so two plugins' libraries never share a file.
        sources: C (``.c``) and C++ files, or a mapping of each to its own flags (after
            the common ``-O3 -fopenmp -fPIC -march=...``).
        headers: Files the sources include (beyond :data:`INCLUDE_DIR`'s): their text is
            part of the cache key.

    Raises:
        NativeBuildError: no compiler, torch without OpenMP, or the build failed (with the
            compiler's output, or how to fix an unwritable cache).

    .. versionadded:: 1.1
    """
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise NativeBuildError(f"native library name {name!r}: use letters, digits, '_' "
                               f"and '-' only")
    flags = {Path(s): tuple(f) for s, f in sources.items()} if isinstance(sources, Mapping) \
        else {Path(s): () for s in sources}
    if not flags:
        raise NativeBuildError(f"native library {name!r}: no sources given")
    _check_openmp(name)
    compiler = find_compiler()
    if compiler is None:
        raise NativeBuildError(
            f"building {name}: no C++ compiler found ($CXX, c++, g++ or clang++ on PATH); "
            f"install one (e.g. apt install g++)")
    try:
        texts = [path.read_text()
                 for path in (*flags, *headers, *sorted(INCLUDE_DIR.glob("*.h")))]
    except OSError as exc:
        raise NativeBuildError(f"building {name}: {exc}") from None
    version = _compiler_version(compiler)
    key = hashlib.sha256("\0".join(
        [*texts, compiler, version, repr((COMPILE_FLAGS, CXX_STANDARD, LINK_FLAGS)),
         repr(sorted((str(p.name), f) for p, f in flags.items())), target_arch(),
         cpu_flags()]).encode())
    target = cache_dir() / "native" / f"{name}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            _build(compiler, target, flags)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeBuildError(
                f"building {name} into {target.parent} failed ({exc}); set ENGINE_CACHE_DIR "
                f"to a writable directory") from None
    return target


def load_library(name: str, sources: Sources, headers: Sequence[Path] = ()) -> ctypes.CDLL:
    """The loaded :func:`build_library` of ``sources``.

    Raises:
        NativeBuildError: it cannot be built or loaded, saying why.

    .. versionadded:: 1.1
    """
    target = build_library(name, sources, headers)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeBuildError(f"loading {target} failed: {exc}") from None


@functools.cache
def _compiler_version(compiler: str) -> str:
    """``compiler --version``: asked once per process, whichever libraries it builds."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def _check_openmp(name: str) -> None:
    """Code built with -fopenmp must share torch's OpenMP runtime: torch must have one."""
    try:
        import torch
    except ImportError:  # no torch in this process: nothing to share a runtime with
        return
    if not torch.backends.openmp.is_available():  # type: ignore[no-untyped-call]
        raise NativeBuildError(f"building {name}: torch was built without OpenMP")


def _build(compiler: str, target: Path, sources: Mapping[Path, Sequence[str]]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]
        built = Path(tmp) / target.name
        commands = [([compiler, *_language(source), *COMPILE_FLAGS, f"-march={target_arch()}",
                      f"-I{INCLUDE_DIR}", *flags, "-c", str(source), "-o", str(obj)], source.name)
                    for (source, flags), obj in zip(sources.items(), objects, strict=True)]
        commands.append(([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(built)],
                         target.name))
        for command, what in commands:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise NativeBuildError(
                    f"building {what} with {compiler} failed:\n{result.stderr.strip()}")
        os.replace(built, target)  # atomic: a concurrent process sees all of it or none


def _language(source: Path) -> tuple[str, ...]:
    return ("-x", "c") if source.suffix == ".c" else (CXX_STANDARD,)


__all__ = ["INCLUDE_DIR", "NativeBuildError", "build_library", "cache_dir", "cpu_flags",
           "cpu_model", "find_compiler", "load_library", "target_arch"]
