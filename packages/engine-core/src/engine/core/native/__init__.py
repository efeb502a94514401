"""The CPU step graph: its recorder (``graph``) and its runtime (``runtime``, built on use).

The runtime interprets a recorded list of calls by function address
(``engine.sdk.graph_calls``), so it names no kernel: the engine's own kernels
(engine-kernels) and a plugin's join a graph the same way.
"""
