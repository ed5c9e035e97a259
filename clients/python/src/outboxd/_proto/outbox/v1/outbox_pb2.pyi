from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IntentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INTENT_STATE_UNSPECIFIED: _ClassVar[IntentState]
    INTENT_STATE_STAGED: _ClassVar[IntentState]
    INTENT_STATE_PENDING: _ClassVar[IntentState]
    INTENT_STATE_LEASED: _ClassVar[IntentState]
    INTENT_STATE_SUBMITTED: _ClassVar[IntentState]
    INTENT_STATE_DELIVERED: _ClassVar[IntentState]
    INTENT_STATE_NEEDS_RECONCILE: _ClassVar[IntentState]
    INTENT_STATE_DEAD_LETTERED: _ClassVar[IntentState]
    INTENT_STATE_DISCARDED: _ClassVar[IntentState]
    INTENT_STATE_WAITING: _ClassVar[IntentState]
    INTENT_STATE_CANCELLED: _ClassVar[IntentState]

class FailOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAIL_OUTCOME_UNSPECIFIED: _ClassVar[FailOutcome]
    FAIL_OUTCOME_RETRY: _ClassVar[FailOutcome]
    FAIL_OUTCOME_PERMANENT: _ClassVar[FailOutcome]
    FAIL_OUTCOME_UNKNOWN: _ClassVar[FailOutcome]

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    DECISION_DELIVERED: _ClassVar[Decision]
    DECISION_REQUEUE: _ClassVar[Decision]
    DECISION_DEAD: _ClassVar[Decision]
    DECISION_CANCEL: _ClassVar[Decision]
INTENT_STATE_UNSPECIFIED: IntentState
INTENT_STATE_STAGED: IntentState
INTENT_STATE_PENDING: IntentState
INTENT_STATE_LEASED: IntentState
INTENT_STATE_SUBMITTED: IntentState
INTENT_STATE_DELIVERED: IntentState
INTENT_STATE_NEEDS_RECONCILE: IntentState
INTENT_STATE_DEAD_LETTERED: IntentState
INTENT_STATE_DISCARDED: IntentState
INTENT_STATE_WAITING: IntentState
INTENT_STATE_CANCELLED: IntentState
FAIL_OUTCOME_UNSPECIFIED: FailOutcome
FAIL_OUTCOME_RETRY: FailOutcome
FAIL_OUTCOME_PERMANENT: FailOutcome
FAIL_OUTCOME_UNKNOWN: FailOutcome
DECISION_UNSPECIFIED: Decision
DECISION_DELIVERED: Decision
DECISION_REQUEUE: Decision
DECISION_DEAD: Decision
DECISION_CANCEL: Decision

class NewIntent(_message.Message):
    __slots__ = ("kind", "payload", "content_type", "region", "idempotency_key", "headers", "max_attempts", "delay", "available_at", "ordering_key", "priority")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    DELAY_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_AT_FIELD_NUMBER: _ClassVar[int]
    ORDERING_KEY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    kind: str
    payload: bytes
    content_type: str
    region: str
    idempotency_key: str
    headers: _containers.ScalarMap[str, str]
    max_attempts: int
    delay: _duration_pb2.Duration
    available_at: _timestamp_pb2.Timestamp
    ordering_key: str
    priority: int
    def __init__(self, kind: _Optional[str] = ..., payload: _Optional[bytes] = ..., content_type: _Optional[str] = ..., region: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ..., max_attempts: _Optional[int] = ..., delay: _Optional[_Union[_duration_pb2.Duration, _Mapping]] = ..., available_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., ordering_key: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class Intent(_message.Message):
    __slots__ = ("id", "state", "kind", "payload", "content_type", "region", "idempotency_key", "headers", "attempts", "max_attempts", "available_at", "created_at", "updated_at", "lease_expires_at", "worker_id", "last_error", "ordering_key", "priority", "tenant")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_AT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    ORDERING_KEY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: IntentState
    kind: str
    payload: bytes
    content_type: str
    region: str
    idempotency_key: str
    headers: _containers.ScalarMap[str, str]
    attempts: int
    max_attempts: int
    available_at: _timestamp_pb2.Timestamp
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    lease_expires_at: _timestamp_pb2.Timestamp
    worker_id: str
    last_error: str
    ordering_key: str
    priority: int
    tenant: str
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[IntentState, str]] = ..., kind: _Optional[str] = ..., payload: _Optional[bytes] = ..., content_type: _Optional[str] = ..., region: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ..., attempts: _Optional[int] = ..., max_attempts: _Optional[int] = ..., available_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., created_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., lease_expires_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., worker_id: _Optional[str] = ..., last_error: _Optional[str] = ..., ordering_key: _Optional[str] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class EnqueueRequest(_message.Message):
    __slots__ = ("intents", "txn_token")
    INTENTS_FIELD_NUMBER: _ClassVar[int]
    TXN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    intents: _containers.RepeatedCompositeFieldContainer[NewIntent]
    txn_token: str
    def __init__(self, intents: _Optional[_Iterable[_Union[NewIntent, _Mapping]]] = ..., txn_token: _Optional[str] = ...) -> None: ...

