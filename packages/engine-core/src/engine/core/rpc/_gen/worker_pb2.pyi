from engine.core.rpc._gen import engine_core_pb2 as _engine_core_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerError(_message.Message):
    __slots__ = ("type", "message", "plugin", "group", "distribution", "version", "rank", "traceback")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    plugin: str
    group: str
    distribution: str
    version: str
    rank: int
    traceback: str
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., plugin: _Optional[str] = ..., group: _Optional[str] = ..., distribution: _Optional[str] = ..., version: _Optional[str] = ..., rank: _Optional[int] = ..., traceback: _Optional[str] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("rank", "num_available_blocks")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    num_available_blocks: int
    def __init__(self, rank: _Optional[int] = ..., num_available_blocks: _Optional[int] = ...) -> None: ...

class InitializeCacheRequest(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class InitializeCacheResponse(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: WorkerError
    def __init__(self, error: _Optional[_Union[WorkerError, _Mapping]] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "sampling_params", "block_ids", "num_computed_tokens", "output_token_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: bytes
    sampling_params: _engine_core_pb2.SamplingParams
    block_ids: bytes
    num_computed_tokens: int
    output_token_ids: bytes
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[bytes] = ..., sampling_params: _Optional[_Union[_engine_core_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[bytes] = ..., num_computed_tokens: _Optional[int] = ..., output_token_ids: _Optional[bytes] = ...) -> None: ...

class CachedRequestData(_message.Message):
    __slots__ = ("req_ids", "new_block_ids", "new_block_id_counts", "num_computed_tokens")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_ID_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    new_block_ids: bytes
    new_block_id_counts: bytes
    num_computed_tokens: bytes
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., new_block_ids: _Optional[bytes] = ..., new_block_id_counts: _Optional[bytes] = ..., num_computed_tokens: _Optional[bytes] = ...) -> None: ...

class RequestIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SchedulerOutput(_message.Message):
    __slots__ = ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "num_scheduled_req_ids", "total_num_scheduled_tokens", "finished_req_ids", "preempted_req_ids", "kv_connector_metadata", "grammar_bitmask")
    SCHEDULED_NEW_REQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_CACHED_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_METADATA_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BITMASK_FIELD_NUMBER: _ClassVar[int]
    scheduled_new_reqs: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: bytes
    num_scheduled_req_ids: RequestIds
    total_num_scheduled_tokens: int
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    preempted_req_ids: _containers.RepeatedScalarFieldContainer[str]
    kv_connector_metadata: bytes
    grammar_bitmask: GrammarBitmask
    def __init__(self, scheduled_new_reqs: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., scheduled_cached_reqs: _Optional[_Union[CachedRequestData, _Mapping]] = ..., num_scheduled_tokens: _Optional[bytes] = ..., num_scheduled_req_ids: _Optional[_Union[RequestIds, _Mapping]] = ..., total_num_scheduled_tokens: _Optional[int] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., preempted_req_ids: _Optional[_Iterable[str]] = ..., kv_connector_metadata: _Optional[bytes] = ..., grammar_bitmask: _Optional[_Union[GrammarBitmask, _Mapping]] = ...) -> None: ...

class GrammarBitmask(_message.Message):
    __slots__ = ("req_ids", "bitmask", "words")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    bitmask: bytes
    words: int
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., bitmask: _Optional[bytes] = ..., words: _Optional[int] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("req_id", "logprobs")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    logprobs: _engine_core_pb2.SampleLogprobs
    def __init__(self, req_id: _Optional[str] = ..., logprobs: _Optional[_Union[_engine_core_pb2.SampleLogprobs, _Mapping]] = ...) -> None: ...

class ModelRunnerOutput(_message.Message):
    __slots__ = ("req_ids", "sampled_token_ids", "sampled_token_counts", "logprobs", "prompt_logprobs", "finished_sending", "finished_recving", "failed")
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _engine_core_pb2.PluginFailure
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_engine_core_pb2.PluginFailure, _Mapping]] = ...) -> None: ...
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SENDING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_RECVING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: bytes
    sampled_token_counts: bytes
    logprobs: _engine_core_pb2.SampleLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    finished_sending: _containers.RepeatedScalarFieldContainer[str]
    finished_recving: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.MessageMap[str, _engine_core_pb2.PluginFailure]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[bytes] = ..., sampled_token_counts: _Optional[bytes] = ..., logprobs: _Optional[_Union[_engine_core_pb2.SampleLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., finished_sending: _Optional[_Iterable[str]] = ..., finished_recving: _Optional[_Iterable[str]] = ..., failed: _Optional[_Mapping[str, _engine_core_pb2.PluginFailure]] = ...) -> None: ...

class ExecuteModelResponse(_message.Message):
    __slots__ = ("output", "error")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    output: ModelRunnerOutput
    error: WorkerError
    def __init__(self, output: _Optional[_Union[ModelRunnerOutput, _Mapping]] = ..., error: _Optional[_Union[WorkerError, _Mapping]] = ...) -> None: ...

class CollectiveRpcRequest(_message.Message):
    __slots__ = ("method", "args_json", "kwargs_json")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    method: str
    args_json: str
    kwargs_json: str
    def __init__(self, method: _Optional[str] = ..., args_json: _Optional[str] = ..., kwargs_json: _Optional[str] = ...) -> None: ...

class CollectiveRpcResponse(_message.Message):
    __slots__ = ("result_json", "error")
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result_json: str
    error: WorkerError
    def __init__(self, result_json: _Optional[str] = ..., error: _Optional[_Union[WorkerError, _Mapping]] = ...) -> None: ...

class WorkerHealthResponse(_message.Message):
    __slots__ = ("healthy", "error")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    error: WorkerError
    def __init__(self, healthy: _Optional[bool] = ..., error: _Optional[_Union[WorkerError, _Mapping]] = ...) -> None: ...
