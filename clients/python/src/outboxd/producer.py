"""The producer: `Outbox.enqueue(conn, ...)` records intents that exist if and only if the
caller's open transaction commits (the two-phase token), `enqueue_direct` records them at
once. `AsyncOutbox` is the same over asyncio (psycopg's AsyncConnection, SQLAlchemy's
AsyncSession)."""

from __future__ import annotations

import datetime as dt
from typing import Any, Iterable, Literal, Mapping, Optional, Sequence, Union

import grpc

from ._errors import OutboxError, TransactionRequired
from ._intent import EnqueueResult, NewIntent, Payload
from ._proto.outbox.v1 import outbox_pb2 as pb
from ._rpc import AsyncClient, Config, SyncClient, transient

TokenMode = Literal["auto", "function", "sql"]

# The token in plain SQL, for databases of the cluster other than the outbox's
# (docs/producers.md). The logical-decoding message makes the transaction write WAL, so its
# COMMIT is flushed (and replicated to a synchronous standby) even if it wrote nothing else.
PLAIN_TOKEN_SQL = (
    "SELECT 'v2.' || system_identifier || '.' || "
    "(extract(epoch FROM least(pg_stat_get_bgwriter_stat_reset_time(), "
    "(SELECT stats_reset FROM pg_stat_archiver))) * 1000000)::bigint "
    "|| '.' || pg_current_xact_id() "
    "FROM pg_control_system(), pg_logical_emit_message(true, 'outboxd', '')"
)
FUNCTION_TOKEN_SQL = "SELECT outbox.txn_token()"
# Whether this database holds the outbox schema (and so its promote-at-once function).
DETECT_SQL = "SELECT to_regprocedure('outbox.txn_token()') IS NOT NULL"


def _enqueue_retry(intents: Sequence[pb.NewIntent]) -> Any:
    """Which failures an Enqueue may retry: a lost answer may have recorded the intents, so
    a retry is safe only when every intent has an idempotency key (the replay returns them);
    otherwise only a definite 'nothing happened' from the server is retried."""
    keyed = all(i.idempotency_key for i in intents)

    def retry(code: grpc.StatusCode, reason: str) -> bool:
        if keyed:
            return transient(code, reason) or reason == "COMMIT_OUTCOME_UNKNOWN"
        return (code == grpc.StatusCode.UNAVAILABLE and reason == "UNAVAILABLE") or (
            code == grpc.StatusCode.ABORTED and reason == "CONFLICT"
        )

    return retry


def _enqueue_try_timeout(timeout: float, intents: Sequence[pb.NewIntent]) -> float:
    """The first try's share of an Enqueue's `timeout`: half when it may be retried (every
    intent keyed), so that the next endpoint gets the other half."""
    return timeout / 2 if all(i.idempotency_key for i in intents) else timeout


def _intents(
    kind: str,
    payload: Payload,
    idempotency_key: str,
    headers: Optional[Mapping[str, str]],
    content_type: str,
    region: str,
    max_attempts: int,
    delay: Optional[float],
    available_at: Optional[dt.datetime],
    ordering_key: Optional[str],
    priority: int,
) -> list[NewIntent]:
    return [
        NewIntent(
            kind=kind,
            payload=payload,
            idempotency_key=idempotency_key,
            headers=dict(headers or {}),
            content_type=content_type,
            region=region,
            max_attempts=max_attempts,
            delay=delay,
            available_at=available_at,
            ordering_key=ordering_key,
            priority=priority,
        )
    ]


def _driver_of(conn: Any) -> str:
    return str(type(conn).__module__).split(".")[0]


def _is_psycopg(conn: Any) -> bool:
    return _driver_of(conn) == "psycopg" and hasattr(conn, "info")


def _reports_libpq_status(conn: Any) -> bool:
    """psycopg 3 and psycopg2 connections both report libpq's transaction status."""
    return _driver_of(conn) in ("psycopg", "psycopg2") and hasattr(conn, "info")


# libpq's PQTRANS_INERROR, as psycopg 3 and psycopg2 report a connection's transaction status.
_INERROR = 3


