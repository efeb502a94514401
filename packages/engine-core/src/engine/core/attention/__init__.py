"""engine-core's attention backend: ``torch`` (an entry of ``engine.attention_backends``).

SDPA over the requests' gathered blocks, on any device torch runs on: the reference and
the fallback where no faster backend (engine-kernels' ``cpu`` and ``triton``, a plugin's)
is installed or can serve the model.
"""

from engine.core.attention.torch_backend import TorchAttentionBackend

__all__ = ["TorchAttentionBackend"]
