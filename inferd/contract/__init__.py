"""The client contract around a local inference process (inferd serve or mistralrs serve).

- plan:       LaunchPlan and its parts; argv rendering and the serving identity digest
- bundle:     digest-addressed model bundles and distribution digests
- supervisor: Supervisor (startup, liveness, exact readiness, backoff restarts, stop)
- staging:    EvidenceStore (sniffed, write-once, digest-addressed media; tenant leases)
- request:    build_chat_request with ordered parts and independent bounds
- sse:        SseDecoder, the incremental bounded SSE decoder
- stream:     StreamConsumer, the strict state machine, and its typed outcomes
- client:     open_chat_stream, the httpx transport around StreamConsumer
- retry:      retry_length_limited: a length-limited run again, larger budget, as the policy allows
- admission:  AdmissionPool: weighted permits taken before a request reaches the server
- receipts:   launch, request and stream receipts in canonical JSON
- identity:   one digest per part of a model (weights, tokenizer, template, processor, quant)
- gate:       the release gate: freeze a release's answers and speed, check a candidate
- example:    ``python -m inferd.contract.example``
"""

from __future__ import annotations

from inferd.contract.admission import AdmissionPool, PermitRefused, request_weight
from inferd.contract.canonical import INTEGRATION_RELEASE, canonical_json, digest_of
from inferd.contract.client import LiveStream, open_chat_stream
from inferd.contract.plan import (
    AccessLog,
    Device,
    EngineKind,
    EngineRelease,
    LaunchPlan,
    Limits,
    ModelFormat,
    ModelSource,
    PagedAttention,
    PlanError,
    Surface,
    Toggle,
)
from inferd.contract.receipts import (
    LaunchReceipt,
    RequestReceipt,
    StreamReceipt,
    launch_receipt,
    read_receipt,
    request_receipt,
    stream_receipt,
    write_receipt,
)
from inferd.contract.request import (
    ChatRequest,
    JsonTooLarge,
    MediaPart,
    MediaTooLarge,
    ModalityNotAdmitted,
    OutputTokensTooLarge,
    PromptTooLarge,
    RequestBoundError,
    RequestBounds,
    RequestError,
    TextPart,
    TooManyMediaParts,
    build_chat_request,
)
from inferd.contract.retry import (
    LengthRetryPolicy,
    RetriedRun,
    RetryError,
    retry_length_limited,
)
from inferd.contract.sse import SseComment, SseDecoder, SseEvent
from inferd.contract.staging import (
    CrossTenantError,
    EvidenceStore,
    Lease,
    MediaType,
    Modality,
    StagingError,
    sniff,
)
from inferd.contract.stream import (
    Cancelled,
    Complete,
    ContentFiltered,
    Expectation,
    IncompleteLengthLimited,
    Outcome,
    OutcomeKind,
    ProtocolError,
    Rule,
    StreamConsumer,
    StreamLimits,
    ToolCallsRequested,
    Usage,
)
from inferd.contract.supervisor import (
    Executable,
    Readiness,
    ReadinessState,
    RestartPolicy,
    StopReport,
    Supervisor,
    assess_models,
)

__all__ = [
    "INTEGRATION_RELEASE",
    "AccessLog",
    "AdmissionPool",
    "Cancelled",
    "ChatRequest",
    "Complete",
    "ContentFiltered",
    "CrossTenantError",
    "Device",
    "EngineKind",
    "EngineRelease",
    "EvidenceStore",
    "Executable",
    "Expectation",
    "IncompleteLengthLimited",
    "JsonTooLarge",
    "LaunchPlan",
    "LaunchReceipt",
    "Lease",
    "LengthRetryPolicy",
    "Limits",
    "LiveStream",
    "MediaPart",
    "MediaTooLarge",
    "MediaType",
    "Modality",
    "ModalityNotAdmitted",
    "ModelFormat",
    "ModelSource",
    "Outcome",
    "OutcomeKind",
    "OutputTokensTooLarge",
    "PagedAttention",
    "PermitRefused",
    "PlanError",
    "PromptTooLarge",
    "ProtocolError",
    "Readiness",
    "ReadinessState",
    "RequestBoundError",
    "RequestBounds",
    "RequestError",
    "RequestReceipt",
    "RestartPolicy",
    "RetriedRun",
    "RetryError",
    "Rule",
    "SseComment",
    "SseDecoder",
    "SseEvent",
    "StagingError",
    "StopReport",
    "StreamConsumer",
    "StreamLimits",
    "StreamReceipt",
    "Supervisor",
    "Surface",
    "TextPart",
    "Toggle",
    "TooManyMediaParts",
    "ToolCallsRequested",
    "Usage",
    "assess_models",
    "build_chat_request",
    "canonical_json",
    "digest_of",
    "launch_receipt",
    "open_chat_stream",
    "read_receipt",
    "request_receipt",
    "request_weight",
    "retry_length_limited",
    "sniff",
    "stream_receipt",
    "write_receipt",
]
