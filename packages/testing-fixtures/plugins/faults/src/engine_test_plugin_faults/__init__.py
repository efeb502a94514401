"""Plugins that raise at run time when asked to, for the engine's fault-policy tests.

* ``test_fault_request`` (per-request logits processor): a request with
  ``extra_args={"fault": "apply"}`` makes its function raise on its first step;
  ``{"fault": "update_state"}`` makes ``new_req_logits_processor`` raise for it;
  ``{"fault": "none"}`` uses it without failing (it counts its calls in ``CALLS``).
* ``test_fault_batch`` (batch-level logits processor): a request with
  ``extra_args={"fault_batch": "raise"}`` makes ``apply`` raise a plain error (the engine
  cannot tell which rows it concerned); ``{"fault_batch": "rows"}`` makes it raise
  ``RowsFailedError`` for that request's row only.
* ``rms_norm`` (custom op): the reference RMSNorm, except that the Nth call in the process
  raises when ``ENGINE_TEST_FAULT_OP_CALL=N`` is set.
* ``test_fault_matmul`` (linear kernel, only when forced with ``--linear-kernel``): the
  Nth ``apply`` raises a plain ``RuntimeError`` when ``ENGINE_TEST_FAULT_KERNEL_CALL=N``.

Installed on its own by the tests that need it (its ``rms_norm`` would replace the built-in
op in every engine that sees it).
"""

from collections import Counter

#: ``"<plugin>.<hook>"`` -> calls in this process.
CALLS: Counter[str] = Counter()