_FAILED_MESSAGE = "the transaction on this connection has failed: roll it back"
# PostgreSQL's in_failed_sql_transaction: a statement of the transaction already failed.
_IN_FAILED_TRANSACTION = "25P02"


def _refuse_failed(conn: Any) -> None:
    if int(conn.info.transaction_status) == _INERROR:
        raise TransactionRequired(_FAILED_MESSAGE)


def _sqlstate(error: BaseException) -> Optional[str]:
    """The SQLSTATE of a driver's error, bare or wrapped by SQLAlchemy (`.orig`):
    psycopg and asyncpg name it `sqlstate`, psycopg2 `pgcode`."""
    for e in (error, getattr(error, "orig", None), error.__cause__):
        code = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
        if isinstance(code, str):
            return code
    return None


def _refused_as_failed(error: Exception) -> None:
    """A token query refused because the transaction had failed (drivers that report no
    transaction status, as asyncpg, tell only this way): TransactionRequired."""
    if _sqlstate(error) == _IN_FAILED_TRANSACTION:
        raise TransactionRequired(_FAILED_MESSAGE) from error


def _check_psycopg(conn: Any) -> None:
    from psycopg.pq import TransactionStatus

    _refuse_failed(conn)
    if conn.info.transaction_status != TransactionStatus.INTRANS:
        raise TransactionRequired(
            "enqueue(conn, ...) needs an open transaction on conn (with conn.transaction(): ...); "
            "use enqueue_direct(...) to enqueue without one"
        )


def _check_sqlalchemy(conn: Any) -> None:
    # An AsyncSession or AsyncConnection: the state lives in its synchronous twin.
    conn = getattr(conn, "sync_session", None) or getattr(conn, "sync_connection", None) or conn
    in_transaction = getattr(conn, "in_transaction", None)
    if in_transaction is None:
        raise TypeError(
            f"enqueue needs a psycopg 3 connection or an SQLAlchemy Session/Connection, not {type(conn).__name__}"
        )
    if not in_transaction():
        raise TransactionRequired(
            "enqueue(session, ...) needs an open transaction (with session.begin(): ...); "
            "use enqueue_direct(...) to enqueue without one"
        )
    # SQLAlchemy still reports a transaction whose statement failed: ask the driver (whose
    # transaction may not have begun yet: SQLAlchemy sends BEGIN with the first statement).
    # An AsyncSession's connection is already open (_connect_async_session): no IO here.
    connection = conn.connection() if callable(getattr(conn, "connection", None)) else conn
    # The driver's own connection (under an async engine, dbapi_connection is an adapter).
    dbapi = getattr(getattr(connection, "connection", None), "driver_connection", None)
    # An AUTOCOMMIT engine or connection: SQLAlchemy reports a transaction, but each
    # statement commits alone (the token's too).
    options = getattr(connection, "get_execution_options", None)
    # The DBAPI connection (an adapter under an async engine, asyncpg's among them) or the
    # driver's own says whether it autocommits.
    dbapi_connections = (getattr(getattr(connection, "connection", None), "dbapi_connection", None), dbapi)
    if (callable(options) and options().get("isolation_level") == "AUTOCOMMIT") or any(
        c is not None and getattr(c, "autocommit", False) is True for c in dbapi_connections
    ):
        raise TransactionRequired(
            "enqueue(...) needs a transaction, and this SQLAlchemy connection is in AUTOCOMMIT "
            "(each statement commits alone); use a connection without it, or enqueue_direct(...)"
        )
    if dbapi is not None and _reports_libpq_status(dbapi):
        _refuse_failed(dbapi)


async def _connect_async_session(conn: Any) -> None:
    """Opens the connection of an AsyncSession in a transaction (as its first statement would;
    `session.begin()` opens none), so that `_check_sqlalchemy` sees whether it is in
    AUTOCOMMIT or failed: the synchronous session cannot open one outside its greenlet."""
    if getattr(conn, "sync_session", None) is not None and conn.in_transaction():
        await conn.connection()


