"""outboxd's Python SDK: workers that lease intents with the full etiquette (long-poll,
replayed claims, heartbeats, MarkSubmitted, batched per-item settles, drain on shutdown)
and producers that enqueue inside their own PostgreSQL transaction."""

from ._errors import LeaseLost, OutboxError, Permanent, Retry, TransactionRequired, Unknown
from ._intent import EnqueueResult, NewIntent
from ._proto.outbox.v1 import outbox_pb2 as pb
from .producer import AsyncOutbox, Outbox
from .worker import Intent, Worker, WorkerStats

__all__ = [
    "AsyncOutbox",
    "EnqueueResult",
    "Intent",
    "LeaseLost",
    "NewIntent",
    "Outbox",
    "OutboxError",
    "Permanent",
    "Retry",
    "TransactionRequired",
    "Unknown",
    "Worker",
    "WorkerStats",
    "pb",
]
__version__ = "0.1.0"
