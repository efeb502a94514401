"""``Worker``: one device's model, KV cache, persistent batch and sampler."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from engine.core.model_loader import iter_weights
from engine.core.plugin_construction import construct_plugin
from engine.core.startup import EngineSetup
from engine.core.worker.input_batch import InputBatch
from engine.core.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for
from engine.core.worker.model_runner import ModelRunner
from engine.core.worker.model_setup import BuiltModel, build_model
from engine.sdk.attention import AttentionContext
from engine.sdk.groups import LOGITS_PROCESSORS
from engine.sdk.logits_processor import LogitsProcessor, LogitsProcessorContext
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("engine.worker")


def logits_processor_classes(setup: EngineSetup) -> dict[str, type[LogitsProcessor]]:
    """Every installed (allowed) processor plus the ones given by ``module:Class``."""
    classes: dict[str, type[LogitsProcessor]] = dict(setup.catalog.load_group(LOGITS_PROCESSORS))
    for path in setup.config.logits_processors:
        classes[path] = setup.catalog.load(LOGITS_PROCESSORS, path)
    return classes


class Worker:
    """Loads the model, sizes and allocates the KV cache, and executes steps."""

    def __init__(self, setup: EngineSetup, *, eos_token_id: int | None) -> None:
        self.setup = setup
        self.eos_token_id = eos_token_id
        self.device = torch.device(setup.platform.device_type)
        config = setup.config
        torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)))
        torch.manual_seed(config.seed)
        self.built: BuiltModel = build_model(
            catalog=setup.catalog, platform=setup.platform, hf_config=setup.hf_config,
            dtype=setup.dtype, block_size=setup.block_size,
            attention_backend=setup.attention_backend,
            weights=iter_weights(setup.source, setup.dtype), device=self.device,
            linear_kernel=config.linear_kernel, disabled_kernels=config.disabled_kernels,
            plugin_options=config.plugin_options,
        )
        layers = self.built.factory.attention_layers
        block_bytes = bytes_per_block(layers, self.built.backend, setup.block_size, setup.dtype)
        self.num_blocks = num_blocks_for(
            num_kv_blocks=config.num_kv_blocks, kv_cache_memory=config.kv_cache_memory,
            block_bytes=block_bytes, block_size=setup.block_size,
            max_model_len=setup.max_model_len, max_num_seqs=config.max_num_seqs,
        )
        self.kv_caches = allocate_kv_cache(layers, self.built.backend, self.num_blocks,
                                           setup.block_size, setup.dtype, self.device)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks,
                    setup.block_size, self.num_blocks * block_bytes / (1 << 30))
        self.logits_processors = self._make_logits_processors()
        self.model_runner = ModelRunner(
            model=self.built.model, builder=self._make_builder(), block_size=setup.block_size,
            input_batch=InputBatch(
                max_num_reqs=config.max_num_seqs, max_model_len=setup.max_model_len,
                max_num_blocks_per_req=-(-setup.max_model_len // setup.block_size),
                vocab_size=setup.vocab_size, device=self.device,
                logits_processors=self.logits_processors,
            ),
            device=self.device, vocab_size=setup.vocab_size,
        )

    def _make_builder(self) -> Any:
        layers = self.built.factory.attention_layers
        spec = next(iter(layers.values())).impl.params.spec
        ctx = AttentionContext(
            plugin_name=self.built.backend.name, spec=spec, layer_names=tuple(layers),
            device=str(self.device), max_num_reqs=self.setup.config.max_num_seqs,
            max_num_batched_tokens=self.setup.config.max_num_batched_tokens,
            max_model_len=self.setup.max_model_len,
        )
        return self.built.backend.get_builder_cls()(ctx)

    def _make_logits_processors(self) -> list[LogitsProcessor]:
        setup = self.setup

        def build(name: str, cls: type[LogitsProcessor]) -> LogitsProcessor:
            return construct_plugin(setup, LOGITS_PROCESSORS, name, cls, lambda options: cls(
                LogitsProcessorContext(
                    plugin_name=name, options=options, process="worker",
                    model=setup.source.display_name, device=str(self.device),
                    max_num_reqs=setup.config.max_num_seqs, vocab_size=setup.vocab_size,
                    is_pin_memory=False, eos_token_id=self.eos_token_id,
                )))

        return [build(name, cls) for name, cls in logits_processor_classes(setup).items()]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step."""
        return self.model_runner.execute_model(scheduler_output)

