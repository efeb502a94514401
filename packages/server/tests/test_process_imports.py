"""The API server process never imports EngineCore, executor, worker, model or sampler code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: What runs in EngineCore's process or the workers only (DESIGN §3).
FORBIDDEN = ("engine.core.engine", "engine.core.executor", "engine.core.worker",
             "engine.core.model_executor", "engine.core.sample", "engine.core.attention",
             "engine.core.scheduler", "engine.core.kv_cache")

SCRIPT = """
import sys
from engine.core.client.async_llm import AsyncLLM
from engine.core.config import EngineConfig
from engine.server.app import build_app
from engine.server.cli import _serve  # noqa: F401

engine = AsyncLLM(EngineConfig(model=sys.argv[1], dtype="float32", plugins="none"))
build_app(engine)
forbidden = tuple(sys.argv[2:])
print("\\n".join(sorted(m for m in sys.modules if m.startswith(forbidden))))
"""


def test_api_server_imports_no_engine_core_or_worker_code(tiny_llama_checkpoint: Path) -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama_checkpoint),
                             *FORBIDDEN], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"the API server imported:\n{result.stdout}"
