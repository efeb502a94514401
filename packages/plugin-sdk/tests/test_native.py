"""``engine.sdk.native``: a plugin's C/C++ built where it runs, cached, failures explained."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from engine.sdk import native
from engine.sdk.graph_calls import GraphFunction

pytestmark = pytest.mark.skipif(native.find_compiler() is None, reason="no C++ compiler here")

C_SOURCE = """
#include <stdint.h>
int add_one(int value) { return value + 1; }
"""
CPP_ENTRY = """
#include "engine_graph_call.h"
ENGINE_GRAPH_ENTRY(twice, 2) {  // args: int64 [n], n
  int64_t* data = x.ptr<int64_t>(0);
  for (int64_t i = 0; i < x.a[1]; ++i) data[i] *= 2;
  return 0;
}
"""


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_c_source_is_built_once_and_then_loaded_from_the_cache(tmp_path: Path,
                                                                 cache: Path) -> None:
    source = tmp_path / "add.c"
    source.write_text(C_SOURCE)
    library = native.load_library("acme_add", [source])
    library.add_one.restype = ctypes.c_int
    assert library.add_one(41) == 42
    built = list((cache / "native").glob("acme_add-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert native.build_library("acme_add", [source]) == built[0]
    assert built[0].stat().st_mtime_ns == mtime  # not rebuilt
    source.write_text(C_SOURCE + "int unused(void) { return 0; }\n")
    assert native.build_library("acme_add", [source]) != built[0]  # a changed source


def test_cpp_gets_the_graph_abi_header(tmp_path: Path) -> None:
    import torch

    source = tmp_path / "twice.cpp"
    source.write_text(CPP_ENTRY)
    twice = GraphFunction.from_library(native.load_library("acme_twice", {source: ("-O2",)}),
                                       "engine_graph_twice", "acme.twice")
    values = torch.arange(5, dtype=torch.int64)
    assert twice(values, 5) == 0
    assert values.tolist() == [0, 2, 4, 6, 8]
    assert twice(values) == 254  # the entry's argument count is 2


def test_a_compile_error_is_reported_with_the_compilers_output(tmp_path: Path,
                                                               cache: Path) -> None:
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    with pytest.raises(native.NativeBuildError, match=r"building broken\.cpp with .* failed"):
        native.load_library("acme_broken", [source])
    assert not list(cache.rglob("*.so"))  # nothing half-built left


@pytest.mark.parametrize("name", ["", "a/b", "x y"])
def test_a_bad_name_is_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(native.NativeBuildError, match="letters, digits"):
        native.build_library(name, [tmp_path / "x.c"])


def test_no_sources_and_missing_sources_are_refused(tmp_path: Path) -> None:
    with pytest.raises(native.NativeBuildError, match="no sources"):
        native.build_library("acme", [])
    with pytest.raises(native.NativeBuildError, match="missing.c"):
        native.build_library("acme", [tmp_path / "missing.c"])


def test_without_a_compiler_it_says_what_to_install(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "find_compiler", lambda: None)
    source = tmp_path / "add.c"
    source.write_text(C_SOURCE)
    with pytest.raises(native.NativeBuildError, match="no C\\+\\+ compiler found"):
        native.build_library("acme_add", [source])


def test_the_compiler_and_cache_follow_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setenv("CXX", "g++")
    assert native.find_compiler() == shutil.which("g++")
    monkeypatch.delenv("ENGINE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.cache_dir() == tmp_path / "engine"
    monkeypatch.setenv("ENGINE_CPU_KERNELS_MARCH", "haswell")
    assert native.target_arch() == "haswell"
