"""``engine.core.rpc.huge_pages``: the GLIBC_TUNABLES the EngineCore process starts with."""

from __future__ import annotations

import os
import sys

import pytest

from engine.core.rpc.huge_pages import huge_page_malloc, tunables_with_huge_pages


@pytest.mark.parametrize(("current", "wanted"), [
    (None, "glibc.malloc.hugetlb=1"),
    ("", "glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    # the operator's own choice wins, 0 included
    ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),
    ("glibc.malloc.hugetlb=2:glibc.malloc.arena_max=2",
     "glibc.malloc.hugetlb=2:glibc.malloc.arena_max=2"),
])
def test_the_tunable_is_added_unless_the_operator_set_it(current: str | None,
                                                         wanted: str) -> None:
    assert tunables_with_huge_pages(current) == wanted


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables: Linux")
@pytest.mark.parametrize("current", [None, "glibc.malloc.arena_max=2"])
def test_the_environment_is_restored_after_the_spawn(current: str | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if current is None:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    else:
        monkeypatch.setenv("GLIBC_TUNABLES", current)
    with huge_page_malloc():
        assert "glibc.malloc.hugetlb=1" in os.environ["GLIBC_TUNABLES"]
    assert os.environ.get("GLIBC_TUNABLES") == current
