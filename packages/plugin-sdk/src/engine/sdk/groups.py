"""Entry-point group names: the public list of extension points.

A plugin distribution publishes entry points under these groups in its ``pyproject.toml``::

    [project.entry-points."engine.logits_processors"]
    no_repeat = "my_pkg.processors:NoRepeatProcessor"

The engine reads them from installed metadata in every process without importing plugin
code, and imports a plugin only when it is selected. :data:`GROUPS` describes each group:
what its entry value must be, which processes load it, and how it is selected.

.. versionadded:: 1.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GENERAL_PLUGINS = "engine.general_plugins"
PLATFORMS = "engine.platforms"
MODELS = "engine.models"
ATTENTION_BACKENDS = "engine.attention_backends"
QUANTIZATION = "engine.quantization"
LINEAR_KERNELS = "engine.linear_kernels"
CUSTOM_OPS = "engine.custom_ops"
KV_CONNECTORS = "engine.kv_connectors"
SCHEDULERS = "engine.schedulers"
SCHEDULING_POLICIES = "engine.scheduling_policies"
LOGITS_PROCESSORS = "engine.logits_processors"
WORKER_EXTENSIONS = "engine.worker_extensions"
STAT_LOGGERS = "engine.stat_loggers"
ENDPOINTS = "engine.endpoints"
IO_PROCESSORS = "engine.io_processors"
STRUCTURED_OUTPUT_BACKENDS = "engine.structured_output_backends"
""".. versionadded:: 1.1"""
TOOL_PARSERS = "engine.tool_parsers"
""".. versionadded:: 1.1"""

#: What an entry value must resolve to: a subclass of ``contract`` ("class"), or a callable
#: ("callable": general plugins and platform detectors; "factory": endpoint factories).
ValueKind = Literal["class", "callable", "factory"]


@dataclass(frozen=True)
class GroupSpec:
    """How the engine treats one entry-point group.

    Attributes:
        name: The group name, e.g. ``"engine.logits_processors"``.
        kind: What the entry value must be (see :data:`ValueKind`).
        contract: ``"module:Class"`` of the ABC a "class" entry must subclass (a path, so that
            reading this table imports nothing, torch included).
        processes: The processes that load the group (``frontend``, ``engine_core``, ``worker``).
        selected_by: How the engine picks entries of this group, for humans.
        opt_in: True when an entry is skipped unless the allowlist names it explicitly.

    .. versionadded:: 1.0
    """

    name: str
    kind: ValueKind
    contract: str
    processes: tuple[str, ...]
    selected_by: str
    opt_in: bool = False


_ALL = ("frontend", "engine_core", "worker")

#: Every extension point, keyed by group name.
GROUPS: dict[str, GroupSpec] = {
    spec.name: spec
    for spec in (
        GroupSpec(GENERAL_PLUGINS, "callable", "", _ALL, "always, once per process"),
        GroupSpec(PLATFORMS, "callable", "engine.sdk.platform:Platform", _ALL,
                  "auto-detected; two out-of-tree platforms claiming the host is an error"),
        GroupSpec(MODELS, "class", "engine.sdk.model:ModelInterface", ("frontend", "worker"),
                  "the checkpoint's architectures; several for one: --model-impl"),
        GroupSpec(ATTENTION_BACKENDS, "class", "engine.sdk.attention:AttentionBackend",
                  ("worker",), "--attention-backend NAME, or the platform default"),
        GroupSpec(QUANTIZATION, "class", "engine.sdk.quantization:QuantizationConfig", _ALL,
                  "--quantization NAME, or the checkpoint's quantization config"),
        GroupSpec(LINEAR_KERNELS, "class", "engine.sdk.linear_kernel:LinearKernel", ("worker",),
                  "priority order; --linear-kernel, --disabled-kernels"),
        GroupSpec(CUSTOM_OPS, "class", "engine.sdk.ops:CustomOp", ("worker",),
                  "per op, the best that runs on the device; --custom-ops and the platform"),
        GroupSpec(KV_CONNECTORS, "class", "engine.sdk.kv_connector:KVConnector",
                  ("engine_core", "worker"), "--kv-connector NAME"),
        GroupSpec(SCHEDULERS, "class", "engine.sdk.scheduler:SchedulerInterface",
                  ("engine_core",), "--scheduler NAME"),
        GroupSpec(SCHEDULING_POLICIES, "class", "engine.sdk.scheduling_policy:SchedulingPolicy",
                  ("engine_core",), "--scheduling-policy NAME"),
        GroupSpec(LOGITS_PROCESSORS, "class", "engine.sdk.logits_processor:LogitsProcessor",
                  ("frontend", "worker"), "all loaded; each applies only to requests using it"),
        GroupSpec(WORKER_EXTENSIONS, "class", "engine.sdk.worker_extension:WorkerExtension",
                  ("worker",), "--worker-extension NAME"),
        GroupSpec(STAT_LOGGERS, "class", "engine.sdk.stat_logger:StatLogger", ("frontend",),
                  "all loaded"),
        GroupSpec(ENDPOINTS, "factory", "engine.sdk.endpoint:EndpointPlugin", ("frontend",),
                  "opt-in: only when named in ENGINE_PLUGINS / --plugins", opt_in=True),
        GroupSpec(IO_PROCESSORS, "class", "engine.sdk.io_processor:IOProcessor", ("frontend",),
                  "--io-processor NAME"),
        GroupSpec(STRUCTURED_OUTPUT_BACKENDS, "class",
                  "engine.sdk.structured_output:StructuredOutputBackend",
                  ("frontend", "engine_core"),
                  "--structured-outputs-backend NAME (default: xgrammar)"),
        GroupSpec(TOOL_PARSERS, "class", "engine.sdk.tool_parser:ToolParser", ("frontend",),
                  "--tool-call-parser NAME (with --enable-auto-tool-choice)"),
    )
}
