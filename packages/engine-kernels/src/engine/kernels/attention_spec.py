"""What engine-kernels' attention backends (``cpu``, ``triton``) refuse alike.

Both list every spec field added since SDK 1.0 in ``answered_spec_fields`` and answer it
here: a backend that does not implement a field passes its flag as False and the spec is
refused with the field named.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.sdk.attention import AttentionSpec
from engine.sdk.support import Support

#: The ``answered_spec_fields`` of the backends that call :func:`decoder_support`.
ANSWERED_SPEC_FIELDS = frozenset({"logits_soft_cap", "has_sinks"})


def decoder_support(spec: AttentionSpec, dtypes: Sequence[str], dtype_hint: str = "", *,
                    soft_cap: bool = False, sinks: bool = False) -> Support:
    """Yes for causal attention over a KV cache of ``spec.dtype``, one of ``dtypes``.

    ``dtype_hint`` follows the refusal of another dtype (where another backend takes it).
    ``soft_cap``: the backend implements ``spec.logits_soft_cap`` (else a spec with one is
    refused, naming the ``torch`` backend, which does); ``sinks`` likewise for
    ``spec.has_sinks``.
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
    if spec.logits_soft_cap is not None and not soft_cap:
        return Support.no(f"logits_soft_cap={spec.logits_soft_cap} not supported (the torch "
                          f"backend supports it: --attention-backend torch)")
    if spec.has_sinks and not sinks:
        return Support.no("attention sinks not supported (the torch backend supports them: "
                          "--attention-backend torch)")
    return Support.yes()


__all__ = ["ANSWERED_SPEC_FIELDS", "decoder_support"]
