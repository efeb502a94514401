"""docs/plugins/{custom-ops,stat-loggers,platforms}.md: every python block runs as written.

Modules of a page (``# src/acme_plugins/x.py``) are written to a temporary ``acme_plugins``
package; the page's tests run against them; blocks that start an engine run with
``engine.core.LLM`` standing in for the tiny test checkpoint (in this process) instead of
the default model, and with the page's plugin installed as an entry point would install
it. A page that gains a python block fails :func:`test_every_block_is_run` until a test
here runs it.
"""

from __future__ import annotations

import functools
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.core
from engine.core import LLM
from engine.sdk import SamplingParams
from engine.sdk.groups import CUSTOM_OPS, STAT_LOGGERS
from engine.testing.docs import code_block, code_blocks, page_package, run_page_tests
from engine.testing.test_plugins import entry_installer

DOCS = Path(__file__).resolve().parents[3] / "docs" / "plugins"

#: The first line of every python block each page has, and so the tests below run.
BLOCKS = {
    "custom-ops.md": ["from __future__ import annotations", "import torch",
                      "# src/my_plugin/avx512_ops.py", "# Offline, the same items as a list.",
                      "# src/my_plugin/cuda_ops.py",
                      "# checking a fused_moe replacement against the reference"],
    "stat-loggers.md": ["# src/acme_plugins/statsd.py", "# tests/test_statsd.py",
                        "# offline_stats.py"],
    "platforms.md": ["# src/acme_plugins/platform.py", "# tests/test_platform.py"],
}


def blocks(page: str) -> list[str]:
    return code_blocks(DOCS / page)


def block(page: str, first_line: str) -> str:
    """The python block of ``page`` whose first line is ``first_line``."""
    return code_block(DOCS / page, first_line)


