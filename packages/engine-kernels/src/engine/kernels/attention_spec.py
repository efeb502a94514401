"""What engine-kernels' attention backends (``cpu``, ``triton``) refuse alike."""

from __future__ import annotations

from collections.abc import Sequence

from engine.sdk.attention import AttentionSpec
from engine.sdk.support import Support


def decoder_support(spec: AttentionSpec, dtypes: Sequence[str], dtype_hint: str = "") -> Support:
    """Yes for causal attention over a KV cache of ``spec.dtype``, one of ``dtypes``.

    ``dtype_hint`` follows the refusal of another dtype (where another backend takes it).
    """
    if spec.dtype not in dtypes:
        return Support.no(f"dtype {spec.dtype} not supported; supported: "
                          f"{', '.join(dtypes)}{dtype_hint}")
    if spec.kv_cache_dtype != spec.dtype:
        return Support.no(f"kv_cache_dtype must equal dtype ({spec.dtype}), got "
                          f"{spec.kv_cache_dtype} (no quantized KV cache yet)")
    if not spec.is_causal:
        return Support.no("only causal (decoder) attention is supported")
    if spec.num_heads % spec.num_kv_heads:
        return Support.no(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads "
                          f"{spec.num_kv_heads}")
    return Support.yes()


__all__ = ["decoder_support"]
