"""``engine.testing.contracts.check_attention_backend`` on ``torch``, ``cpu``, broken backends.

The built-in backends pass every default case (float32; one in bfloat16) and every case of
the 1.1 spec options (soft cap, sinks); a backend not listing those fields has their cases
skipped with the engine's reason; variants of it
that break one rule each fail, with a message naming the case, step and request; the
example backend of docs/plugins/attention-backends.md, which turns sliding windows down,
has those cases reported as skipped, and the page's ``check_attention_backend`` block runs
here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import torch

from engine.core.attention import TorchAttentionBackend
from engine.core.attention.torch_backend import TorchAttentionImpl, TorchAttentionMetadataBuilder
from engine.kernels.cpu.attention import CpuAttentionBackend
from engine.sdk.attention import (
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from engine.testing.contracts import (
    DEFAULT_ATTENTION_CASES,
    SPEC_OPTION_CASES,
    AttentionCase,
    check_attention_backend,
)
from engine.testing.docs import code_block, exec_block, page_package, run_page_tests

GQA_WINDOW = DEFAULT_ATTENTION_CASES[2]


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend],
                         ids=lambda b: b.name)
def test_the_built_in_backends_conform(backend: Any) -> None:
    report = check_attention_backend(backend)
    assert report.cases == tuple(case.name for case in DEFAULT_ATTENTION_CASES)
    assert not report.skipped and report.num_steps == 5 * len(DEFAULT_ATTENTION_CASES)


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend],
                         ids=lambda b: b.name)
def test_the_built_in_backends_conform_in_bfloat16(backend: Any) -> None:
    report = check_attention_backend(backend, dtype="bfloat16",
                                     cases=[GQA_WINDOW])
    assert report.cases == (GQA_WINDOW.name,)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend],
                         ids=lambda b: b.name)
def test_the_built_in_backends_conform_with_soft_cap_and_sinks(backend: Any, dtype: str) -> None:
    report = check_attention_backend(backend, dtype=dtype, cases=SPEC_OPTION_CASES)
    assert report.cases == tuple(case.name for case in SPEC_OPTION_CASES)


def test_the_option_cases_fail_a_backend_ignoring_them() -> None:
    class Ignoring(TorchAttentionBackend):
        """Says it answers the fields, but computes plain attention."""

        @classmethod
        def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
            class Plain(TorchAttentionImpl):
                def forward(self, *args: Any) -> Any:
                    plain = dataclasses.replace(self.params, sinks=None, spec=dataclasses.replace(
                        self.params.spec, logits_soft_cap=None, has_sinks=False))
                    return TorchAttentionImpl(plain).forward(*args)

            return Plain

    for case in SPEC_OPTION_CASES:
        with pytest.raises(AssertionError, match="differs from dense attention"):
            check_attention_backend(Ignoring, cases=[case])


def test_a_backend_not_listing_the_fields_has_their_cases_skipped() -> None:
    class Legacy(TorchAttentionBackend):
        answered_spec_fields: ClassVar[frozenset[str]] = frozenset()

    report = check_attention_backend(Legacy, cases=[*SPEC_OPTION_CASES, GQA_WINDOW])
    assert report.cases == (GQA_WINDOW.name,)
    assert [name for name, _ in report.skipped] == [c.name for c in SPEC_OPTION_CASES]
    assert all("answered_spec_fields" in reason for _, reason in report.skipped)


def test_a_torch_dtype_is_taken_as_its_name() -> None:
    by_dtype = check_attention_backend(TorchAttentionBackend, dtype=torch.bfloat16,
                                       cases=[GQA_WINDOW])
    assert by_dtype == check_attention_backend(TorchAttentionBackend, dtype="bfloat16",
                                               cases=[GQA_WINDOW])


def test_a_dtype_of_another_kind_is_refused_at_once() -> None:
    with pytest.raises(TypeError, match=r"dtype must be a dtype name such as 'bfloat16' or "
                       r"a torch.dtype such as torch.bfloat16, got 16"):
        check_attention_backend(TorchAttentionBackend, dtype=16)  # type: ignore[arg-type]


class _NoWindowBuilder(TorchAttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> Any:
        spec = dataclasses.replace(self.ctx.spec, sliding_window=None)
        self.ctx = dataclasses.replace(self.ctx, spec=spec)
        return super().build(common)


class _WholeBlocksBuilder(TorchAttentionMetadataBuilder):
    """Reads every key of a request's last block, past its context."""

    def build(self, common: CommonAttentionMetadata) -> Any:
        bs = self.ctx.spec.block_size
        rounded = (common.seq_lens_cpu + bs - 1) // bs * bs
        return super().build(dataclasses.replace(common, seq_lens_cpu=rounded))


