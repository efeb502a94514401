"""Build, cache and load the engine's CPU kernels (the ``*.cpp`` files beside this one).

``paged_attention.cpp`` (the ``cpu`` attention backend), ``elementwise.cpp`` (the CPU
custom ops, ``engine.kernels.cpu.ops``; exp, erf and tanh from ``vmath.h``),
``small_matmul.cpp``, ``packed_matmul.cpp``, ``amx_matmul.cpp`` and ``matmul.cpp`` (the
``cpu`` linear kernel), ``fused_moe.cpp`` (the ``fused_moe`` op, ``engine.kernels.cpu.moe``)
and ``gguf_dequant.cpp`` (the GGUF kernels' dequantization, ``engine.kernels.gguf``) are
compiled on first use with the system C++ compiler for this machine by the SDK's
``engine.sdk.native``, as a plugin's native code is (float flags per file, see
``SOURCES``); later processes load the built file in milliseconds. The CPU step graph's
interpreter is engine-core's: it calls these kernels' step-graph entries
(``engine_graph_<kernel>``) by address. The library is called through ``ctypes`` with
raw pointers, so it needs neither Python nor torch headers, and its OpenMP calls run on
the runtime torch already loaded (same ``libgomp.so.1``), with torch's thread count.

Without a compiler, or when the build fails, ``load()`` raises ``NativeBuildError``
with the reason; the ``cpu`` attention backend reports that reason from ``supports`` and
the platform picks the pure-torch backend instead.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kernels.cpu.native.calls import call_status, check_rows, invoke
from engine.sdk.graph_calls import GraphFunction
from engine.sdk.native import NativeBuildError, load_library

# Per source, the flags after COMPILE_FLAGS. The attention kernel may reorder float math
# freely; the elementwise ops keep IEEE division and rounding (they reproduce torch's ops).
SOURCES = {
    Path(__file__).with_name("paged_attention.cpp"): ("-ffast-math",),
    Path(__file__).with_name("elementwise.cpp"): (
        "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
        "-ffp-contract=off"),
    # Intrinsics only; float32 sums in its own order, as any matmul kernel.
    Path(__file__).with_name("small_matmul.cpp"): (),
    Path(__file__).with_name("packed_matmul.cpp"): (),
    Path(__file__).with_name("amx_matmul.cpp"): (),
    # Products then sums, rounded as torch rounds them: the same values bit for bit.
    Path(__file__).with_name("gguf_dequant.cpp"): ("-fno-math-errno", "-ffp-contract=off"),
    # The matmul that picks its loop by row count (the `cpu` linear kernel's).
    Path(__file__).with_name("matmul.cpp"): (),
    # The mixture of experts (engine.kernels.cpu.moe): its weighted sums in the reference's
    # order and rounding (no contraction), its products matmul.cpp's.
    Path(__file__).with_name("fused_moe.cpp"): ("-fno-math-errno", "-ffp-contract=off"),
}
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("kernels.h", "numerics.h", "q8_0.h", "simd.h", "vmath.h"))
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
#: ``NativeKernels.fused_moe``'s activations (``FusedMoEOp.ACTIVATIONS``): fused_moe.cpp's codes.
FUSED_MOE_ACTIVATIONS = {"silu": 0, "swigluoai": 1}
#: The products' code for float32 activations with weights packed as bfloat16
#: (``pack_matmul_weight(..., as_bfloat16=True)``; packed_matmul.cpp's kWidened).
WIDENED_CODE = 2
#: GGUF types ``NativeKernels.gguf_dequant`` reads (ggml type code: bytes per 32 weights).
GGUF_DEQUANT_TYPES = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0
#: Most rows ``NativeKernels.small_matmul`` takes (``kMaxRows`` in small_matmul.cpp).
SMALL_MATMUL_ROWS = 3
#: Output columns per panel of ``NativeKernels.pack_matmul_weight`` (``kPanel``).
PACKED_MATMUL_PANEL = 32
#: The kernels with a step-graph entry (``engine_graph_<kernel>``, engine_graph_call.h): their
#: calls are recorded (engine.sdk.graph_calls); any other kernel's refuses the recording.
GRAPH_KERNELS = ("rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul", "matmul",
                 "write_kv", "paged_attention", "fused_moe")
#: ``gelu_and_mul``'s codes of the GELU forms (``approximate`` as ``F.gelu`` takes it).
GELU_CODES = {"none": 0, "tanh": 1}
_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def load() -> NativeKernels:
    """The kernels, built on first use; raises ``NativeBuildError``."""
    return NativeKernels(load_library("engine_cpu_kernels", SOURCES, HEADERS))


@functools.cache
def native_kernels() -> NativeKernels | None:
    """The kernels, or None where they cannot be built here (``load()`` says why)."""
    try:
        return load()
    except NativeBuildError:
        return None


class NativeKernels:
    """Typed calls into the built library (tensors in, results written in place)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        #: Each recordable kernel's step-graph entry, which a recording calls instead of
        #: the kernel (engine.sdk.graph_calls: as any plugin's native code is recorded).
        self.graph_functions = {kernel: GraphFunction.from_library(lib, f"engine_graph_{kernel}",
                                                                   kernel)
                                for kernel in GRAPH_KERNELS}
        self._attention = lib.engine_paged_attention
        self._attention.restype = _I32
        self._attention.argtypes = [
            _I32, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _P, _I64,
            _I64, _I64, _I64, _I32, _F, _F, _P, _I32]
        self._write_kv = lib.engine_write_kv
        self._write_kv.restype = None
        self._write_kv.argtypes = [
            _I32, _P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _I32,
            _I32, _I32]
        self._rms_norm = lib.engine_rms_norm
        self._rms_norm.restype = _I32
        self._rms_norm.argtypes = [_I32, _P, _I64, _P, _I64, _P, _I64, _I64, _F, _I32]
        self._rotary = lib.engine_rotary_embedding
        self._rotary.restype = _I32
        self._rotary.argtypes = [_I32, _P, _I64, _P, _I64, _I64, _I32, _I32, _P, _I64, _I64,
                                 _I32, _P, _I64, _I64, _I32, _I32]
        self._silu_and_mul = lib.engine_silu_and_mul
        self._silu_and_mul.restype = _I32
        self._silu_and_mul.argtypes = [_I32, _P, _I64, _P, _I64, _I64, _I64, _I32]
        self._gelu_and_mul = lib.engine_gelu_and_mul
        self._gelu_and_mul.restype = _I32
        self._gelu_and_mul.argtypes = [_I32, _P, _I64, _P, _I64, _I64, _I64, _I32, _I32]
        self._small_matmul = lib.engine_small_matmul
        self._small_matmul.restype = _I32
        self._small_matmul.argtypes = [_I32, _P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I32]
        self._gguf_dequant = lib.engine_gguf_dequant
        self._gguf_dequant.restype = _I32
        self._gguf_dequant.argtypes = [_I32, _P, _I64, _I32, _P, _I32]
        self._int4pack_dequant_t = lib.engine_int4pack_dequant_t
        self._int4pack_dequant_t.restype = _I32
        self._int4pack_dequant_t.argtypes = [_P, _I64, _I32, _I64, _I64, _P, _I64, _I32, _P,
                                               _I32]
        self._small_matmul_q8_0 = lib.engine_small_matmul_q8_0
        self._small_matmul_q8_0.restype = _I32
        self._small_matmul_q8_0.argtypes = self._small_matmul.argtypes
        self._pack_matmul_weight = lib.engine_pack_matmul_weight
        self._pack_matmul_weight.restype = _I32
        self._pack_matmul_weight.argtypes = [_I32, _P, _I64, _I64, _P, _I32]
        self._packed_matmul = lib.engine_packed_matmul
        self._packed_matmul.restype = _I32
        self._packed_matmul.argtypes = self._small_matmul.argtypes
        self._matmul = lib.engine_matmul
        self._matmul.restype = _I32
        self._matmul.argtypes = [_I32, _P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _I32]
        self._fused_moe = lib.engine_fused_moe
        self._fused_moe.restype = _I32
        self._fused_moe.argtypes = [_I32, _P, _I64, _I64, _I32, _P, _I64, _I64, _I64, _I32, _F,
                                    _F, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _P, _I32]
        self._fused_moe_workspace = lib.engine_fused_moe_workspace
        self._fused_moe_workspace.restype = _I64
        self._fused_moe_workspace.argtypes = [_I64, _I64, _I64, _I64, _I64, _I64]
        #: Dtypes ``packed_matmul`` has a kernel for on this CPU (as ``small_matmul_dtypes``).
        self.packed_matmul_dtypes = _dtypes_in(lib.engine_packed_matmul_dtypes())
        #: Whether a float32 weight whose values are all bfloat16 values can be packed as
        #: bfloat16 (``pack_matmul_weight(..., as_bfloat16=True)``): AVX2 builds.
        self.packs_float32_as_bfloat16 = bool(
            lib.engine_packed_matmul_dtypes() >> WIDENED_CODE & 1)
        #: Dtypes ``small_matmul`` has a kernel for on this CPU (float32 needs AVX-512 or
        #: AVX2 and FMA, bfloat16 avx512_bf16); empty elsewhere.
        self.small_matmul_dtypes = _dtypes_in(lib.engine_small_matmul_dtypes())
        amx = lib.engine_amx_packed_matmul
        amx.restype = _I32
        amx.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I32]
        #: Whether bfloat16 panels are multiplied on AMX tiles (a build for a CPU with
        #: amx_bf16, the process allowed to use them): ``packed_matmul`` and ``matmul``
        #: then take them at every row count (amx_matmul.cpp). Asked with no rows.
        self.amx_bfloat16 = amx(None, 0, 0, None, 0, 0, None, None, 0, 1) == 0

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> None:
        """In place: ``x`` ``[rows, n]`` becomes ``rms_norm(x + residual) * weight``.

        ``residual`` (``[rows, n]``, or None) becomes ``x + residual`` rounded to the dtype;
        ``weight``: ``[n]``, contiguous. One dtype for all three.
        """
        rows, n = x.shape
        code = _dtype_code("rms_norm", x)
        check_rows("rms_norm", x.dtype, n, x, *(() if residual is None else (residual,)))
        check_rows("rms_norm", x.dtype, n, weight.view(1, -1))
        call_status("rms_norm", self._invoke("rms_norm", self._rms_norm,
            code, x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0), weight.data_ptr(), rows, n, eps,
            torch.get_num_threads()))

    def rotary_embedding(self, positions: torch.Tensor, query: torch.Tensor,
                         key: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int,
                         is_neox_style: bool) -> None:
        """In place: rotate ``query``/``key`` ``[tokens, heads, D]`` by their positions.

        ``positions``: int64 ``[tokens]``, contiguous; ``cos_sin_cache``: float32
        ``[max_position, rotary_dim]``, contiguous. A position outside the cache is an
        IndexError (nothing is written).
        """
        tokens = positions.shape[0]
        code = _dtype_code("rotary_embedding", query)
        for t in (query, key):
            if (t.dim() != 3 or t.shape[0] != tokens or t.stride(2) != 1 or t.dtype != query.dtype
                    or not t.is_cpu or t.shape[2] < rotary_dim):
                raise ValueError(
                    f"rotary_embedding: expected query and key [{tokens}, heads, head_size >= "
                    f"{rotary_dim}] of one dtype on the CPU with a contiguous last axis, got "
                    f"{tuple(query.shape)} {query.dtype} and {tuple(key.shape)} {key.dtype}")
        if (positions.dtype != torch.int64 or not positions.is_contiguous()
                or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous()
                or cos_sin_cache.shape[1] != rotary_dim):
            raise ValueError(
                f"rotary_embedding: expected contiguous int64 positions and a contiguous "
                f"float32 [max_position, {rotary_dim}] cache, got {positions.dtype} and "
                f"{tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype}")
        status = self._invoke("rotary_embedding", self._rotary,
            code, positions.data_ptr(), tokens, cos_sin_cache.data_ptr(),
            cos_sin_cache.stride(0), cos_sin_cache.shape[0], rotary_dim, int(is_neox_style),
            query.data_ptr(), query.stride(0), query.stride(1), query.shape[1], key.data_ptr(),
            key.stride(0), key.stride(1), key.shape[1], torch.get_num_threads())
        if status == 2:
            raise IndexError(f"rotary_embedding: a position is outside the cos/sin cache "
                             f"(0..{cos_sin_cache.shape[0] - 1})")
        call_status("rotary_embedding", status)

    def silu_and_mul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` ``[rows, d]`` = ``silu(x[:, :d]) * x[:, d:]``, ``x`` ``[rows, 2d]``."""
        rows, d = out.shape
        code = _dtype_code("silu_and_mul", x)
        check_rows("silu_and_mul", x.dtype, 2 * d, x)
        check_rows("silu_and_mul", x.dtype, d, out)
        if x.shape[0] != rows:
            raise ValueError(f"silu_and_mul: {x.shape[0]} input rows, {rows} output rows")
        call_status("silu_and_mul", self._invoke("silu_and_mul", self._silu_and_mul,
            code, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), rows, d,
            torch.get_num_threads()))

    def gelu_and_mul(self, x: torch.Tensor, out: torch.Tensor, approximate: str) -> None:
        """``out`` ``[rows, d]`` = ``gelu(x[:, :d], approximate) * x[:, d:]``, ``x`` ``[rows, 2d]``.

        ``approximate``: ``"none"`` (the erf form) or ``"tanh"``, as ``F.gelu`` takes it.
        """
        rows, d = out.shape
        code = _dtype_code("gelu_and_mul", x)
        if approximate not in GELU_CODES:
            raise ValueError(f"gelu_and_mul: approximate={approximate!r} is not supported; "
                             f"allowed: {', '.join(map(repr, GELU_CODES))}")
        check_rows("gelu_and_mul", x.dtype, 2 * d, x)
        check_rows("gelu_and_mul", x.dtype, d, out)
        if x.shape[0] != rows:
            raise ValueError(f"gelu_and_mul: {x.shape[0]} input rows, {rows} output rows")
        call_status("gelu_and_mul", self._invoke("gelu_and_mul", self._gelu_and_mul,
            code, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), rows, d,
            GELU_CODES[approximate], torch.get_num_threads()))

    def small_matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     out: torch.Tensor) -> None:
        """``out`` = ``x @ weight.T + bias``, ``x`` ``[M, K]`` with M up to ``SMALL_MATMUL_ROWS``.

        ``out``: ``[M, N]``; ``weight``: ``[N, K]``, contiguous; ``bias``: ``[N]`` or None;
        rows of ``x`` and ``out`` contiguous. One dtype, in ``small_matmul_dtypes``. Every
        weight is read once, so decode steps of small batches run at the memory's speed.
        """
        k = weight.shape[1]
        _check_supported("small_matmul", x.dtype, self.small_matmul_dtypes)
        _check_dense_weight("small_matmul", x.dtype, weight)
        self._run_small_matmul("small_matmul", self._small_matmul, x, (weight.data_ptr(),), k,
                               bias, out)

    def small_matmul_q8_0(self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None,
                          out: torch.Tensor) -> None:
        """``small_matmul`` with the weight as GGUF Q8_0 rows, read as they are stored.

        ``blocks``: contiguous ``uint8 [N, K / 32 * 34]``. The same values as
        ``small_matmul`` on those rows dequantized to ``x``'s dtype (each weight computed
        and rounded as ``gguf_dequant`` would, then the same sums), at a fraction of the
        bytes read.
        """
        rows, n = out.shape
        k = x.shape[1] if x.dim() == 2 else -1
        _check_supported("small_matmul_q8_0", x.dtype, self.small_matmul_dtypes)
        if not 1 <= rows <= SMALL_MATMUL_ROWS or k % 32 or tuple(blocks.shape) != (
                n, k // 32 * 34):
            raise ValueError(f"small_matmul_q8_0: expected 1..{SMALL_MATMUL_ROWS} rows of K "
                             f"(a multiple of 32) and Q8_0 blocks [N, K / 32 * 34], got x "
                             f"{tuple(x.shape)}, blocks {tuple(blocks.shape)}, out "
                             f"{tuple(out.shape)}")
        _check_flat("small_matmul_q8_0", ("blocks", blocks, torch.uint8, blocks.numel()))
        self._run_small_matmul("small_matmul_q8_0", self._small_matmul_q8_0, x,
                               (blocks.data_ptr(),), k, bias, out)

    def pack_matmul_weight(self, weight: torch.Tensor, *,
                           as_bfloat16: bool = False) -> torch.Tensor | None:
        """``weight`` ``[N, K]`` (contiguous) packed into column panels for ``packed_matmul``.

        Returns a 1-D tensor of the weight's dtype (in ``packed_matmul_dtypes``) with
        ``packed_matmul_size(N, K)`` elements. bfloat16 needs K even (its pairs).

        ``as_bfloat16`` (a float32 weight, where ``packs_float32_as_bfloat16``): the panels
        hold the values as bfloat16, half the bytes, and multiply float32 activations with
        the same sums bit for bit; None when some value is not a bfloat16 value (the
        weight is then packed as float32 or not at all, the caller's choice).
        """
        n, k = weight.shape
        code = DTYPE_CODES.get(weight.dtype)
        if as_bfloat16:
            if weight.dtype != torch.float32 or not self.packs_float32_as_bfloat16:
                raise ValueError(f"pack_matmul_weight: as_bfloat16 takes a float32 weight on "
                                 f"a CPU with the AVX2 kernel for it; got {weight.dtype}, "
                                 f"kernel built: {self.packs_float32_as_bfloat16}")
            code = WIDENED_CODE
        else:
            self._check_packed_dtype("pack_matmul_weight", weight.dtype, k)
        _check_flat("pack_matmul_weight", ("weight", weight, weight.dtype, n * k))
        packed = torch.empty(packed_matmul_size(n, k),
                             dtype=torch.bfloat16 if as_bfloat16 else weight.dtype)
        status = self._invoke("pack_matmul_weight", self._pack_matmul_weight, code,
                              weight.data_ptr(), n, k, packed.data_ptr(),
                              torch.get_num_threads())
        if as_bfloat16 and status == 3:  # a value with float32 bits below bfloat16's
            return None
        call_status("pack_matmul_weight", status)
        return packed

    def packed_matmul(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                      bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """``out`` = ``x @ weight.T + bias`` with the weight as ``pack_matmul_weight`` left it.

        ``x``: ``[M, K]``, any M >= 1; ``out``: ``[M, n]``; rows of both contiguous;
        ``bias``: ``[n]`` or None. One dtype (bfloat16 ``packed`` for float32 ``x``: packed
        ``as_bfloat16``). Sums in float32 over K in order (on AMX, ``amx_bfloat16``: in
        the tiles' order), the bias added before the one rounding to the dtype.
        """
        k = x.shape[1] if x.dim() == 2 else -1
        code = self._check_panels("packed_matmul", x.dtype, k, packed, n)
        self._run_small_matmul("packed_matmul", self._packed_matmul, x, (packed.data_ptr(),), k,
                               bias, out, max_rows=None, code=code)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, panels: torch.Tensor | None,
               bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """``out`` = ``x @ weight.T + bias``, the loop picked by the row count in C.

        ``small_matmul`` on ``weight`` (``[N, K]``, contiguous) for 1 to
        ``SMALL_MATMUL_ROWS`` rows where its dtype is built, else ``packed_matmul`` on
        ``panels`` (``pack_matmul_weight(weight)``; None: only the small rows are taken).
        Panels packed ``as_bfloat16`` take every row count (at 1-3 rows they read half the
        bytes the dense float32 weight would), and so do bfloat16 panels on AMX
        (``amx_bfloat16``: faster from 1 row). What the ``cpu`` linear kernel calls: the
        choice is made in the library, so a recorded step graph makes it again for each
        step's rows.
        """
        n, k = weight.shape
        rows = out.shape[0]
        if panels is None and not (rows <= SMALL_MATMUL_ROWS
                                   and x.dtype in self.small_matmul_dtypes):
            raise ValueError(f"matmul: {rows} rows of {x.dtype} need the packed weight "
                             f"(panels); without it 1..{SMALL_MATMUL_ROWS} rows of "
                             f"{sorted(map(str, self.small_matmul_dtypes))}")
        _check_dense_weight("matmul", x.dtype, weight)
        code = DTYPE_CODES[x.dtype]
        if panels is not None:
            code = self._check_panels("matmul", x.dtype, k, panels, n)
        dense = None if code == WIDENED_CODE else weight.data_ptr()  # widened: panels only
        self._run_small_matmul("matmul", self._matmul, x, (
            dense, None if panels is None else panels.data_ptr()), k, bias, out,
            max_rows=None, code=code)

    def fused_moe(self, hidden: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                  renormalize: bool, w13: torch.Tensor, w2: torch.Tensor,
                  panels: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                  out: torch.Tensor, *, activation: str = "silu", swiglu_alpha: float = 1.702,
                  swiglu_limit: float = 7.0,
                  biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``out`` ``[T, H]`` = the mixture of experts of ``hidden`` (``FusedMoEOp``'s rules).

        ``router_logits``: ``[T, E]`` float32 or bfloat16; ``w13`` ``[E, 2I, H]`` and ``w2``
        ``[E, H, I]``, contiguous, ``hidden``'s dtype; ``panels``: the gate halves', up
        halves' and ``w2``'s panels (``pack_matmul_weight`` of each expert's ``[I, H]``,
        ``[I, H]`` and ``[H, I]``, stacked ``[E, size]``), or None (then at most
        ``SMALL_MATMUL_ROWS`` tokens per expert: 1-3 tokens). Rows of ``hidden``,
        ``router_logits`` and ``out`` contiguous. One call routes, groups by expert and
        runs every product (fused_moe.cpp); a step graph records it whole.
        ``activation`` (with ``swiglu_alpha``, ``swiglu_limit``): one of
        ``FUSED_MOE_ACTIVATIONS``, as ``FusedMoEOp.activate``; ``biases``: ``w13_bias``
        ``[E, 2I]`` and ``w2_bias`` ``[E, H]``, contiguous, ``hidden``'s dtype, or None.
        """
        tokens, hidden_size = hidden.shape
        experts, size2, _ = w13.shape
        size = size2 // 2
        if router_logits.dim() != 2 or router_logits.shape[0] != tokens or not (
                router_logits.stride(1) == 1 and router_logits.dtype in DTYPE_CODES):
            raise ValueError(f"fused_moe: expected router logits [{tokens}, {experts}] float32 "
                             f"or bfloat16 with contiguous rows, got "
                             f"{tuple(router_logits.shape)} {router_logits.dtype}")
        if router_logits.shape[1] != experts or not 1 <= top_k <= experts:
            raise ValueError(f"fused_moe: {router_logits.shape[1]} logits per token and "
                             f"top_k {top_k} for {experts} experts")
        check_rows("fused_moe", hidden.dtype, hidden_size, hidden, out)
        _check_flat("fused_moe", ("w13", w13, hidden.dtype, experts * size2 * hidden_size),
                    ("w2", w2, hidden.dtype, experts * hidden_size * size))
        if activation not in FUSED_MOE_ACTIVATIONS:
            raise ValueError(f"fused_moe: activation {activation!r} is not supported; "
                             f"supported: {', '.join(FUSED_MOE_ACTIVATIONS)}")
        if biases is not None:
            _check_flat("fused_moe", ("w13_bias", biases[0], hidden.dtype, experts * size2),
                        ("w2_bias", biases[1], hidden.dtype, experts * hidden_size))
        code = DTYPE_CODES[hidden.dtype]
        if panels is None:
            if tokens > SMALL_MATMUL_ROWS or hidden.dtype not in self.small_matmul_dtypes:
                raise ValueError(f"fused_moe: {tokens} tokens of {hidden.dtype} need the "
                                 f"packed weights (panels); without them 1.."
                                 f"{SMALL_MATMUL_ROWS} tokens of "
                                 f"{sorted(map(str, self.small_matmul_dtypes))}")
        else:
            code = self._check_panels("fused_moe", hidden.dtype, hidden_size, panels[0][0],
                                      size)
            for part, n, k in ((panels[0], size, hidden_size), (panels[1], size, hidden_size),
                               (panels[2], hidden_size, size)):
                _check_flat("fused_moe", ("panels", part, panels[0].dtype,
                                          experts * packed_matmul_size(n, k)))
        workspace = torch.empty(self._fused_moe_workspace(
            tokens, top_k, experts, hidden_size, size, hidden.element_size()), dtype=torch.uint8)
        gate, up, down = (None, None, None) if panels is None else panels
        b13, b2 = ((None, None) if biases is None
                   else (biases[0].data_ptr(), biases[1].data_ptr()))
        options = int(renormalize) | FUSED_MOE_ACTIVATIONS[activation] << 1
        call_status("fused_moe", self._invoke("fused_moe", self._fused_moe,
            code, hidden.data_ptr(), hidden.stride(0), tokens, DTYPE_CODES[router_logits.dtype],
            router_logits.data_ptr(), router_logits.stride(0), experts, top_k, options,
            swiglu_alpha, swiglu_limit, w13.data_ptr(), b13,
            None if gate is None else gate.data_ptr(), None if up is None else up.data_ptr(),
            w2.data_ptr(), b2, None if down is None else down.data_ptr(),
            hidden_size << 32 | size, out.data_ptr(), out.stride(0), workspace.data_ptr(),
            torch.get_num_threads()))

    def _invoke(self, kernel: str, entry: Callable[..., int | None], *args: object) -> int:
        """Call ``entry``, or record its step-graph entry's call while a graph is recorded."""
        return invoke(kernel, entry, self.graph_functions.get(kernel), *args)

    def _check_panels(self, kernel: str, dtype: torch.dtype, k: int, panels: torch.Tensor,
                      n: int) -> int:
        """The product's dtype code for ``dtype`` activations on these panels."""
        if dtype == torch.float32 and panels.dtype == torch.bfloat16 and (
                self.packs_float32_as_bfloat16):
            _check_flat(kernel, ("panels", panels, torch.bfloat16, packed_matmul_size(n, k)))
            return WIDENED_CODE
        self._check_packed_dtype(kernel, dtype, k)
        _check_flat(kernel, ("panels", panels, dtype, packed_matmul_size(n, k)))
        return DTYPE_CODES[dtype]

    def _check_packed_dtype(self, kernel: str, dtype: torch.dtype, k: int) -> None:
        _check_supported(kernel, dtype, self.packed_matmul_dtypes)
        if k < 0 or (dtype == torch.bfloat16 and k % 2):
            raise ValueError(f"{kernel}: K = {k}; bfloat16 weights are packed in pairs "
                             f"along K, so K must be even")

    def _run_small_matmul(self, kernel: str, entry: Callable[..., int], x: torch.Tensor,
                          weights: tuple[int | None, ...], k: int, bias: torch.Tensor | None,
                          out: torch.Tensor, max_rows: int | None = SMALL_MATMUL_ROWS,
                          code: int | None = None) -> None:
        """The checks and the call the products share (the weights checked by the caller).

        ``code``: the dtype code the library is given, when not ``x``'s own.
        """
        rows, n = out.shape
        if rows < 1 or (max_rows is not None and rows > max_rows):
            raise ValueError(f"{kernel}: {rows} rows; supported: 1.."
                             f"{max_rows if max_rows is not None else 'any'}")
        check_rows(kernel, x.dtype, k, x)
        check_rows(kernel, x.dtype, n, out)
        if x.shape[0] != rows:
            raise ValueError(f"{kernel}: {x.shape[0]} input rows, {rows} output rows")
        if bias is not None:
            check_rows(kernel, x.dtype, n, bias.view(1, -1))
        call_status(kernel, self._invoke(kernel, entry,
            DTYPE_CODES[x.dtype] if code is None else code, x.data_ptr(), x.stride(0), rows,
            *weights, n, k,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            torch.get_num_threads()))

    def gguf_dequant(self, ggml_type: int, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = the values of GGUF ``blocks`` (``GGUF_DEQUANT_TYPES``), in place.

        ``blocks``: contiguous ``uint8 [n, type_size]``; ``out``: contiguous float32 or
        bfloat16 with ``n * 32`` elements. Exact: the float32 values of ``gguf_formats``
        (a product, then a sum), rounded once to ``out``'s dtype.
        """
        code = _dtype_code("gguf_dequant", out)
        if ggml_type not in GGUF_DEQUANT_TYPES or blocks.dim() != 2 or (
                blocks.shape[1] != GGUF_DEQUANT_TYPES[ggml_type]):
            raise ValueError(f"gguf_dequant: expected blocks uint8 [n, type_size] of Q4_0 (ggml "
                             f"type 2, 18-byte blocks), Q4_1 (3, 20 bytes) or Q8_0 (8, 34 "
                             f"bytes), got type {ggml_type} {tuple(blocks.shape)}")
        _check_flat("gguf_dequant", ("blocks", blocks, torch.uint8, blocks.numel()),
                    ("out", out, out.dtype, blocks.shape[0] * 32))
        call_status("gguf_dequant", self._invoke("gguf_dequant", self._gguf_dequant,
            ggml_type, blocks.data_ptr(), blocks.shape[0], code, out.data_ptr(),
            torch.get_num_threads()))

    def int4pack_dequant_t(self, packed: torch.Tensor, scales_zeros: torch.Tensor, start: int,
                           stop: int, out: torch.Tensor) -> None:
        """``out`` ``[K, stop - start]``: rows ``[start, stop)`` of an int4 weight, transposed.

        ``packed``: ``uint8 [N / B, K, B / 2]`` from ``_convert_weight_to_int4pack_for_cpu(q,
        1)``, in tiles of B = 64 or 32 rows (torch's layout for the CPU:
        ``gguf_kernels.int4pack_block()``); ``scales_zeros``: ``[K / 32, N, 2]`` in ``out``'s
        dtype (float32 or bfloat16), both contiguous; ``start``/``stop``: multiples of 64.
        ``w = (q - 8) * scale + zero`` in float32, rounded once.
        """
        if packed.dim() != 3 or packed.shape[2] not in (16, 32):
            raise ValueError(f"int4pack_dequant_t: expected packed uint8 [N / B, K, B / 2] with "
                             f"B 64 or 32, got {tuple(packed.shape)}")
        tiles, cols, half = packed.shape
        rows = 2 * half * tiles
        code = _dtype_code("int4pack_dequant_t", out)
        if not (0 <= start < stop <= rows and start % 64 == 0 and stop % 64 == 0
                and cols % 32 == 0 and tuple(scales_zeros.shape) == (cols // 32, rows, 2)
                and tuple(out.shape) == (cols, stop - start)):
            raise ValueError(
                f"int4pack_dequant_t: rows [{start}, {stop}) of packed {tuple(packed.shape)} "
                f"with scales {tuple(scales_zeros.shape)} into {tuple(out.shape)}: expected "
                f"multiples of 64 within the weight and out [K, stop - start]")
        _check_flat("int4pack_dequant_t", ("packed", packed, torch.uint8, packed.numel()),
                    ("scales_zeros", scales_zeros, out.dtype, scales_zeros.numel()),
                    ("out", out, out.dtype, out.numel()))
        call_status("int4pack_dequant_t", self._invoke(
            "int4pack_dequant_t", self._int4pack_dequant_t, packed.data_ptr(), cols,
            2 * half, start, stop - start, scales_zeros.data_ptr(), rows, code, out.data_ptr(),
            torch.get_num_threads()))

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy ``key``/``value`` rows ``[tokens, kv_heads, D]`` into their cache slots.

        ``slots``: int64 ``[tokens]``; the caches ``[blocks, kv_heads, block_size, D]``.
        """
        tokens, kv_heads, head_size = key.shape
        _check_layout("write_kv", (key, value), (key_cache, value_cache), (slots,), torch.int64)
        self._invoke("write_kv", self._write_kv,
            key.element_size(), key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(),
            value.stride(0), value.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
            *key_cache.stride()[:3], slots.data_ptr(), tokens, kv_heads, head_size,
            key_cache.shape[2])

    def paged_attention(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        block_table: torch.Tensor, requests: torch.Tensor, positions: torch.Tensor,
        output: torch.Tensor, scale: float, sliding_window: int | None,
        soft_cap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> None:
        """Attention of query rows over their requests' cached keys, into ``output``.

        ``query``/``output``: ``[tokens, heads, D]`` (last axis contiguous); ``block_table``
        int32 ``[requests, max_blocks]`` (rows contiguous); ``requests``/``positions``:
        int32 ``[rows]``, contiguous: query row ``t < rows`` belongs to request
        ``requests[t]``, sees that request's keys ``0..positions[t]`` and fills output row
        ``t``. ``soft_cap``: scores become ``soft_cap * tanh(score / soft_cap)`` before the
        softmax. ``sinks``: float32 ``[heads]`` (contiguous), one more logit per head in
        the softmax's denominator (attention sinks).
        """
        _, heads, head_size = query.shape
        if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (heads,)
                                  or not sinks.is_contiguous() or not sinks.is_cpu):
            raise ValueError(f"paged_attention: sinks must be a contiguous float32 CPU tensor "
                             f"of [{heads}] (one per head), got {tuple(sinks.shape)} "
                             f"{sinks.dtype} on {sinks.device}")
        if soft_cap is not None and not soft_cap > 0:
            raise ValueError(f"paged_attention: soft_cap must be > 0 or None, got {soft_cap}")
        _check_layout("paged_attention", (query, output), (key_cache, value_cache),
                      (block_table, requests, positions), torch.int32)
        code = _dtype_code("paged_attention", query)
        call_status("paged_attention", self._invoke("paged_attention", self._attention,
            code, query.data_ptr(), query.stride(0), query.stride(1),
            key_cache.data_ptr(), value_cache.data_ptr(), *key_cache.stride()[:3],
            block_table.data_ptr(), block_table.stride(0), requests.data_ptr(),
            positions.data_ptr(), requests.shape[0], output.data_ptr(), output.stride(0),
            output.stride(1), heads << 32 | key_cache.shape[1],
            head_size << 32 | key_cache.shape[2], sliding_window or 0, scale, soft_cap or 0.0,
            None if sinks is None else sinks.data_ptr(), torch.get_num_threads()))


def packed_matmul_size(n: int, k: int) -> int:
    """Elements of an ``[n, k]`` weight packed by ``NativeKernels.pack_matmul_weight``."""
    return -(-n // PACKED_MATMUL_PANEL) * PACKED_MATMUL_PANEL * k


def _dtypes_in(codes: int) -> frozenset[torch.dtype]:
    """The dtypes whose ``DTYPE_CODES`` bit is set in ``codes`` (a kernel's report)."""
    return frozenset(dtype for dtype, code in DTYPE_CODES.items() if codes >> code & 1)


def _check_supported(kernel: str, dtype: torch.dtype, supported: frozenset[torch.dtype]) -> None:
    if dtype not in supported:
        raise ValueError(f"{kernel}: dtype {dtype} not supported on this CPU; "
                         f"supported: {sorted(map(str, supported))}")


def _dtype_code(kernel: str, tensor: torch.Tensor) -> int:
    code = DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise ValueError(f"{kernel}: dtype {tensor.dtype} not supported; supported: "
                         f"{', '.join(map(str, DTYPE_CODES))}")
    return code


def _check_flat(kernel: str, *specs: tuple[str, torch.Tensor, torch.dtype, int]) -> None:
    """Refuse anything but contiguous CPU tensors of the given dtype and element count."""
    for name, t, dtype, count in specs:
        if not (t.is_contiguous() and t.dtype == dtype and t.is_cpu and t.numel() == count):
            raise ValueError(
                f"{kernel}: expected {name} as a contiguous {dtype} CPU tensor of {count} "
                f"elements, got "
                f"{tuple(t.shape)} {t.dtype} on {t.device.type} (contiguous: "
                f"{t.is_contiguous()})")


def _check_dense_weight(kernel: str, dtype: torch.dtype, weight: torch.Tensor) -> None:
    """A ``[N, K]`` weight of ``dtype`` the products read flat: contiguous."""
    n, k = weight.shape
    check_rows(kernel, dtype, k, weight)
    if not weight.is_contiguous():
        raise ValueError(f"{kernel}: expected a contiguous [{n}, {k}] weight, got "
                         f"{tuple(weight.shape)} (contiguous: {weight.is_contiguous()})")


def _check_layout(kernel: str, rows: tuple[torch.Tensor, ...], caches: tuple[torch.Tensor, ...],
                  indices: tuple[torch.Tensor, ...], index_dtype: torch.dtype) -> None:
    """Refuse what the C++ code would misread (it trusts shapes, strides and dtypes).

    Called for every kernel launch (twice per layer and step), so it reads each tensor's
    metadata once and builds no views.
    """
    dtype = caches[0].dtype
    head_size = caches[0].shape[-1]
    ok = all(t.dim() == 3 and t.stride(2) == 1 and t.dtype == dtype and t.is_cpu
             and t.shape[2] == head_size for t in rows)
    ok = ok and all(t.dtype == dtype and t.is_cpu and _blocks_contiguous(t) for t in caches)
    if not ok:
        raise ValueError(
            f"{kernel}: expected [tokens, heads, head_size] rows with a contiguous last axis "
            f"and [blocks, kv_heads, block_size, head_size] caches with contiguous blocks, "
            f"all {dtype} on the CPU; got rows "
            f"{[(tuple(t.shape), t.dtype, t.device.type) for t in rows]}, caches "
            f"{[(tuple(t.shape), t.dtype, t.device.type) for t in caches]}")
    if not all(t.dtype == index_dtype and t.stride(-1) == 1 and t.is_cpu for t in indices):
        raise ValueError(f"{kernel}: index tensors must be {index_dtype} on the CPU with a "
                         f"contiguous last axis, got "
                         f"{[(tuple(t.shape), t.dtype, t.device.type) for t in indices]}")


def _blocks_contiguous(cache: torch.Tensor) -> bool:
    """``cache[b]`` is contiguous for every block ``b`` (``cache[0].is_contiguous()``)."""
    if cache.dim() != 4:
        return False
    _, heads, block, head_size = cache.shape
    s = cache.stride()
    return ((s[3] == 1 or head_size == 1) and (s[2] == head_size or block == 1)
            and (s[1] == block * head_size or heads == 1))


__all__ = ["DTYPE_CODES", "GGUF_DEQUANT_TYPES", "GRAPH_KERNELS", "SMALL_MATMUL_ROWS",
           "NativeBuildError", "NativeKernels", "load",
           "native_kernels", "packed_matmul_size"]
