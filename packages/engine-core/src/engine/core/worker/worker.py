"""``Worker``: one rank's model, KV cache, persistent batch and sampler.

Lifecycle, as the executor drives it (one worker per tensor-parallel rank)::

    w = Worker(setup, eos_token_id=..., rank=r, world_size=n, distributed_init_method=addr)
        # joins the ranks' process group (n > 1), loads this rank's shard of the model,
        # and sizes what its KV cache could hold: w.num_available_blocks
    w.initialize_cache(min(num_available_blocks over the ranks))
        # allocates the cache; with --kv-connector builds the connector's worker side
        # and registers the cache with it
    w.capture_step_graph()
        # records the forward pass for replay where it can be (a CPU step graph, CUDA
        # decode graphs), after the worker extensions start and again after each
        # collective_rpc
    w.execute_model(scheduler_output)   # every rank, every step; rank 0's output is real
    w.shutdown()
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine.core.attention.layer_groups import make_builder
from engine.core.cpu_threads import log_choice, model_threads
from engine.core.distributed import destroy_tensor_parallel, init_tensor_parallel
from engine.core.model_loader import iter_weights
from engine.core.native.runtime import graph_runtime
from engine.core.plugin_construction import construct_plugin, logits_processor_classes
from engine.core.plugin_faults import ForwardAttribution
from engine.core.sample.faults import LogitsFaults
from engine.core.startup import EngineSetup
from engine.core.thread_governor import follow_free_cpus
from engine.core.worker.cuda_graphs import capture_sizes, try_capture_cuda
from engine.core.worker.gpu_memory import kv_cache_budget, profile_step_peak
from engine.core.worker.input_batch import InputBatch
from engine.core.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for
from engine.core.worker.kv_connector import WorkerKVConnector
from engine.core.worker.kv_prefault import KVPrefault
from engine.core.worker.model_runner import ModelRunner
from engine.core.worker.model_setup import BuiltModel, build_model
from engine.core.worker.onednn_caches import bound_onednn_caches
from engine.core.worker.step_graph import try_capture
from engine.sdk.groups import LOGITS_PROCESSORS
from engine.sdk.logits_processor import LogitsProcessor, LogitsProcessorContext
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("engine.worker")


class Worker:
    """Loads this rank's model shard, then (``initialize_cache``) its KV cache; runs steps.

    Args:
        setup: The resolved engine (``startup.prepare(config, process="worker")``).
        eos_token_id: The tokenizer's end-of-sequence id (for logits processors).
        rank: This worker's tensor-parallel rank; rank 0 is the driver.
        world_size: Number of ranks (``config.tensor_parallel_size``).
        distributed_init_method: Rendezvous of the ranks, e.g. ``"tcp://127.0.0.1:PORT"``
            (``None``: ``env://``); unused for one rank.

    Raises:
        ValueError: ``world_size`` differs from ``config.tensor_parallel_size``, or
            ``rank`` is not in ``[0, world_size)``.
    """

    def __init__(self, setup: EngineSetup, *, eos_token_id: int | None, rank: int = 0,
                 world_size: int = 1, distributed_init_method: str | None = None) -> None:
        config = setup.config
        if world_size != config.tensor_parallel_size:
            raise ValueError(f"worker world_size {world_size} differs from the config's "
                             f"tensor_parallel_size {config.tensor_parallel_size}")
        self.setup = setup
        self.eos_token_id = eos_token_id
        self.rank = rank
        self.world_size = world_size
        self.device = self._select_device()
        self.tp, self._owns_group = init_tensor_parallel(
            backend=setup.platform.dist_backend, init_method=distributed_init_method,
            rank=rank, world_size=world_size)
        if self.device.type == "cpu":  # before the first oneDNN primitive (weight reorders)
            bound_onednn_caches()
        threads = model_threads(config.num_threads, world_size)
        log_choice(f"rank {rank} model", threads)
        torch.set_num_threads(threads.num_threads)
        self._governor = (follow_free_cpus(threads.num_threads)
                          if self.device.type == "cpu" and config.num_threads is None else None)
        torch.manual_seed(config.seed)
        self.built: BuiltModel = build_model(
            catalog=setup.catalog, platform=setup.platform, hf_config=setup.hf_config,
            dtype=setup.dtype, block_size=setup.block_size,
            attention_backend=setup.attention_backend,
            weights=iter_weights(setup.source, setup.dtype, progress=rank == 0,
                                 packed_gguf=setup.keeps_gguf_blocks,
                                 keep_checkpoint_tensors=setup.quant_config is not None),
            device=self.device, linear_kernel=config.linear_kernel,
            disabled_kernels=config.disabled_kernels, plugin_options=config.plugin_options,
            tp=self.tp, custom_ops=setup.custom_ops, quant_config=setup.quant_config,
            model_choice=setup.model, kernel_selection=config.kernel_selection,
            step_tokens=setup.max_num_batched_tokens, step_graph=not setup.enforce_eager,
            max_model_len=setup.max_model_len,
        )
        layers = self.built.factory.attention_layers
        self._block_bytes = bytes_per_block(layers, self.built.backend, setup.block_size,
                                           setup.dtype)
        self.num_available_blocks = num_blocks_for(
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory=config.kv_cache_memory or self._kv_gib_from_utilization(),
            block_bytes=self._block_bytes, block_size=setup.block_size,
            max_model_len=setup.max_model_len, max_num_seqs=config.max_num_seqs,
        )
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.num_blocks = 0  # allocated blocks (null block included), set by initialize_cache
        self.logits_processors: list[LogitsProcessor] = []
        self.kv_connector: WorkerKVConnector | None = None
        self.model_runner: ModelRunner | None = None
        self.kv_prefault: KVPrefault | None = None

    def _kv_gib_from_utilization(self) -> float | None:
        """The KV cache's GiB from ``--gpu-memory-utilization``, or None.

        On CUDA when the operator gave it and no explicit size (``--kv-cache-memory`` or
        ``--num-kv-blocks``): what the GPU has left (``engine.core.worker.gpu_memory``).
        """
        config, setup = self.setup.config, self.setup
        utilization = config.gpu_memory_utilization
        if self.device.type != "cuda" or utilization is None or config.num_kv_blocks:
            return None
        peak = None
        if not self.tp.is_parallel:
            peak = profile_step_peak(
                self.built.model, self._make_builder(), self.built.factory.attention_layers,
                self.built.backend, tokens=setup.max_num_batched_tokens,
                rows=config.max_num_seqs, max_model_len=setup.max_model_len,
                block_size=setup.block_size, dtype=setup.dtype, device=self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        gib, how = kv_cache_budget(utilization=utilization, free=free, total=total,
                                   step_peak=peak)
        logger.info("rank %d KV cache memory: %s", self.rank, how)
        return gib

    @property
    def model(self) -> nn.Module:
        """The loaded model (this rank's shard)."""
        return self.built.model

    def _select_device(self) -> torch.device:
        device_type = self.setup.platform.device_type
        if device_type == "cpu":
            return torch.device("cpu")
        index = self.rank % max(1, self.setup.platform.device_count())
        device = torch.device(device_type, index)
        if device_type == "cuda":
            torch.cuda.set_device(device)
        return device

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache with ``num_blocks`` blocks (the null block included).

        Called: once, after every rank is loaded, with the smallest
        ``num_available_blocks`` of the ranks (the same on every rank).

        Raises:
            ValueError: ``num_blocks`` is more than this rank can hold, or not above 1.
            RuntimeError: the cache is already allocated.
        """
        if self.model_runner is not None:
            raise RuntimeError("the KV cache is already allocated")
        if not 1 < num_blocks <= self.num_available_blocks:
            raise ValueError(f"num_blocks {num_blocks} is not in [2, {self.num_available_blocks}]"
                             f" (what rank {self.rank} can hold)")
        setup, config = self.setup, self.setup.config
        layers = self.built.factory.attention_layers
        self.kv_caches = allocate_kv_cache(layers, self.built.backend, num_blocks,
                                           setup.block_size, setup.dtype, self.device)
        self.num_blocks = num_blocks
        logger.info("rank %d KV cache: %d blocks of %d tokens (%.2f GiB)", self.rank,
                    num_blocks, setup.block_size, num_blocks * self._block_bytes / (1 << 30))
        faults = None
        if self.tp.is_driver:  # only rank 0 samples
            processors = self._make_logits_processors()
            self.logits_processors = list(processors.values())
            faults = LogitsFaults.for_processors(processors, lambda name, cause: (
                setup.catalog.error(LOGITS_PROCESSORS, name, cause)))
        self.kv_connector = WorkerKVConnector.build(
            setup, layers=layers, kv_caches=self.kv_caches, num_blocks=num_blocks, tp=self.tp)
        self.model_runner = ModelRunner(
            model=self.built.model, builder=self._make_builder(), block_size=setup.block_size,
            input_batch=InputBatch(
                max_num_reqs=config.max_num_seqs, max_model_len=setup.max_model_len,
                max_num_blocks_per_req=-(-setup.max_model_len // setup.block_size),
                vocab_size=setup.vocab_size, device=self.device,
                logits_processors=self.logits_processors, faults=faults,
            ),
            device=self.device, vocab_size=setup.vocab_size, tp=self.tp,
            kv_connector=self.kv_connector, faults=faults,
            attribution=ForwardAttribution(setup.catalog),
        )
        if self.tp.is_parallel:
            return  # ranks would have to warm up in lockstep (collectives); not done yet
        try:
            self.model_runner.warm_up()
        except Exception as exc:  # noqa: BLE001 - a step would report it, naming the plugin
            logger.warning("rank %d: the warm-up forward pass failed (%s: %s); the first "
                           "step will pay the set-up it would have done", self.rank,
                           type(exc).__name__, exc)

    def _make_builder(self) -> Any:
        """One metadata builder per attention group (layers of one spec; ``layer_groups``).

        One group: the backend's builder itself. Several: a ``GroupedMetadataBuilder``
        over them, whose metadata each layer picks its group's from.
        """
        layers = self.built.factory.attention_layers
        return make_builder(
            self.built.backend, {name: layer.impl.params.spec for name, layer in layers.items()},
            plugin_name=self.built.backend.name, device=str(self.device),
            max_num_reqs=self.setup.config.max_num_seqs,
            max_num_batched_tokens=self.setup.max_num_batched_tokens,
            max_model_len=self.setup.max_model_len, options=self.built.factory.backend_options)

    def _make_logits_processors(self) -> dict[str, LogitsProcessor]:
        setup = self.setup

        def build(name: str, cls: type[LogitsProcessor]) -> LogitsProcessor:
            return construct_plugin(setup, LOGITS_PROCESSORS, name, cls, lambda options: cls(
                LogitsProcessorContext(
                    plugin_name=name, options=options, process="worker",
                    model=setup.source.display_name, device=str(self.device),
                    max_num_reqs=setup.config.max_num_seqs, vocab_size=setup.vocab_size,
                    is_pin_memory=False, eos_token_id=self.eos_token_id,
                )))

        return {name: build(name, cls) for name, cls in logits_processor_classes(setup).items()}

    def prefault_kv_cache(self) -> None:
        """On the CPU, start faulting in the KV cache's first blocks on a background thread.

        Called once, after the warm-up and the step graph's capture: the thread's page
        faults would slow them down (measured: ~0.4 s more to ``engine serve``'s ready on a
        2-core VM, huge pages making each fault dearer), and traffic needs those pages only
        once the server is up.
        """
        if self.device.type == "cpu" and self.kv_caches and self.kv_prefault is None:
            self.kv_prefault = KVPrefault(self.kv_caches, self.num_blocks)

    def capture_step_graph(self, *, again: bool = False) -> None:
        """Capture the forward pass for replay, or log why it runs eagerly.

        On the CPU a step graph (``engine.core.worker.step_graph``), on CUDA decode graphs
        (``engine.core.worker.cuda_graphs``); the model runner replays them.

        ``again``: after a ``collective_rpc``, which may have changed the model; it is
        captured anew (or dropped) and nothing is logged unless that changes.
        """
        runner = self.model_runner
        if runner is None or self.device.type not in ("cpu", "cuda"):
            return
        had = runner.step_graph is not None
        runner.step_graph = None
        if again and not had:
            return
        setup = self.setup
        backend = self.built.backend
        reasons = [why for cond, why in (
            (self.tp.is_parallel, "tensor parallelism: the ranks' collectives run in Python"),
            (self.kv_connector is not None, "a KV connector hooks every layer"),
        ) if cond]
        # Each component of the pass is asked whether the graph can record it (its plugin
        # named in the log line where one refuses): engine.core.worker.capture_components.
        named = {"attribution": runner.attribution, "platform": setup.platform.info()}
        if self.device.type == "cuda":
            runner.step_graph = try_capture_cuda(
                self.built.model, runner.builder, backend.cudagraph_support,
                enforce_eager=setup.enforce_eager, reasons=reasons, quiet=again,
                sizes=capture_sizes(setup.config.max_num_seqs),
                max_blocks=runner.input_batch.block_table.shape[1],
                max_model_len=setup.max_model_len, block_size=setup.block_size,
                device=self.device, **named)
        else:
            runner.step_graph = try_capture(
                self.built.model, graph_runtime(), runner.builder,
                enforce_eager=setup.enforce_eager, reasons=reasons, quiet=again,
                max_tokens=setup.max_num_batched_tokens, max_reqs=setup.config.max_num_seqs,
                max_blocks=runner.input_batch.block_table.shape[1],
                block_size=setup.block_size, kv_caches=list(self.kv_caches.values()), **named)
        if again and runner.step_graph is None:
            logger.warning("rank %d: the forward pass could not be captured again after "
                           "collective_rpc; the model runs eagerly from now on", self.rank)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (on every rank); the real output on rank 0, an empty one elsewhere.

        Raises:
            RuntimeError: ``initialize_cache`` has not run.
        """
        if self.model_runner is None:
            raise RuntimeError("execute_model before initialize_cache: no KV cache yet")
        if self._governor is not None:
            self._governor.before_step()
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Stop the KV connector's worker side and the KV pre-fault; leave the group; idempotent."""
        connector, self.kv_connector = self.kv_connector, None
        prefault, self.kv_prefault = self.kv_prefault, None
        if prefault is not None:
            prefault.stop()
        try:
            if connector is not None:
                connector.shutdown()
        finally:
            destroy_tensor_parallel(self._owns_group)
            self._owns_group = False