class _InterleavedHeadsImpl(TorchAttentionImpl):
    """Maps query head h to KV head h % num_kv_heads instead of h // group."""

    def forward(self, query: torch.Tensor, *args: Any) -> torch.Tensor:
        n, heads, size = query.shape
        group = heads // self.params.spec.num_kv_heads
        swapped = query.view(n, group, heads // group, size).transpose(1, 2).reshape(query.shape)
        output = args[-1]
        out = super().forward(swapped, *args[:-1], torch.empty_like(output))
        output.copy_(out.view(n, heads // group, group, size).transpose(1, 2).reshape(out.shape))
        return output


class _FreshOutputImpl(TorchAttentionImpl):
    def forward(self, *args: Any) -> torch.Tensor:
        return super().forward(*args[:-1], torch.empty_like(args[-1]))


def _variant(builder: type[AttentionMetadataBuilder[Any]] = TorchAttentionMetadataBuilder,
             impl: type[AttentionImpl[Any]] = TorchAttentionImpl) -> type[TorchAttentionBackend]:
    class Variant(TorchAttentionBackend):
        name: ClassVar[str] = "torch_variant"

        @classmethod
        def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
            return builder

        @classmethod
        def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
            return impl

    return Variant


@pytest.mark.parametrize(("backend", "case", "message"), [
    (_variant(builder=_NoWindowBuilder), GQA_WINDOW,
     r"gqa 4, head 64, block 32, window 35: step 'prompts', layer 0, request 'a' \(full "
     r"prompt: 61 new tokens, 0 cached\): output row \d+ .*differs from dense attention"),
    (_variant(builder=_WholeBlocksBuilder), DEFAULT_ATTENTION_CASES[0],  # stale keys read
     r"mha, head 64, block 16: step 'prompts', layer 0, request 'a' \(full prompt: 29 new "
     r"tokens, 0 cached\): output row 0 "),
    (_variant(impl=_InterleavedHeadsImpl), DEFAULT_ATTENTION_CASES[1],
     r"gqa 3, head 128, block 16: step 'stale blocks', layer 0"),
    (_variant(impl=_FreshOutputImpl), DEFAULT_ATTENTION_CASES[0],
     r"_FreshOutputImpl.forward must return the output tensor it was given"),
])
def test_a_backend_breaking_a_rule_fails_naming_where(backend: type[TorchAttentionBackend],
                                                      case: AttentionCase, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_attention_backend(backend, cases=[case])


PAGE = "attention-backends.md"


def test_the_pages_suite_block_passes_on_the_pages_backend(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The page's example backend turns sliding windows down: those cases are reported as
    skipped, the others run (the page's test block asserts both)."""
    backend = {"attention": code_block(PAGE, "from __future__ import annotations")}
    with page_package(tmp_path_factory.mktemp("docs"), "my_plugin", backend):
        assert run_page_tests(code_block(
            PAGE, "from engine.testing.contracts import DEFAULT_ATTENTION_CASES, "
                  "check_attention_backend")) == ["test_torch_paged_conforms"]


def test_a_backend_that_turns_down_every_case_fails() -> None:
    backend = exec_block(code_block(PAGE, "from __future__ import annotations"))
    with pytest.raises(AssertionError, match="turned down every case: gqa 4, head 64, "
                                             "block 32, window 35: sliding window"):
        check_attention_backend(backend["TorchPagedBackend"], cases=[GQA_WINDOW])
