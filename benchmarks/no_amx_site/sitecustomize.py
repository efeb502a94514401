"""Makes torch report a CPU without AMX to the peers' Python (vLLM, transformers).

``benchmarks/peers.py --isa no-amx`` puts this directory on the peers' ``PYTHONPATH``.
vLLM picks its AMX attention and linear paths by ``torch.cpu._is_amx_tile_supported()``
(and ``_is_amx_fp16_supported()``): with both False it runs what it runs on an
avx512_bf16 CPU without AMX (a Zen 4). oneDNN is held by ``ONEDNN_MAX_CPU_ISA``.
Nothing else is changed.
"""

try:
    import torch.cpu
except ImportError:  # a Python without torch: nothing to restrict
    pass
else:
    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_amx_fp16_supported = lambda: False
