"""engine.sdk: the plugin SDK (contract v1).

Plugin authors import from here. Nothing in this package imports torch at import time
(``engine.sdk.ops`` excepted, which subclasses ``torch.nn.Module``; import it directly).
"""

from engine.sdk import groups
from engine.sdk._version import SDK_MAJOR, __version__
from engine.sdk.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionImpl,
    AttentionImplParams,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
    GraphMetadata,
)
from engine.sdk.capture import Capturable, CaptureContext, GraphKind
from engine.sdk.context import PluginContext
from engine.sdk.endpoint import EndpointPlugin
from engine.sdk.errors import (
    EngineSDKError,
    PluginError,
    PluginFailure,
    UnsupportedError,
    ValidationError,
)
from engine.sdk.graph_calls import GraphFunction
from engine.sdk.io_processor import (
    GenerationResult,
    IOProcessor,
    IOProcessorContext,
    ProcessedPrompt,
)
from engine.sdk.kv_connector import (
    KVConnector,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from engine.sdk.layers import (
    AttentionLayer,
    EmbeddingLayer,
    FusedMoELayer,
    LayerFactory,
    LinearLayer,
)
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    MoveDirectionality,
    MovedRequest,
    PerRequestLogitsProcessor,
    process_dict_updates,
)
from engine.sdk.model import ModelContext, ModelInterface
from engine.sdk.platform import Platform, PlatformConfig, PlatformInfo
from engine.sdk.plugin import Plugin, PluginOptions, check_contract_version
from engine.sdk.quantization import LayerInfo, QuantizationConfig, QuantizeMethod
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import (
    CachedRequestData,
    EngineCoreOutput,
    EngineRequest,
    ModelRunnerOutput,
    NewRequestData,
    RequestStatus,
    RequestView,
    SampleLogprobs,
    SchedulerContext,
    SchedulerInterface,
    SchedulerOutput,
)
from engine.sdk.scheduling_policy import (
    SchedulerState,
    SchedulingPolicy,
    SchedulingPolicyContext,
)
from engine.sdk.stat_logger import StatLogger, StatLoggerContext
from engine.sdk.stats import (
    FinishedRequestStats,
    IterationStats,
    PrefixCacheStats,
    SchedulerStats,
)
from engine.sdk.structured_output import (
    GrammarBitmask,
    StructuredOutputBackend,
    StructuredOutputContext,
    StructuredOutputMatcher,
    StructuredOutputsParams,
)
from engine.sdk.support import Support
from engine.sdk.tool_parser import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolParserContext,
)
from engine.sdk.worker_extension import WorkerExtension

__all__ = [
    "__version__",
    "SDK_MAJOR",
    "groups",
    # base
    "Plugin",
    "PluginOptions",
    "PluginContext",
    "Support",
    "check_contract_version",
    # errors
    "EngineSDKError",
    "PluginError",
    "PluginFailure",
    "UnsupportedError",
    "ValidationError",
    # requests and scheduling
    "SamplingParams",
    "EngineRequest",
    "RequestStatus",
    "RequestView",
    "NewRequestData",
    "CachedRequestData",
    "SchedulerOutput",
    "SampleLogprobs",
    "ModelRunnerOutput",
    "EngineCoreOutput",
    "SchedulerContext",
    "SchedulerInterface",
    "SchedulingPolicy",
    "SchedulingPolicyContext",
    "SchedulerState",
    # logits processors
    "LogitsProcessor",
    "LogitsProcessorContext",
    "BatchUpdate",
    "AddedRequest",
    "MovedRequest",
    "MoveDirectionality",
    "PerRequestLogitsProcessor",
    "process_dict_updates",
    # attention
    "AttentionBackend",
    "AttentionContext",
    "AttentionImpl",
    "AttentionImplParams",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "CommonAttentionMetadata",
    "CudaGraphSupport",
    # quantization and linear kernels
    "QuantizationConfig",
    "QuantizeMethod",
    "LayerInfo",
    "LinearKernel",
    "LinearKernelConfig",
    # KV connectors
    "KVConnector",
    "KVConnectorContext",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    # platform
    "Platform",
    "PlatformConfig",
    "PlatformInfo",
    # stats
    "StatLogger",
    "StatLoggerContext",
    "SchedulerStats",
    "IterationStats",
    "FinishedRequestStats",
    "PrefixCacheStats",
    # structured outputs
    "StructuredOutputsParams",
    "StructuredOutputBackend",
    "StructuredOutputContext",
    "StructuredOutputMatcher",
    "GrammarBitmask",
    # tool calling
    "ToolParser",
    "ToolParserContext",
    "ToolCall",
    "ToolCallDelta",
    "ExtractedToolCalls",
    "StreamDelta",
    # front end
    "EndpointPlugin",
    "IOProcessor",
    "IOProcessorContext",
    "ProcessedPrompt",
    "GenerationResult",
    # workers and models
    "WorkerExtension",
    "ModelInterface",
    "ModelContext",
    "LayerFactory",
    "LinearLayer",
    "EmbeddingLayer",
    "AttentionLayer",
    "FusedMoELayer",
    # graph capture
    "Capturable",
    "CaptureContext",
    "GraphKind",
    "GraphFunction",
    "GraphMetadata",
]