@pytest.mark.parametrize("page", sorted(BLOCKS))
def test_every_block_is_run(page: str) -> None:
    assert sorted(b.splitlines()[0] for b in blocks(page)) == sorted(BLOCKS[page])


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``acme_plugins`` with the modules of the pages, importable."""
    modules = {"statsd": block("stat-loggers.md", "# src/acme_plugins/statsd.py"),
               "platform": block("platforms.md", "# src/acme_plugins/platform.py")}
    with page_package(tmp_path_factory.mktemp("docs"), "acme_plugins", modules) as root:
        yield root


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str, type], None]:
    """``install(group, name, cls)``: the engine discovers ``cls`` as an installed entry."""
    return entry_installer(monkeypatch, "acme-docs", "0.1")


def exec_block(source: str, namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    namespace = namespace if namespace is not None else {"__name__": "page_block"}
    exec(compile(source, "page_block.py", "exec"), namespace)
    return namespace


# -- custom-ops.md --------------------------------------------------------------------------


def test_custom_ops_replacement_and_its_reference_check() -> None:
    namespace = exec_block(block("custom-ops.md", "from __future__ import annotations"))
    exec_block(block("custom-ops.md", "import torch"), namespace)  # asserts close to reference


def test_a_fused_moe_replacement_checked_against_its_reference() -> None:
    namespace = exec_block(block("custom-ops.md",
                                 "# checking a fused_moe replacement against the reference"))
    assert namespace["candidate"].method_for("cpu") == "forward_cpu"


def test_custom_ops_replacement_in_the_engine_and_the_offline_flag(
        install: Callable[[str, str, type], None], tiny_llm: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    namespace = exec_block(block("custom-ops.md", "from __future__ import annotations"))
    fused = namespace["FusedRMSNorm"]
    install(CUSTOM_OPS, "rms_norm", fused)  # beside engine-kernels' rms_norm
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = {}
    for items in ((), ("-rms_norm",)):
        with engine.core.LLM(custom_ops=items) as llm:
            norm = llm.llm_engine.core.worker.built.model.norm
            assert isinstance(norm, fused) is (items == ())
            [out] = llm.generate({"prompt_token_ids": [3, 1, 4, 1, 5]}, params,
                                 use_tqdm=False)
            results[items] = out.outputs[0].token_ids
    assert results[()] == results[("-rms_norm",)]  # in place, and still the reference
    exec_block(block("custom-ops.md", "# Offline, the same items as a list."))
    [llm] = tiny_llm.made[-1:]
    assert type(llm.llm_engine.core.worker.built.model.norm).__name__ == "RMSNorm"


def test_custom_ops_is_supported_and_priority_example(
        install: Callable[[str, str, type], None]) -> None:
    from engine.core.custom_op_selection import CustomOpSettings, plan_custom_ops
    from engine.core.plugins import PluginCatalog
    from engine.sdk import PlatformInfo

    avx512 = exec_block(block("custom-ops.md", "# src/my_plugin/avx512_ops.py"))["Avx512RMSNorm"]
    fused = exec_block(block("custom-ops.md", "from __future__ import annotations"))[
        "FusedRMSNorm"]
    cpu, cuda = PlatformInfo("cpu", "cpu"), PlatformInfo("cuda", "cuda")
    has_avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    assert avx512.is_supported(cpu).ok is has_avx512
    assert "no cuda path of its own" in avx512.is_supported(cuda).reason
    install(CUSTOM_OPS, "rms_norm", fused)
    install(CUSTOM_OPS, "rms_norm", avx512)
    plan = plan_custom_ops(PluginCatalog.discover(), CustomOpSettings(), "cpu", cpu)
    [rms] = [c for c in plan if c.name == "rms_norm"]
    assert ("Avx512RMSNorm" if has_avx512 else "FusedRMSNorm") in rms.chosen.value


# -- stat-loggers.md ------------------------------------------------------------------------


def test_stat_loggers_page_test(acme: Path) -> None:
    assert sorted(run_page_tests(block("stat-loggers.md", "# tests/test_statsd.py"))) == [
        "test_rejects_a_port_out_of_range", "test_sends_buffered_metrics_on_log"]


def test_stat_loggers_offline_example_flushes_at_shutdown(
        acme: Path, install: Callable[[str, str, type], None], tiny_llm: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from acme_plugins.statsd import StatsdLogger

    install(STAT_LOGGERS, "statsd", StatsdLogger)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]

        def with_port(factory: Callable[..., LLM], *args: Any, **kwargs: Any) -> LLM:
            options = kwargs.setdefault("plugin_options", {})
            options["statsd"] = {**options.get("statsd", {}), "port": port}
            return factory(*args, **kwargs)

        monkeypatch.setattr(engine.core, "LLM", functools.partial(with_port, tiny_llm))
        exec_block(block("stat-loggers.md", "# offline_stats.py"))
        server.settimeout(0.5)
        received: list[str] = []
        try:
            while True:
                received.append(server.recv(512).decode())
        except TimeoutError:
            pass
    # Nothing was sent before the engine stopped (log() runs every 10 s): shutdown() sent all.
    assert "batch.0.kv_blocks:32|g" in received  # from log_engine_initialized
    tokens = [int(line.split(":")[1].split("|")[0]) for line in received
              if line.startswith("batch.0.generation_tokens:")]
    assert sum(tokens) <= 16 and tokens  # two prompts, max_tokens=8 (EOS may end one)
    assert sum(line.startswith("batch.0.finished.") for line in received) == 2


# -- platforms.md ---------------------------------------------------------------------------


def test_platform_page_test(acme: Path, tmp_path: Path) -> None:
    tests = tmp_path / "test_platform.py"
    tests.write_text(block("platforms.md", "# tests/test_platform.py"))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(acme)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


def test_torch_is_what_the_pages_assume() -> None:
    assert torch.get_default_dtype() == torch.float32  # the check block compares in fp32


def test_the_custom_op_capture_example_runs() -> None:
    """custom-ops.md, "Graph capture": its asserts hold (a CUDA path declares, a CPU one not)."""
    from engine.testing.docs import exec_block

    namespace = exec_block(block("custom-ops.md", "# src/my_plugin/cuda_ops.py"),
                           filename="cuda_ops.py")
    from engine.sdk.capture import CaptureContext, GraphKind

    op = namespace["FusedSiluAndMul"](dispatch_key="cuda")
    assert not op.capture_support(CaptureContext(kind=GraphKind.CPU_STEP_GRAPH))
