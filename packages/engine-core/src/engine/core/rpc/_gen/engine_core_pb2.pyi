from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATUS_UNSPECIFIED: _ClassVar[RequestStatus]
    REQUEST_STATUS_WAITING: _ClassVar[RequestStatus]
    REQUEST_STATUS_RUNNING: _ClassVar[RequestStatus]
    REQUEST_STATUS_PREEMPTED: _ClassVar[RequestStatus]
    REQUEST_STATUS_FINISHED_STOPPED: _ClassVar[RequestStatus]
    REQUEST_STATUS_FINISHED_LENGTH_CAPPED: _ClassVar[RequestStatus]
    REQUEST_STATUS_FINISHED_ABORTED: _ClassVar[RequestStatus]
    REQUEST_STATUS_FINISHED_ERROR: _ClassVar[RequestStatus]
REQUEST_STATUS_UNSPECIFIED: RequestStatus
REQUEST_STATUS_WAITING: RequestStatus
REQUEST_STATUS_RUNNING: RequestStatus
REQUEST_STATUS_PREEMPTED: RequestStatus
REQUEST_STATUS_FINISHED_STOPPED: RequestStatus
REQUEST_STATUS_FINISHED_LENGTH_CAPPED: RequestStatus
REQUEST_STATUS_FINISHED_ABORTED: RequestStatus
REQUEST_STATUS_FINISHED_ERROR: RequestStatus

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "logit_bias", "skip_special_tokens", "include_stop_str_in_output", "extra_args_json", "structured_outputs_json")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_JSON_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: bytes
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    logit_bias: LogitBias
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    extra_args_json: str
    structured_outputs_json: str
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[bytes] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Union[LogitBias, _Mapping]] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., extra_args_json: _Optional[str] = ..., structured_outputs_json: _Optional[str] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_ids", "biases")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BIASES_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    biases: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[bytes] = ..., biases: _Optional[_Iterable[float]] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "arrival_time", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: bytes
    sampling_params: SamplingParams
    eos_token_id: int
    arrival_time: float
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[bytes] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., eos_token_id: _Optional[int] = ..., arrival_time: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class AddRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[EngineRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[EngineRequest, _Mapping]]] = ...) -> None: ...

class AbortRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FinishRequests(_message.Message):
    __slots__ = ("request_ids", "status")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    status: RequestStatus
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., status: _Optional[_Union[RequestStatus, str]] = ...) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("add", "abort", "finish")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    add: AddRequests
    abort: AbortRequests
    finish: FinishRequests
    def __init__(self, add: _Optional[_Union[AddRequests, _Mapping]] = ..., abort: _Optional[_Union[AbortRequests, _Mapping]] = ..., finish: _Optional[_Union[FinishRequests, _Mapping]] = ...) -> None: ...

class SampleLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "row_lengths", "sampled_token_ranks")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROW_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_RANKS_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    logprobs: bytes
    row_lengths: bytes
    sampled_token_ranks: bytes
    def __init__(self, token_ids: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., row_lengths: _Optional[bytes] = ..., sampled_token_ranks: _Optional[bytes] = ...) -> None: ...

class EngineCoreOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs", "finish_reason", "stop_reason", "num_cached_tokens", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEW_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: bytes
    new_logprobs: SampleLogprobs
    new_prompt_logprobs: SampleLogprobs
    finish_reason: str
    stop_reason: int
    num_cached_tokens: int
    error: PluginFailure
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[bytes] = ..., new_logprobs: _Optional[_Union[SampleLogprobs, _Mapping]] = ..., new_prompt_logprobs: _Optional[_Union[SampleLogprobs, _Mapping]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[_Union[PluginFailure, _Mapping]] = ...) -> None: ...

class PluginFailure(_message.Message):
    __slots__ = ("cause", "plugin", "group", "distribution", "version")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    cause: str
    plugin: str
    group: str
    distribution: str
    version: str
    def __init__(self, cause: _Optional[str] = ..., plugin: _Optional[str] = ..., group: _Optional[str] = ..., distribution: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("queries", "hits", "reset")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    queries: int
    hits: int
    reset: bool
    def __init__(self, queries: _Optional[int] = ..., hits: _Optional[int] = ..., reset: _Optional[bool] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "num_free_blocks", "num_total_blocks", "prefix_cache", "num_preempted_reqs", "connector_prefix_cache")
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_REQS_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache: PrefixCacheStats
    num_preempted_reqs: int
    connector_prefix_cache: PrefixCacheStats
    def __init__(self, num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., num_preempted_reqs: _Optional[int] = ..., connector_prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("outputs", "scheduler_stats", "timestamp")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_STATS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    timestamp: float
    def __init__(self, outputs: _Optional[_Iterable[_Union[EngineCoreOutput, _Mapping]]] = ..., scheduler_stats: _Optional[_Union[SchedulerStats, _Mapping]] = ..., timestamp: _Optional[float] = ...) -> None: ...

class EngineError(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("step", "error")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step: StepOutputs
    error: EngineError
    def __init__(self, step: _Optional[_Union[StepOutputs, _Mapping]] = ..., error: _Optional[_Union[EngineError, _Mapping]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("healthy",)
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    def __init__(self, healthy: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model_name", "max_model_len", "num_kv_blocks", "block_size", "vocab_size", "tensor_parallel_size", "executor_backend", "extra_args_keys")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_BACKEND_FIELD_NUMBER: _ClassVar[int]
    EXTRA_ARGS_KEYS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    tensor_parallel_size: int
    executor_backend: str
    extra_args_keys: _containers.RepeatedCompositeFieldContainer[ExtraArgsKey]
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., executor_backend: _Optional[str] = ..., extra_args_keys: _Optional[_Iterable[_Union[ExtraArgsKey, _Mapping]]] = ...) -> None: ...

class ExtraArgsKey(_message.Message):
    __slots__ = ("key", "plugins")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PLUGINS_FIELD_NUMBER: _ClassVar[int]
    key: str
    plugins: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[str] = ..., plugins: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CollectiveRpcCall(_message.Message):
    __slots__ = ("method", "args_json", "kwargs_json", "timeout_s")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    method: str
    args_json: str
    kwargs_json: str
    timeout_s: float
    def __init__(self, method: _Optional[str] = ..., args_json: _Optional[str] = ..., kwargs_json: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class CollectiveRpcFailure(_message.Message):
    __slots__ = ("message", "rank")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    message: str
    rank: int
    def __init__(self, message: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class CollectiveRpcResults(_message.Message):
    __slots__ = ("results_json", "error")
    RESULTS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    results_json: str
    error: CollectiveRpcFailure
    def __init__(self, results_json: _Optional[str] = ..., error: _Optional[_Union[CollectiveRpcFailure, _Mapping]] = ...) -> None: ...
