"""The client contract around a local inference process (inferd serve or mistralrs serve).

- plan:       LaunchPlan and its parts; argv rendering and the serving identity digest
- bundle:     digest-addressed model bundles and distribution digests
- supervisor: Supervisor (startup, liveness, exact readiness, backoff restarts, stop)
- staging:    EvidenceStore (sniffed, write-once, digest-addressed media; tenant leases)
- request:    build_chat_request with ordered parts and independent bounds
- sse:        SseDecoder, the incremental bounded SSE decoder
- stream:     StreamConsumer, the strict state machine, and its typed outcomes (cancellations
              typed by who cut the run: caller, connection, server, scheduler)
- reconcile:  a cancelled run's usage set against the server's access-log record of it
- client:     open_chat_stream, the httpx transport around StreamConsumer
- retry:      retry_length_limited: a length-limited run again, larger budget, as the policy allows
- admission:  AdmissionPool: weighted permits taken before a request reaches the server
- receipts:   launch, request and stream receipts in canonical JSON
- identity:   one digest per part of a model (weights, tokenizer, template, processor, quant)
- gate:       the release gate: freeze a release's answers and speed, check a candidate
- mirror:     MirrorProxy: a canary's share of live traffic mirrored to the candidate, compared
- example:    ``python -m inferd.contract.example``
"""

from __future__ import annotations

from inferd.contract.admission import AdmissionPool, PermitRefused, request_weight
from inferd.contract.canonical import INTEGRATION_RELEASE, canonical_json, digest_of
from inferd.contract.client import LiveStream, open_chat_stream
from inferd.contract.mirror import MirrorProxy, mirrored
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
from inferd.contract.reconcile import Reconciliation, ServerRecord, reconcile, server_record
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
    CallerCancelled,
    Cancelled,
    Canceller,
    Complete,
    ConnectionDropped,
    ContentFiltered,
    Expectation,
    IncompleteLengthLimited,
    Outcome,
    OutcomeKind,
    ProtocolError,
    Rule,
    SchedulerCancelled,
    ServerCancelled,
    StreamConsumer,
    StreamLimits,
    ToolCallsRequested,
    Usage,
    UsageSource,
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
    "CallerCancelled",
    "Cancelled",
    "Canceller",
    "ChatRequest",
    "Complete",
    "ConnectionDropped",
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
    "MirrorProxy",
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
    "Reconciliation",
    "RequestBoundError",
    "RequestBounds",
    "RequestError",
    "RequestReceipt",
    "RestartPolicy",
    "RetriedRun",
    "RetryError",
    "Rule",
    "SchedulerCancelled",
    "ServerCancelled",
    "ServerRecord",
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
    "UsageSource",
    "assess_models",
    "build_chat_request",
    "canonical_json",
    "digest_of",
    "launch_receipt",
    "mirrored",
    "open_chat_stream",
    "read_receipt",
    "reconcile",
    "request_receipt",
    "request_weight",
    "retry_length_limited",
    "server_record",
    "sniff",
    "stream_receipt",
    "write_receipt",
]