class EnqueueResult(_message.Message):
    __slots__ = ("id", "state", "deduplicated")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: IntentState
    deduplicated: bool
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[IntentState, str]] = ..., deduplicated: bool = ...) -> None: ...

class EnqueueResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EnqueueResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EnqueueResult, _Mapping]]] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("worker_id", "region", "kinds", "max_intents", "lease_duration", "wait", "request_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    MAX_INTENTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    region: str
    kinds: _containers.RepeatedScalarFieldContainer[str]
    max_intents: int
    lease_duration: _duration_pb2.Duration
    wait: _duration_pb2.Duration
    request_id: str
    def __init__(self, worker_id: _Optional[str] = ..., region: _Optional[str] = ..., kinds: _Optional[_Iterable[str]] = ..., max_intents: _Optional[int] = ..., lease_duration: _Optional[_Union[_duration_pb2.Duration, _Mapping]] = ..., wait: _Optional[_Union[_duration_pb2.Duration, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("intent", "lease_id", "attempt", "lease_expires_at")
    INTENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    intent: Intent
    lease_id: str
    attempt: int
    lease_expires_at: _timestamp_pb2.Timestamp
    def __init__(self, intent: _Optional[_Union[Intent, _Mapping]] = ..., lease_id: _Optional[str] = ..., attempt: _Optional[int] = ..., lease_expires_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ...) -> None: ...

class LeaseRef(_message.Message):
    __slots__ = ("intent_id", "lease_id")
    INTENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    intent_id: str
    lease_id: str
    def __init__(self, intent_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "reason", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    message: str
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class LeaseResult(_message.Message):
    __slots__ = ("intent_id", "error", "state", "lease_expires_at")
    INTENT_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    intent_id: str
    error: ItemError
    state: IntentState
    lease_expires_at: _timestamp_pb2.Timestamp
    def __init__(self, intent_id: _Optional[str] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., state: _Optional[_Union[IntentState, str]] = ..., lease_expires_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ExtendLeaseRequest(_message.Message):
    __slots__ = ("leases", "lease_duration")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseRef]
    lease_duration: _duration_pb2.Duration
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseRef, _Mapping]]] = ..., lease_duration: _Optional[_Union[_duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ExtendLeaseResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LeaseResult]
    def __init__(self, results: _Optional[_Iterable[_Union[LeaseResult, _Mapping]]] = ...) -> None: ...

class MarkSubmittedRequest(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseRef]
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseRef, _Mapping]]] = ...) -> None: ...

class MarkSubmittedResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LeaseResult]
    def __init__(self, results: _Optional[_Iterable[_Union[LeaseResult, _Mapping]]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseRef]
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseRef, _Mapping]]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LeaseResult]
    def __init__(self, results: _Optional[_Iterable[_Union[LeaseResult, _Mapping]]] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("lease", "error", "outcome", "retry_after")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    lease: LeaseRef
    error: str
    outcome: FailOutcome
    retry_after: _duration_pb2.Duration
    def __init__(self, lease: _Optional[_Union[LeaseRef, _Mapping]] = ..., error: _Optional[str] = ..., outcome: _Optional[_Union[FailOutcome, str]] = ..., retry_after: _Optional[_Union[_duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class FailRequest(_message.Message):
    __slots__ = ("failures",)
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    failures: _containers.RepeatedCompositeFieldContainer[Failure]
    def __init__(self, failures: _Optional[_Iterable[_Union[Failure, _Mapping]]] = ...) -> None: ...

class FailResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LeaseResult]
    def __init__(self, results: _Optional[_Iterable[_Union[LeaseResult, _Mapping]]] = ...) -> None: ...

class ReconcileFilter(_message.Message):
    __slots__ = ("states", "kind", "region", "created_before")
    STATES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    CREATED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[IntentState]
    kind: str
    region: str
    created_before: _timestamp_pb2.Timestamp
    def __init__(self, states: _Optional[_Iterable[_Union[IntentState, str]]] = ..., kind: _Optional[str] = ..., region: _Optional[str] = ..., created_before: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReconcileRequest(_message.Message):
    __slots__ = ("ids", "filter", "decision", "actor", "reason", "limit")
    IDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    ids: ReconcileIds
    filter: ReconcileFilter
    decision: Decision
    actor: str
    reason: str
    limit: int
    def __init__(self, ids: _Optional[_Union[ReconcileIds, _Mapping]] = ..., filter: _Optional[_Union[ReconcileFilter, _Mapping]] = ..., decision: _Optional[_Union[Decision, str]] = ..., actor: _Optional[str] = ..., reason: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ReconcileIds(_message.Message):
    __slots__ = ("ids", "updated_at")
    IDS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    updated_at: _containers.RepeatedCompositeFieldContainer[_timestamp_pb2.Timestamp]
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., updated_at: _Optional[_Iterable[_Union[_timestamp_pb2.Timestamp, _Mapping]]] = ...) -> None: ...

class ReconcileResult(_message.Message):
    __slots__ = ("intent_id", "error", "state")
    INTENT_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    intent_id: str
    error: ItemError
    state: IntentState
    def __init__(self, intent_id: _Optional[str] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., state: _Optional[_Union[IntentState, str]] = ...) -> None: ...

class ReconcileResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReconcileResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReconcileResult, _Mapping]]] = ...) -> None: ...

class Resolution(_message.Message):
    __slots__ = ("decision", "from_state", "actor", "reason", "resolved_at", "api_key")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_AT_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    from_state: IntentState
    actor: str
    reason: str
    resolved_at: _timestamp_pb2.Timestamp
    api_key: str
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., from_state: _Optional[_Union[IntentState, str]] = ..., actor: _Optional[str] = ..., reason: _Optional[str] = ..., resolved_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., api_key: _Optional[str] = ...) -> None: ...

class GetIntentRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class GetIntentResponse(_message.Message):
    __slots__ = ("intent", "resolutions")
    INTENT_FIELD_NUMBER: _ClassVar[int]
    RESOLUTIONS_FIELD_NUMBER: _ClassVar[int]
    intent: Intent
    resolutions: _containers.RepeatedCompositeFieldContainer[Resolution]
    def __init__(self, intent: _Optional[_Union[Intent, _Mapping]] = ..., resolutions: _Optional[_Iterable[_Union[Resolution, _Mapping]]] = ...) -> None: ...

class ListIntentsRequest(_message.Message):
    __slots__ = ("states", "kind", "region", "page_size", "page_token", "include_payload", "ordering_key", "awaiting_decision")
    STATES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ORDERING_KEY_FIELD_NUMBER: _ClassVar[int]
    AWAITING_DECISION_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[IntentState]
    kind: str
    region: str
    page_size: int
    page_token: str
    include_payload: bool
    ordering_key: str
    awaiting_decision: bool
    def __init__(self, states: _Optional[_Iterable[_Union[IntentState, str]]] = ..., kind: _Optional[str] = ..., region: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., include_payload: bool = ..., ordering_key: _Optional[str] = ..., awaiting_decision: bool = ...) -> None: ...

