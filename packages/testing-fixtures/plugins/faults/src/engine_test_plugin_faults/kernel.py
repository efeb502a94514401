"""A linear kernel whose Nth ``apply`` in the process raises (``ENGINE_TEST_FAULT_KERNEL_CALL``).

Priority -100: used only when forced with ``--linear-kernel test_fault_matmul``. Its
exception is a plain ``RuntimeError``: the engine names the plugin from the traceback.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from engine.sdk import LinearKernel, LinearKernelConfig, PlatformInfo, Support
from engine_test_plugin_faults import CALLS


class FaultyMatmul(LinearKernel):
    name: ClassVar[str] = "test_fault_matmul"
    priority: ClassVar[int] = -100

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        if config.scheme != "unquantized":
            return Support.no(f"scheme {config.scheme} is not unquantized")
        return Support.yes()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        CALLS["test_fault_matmul.apply"] += 1
        fail_at = os.environ.get("ENGINE_TEST_FAULT_KERNEL_CALL")
        if fail_at and CALLS["test_fault_matmul.apply"] == int(fail_at):
            raise RuntimeError(f"test_fault_matmul failed on call {fail_at}")
        return torch.nn.functional.linear(x, layer.weight, bias)
