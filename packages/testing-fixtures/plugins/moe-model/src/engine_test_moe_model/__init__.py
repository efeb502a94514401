"""engine-test-moe-model: a mixture-of-experts model plugin written from the SDK alone.

* ``Qwen2MoeForCausalLM`` (``engine.models``): Qwen2-MoE (Qwen1.5-MoE), an architecture
  engine-core has no model for, built only through ``ctx.layers``: routed experts in
  ``layers.fused_moe`` beside a shared expert of ``layers.linear`` and
  ``layers.silu_and_mul``. ``qwen2_moe.py`` is also the worked example of
  ``docs/plugins/models.md`` (a test keeps the two identical).
"""
