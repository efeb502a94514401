"""A quantization method (weights stored in float16) and the linear kernel for its scheme.

* ``test_quant_fp16`` (``engine.quantization``): linear layers (not the embedding, not the
  LM head) register a ``float16`` weight; the engine's loader casts the checkpoint into it.
  Settings: ``{"quant_method": "test_quant_fp16", "skip": ["down_proj"]}`` in
  ``config.json``'s ``quantization_config`` or in ``test_quant_fp16.json``.
* ``test_quant_fp16_matmul`` (``engine.linear_kernels``, scheme ``test_fp16_weights``):
  upcasts the weight to the activation dtype and calls ``F.linear``.

Everything they do is counted in :data:`engine_test_plugin_quant.counters.CALLS`; with
``ENGINE_TEST_QUANT_LOG=FILE`` each ``create_weights`` also appends one JSON line (prefix,
rank, shapes) to FILE, so tests see what worker processes saw. With
``ENGINE_TEST_QUANT_UNSUPPORTED=1`` ``is_supported`` says no.
"""