class ListIntentsResponse(_message.Message):
    __slots__ = ("intents", "next_page_token")
    INTENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    intents: _containers.RepeatedCompositeFieldContainer[Intent]
    next_page_token: str
    def __init__(self, intents: _Optional[_Iterable[_Union[Intent, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetQueueStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StateCount(_message.Message):
    __slots__ = ("state", "region", "count")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    state: IntentState
    region: str
    count: int
    def __init__(self, state: _Optional[_Union[IntentState, str]] = ..., region: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class GetQueueStatsResponse(_message.Message):
    __slots__ = ("counts", "oldest_pending_at", "oldest_staged_at", "reconcile_backlog", "blocked_keys", "oldest_blocked_at", "policies", "regions_left_out", "policies_left_out")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_PENDING_AT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_STAGED_AT_FIELD_NUMBER: _ClassVar[int]
    RECONCILE_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_BLOCKED_AT_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    POLICIES_LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedCompositeFieldContainer[StateCount]
    oldest_pending_at: _timestamp_pb2.Timestamp
    oldest_staged_at: _timestamp_pb2.Timestamp
    reconcile_backlog: int
    blocked_keys: int
    oldest_blocked_at: _timestamp_pb2.Timestamp
    policies: _containers.RepeatedCompositeFieldContainer[QueuePolicy]
    regions_left_out: bool
    policies_left_out: bool
    def __init__(self, counts: _Optional[_Iterable[_Union[StateCount, _Mapping]]] = ..., oldest_pending_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., oldest_staged_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., reconcile_backlog: _Optional[int] = ..., blocked_keys: _Optional[int] = ..., oldest_blocked_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., policies: _Optional[_Iterable[_Union[QueuePolicy, _Mapping]]] = ..., regions_left_out: bool = ..., policies_left_out: bool = ...) -> None: ...

class QueuePolicy(_message.Message):
    __slots__ = ("tenant", "kind", "paused", "max_in_flight", "rate_per_second", "burst", "actor", "reason", "updated_at", "in_flight", "tokens", "api_key")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RATE_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    kind: str
    paused: bool
    max_in_flight: int
    rate_per_second: float
    burst: int
    actor: str
    reason: str
    updated_at: _timestamp_pb2.Timestamp
    in_flight: int
    tokens: float
    api_key: str
    def __init__(self, tenant: _Optional[str] = ..., kind: _Optional[str] = ..., paused: bool = ..., max_in_flight: _Optional[int] = ..., rate_per_second: _Optional[float] = ..., burst: _Optional[int] = ..., actor: _Optional[str] = ..., reason: _Optional[str] = ..., updated_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., in_flight: _Optional[int] = ..., tokens: _Optional[float] = ..., api_key: _Optional[str] = ...) -> None: ...

class SetQueuePolicyRequest(_message.Message):
    __slots__ = ("kind", "paused", "max_in_flight", "rate_per_second", "burst", "actor", "reason", "expected_updated_at")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RATE_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    paused: bool
    max_in_flight: int
    rate_per_second: float
    burst: int
    actor: str
    reason: str
    expected_updated_at: _timestamp_pb2.Timestamp
    def __init__(self, kind: _Optional[str] = ..., paused: bool = ..., max_in_flight: _Optional[int] = ..., rate_per_second: _Optional[float] = ..., burst: _Optional[int] = ..., actor: _Optional[str] = ..., reason: _Optional[str] = ..., expected_updated_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class SetQueuePolicyResponse(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: QueuePolicy
    def __init__(self, policy: _Optional[_Union[QueuePolicy, _Mapping]] = ...) -> None: ...

class ListQueuePoliciesRequest(_message.Message):
    __slots__ = ("kind", "page_token")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    kind: str
    page_token: str
    def __init__(self, kind: _Optional[str] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListQueuePoliciesResponse(_message.Message):
    __slots__ = ("policies", "next_page_token")
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    policies: _containers.RepeatedCompositeFieldContainer[QueuePolicy]
    next_page_token: str
    def __init__(self, policies: _Optional[_Iterable[_Union[QueuePolicy, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
