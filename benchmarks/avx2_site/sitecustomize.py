"""Makes torch report a CPU without AVX-512 to the peers' Python (vLLM, transformers).

``benchmarks/peers.py --isa avx2`` puts this directory on the peers' ``PYTHONPATH``. vLLM
picks its compiled kernels by ``torch.cpu._is_avx512_supported()`` /
``_is_avx512_bf16_supported()`` (``vllm._C_AVX2`` on a CPU without AVX-512): with both
False it loads the AVX2 build it would load on such a CPU. Nothing else is changed.
"""

try:
    import torch.cpu
except ImportError:  # a Python without torch: nothing to restrict
    pass
else:
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
