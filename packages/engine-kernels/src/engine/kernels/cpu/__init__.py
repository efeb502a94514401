"""engine-kernels' CPU kernels: C++ built on first use, reaching the engine as any plugin's.

``linear`` (the ``cpu`` and ``onednn`` linear kernels), ``attention`` (the ``cpu``
attention backend), ``ops`` (the CPU paths of ``rms_norm``, ``rotary_embedding``,
``silu_and_mul`` and ``gelu_and_mul``), ``moe`` (``fused_moe``'s), all over the C++ in
``native``; each is an entry point of this
distribution and is chosen (measured or ranked) beside any third party's.
"""