def _cache_key(conn: Any) -> Any:
    if _is_psycopg(conn):
        info = conn.info
        return ("psycopg", info.host, info.port, info.dbname)
    bind = conn.get_bind() if hasattr(conn, "get_bind") else getattr(conn, "engine", None)
    url = getattr(bind, "url", None)
    return ("sqlalchemy", str(url)) if url is not None else None


class _Base:
    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        api_key: str,
        *,
        tenant: Optional[str],
        credentials: Optional[grpc.ChannelCredentials],
        timeout: float,
        token: TokenMode,
    ) -> None:
        if token not in ("auto", "function", "sql"):
            raise ValueError("token must be 'auto', 'function' or 'sql'")
        self._config = Config(
            endpoints=[endpoints] if isinstance(endpoints, str) else list(endpoints),
            api_key=api_key,
            tenant=tenant,
            credentials=credentials,
        )
        self.timeout = timeout
        self.token_mode = token
        self._has_function: dict[Any, bool] = {}

    def _token_sql(self, key: Any, detected: Optional[bool]) -> str:
        if self.token_mode == "function":
            return FUNCTION_TOKEN_SQL
        if self.token_mode == "sql":
            return PLAIN_TOKEN_SQL
        return FUNCTION_TOKEN_SQL if detected else PLAIN_TOKEN_SQL

    @staticmethod
    def _request(intents: Iterable[NewIntent], token: str) -> pb.EnqueueRequest:
        messages = [i.to_pb() for i in intents]
        if not messages:
            raise ValueError("nothing to enqueue")
        return pb.EnqueueRequest(intents=messages, txn_token=token)


