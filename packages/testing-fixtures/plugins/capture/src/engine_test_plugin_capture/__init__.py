"""Graph capture as a plugin author declares it (``engine.sdk.capture``, SDK 1.1).

* ``Qwen3ForCausalLM`` (``engine.models``): Qwen3 dense models built only through
  ``ctx.layers`` and the SDK, which declare that a graph may record their forward pass:
  on the CPU the step graph replays it (per-head q/k norms included).
* ``test_capture_cpu`` (``engine.linear_kernels``): a third party's kernel that composes
  the engine's first-party ``cpu`` kernel (reached through its entry point) and declares
  what it declares: recorded by the CPU step graph.
* ``test_capture_torch`` (``engine.linear_kernels``): declares capture support but
  multiplies with ``F.linear``; the CPU step graph's recorder refuses it, naming the op.

Both kernels have a priority below the engine's own: they serve only when forced with
``--linear-kernel``.
"""
