"""Custom ops: model building blocks with a reference implementation and per-platform ones.

A :class:`CustomOp` is a ``torch.nn.Module`` whose ``forward`` dispatches, once at
construction, to one of:

* ``forward_native``: the reference semantics in plain torch; required, and the
  definition every other implementation is checked against;
* ``forward_cuda`` / ``forward_cpu``: faster paths for those device types;
* ``forward_oot``: the path for any other (out-of-tree) device type.

The non-native methods default to ``forward_native``. The dispatch key is the
constructor's ``dispatch_key``: ``"native"`` (the reference; the default), ``"cpu"``,
``"cuda"``, or any other device type (``"npu"``, ``"xpu"``, ...), which selects
``forward_oot``. The engine builds every op with the platform's device type as its key.
Which class it builds an op from: every class registered under the op's name, by any
distribution (the engine's own built-in among them), is a candidate; by default the one
that can run on the device (:meth:`CustomOp.is_supported`) with the highest
:attr:`~CustomOp.priority` wins, a third party's before the engine's own at equal
priority. The operator and the platform can choose (``--custom-ops all,none,+name,
+name=DISTRIBUTION,-name`` and ``PlatformConfig.custom_ops``; the operator's flag wins).

Replacing an op: publish a subclass of its contract class (e.g. :class:`RMSNormOp`) in
``engine.custom_ops`` under the op's :attr:`~CustomOp.name`, overriding the forward
methods for your device. Other distributions may register the same name; nothing about
that is an error. The engine builds the model's ops from the chosen class, so nothing is
monkey-patched and model code is unchanged::

    [project.entry-points."engine.custom_ops"]
    rms_norm = "my_npu_plugin.ops:NPURMSNorm"

:func:`check_replacement` is what the engine checks the class with. Built-in contracts:
:data:`BUILTIN_OPS`. Replacements may work in place; compare them with the reference on
cloned inputs.

.. versionadded:: 1.0
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

import torch
import torch.nn.functional as F

from engine.sdk.capture import CaptureContext, not_declared
from engine.sdk.plugin import Plugin
from engine.sdk.support import Support

if TYPE_CHECKING:
    from engine.sdk.platform import PlatformInfo

#: Dispatch key that selects ``forward_native`` whatever the device.
NATIVE = "native"

_METHOD_BY_KEY = {NATIVE: "forward_native", "cpu": "forward_cpu", "cuda": "forward_cuda"}


class CustomOp(Plugin, torch.nn.Module, ABC):
    """Base of every custom op: a module with per-platform forward implementations.

    Called: constructed in the worker while the model is built (through the class the
    engine resolved for :attr:`name`); ``forward`` on every use in the model's forward.

    Attributes:
        name: The op's name (``"rms_norm"``, ...), the entry-point name in
            ``engine.custom_ops`` a replacement is registered under.
        priority: Rank among the implementations of the op that can run on the device
            (:meth:`is_supported`): the higher wins. At equal priority a third party's
            implementation wins over the engine's own (engine-core's built-ins and
            engine-kernels' are 0), and two third parties' need the operator's choice
            (``--custom-ops +NAME=DISTRIBUTION``). Default 0: a replacement you install is
            used wherever it has a path of its own. A negative priority makes it a fallback
            that the engine's own implementations beat.
        dispatch_key: The key this instance was built with.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``priority`` and ``is_supported``.
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    def __init__(self, *, dispatch_key: str = NATIVE) -> None:
        """Choose the forward implementation for ``dispatch_key``, once.

        Args:
            dispatch_key: ``"native"``, ``"cpu"``, ``"cuda"``, or another device type
                (selects ``forward_oot``).
        """
        super().__init__()
        self.dispatch_key = dispatch_key
        self._forward_impl: Callable[..., Any] = getattr(self, self.method_for(dispatch_key))

    @staticmethod
    def method_for(dispatch_key: str) -> str:
        """The name of the forward method ``dispatch_key`` selects.

        ``"native"`` -> ``"forward_native"``, ``"cpu"`` -> ``"forward_cpu"``, ``"cuda"``
        -> ``"forward_cuda"``, any other key -> ``"forward_oot"``. The engine uses it to
        tell whether a replacement has code of its own for the platform's device (it
        overrides this method or ``forward_native``).

        .. versionadded:: 1.1
        """
        return _METHOD_BY_KEY.get(dispatch_key, "forward_oot")

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        """Whether this implementation is a candidate for its op on ``platform``.

        Called: by the engine in the worker while it builds the model, once per op
        implementation installed (and by ``engine plugins list``), before any instance
        exists. A ``no`` keeps the class out of the default choice, with the reason in the
        worker's log; the operator can still force it (``--custom-ops +NAME=...``).

        Default: yes when the class has code of its own for ``platform.device_type``: it
        overrides that device's forward method (:meth:`method_for`) or ``forward_native``,
        compared with the contract it subclasses. A class that inherits both would only run
        the contract's reference there. Override to refuse for other reasons (a missing
        instruction set, library or dtype), calling ``super().is_supported(platform)`` first.

        Args:
            platform: The device the model runs on.

        Returns:
            ``Support.yes()``, or ``Support.no(reason)``.

        .. versionadded:: 1.1
        """
        contract = next((c for c in cls.__mro__ if c in _CONTRACTS), CustomOp)
        method = cls.method_for(platform.device_type)
        if any(getattr(cls, m) is not getattr(contract, m) for m in (method, "forward_native")):
            return Support.yes()
        return Support.no(f"it has no {platform.device_type} path of its own ({method} "
                          f"and forward_native are {contract.__qualname__}'s reference)")

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Whether a graph of ``ctx.kind`` can record this instance's forward.

        Called: in the worker, once per op instance the forward pass calls, each time the
        engine records the pass (:mod:`engine.sdk.capture`).

        Answer for the implementation this instance was built to run (the method
        :meth:`method_for` its ``dispatch_key`` selects). ``GraphKind.CPU_STEP_GRAPH``
        replays only native calls (its own C code called through a
        :class:`~engine.sdk.graph_calls.GraphFunction`, or the engine's kernels), so an op
        computing in torch answers no there; ``GraphKind.CUDA_GRAPHS`` takes any CUDA work
        that does not synchronise with the host.

        Default: no (the pass runs eagerly, with this op named in the log). A subclass
        inherits its base's answer: one that overrides the forward method its base's
        answer is about should answer again.

        Returns:
            ``Support.yes()``, or ``Support.no(reason)``.

        Must: not raise.

        .. versionadded:: 1.1
        """
        return not_declared(f"custom op {self.name!r} ({type(self).__qualname__})", ctx)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the implementation chosen at construction (see the subclass's contract)."""
        return self._forward_impl(*args, **kwargs)

    @abstractmethod
    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The reference semantics, in plain torch, on any device.

        Must: be exact enough to serve as the test oracle for every other implementation.
        """
        raise NotImplementedError

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        """The CUDA path. Default: ``forward_native``."""
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        """The CPU path. Default: ``forward_native``."""
        return self.forward_native(*args, **kwargs)

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        """The path for out-of-tree device types. Default: ``forward_native``."""
        return self.forward_native(*args, **kwargs)


class RMSNormOp(CustomOp):
    """``rms_norm``: RMS normalisation with a learned scale, optionally fused with a residual add.

    Call: ``op(x)`` -> ``y``; ``op(x, residual)`` -> ``(y, new_residual)``.

    Reference semantics (``forward_native``), with ``d = x.dtype``::

        h = x.float()                                   # residual given:
        h = h + residual.float(); new_residual = h.to(d)
        y = (h * rsqrt(mean(h ** 2, -1) + eps)).to(d) * weight

    Shapes: ``x`` and ``residual`` ``[..., hidden_size]`` of one dtype; outputs the same.
    Replacements may overwrite ``x`` and ``residual`` in place (fused kernels do); callers
    must not reuse them after the call.

    Attributes:
        weight: ``[hidden_size]`` parameter (initialised to ones).
        eps: Added to the mean square.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``priority``.
    """

    name: ClassVar[str] = "rms_norm"

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype | None = None,
        dispatch_key: str = NATIVE,
    ) -> None:
        """Create the weight.

        Args:
            hidden_size: Size of the normalised (last) dimension.
            eps: Added to the mean square before the reciprocal square root.
            dtype: Dtype of ``weight`` (default: torch's default dtype).
            dispatch_key: See :class:`CustomOp`.
        """
        super().__init__(dispatch_key=dispatch_key)
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...
    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (after adding ``residual``, if given); see the class docstring."""
        result: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = self._forward_impl(
            x, residual
        )
        return result

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Reference RMSNorm (see the class docstring); computes in float32.

        ``F.rms_norm`` computes exactly ``h * rsqrt(mean(h ** 2, -1) + eps)`` (bitwise, in
        float32), in one call instead of four.
        """
        orig_dtype = x.dtype
        h = x.to(torch.float32)
        if residual is not None:
            h = h + residual.to(torch.float32)
            residual = h.to(orig_dtype)
        y = F.rms_norm(h, (h.shape[-1],), eps=self.eps).to(orig_dtype) * self.weight
        return y if residual is None else (y, residual)


class RotaryEmbeddingOp(CustomOp):
    """``rotary_embedding``: rotate queries and keys by their positions (RoPE).

    Call: ``op(positions, query, key)`` -> ``(query, key)``.

    Shapes: ``positions`` ``[num_tokens]`` int64; ``query`` ``[num_tokens, num_heads,
    head_size]``; ``key`` ``[num_tokens, num_kv_heads, head_size]``; outputs have the
    inputs' shapes and dtypes. Only the first ``rotary_dim`` elements of each head rotate;
    the rest pass through unchanged.

    Reference semantics (``forward_native``), computed in float32 and cast back, with
    ``cos, sin = cos_sin_cache[positions].chunk(2, -1)`` (each ``[num_tokens, r/2]``,
    ``r = rotary_dim``) broadcast over heads:

    * NeoX style (``is_neox_style=True``): ``x1, x2 = x[..., :r/2], x[..., r/2:r]``;
      result ``cat(x1*cos - x2*sin, x2*cos + x1*sin)``.
    * GPT-J style: ``x1, x2 = x[..., 0:r:2], x[..., 1:r:2]``; results interleaved back
      into the even and odd positions.

    Rope scaling (linear, NTK, Llama 3, YaRN, ...) is the engine's business: it only
    changes the cache, which the constructor takes precomputed (see
    :meth:`default_cos_sin_cache`). Replacements may rotate ``query`` and ``key`` in place.

    Attributes:
        cos_sin_cache: ``[max_position, rotary_dim]`` non-persistent buffer: cosines in
            the first half of the last dimension, sines in the second.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``priority``.
    """

    name: ClassVar[str] = "rotary_embedding"

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        cos_sin_cache: torch.Tensor,
        is_neox_style: bool = True,
        *,
        dispatch_key: str = NATIVE,
    ) -> None:
        """Store the geometry and the precomputed cache.

        Args:
            head_size: Elements per head.
            rotary_dim: Leading elements of each head that rotate (even, <= head_size).
            cos_sin_cache: ``[max_position, rotary_dim]`` float tensor, as described above.
            is_neox_style: NeoX (rotate halves) or GPT-J (rotate pairs) style.
            dispatch_key: See :class:`CustomOp`.

        Raises:
            ValueError: ``rotary_dim`` is odd or larger than ``head_size``, or the cache's
                last dimension is not ``rotary_dim``.
        """
        super().__init__(dispatch_key=dispatch_key)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
            raise ValueError(f"rotary_dim must be even and in (0, {head_size}], got {rotary_dim}")
        if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] != rotary_dim:
            raise ValueError(
                f"cos_sin_cache must be [max_position, {rotary_dim}], got "
                f"{tuple(cos_sin_cache.shape)}"
            )
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    @staticmethod
    def default_cos_sin_cache(
        rotary_dim: int,
        max_position: int,
        base: float = 10000.0,
        *,
        inv_freq: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The standard RoPE cache ``cat(cos(p * f), sin(p * f))`` for ``p < max_position``.

        Args:
            rotary_dim: Rotating elements per head.
            max_position: Positions covered.
            base: Frequency base (``rope_theta``); ignored when ``inv_freq`` is given.
            inv_freq: ``[rotary_dim / 2]`` frequencies, for scaled variants; default
                ``base ** -(arange(0, rotary_dim, 2) / rotary_dim)``.
            dtype: Dtype of the result.

        Returns:
            ``[max_position, rotary_dim]``.
        """
        if inv_freq is None:
            exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
            inv_freq = 1.0 / (base**exponents)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` and ``key``; see the class docstring."""
        result: tuple[torch.Tensor, torch.Tensor] = self._forward_impl(positions, query, key)
        return result

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference rotation (see the class docstring)."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).float().chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        rot, rest = x[..., :r].float(), x[..., r:]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if rest.shape[-1] == 0:  # the usual full-width rotation: nothing to append
            return out.to(x.dtype)
        return torch.cat((out.to(x.dtype), rest), dim=-1)


class SiluAndMulOp(CustomOp):
    """``silu_and_mul``: the gated activation of SwiGLU MLPs.

    Call: ``op(x)`` -> ``y``, with ``x`` ``[..., 2 * d]`` and ``y`` ``[..., d]`` of
    ``x``'s dtype.

    Reference semantics (``forward_native``), in ``x``'s dtype::

        y = silu(x[..., :d]) * x[..., d:]

    Must: not modify ``x``.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``priority``.
    """

    name: ClassVar[str] = "silu_and_mul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gate; see the class docstring."""
        result: torch.Tensor = self._forward_impl(x)
        return result

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """Reference SiLU-and-mul (see the class docstring)."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


_GELU_APPROXIMATIONS = ("none", "tanh")


class GeluAndMulOp(CustomOp):
    """``gelu_and_mul``: the gated activation of GeGLU MLPs (Gemma, T5 v1.1 and the like).

    Call: ``op(x)`` -> ``y``, with ``x`` ``[..., 2 * d]`` and ``y`` ``[..., d]`` of
    ``x``'s dtype.

    Reference semantics (``forward_native``), in ``x``'s dtype, with ``approximate`` as
    :func:`torch.nn.functional.gelu` takes it (``"none"``: the exact erf form; ``"tanh"``:
    the tanh approximation, transformers' ``gelu_pytorch_tanh``)::

        y = gelu(x[..., :d], approximate=approximate) * x[..., d:]

    Must: not modify ``x``.

    .. versionadded:: 1.1
    """

    name: ClassVar[str] = "gelu_and_mul"

    def __init__(self, approximate: Literal["none", "tanh"] = "none", *,
                 dispatch_key: str = NATIVE) -> None:
        """Choose the GELU form.

        Args:
            approximate: ``"none"`` (exact, erf) or ``"tanh"``.
            dispatch_key: See :class:`CustomOp`.

        Raises:
            ValueError: ``approximate`` is neither ``"none"`` nor ``"tanh"``.
        """
        if approximate not in _GELU_APPROXIMATIONS:
            raise ValueError(f"gelu_and_mul: approximate={approximate!r} is not supported; "
                             f"allowed: {', '.join(map(repr, _GELU_APPROXIMATIONS))}")
        super().__init__(dispatch_key=dispatch_key)
        self.approximate = approximate

    def extra_repr(self) -> str:
        """``approximate``, in the module's ``repr``."""
        return f"approximate={self.approximate!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gate; see the class docstring."""
        result: torch.Tensor = self._forward_impl(x)
        return result

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """Reference GELU-and-mul (see the class docstring)."""
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


class FusedMoEOp(CustomOp):
    """``fused_moe``: a mixture-of-experts MLP (router top-k, gated experts, weighted sum).

    Call: ``op(hidden, router_logits)`` -> ``out``, with ``hidden`` ``[T, H]``,
    ``router_logits`` ``[T, E]`` (the router's scores of every expert, any float dtype) and
    ``out`` ``[T, H]`` of ``hidden``'s dtype.

    Routing (:meth:`route`), in float32: ``p = softmax(router_logits, -1)``; each token
    keeps its ``top_k`` largest ``p`` (``ids [T, top_k]``, ``weights [T, top_k]``); with
    ``renormalize`` the kept weights are divided by their sum (Mixtral; Qwen3-MoE's
    ``norm_topk_prob``), without it they stay the softmax's probabilities (Qwen2-MoE).
    ("Top-k, then softmax over the k logits", as some checkpoints spell it (GPT-OSS), is
    the same as ``renormalize=True``.)

    Reference semantics (``forward_native``), with ``I`` this rank's intermediate size::

        for every token t and each of its k experts e = ids[t, j]:
            gate_up = w13[e] @ hidden[t] (+ w13_bias[e])    # [2 * I], hidden's dtype
            a = act(gate_up[:I], gate_up[I:])               # activate()
            out[t] += weights[t, j] * (w2[e] @ a (+ w2_bias[e]))   # summed in float32
        out = out.to(hidden.dtype)

    with ``act`` chosen by ``activation``:

    * ``"silu"`` (the default; SwiGLU: Mixtral, Qwen-MoE): ``silu(gate) * up``, as
      :class:`SiluAndMulOp`;
    * ``"swigluoai"`` (GPT-OSS's clamped SwiGLU, constants ``swiglu_alpha`` and
      ``swiglu_limit``)::

          gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
          act = (up + 1) * (gate * sigmoid(alpha * gate))

      Gate and up are the halves of ``gate_up`` here as for ``"silu"``; a checkpoint that
      interleaves them (GPT-OSS's ``gate_up_proj`` columns ``0::2`` gate, ``1::2`` up) is
      de-interleaved when it is loaded.

    With ``bias`` the experts' projections carry biases (``w13_bias``, ``w2_bias``; the
    ``(+ ...)`` terms above); without it there are none (``w13_bias`` and ``w2_bias`` are
    ``None``).

    Under tensor parallelism every rank holds every expert, each with its share ``I`` of
    the intermediate dimension (w1/w3 rows and their bias, w2 columns): ``out`` is then
    this rank's partial sum, and the caller sums it over the ranks, as a row-parallel
    linear layer does (the layer :meth:`engine.sdk.layers.LayerFactory.fused_moe` builds
    does that). ``w2_bias`` must enter that sum once: the layer loads the checkpoint's on
    rank 0 and leaves zeros on the others, so the op always adds the ``w2_bias`` it holds.

    Parameters (initialised to zeros; the engine's layer loads them):

    * ``w13``: ``[E, 2 * I, H]``, expert ``e``'s gate projection (``w1``, ``gate_proj``)
      in rows ``[:I]`` and its up projection (``w3``, ``up_proj``) in rows ``[I:]``;
    * ``w2``: ``[E, H, I]``, the down projections (``w2``, ``down_proj``);
    * with ``bias``: ``w13_bias`` ``[E, 2 * I]`` (gate's then up's) and ``w2_bias``
      ``[E, H]``.

    The reference groups the tokens by expert (one product per expert over only its
    tokens). Because the groups' sizes depend on the routing (a host synchronisation),
    neither graph kind can record it; the engine's CPU implementation (engine-kernels')
    keeps them inside one native call instead.
    Replacements (a fused kernel that routes, groups and multiplies in a few launches)
    must match it within floating-point tolerance and must not modify their inputs; they
    may keep the weights in another layout after ``process_weights_after_loading``. A
    replacement that implements only some options must check each instance's
    (:meth:`extra_options`: empty for plain SwiGLU experts without biases) and run the
    reference (``FusedMoEOp.forward_native``, weights kept in its layout) for the others.

    Attributes:
        num_experts: ``E``.
        top_k: Experts per token.
        hidden_size: ``H``.
        intermediate_size: ``I``, this rank's share of each expert's intermediate size.
        renormalize: Whether the ``top_k`` weights are renormalised to sum to one.
        activation: ``"silu"`` or ``"swigluoai"``.
        swiglu_alpha: ``"swigluoai"``'s ``alpha`` (unused by ``"silu"``).
        swiglu_limit: ``"swigluoai"``'s ``limit`` (unused by ``"silu"``).
        has_bias: Whether ``w13_bias`` and ``w2_bias`` exist.

    .. versionadded:: 1.1
    """

    name: ClassVar[str] = "fused_moe"

    #: The ``activation`` values the contract defines.
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("silu", "swigluoai")

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool = True,
        activation: Literal["silu", "swigluoai"] = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        dispatch_key: str = NATIVE,
    ) -> None:
        """Create ``w13`` and ``w2`` (and with ``bias`` ``w13_bias``, ``w2_bias``), zeros.

        Args:
            num_experts: Experts ``E``.
            top_k: Experts each token is routed to (``1 <= top_k <= E``).
            hidden_size: ``H``.
            intermediate_size: This rank's intermediate size ``I`` of each expert.
            renormalize: Renormalise the kept weights to sum to one (see the class
                docstring).
            activation: The experts' gated activation, ``"silu"`` or ``"swigluoai"`` (see
                the class docstring).
            swiglu_alpha: ``"swigluoai"``'s ``alpha`` (GPT-OSS: 1.702).
            swiglu_limit: ``"swigluoai"``'s clamp ``limit``, positive (GPT-OSS: 7.0).
            bias: The experts' projections carry biases.
            dtype: Dtype of the weights (default: torch's default dtype).
            dispatch_key: See :class:`CustomOp`.

        Raises:
            ValueError: a size is not positive, ``top_k`` is not in ``[1, E]``,
                ``activation`` is not one of :attr:`ACTIVATIONS`, or ``swiglu_limit`` is
                not positive.
        """
        super().__init__(dispatch_key=dispatch_key)
        if min(num_experts, hidden_size, intermediate_size) <= 0:
            raise ValueError(f"fused_moe sizes must be positive, got num_experts={num_experts}"
                             f", hidden_size={hidden_size}, "
                             f"intermediate_size={intermediate_size}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"fused_moe activation {activation!r} is not supported; "
                             f"supported: {', '.join(self.ACTIVATIONS)}")
        if not swiglu_limit > 0:
            raise ValueError(f"fused_moe swiglu_limit must be positive, got {swiglu_limit}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.activation = activation
        self.swiglu_alpha = float(swiglu_alpha)
        self.swiglu_limit = float(swiglu_limit)
        self.has_bias = bias
        self.w13 = torch.nn.Parameter(
            torch.zeros(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
            requires_grad=False)
        self.w2 = torch.nn.Parameter(
            torch.zeros(num_experts, hidden_size, intermediate_size, dtype=dtype),
            requires_grad=False)
        self.w13_bias: torch.nn.Parameter | None = None
        self.w2_bias: torch.nn.Parameter | None = None
        if bias:
            self.w13_bias = torch.nn.Parameter(
                torch.zeros(num_experts, 2 * intermediate_size, dtype=dtype),
                requires_grad=False)
            self.w2_bias = torch.nn.Parameter(
                torch.zeros(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def extra_options(self) -> dict[str, object]:
        """The options this instance sets beyond plain SwiGLU experts without biases.

        ``{}`` for ``activation="silu"`` without ``bias``; else ``"activation"`` (with its
        ``"swiglu_alpha"`` and ``"swiglu_limit"``) and/or ``"bias"`` mapped to their values.
        A replacement compares the keys with those it implements (``renormalize`` is
        routing, which :meth:`route` covers, and is not listed).

        .. versionadded:: 1.1
        """
        options: dict[str, object] = {}
        if self.activation != "silu":
            options.update(activation=self.activation, swiglu_alpha=self.swiglu_alpha,
                           swiglu_limit=self.swiglu_limit)
        if self.has_bias:
            options["bias"] = True
        return options

    def extra_repr(self) -> str:
        """Sizes and options, for ``print(model)``."""
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
                f", renormalize={self.renormalize}, activation={self.activation!r}, "
                f"bias={self.has_bias}")

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing rule: ``(weights [T, top_k] float32, ids [T, top_k] int64)``.

        See the class docstring; replacements may call it and fuse the rest.

        .. versionadded:: 1.1
        """
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated activation: ``[..., 2 * I]`` (gate, then up) -> ``[..., I]``.

        ``activation``'s formula (see the class docstring) in ``gate_up``'s dtype;
        replacements may call it.

        .. versionadded:: 1.1
        """
        size = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :size], gate_up[..., size:]
        if self.activation == "silu":
            return F.silu(gate) * up
        limit = self.swiglu_limit
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Route and run the experts; see the class docstring."""
        result: torch.Tensor = self._forward_impl(hidden, router_logits)
        return result

    def forward_native(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Reference mixture of experts (see the class docstring), grouped by expert.

        The ``T * top_k`` (token, expert) pairs are sorted by expert; each expert with
        tokens runs two products over only its tokens, and its weighted rows are added
        into a float32 output with ``index_add_``.
        """
        weights, ids = self.route(router_logits)
        num_tokens = hidden.shape[0]
        out = torch.zeros(num_tokens, self.hidden_size, dtype=torch.float32,
                          device=hidden.device)
        if num_tokens == 0:
            return out.to(hidden.dtype)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        tokens = order // self.top_k  # the token of each sorted pair
        pair_weights = weights.reshape(-1)[order]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            x = hidden.index_select(0, rows)
            b13 = None if self.w13_bias is None else self.w13_bias[expert]
            b2 = None if self.w2_bias is None else self.w2_bias[expert]
            y = F.linear(self.activate(F.linear(x, self.w13[expert], b13)), self.w2[expert],
                         b2)
            out.index_add_(0, rows, y.float() * pair_weights[start:start + count, None])
            start += count
        return out.to(hidden.dtype)


#: The built-in op contracts by name: a replacement registered under one of these names
#: must subclass the class given here.
BUILTIN_OPS: Mapping[str, type[CustomOp]] = {
    op.name: op for op in (RMSNormOp, RotaryEmbeddingOp, SiluAndMulOp, GeluAndMulOp,
                           FusedMoEOp)
}

_CONTRACTS = frozenset(BUILTIN_OPS.values())


def check_replacement(name: str, cls: object) -> Support:
    """Whether ``cls`` may be registered in ``engine.custom_ops`` under ``name``.

    Called: by the engine in the worker when it loads a custom-op entry point, and by
    ``engine plugins check``.

    Returns:
        ``Support.no`` when ``cls`` is not a :class:`CustomOp` subclass, its ``name``
        differs from ``name``, it does not subclass the built-in contract of that name
        (:data:`BUILTIN_OPS`), or it has abstract methods left; else yes.

    .. versionadded:: 1.0
    """
    if not (isinstance(cls, type) and issubclass(cls, CustomOp)):
        return Support.no(f"{cls!r} is not a subclass of engine.sdk.ops.CustomOp")
    if cls.name != name:
        return Support.no(
            f"{cls.__qualname__}.name is {cls.name!r} but it is registered as {name!r}"
        )
    contract = BUILTIN_OPS.get(name)
    if contract is not None and not issubclass(cls, contract):
        return Support.no(
            f"{cls.__qualname__} replaces built-in op {name!r} but does not subclass "
            f"engine.sdk.ops.{contract.__qualname__}"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        return Support.no(f"{cls.__qualname__} leaves abstract methods: {missing}")
    return Support.yes()