class Outbox(_Base):
    """A producer's handle on outboxd (thread-safe; make one per process).

    ```python
    outbox = Outbox(endpoints=["outboxd:50051"], api_key=key)
    with conn.transaction():                      # psycopg 3
        conn.execute("INSERT INTO orders ...")
        outbox.enqueue(conn, kind="order.created", payload={"id": 7},
                       idempotency_key="orders/7/created")
    ```

    `token`: `"auto"` takes `outbox.txn_token()` where the connection's database holds the
    outbox schema (promoted the moment you commit) and the plain-SQL token elsewhere in the
    cluster (promoted by outboxd's sweep within ~100 ms); `"function"` or `"sql"` forces one.
    `timeout` bounds each call, retries included: a transaction is never held open on a
    stuck call.
    """

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        api_key: str,
        *,
        tenant: Optional[str] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        timeout: float = 10.0,
        token: TokenMode = "auto",
    ) -> None:
        super().__init__(endpoints, api_key, tenant=tenant, credentials=credentials, timeout=timeout, token=token)
        self._client = SyncClient(self._config)

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channels."""
        self._client.close()

    def txn_token(self, conn: Any) -> str:
        """The two-phase token naming the open transaction of `conn` (psycopg 3 Connection,
        SQLAlchemy Session or Connection). Raises TransactionRequired outside one."""
        if _is_psycopg(conn):
            _check_psycopg(conn)

            def scalar(sql: str) -> Any:
                try:
                    row = conn.execute(sql).fetchone()
                except Exception as error:
                    _refused_as_failed(error)
                    raise
                return row[0] if row else None
        else:
            _check_sqlalchemy(conn)
            from sqlalchemy import text

            def scalar(sql: str) -> Any:
                try:
                    return conn.execute(text(sql)).scalar_one()
                except Exception as error:
                    _refused_as_failed(error)
                    raise

        key = _cache_key(conn)
        detected = None
        if self.token_mode == "auto":
            detected = self._has_function.get(key)
            if detected is None:
                detected = bool(scalar(DETECT_SQL))
                if key is not None:
                    self._has_function[key] = detected
        token = scalar(self._token_sql(key, detected))
        if not token:
            # Empty would mean direct mode: intents of a transaction that may roll back.
            raise OutboxError(grpc.StatusCode.INTERNAL, "NO_TOKEN", "the token query returned nothing")
        return str(token)

    def enqueue(
        self,
        conn: Any,
        kind: str,
        payload: Payload = b"",
        *,
        idempotency_key: str = "",
        headers: Optional[Mapping[str, str]] = None,
        content_type: str = "",
        region: str = "",
        max_attempts: int = 0,
        delay: Optional[float] = None,
        available_at: Optional[dt.datetime] = None,
        ordering_key: Optional[str] = None,
        priority: int = 0,
    ) -> EnqueueResult:
        """Enqueues one intent in the open transaction of `conn`: STAGED now, PENDING when
        that transaction commits, DISCARDED if it rolls back. Raises TransactionRequired
        outside a transaction, OutboxError when outboxd refuses.

        `ordering_key`: intents of the same key are delivered one at a time, in the order
        their transactions committed (WAITING behind an unfinished earlier one). None or
        empty: unordered. `priority`: from -10 to 10 (default 0), higher claimed first
        among the claimable intents of its kind."""
        intents = _intents(
            kind,
            payload,
            idempotency_key,
            headers,
            content_type,
            region,
            max_attempts,
            delay,
            available_at,
            ordering_key,
            priority,
        )
        return self.enqueue_many(conn, intents)[0]

    def enqueue_many(self, conn: Any, intents: Iterable[NewIntent]) -> list[EnqueueResult]:
        """Enqueues a batch (all or none, at most 1,000) in the open transaction of `conn`."""
        request = self._request(intents, self.txn_token(conn))
        return self._send(request)

    def enqueue_direct(
        self,
        kind: str,
        payload: Payload = b"",
        *,
        idempotency_key: str = "",
        headers: Optional[Mapping[str, str]] = None,
        content_type: str = "",
        region: str = "",
        max_attempts: int = 0,
        delay: Optional[float] = None,
        available_at: Optional[dt.datetime] = None,
        ordering_key: Optional[str] = None,
        priority: int = 0,
    ) -> EnqueueResult:
        """Enqueues one intent outside any transaction: PENDING as soon as this returns
        (WAITING when an earlier intent of its `ordering_key` is unfinished)."""
        intents = _intents(
            kind,
            payload,
            idempotency_key,
            headers,
            content_type,
            region,
            max_attempts,
            delay,
            available_at,
            ordering_key,
            priority,
        )
        return self.enqueue_direct_many(intents)[0]

    def enqueue_direct_many(self, intents: Iterable[NewIntent]) -> list[EnqueueResult]:
        """Enqueues a batch (all or none) outside any transaction."""
        return self._send(self._request(intents, ""))

    def _send(self, request: pb.EnqueueRequest) -> list[EnqueueResult]:
        answer = self._client.call(
            "Enqueue",
            request,
            pb.EnqueueResponse,
            timeout=_enqueue_try_timeout(self.timeout, request.intents),
            budget=self.timeout,
            bounded=True,
            retry=_enqueue_retry(request.intents),
        )
        return [EnqueueResult.from_pb(r) for r in answer.results]

    def get_intent(self, intent_id: str) -> pb.GetIntentResponse:
        """The intent with its payload and resolution history (needs the operate scope)."""
        return self._client.call(
            "GetIntent",
            pb.GetIntentRequest(id=intent_id),
            pb.GetIntentResponse,
            timeout=self.timeout,
            budget=self.timeout,
            bounded=True,
        )


class AsyncOutbox(_Base):
    """`Outbox` over asyncio: psycopg's AsyncConnection or SQLAlchemy's AsyncSession /
    AsyncConnection (asyncpg too). Same arguments and semantics; every call is awaited.

    Its gRPC channels bind to the event loop that first uses them: make one per loop."""

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        api_key: str,
        *,
        tenant: Optional[str] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        timeout: float = 10.0,
        token: TokenMode = "auto",
    ) -> None:
        super().__init__(endpoints, api_key, tenant=tenant, credentials=credentials, timeout=timeout, token=token)
        self._client_: Optional[AsyncClient] = None

    @property
    def _client(self) -> AsyncClient:
        # grpc.aio channels bind to the loop that first uses them: create them lazily.
        if self._client_ is None:
            self._client_ = AsyncClient(self._config)
        return self._client_

    async def __aenter__(self) -> AsyncOutbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channels."""
        if self._client_ is not None:
            await self._client_.close()
            self._client_ = None

    async def txn_token(self, conn: Any) -> str:
        """The token naming the open transaction of `conn` (see `Outbox.txn_token`)."""
        if _is_psycopg(conn):
            _check_psycopg(conn)

            async def scalar(sql: str) -> Any:
                try:
                    cur = await conn.execute(sql)
                    row = await cur.fetchone()
                except Exception as error:
                    _refused_as_failed(error)
                    raise
                return row[0] if row else None
        else:
            await _connect_async_session(conn)
            _check_sqlalchemy(conn)
            from sqlalchemy import text

            async def scalar(sql: str) -> Any:
                try:
                    result = await conn.execute(text(sql))
                except Exception as error:
                    # asyncpg reports no transaction status: a failed one shows here.
                    _refused_as_failed(error)
                    raise
                return result.scalar_one()

        key = _cache_key(conn)
        detected = None
        if self.token_mode == "auto":
            detected = self._has_function.get(key)
            if detected is None:
                detected = bool(await scalar(DETECT_SQL))
                if key is not None:
                    self._has_function[key] = detected
        token = await scalar(self._token_sql(key, detected))
        if not token:
            raise OutboxError(grpc.StatusCode.INTERNAL, "NO_TOKEN", "the token query returned nothing")
        return str(token)

    async def enqueue(
        self,
        conn: Any,
        kind: str,
        payload: Payload = b"",
        *,
        idempotency_key: str = "",
        headers: Optional[Mapping[str, str]] = None,
        content_type: str = "",
        region: str = "",
        max_attempts: int = 0,
        delay: Optional[float] = None,
        available_at: Optional[dt.datetime] = None,
        ordering_key: Optional[str] = None,
        priority: int = 0,
    ) -> EnqueueResult:
        """See `Outbox.enqueue`."""
        intents = _intents(
            kind,
            payload,
            idempotency_key,
            headers,
            content_type,
            region,
            max_attempts,
            delay,
            available_at,
            ordering_key,
            priority,
        )
        return (await self.enqueue_many(conn, intents))[0]

    async def enqueue_many(self, conn: Any, intents: Iterable[NewIntent]) -> list[EnqueueResult]:
        """See `Outbox.enqueue_many`."""
        request = self._request(intents, await self.txn_token(conn))
        return await self._send(request)

    async def enqueue_direct(
        self,
        kind: str,
        payload: Payload = b"",
        *,
        idempotency_key: str = "",
        headers: Optional[Mapping[str, str]] = None,
        content_type: str = "",
        region: str = "",
        max_attempts: int = 0,
        delay: Optional[float] = None,
        available_at: Optional[dt.datetime] = None,
        ordering_key: Optional[str] = None,
        priority: int = 0,
    ) -> EnqueueResult:
        """See `Outbox.enqueue_direct`."""
        intents = _intents(
            kind,
            payload,
            idempotency_key,
            headers,
            content_type,
            region,
            max_attempts,
            delay,
            available_at,
            ordering_key,
            priority,
        )
        return (await self.enqueue_direct_many(intents))[0]

    async def enqueue_direct_many(self, intents: Iterable[NewIntent]) -> list[EnqueueResult]:
        """See `Outbox.enqueue_direct_many`."""
        return await self._send(self._request(intents, ""))

    async def _send(self, request: pb.EnqueueRequest) -> list[EnqueueResult]:
        answer = await self._client.call(
            "Enqueue",
            request,
            pb.EnqueueResponse,
            timeout=_enqueue_try_timeout(self.timeout, request.intents),
            budget=self.timeout,
            bounded=True,
            retry=_enqueue_retry(request.intents),
        )
        return [EnqueueResult.from_pb(r) for r in answer.results]
