"""``--quantization gguf``: llama.cpp's block formats kept quantized, engine-kernels' entries.

``method`` (the ``gguf`` quantization method: which layers, which kernels), ``formats``
(each storage type's layout and torch dequantization), ``kernels`` (the ``gguf_dequant``
and ``gguf_int4`` linear kernels, with the C++ dequantization of ``engine.kernels.cpu``).
engine-core's GGUF loader hands a method that declares ``reads_gguf_blocks`` the file's
blocks as they are stored; nothing in engine-core names these classes.
"""
