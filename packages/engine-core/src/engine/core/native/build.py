"""Building a native library of the engine on first use, cached by everything it depends on.

``build_library`` compiles C++ sources with the system compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``) for this machine (``-O3 -march=native -fopenmp``; ``target_arch()``
says how to build for an older CPU; float flags per source) into the cache directory
(``$ENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/engine`` or ``~/.cache/engine``), under a
name derived from the sources, the compiler and the CPU's flags; later processes find the
built file in milliseconds. Two libraries are built this way: the CPU kernels
(``library.py``) and the step graph's runtime (``runtime.py``), each on its own. Also the
checks their Python wrappers share.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from engine.core.machine import cache_dir, cpu_flags
from engine.sdk.graph_calls import GraphFunction, is_recording

# -ffast-math only when compiling: linked with it, GCC < 13 adds crtfastmath.o, whose
# constructor turns on flush-to-zero for the whole process (torch's numerics included).
COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
T = TypeVar("T")


class NativeKernelsUnavailable(RuntimeError):
    """A native library cannot be built or loaded here; the message says why."""


def target_arch() -> str:
    """The ``-march`` the kernels are built for: ``$ENGINE_CPU_KERNELS_MARCH``, else ``native``.

    Another value (``haswell``: AVX2 and FMA, no AVX-512) builds the code paths of an older
    CPU on this one; the tests run the AVX2 build that way on AVX-512 machines. It must be a
    subset of this CPU's instructions, or the kernels die with SIGILL when called.
    """
    return os.environ.get("ENGINE_CPU_KERNELS_MARCH") or "native"


def find_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_library(stem: str, sources: Mapping[Path, Sequence[str]], headers: Sequence[Path],
                  compiler: str | None) -> Path:
    """The built ``{stem}-{hash}.so`` of ``sources``, built where it is not cached yet.

    Each source is compiled with its flags after ``COMPILE_FLAGS``.

    Raises:
        NativeKernelsUnavailable: no OpenMP in torch, no compiler, or the build failed
            (with the compiler's output, or how to fix an unwritable cache).
    """
    if not torch.backends.openmp.is_available():  # type: ignore[no-untyped-call]
        raise NativeKernelsUnavailable("torch was built without OpenMP")
    if compiler is None:
        raise NativeKernelsUnavailable(
            "no C++ compiler found ($CXX, c++, g++ or clang++ on PATH); install one (e.g. "
            "apt install g++) to build the engine's CPU kernels")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join(
        [*(source.read_text() for source in (*sources, *headers)), compiler, version,
         repr((COMPILE_FLAGS, dict(sources), LINK_FLAGS)), target_arch(),
         cpu_flags()]).encode())
    target = cache_dir() / "cpu_kernels" / f"{stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            _build(compiler, target, sources)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeKernelsUnavailable(
                f"building into {target.parent} failed ({exc}); set ENGINE_CACHE_DIR to a "
                f"writable directory") from None
    return target


def load_library(stem: str, sources: Mapping[Path, Sequence[str]], headers: Sequence[Path],
                 compiler: str | None, wrap: Callable[[ctypes.CDLL], T]) -> T:
    """``wrap`` of the loaded ``build_library(...)``; raises ``NativeKernelsUnavailable``."""
    target = build_library(stem, sources, headers, compiler)
    try:
        return wrap(ctypes.CDLL(str(target)))
    except OSError as exc:
        raise NativeKernelsUnavailable(f"loading {target} failed: {exc}") from None


def _build(compiler: str, target: Path, sources: Mapping[Path, Sequence[str]]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in sources]
        built = Path(tmp) / target.name
        commands = [([compiler, *COMPILE_FLAGS, f"-march={target_arch()}", *flags, "-c",
                      str(source), "-o", str(obj)],
                     source.name)
                    for (source, flags), obj in zip(sources.items(), objects, strict=True)]
        commands.append(([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(built)],
                         target.name))
        for command, what in commands:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise NativeKernelsUnavailable(
                    f"building {what} with {compiler} failed:\n{result.stderr.strip()}")
        os.replace(built, target)  # atomic: a concurrent process sees all of it or none


def invoke(kernel: str, entry: Callable[..., int | None], function: GraphFunction | None,
           *args: object) -> int:
    """Call the ctypes function ``entry``, or record its step-graph entry ``function``.

    While a step graph is recorded the call of ``function`` with the same arguments is
    recorded instead (``entry.argtypes`` say which are pointers and floats). Returns the
    status (0 when recorded).

    Raises:
        NotCapturable: a recording reached a kernel without a step-graph entry.
    """
    if is_recording():
        if function is None:
            from engine.core.native.graph import NotCapturable

            raise NotCapturable(f"the native kernel {kernel} has no step-graph entry")
        argtypes = entry.argtypes  # type: ignore[attr-defined]
        return function(*(ctypes.c_void_p(int(value or 0))  # type: ignore[call-overload]
                          if ctype is ctypes.c_void_p
                          else float(value) if ctype is ctypes.c_float  # type: ignore[arg-type]
                          else int(value)  # type: ignore[call-overload]
                          for value, ctype in zip(args, argtypes, strict=True)))
    status = entry(*args)
    return 0 if status is None else status


def call_status(kernel: str, status: int) -> None:
    """Raise for a library call's nonzero status, naming the call."""
    if status:  # the library and its Python wrapper disagree: a stale or foreign build
        raise RuntimeError(f"{kernel}: the library refused its arguments (status {status})")


def check_rows(kernel: str, dtype: torch.dtype, width: int, *tensors: torch.Tensor) -> None:
    """Refuse anything but ``[rows, width]`` CPU views of ``dtype`` with contiguous rows."""
    rows = tensors[0].shape[0]
    for t in tensors:
        if (t.dim() != 2 or t.shape[0] != rows or t.shape[1] != width or t.stride(1) != 1
                or t.dtype != dtype or not t.is_cpu):
            raise ValueError(
                f"{kernel}: expected [{rows}, {width}] {dtype} CPU tensors with contiguous rows, "
                f"got {[(tuple(t.shape), t.stride(), t.dtype, t.device.type) for t in tensors]}")
