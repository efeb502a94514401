"""An ``rms_norm`` replacement that raises on its Nth call (``ENGINE_TEST_FAULT_OP_CALL=N``)."""

from __future__ import annotations

import os
from typing import Any

from engine.sdk.ops import RMSNormOp
from engine_test_plugin_faults import CALLS


class FaultyRMSNorm(RMSNormOp):
    """The reference RMSNorm; its Nth call in the process raises ``RuntimeError``."""

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        CALLS["rms_norm.forward"] += 1
        fail_at = os.environ.get("ENGINE_TEST_FAULT_OP_CALL")
        if fail_at and CALLS["rms_norm.forward"] == int(fail_at):
            raise RuntimeError(f"rms_norm failed on call {fail_at}")
        return super().forward_native(*args, **kwargs)
