"""The producer: intents that exist iff the caller's transaction commits."""

from __future__ import annotations

import asyncio
import collections
from typing import Callable

import psycopg
import pytest
from conftest import Running, list_intents, state, wait_state
from harness import Stack, free_port, wait_for
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outboxd
from outboxd import AsyncOutbox, Intent, NewIntent, Outbox, TransactionRequired, Worker, pb


@pytest.fixture(scope="module")
def orders(stack: Stack) -> None:
    for db in ("app", "shop"):
        with psycopg.connect(stack.cluster.url(db), autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, customer text NOT NULL)")


def place(conn: psycopg.Connection[tuple[int]], outbox: Outbox, kind: str, customer: str, commit: bool) -> str:
    with conn.transaction():
        row = conn.execute("INSERT INTO orders (customer) VALUES (%s) RETURNING id", (customer,)).fetchone()
        assert row is not None
        result = outbox.enqueue(
            conn, kind=kind, payload={"order_id": row[0]}, idempotency_key=f"orders/{kind}/{row[0]}/created"
        )
        assert result.state == "STAGED"
        if not commit:
            raise psycopg.Rollback()
    return result.id


@pytest.mark.parametrize("db", ["app", "shop"])
def test_a_committed_intent_is_delivered_and_a_rolled_back_one_is_discarded_and_never_delivered(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str], orders: None, db: str
) -> None:
    # app holds the outbox schema (token from outbox.txn_token()); shop does not (plain SQL).
    k = kind("order.created")
    delivered: collections.Counter[str] = collections.Counter()
    payloads: list[object] = []
    worker = Worker(stack.endpoints, stack.api_key, concurrency=2, claim_wait=1)

    @worker.handler(k)
    def handle(intent: Intent) -> None:
        delivered[intent.id] += 1
        payloads.append(intent.json())

    with Running(worker), psycopg.connect(stack.cluster.url(db), autocommit=True) as conn:
        committed = place(conn, outbox, k, "ada", commit=True)
        rolled_back = place(conn, outbox, k, "bob", commit=False)
        wait_state(outbox, committed, "DELIVERED")
        wait_state(outbox, rolled_back, "DISCARDED")
        # Once the rolled-back intent is resolved, anything claimable would come next:
        # a sentinel enqueued now proves the worker claimed past it.
        sentinel = outbox.enqueue_direct(k, b"{}").id
        wait_for("the sentinel", lambda: delivered[sentinel], timeout=10)
    assert delivered == {committed: 1, sentinel: 1}
    assert rolled_back not in delivered
    assert isinstance(payloads[0], dict) and "order_id" in payloads[0]


def test_enqueue_outside_a_transaction_raises_and_records_nothing(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str], orders: None
) -> None:
    k = kind("nowhere")
    with psycopg.connect(stack.cluster.url("app"), autocommit=True) as conn:
        with pytest.raises(TransactionRequired):
            outbox.enqueue(conn, kind=k, payload=b"x")
    # Not autocommit, but no statement yet: no transaction either (no implicit BEGIN).
    with psycopg.connect(stack.cluster.url("app")) as conn:
        with pytest.raises(TransactionRequired):
            outbox.enqueue(conn, kind=k, payload=b"x")
        # A failed transaction is refused too, with a hint to roll back.
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(TransactionRequired, match="roll it back"):
            outbox.enqueue(conn, kind=k, payload=b"x")
    engine = create_engine(stack.cluster.url("app").replace("postgres://", "postgresql+psycopg://"))
    with Session(engine) as session:
        with pytest.raises(TransactionRequired):
            outbox.enqueue(session, kind=k, payload=b"x")
    # A transaction whose statement failed: SQLAlchemy still calls it open.
    with engine.connect() as connection:
        transaction = connection.begin()
        with pytest.raises(DBAPIError):
            connection.execute(text("SELECT 1/0"))
        with pytest.raises(TransactionRequired):
            outbox.enqueue(connection, kind=k, payload=b"x")
        transaction.rollback()
    # AUTOCOMMIT, on the engine or the connection: SQLAlchemy calls it a transaction.
    autocommit = create_engine(engine.url, isolation_level="AUTOCOMMIT")
    with autocommit.begin() as connection:
        with pytest.raises(TransactionRequired, match="AUTOCOMMIT"):
            outbox.enqueue(connection, kind=k, payload=b"x")
    with engine.connect() as connection:
        with connection.execution_options(isolation_level="AUTOCOMMIT").begin():
            with pytest.raises(TransactionRequired, match="AUTOCOMMIT"):
                outbox.enqueue(connection, kind=k, payload=b"x")
    assert list_intents(outbox, k) == {}


def test_a_batch_an_sqlalchemy_session_and_idempotency_keys(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str], orders: None
) -> None:
    k = kind("batch")
    engine = create_engine(stack.cluster.url("app").replace("postgres://", "postgresql+psycopg://"))
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO orders (customer) VALUES ('cy')"))
        results = outbox.enqueue_many(
            session,
            [
                NewIntent(kind=k, payload={"n": n}, idempotency_key=f"{k}/{n}", headers={"x-n": str(n)})
                for n in range(3)
            ],
        )
        # The same keys again in the same transaction: the same intents.
        again = outbox.enqueue_many(session, [NewIntent(kind=k, payload={"n": 0}, idempotency_key=f"{k}/0")])
    assert [r.state for r in results] == ["STAGED"] * 3
    assert again[0].id == results[0].id and again[0].deduplicated
    for r in results:
        wait_state(outbox, r.id, "PENDING")
    with Session(engine) as session, session.begin():
        rolled = outbox.enqueue(session, kind=k, payload=b"no")
        session.rollback()
    wait_state(outbox, rolled.id, "DISCARDED")
    direct = outbox.enqueue_direct(k, "plain text", delay=60)
    assert direct.state == "PENDING"
    got = outbox.get_intent(direct.id).intent
    assert got.payload == b"plain text" and got.available_at.seconds > got.created_at.seconds + 50
    assert outbox.get_intent(results[2].id).intent.headers["x-n"] == "2"


def test_the_async_producer_with_psycopg_async_connection(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str], orders: None
) -> None:
    k = kind("async")

    async def produce() -> tuple[str, str]:
        async with AsyncOutbox(stack.endpoints, stack.api_key) as aoutbox:
            async with await psycopg.AsyncConnection.connect(stack.cluster.url("app"), autocommit=True) as conn:
                with pytest.raises(TransactionRequired):
                    await aoutbox.enqueue(conn, kind=k, payload=b"x")
                async with conn.transaction():
                    await conn.execute("INSERT INTO orders (customer) VALUES ('dee')")
                    kept = await aoutbox.enqueue(conn, kind=k, payload={"ok": True})
                try:
                    async with conn.transaction():
                        dropped = await aoutbox.enqueue(conn, kind=k, payload={"ok": False})
                        raise RuntimeError("a later step failed")
                except RuntimeError:
                    pass
                return kept.id, dropped.id

    kept, dropped = asyncio.run(produce())
    wait_state(outbox, kept, "PENDING")
    wait_state(outbox, dropped, "DISCARDED")
    assert state(outbox, kept) == "PENDING"


def test_the_async_producer_with_sqlalchemy_async_session_and_connection(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str], orders: None
) -> None:
    k = kind("async-sqlalchemy")
    url = stack.cluster.url("app").replace("postgres://", "postgresql+psycopg://")

    async def produce() -> tuple[str, str, str]:
        engine = create_async_engine(url)
        try:
            async with AsyncOutbox(stack.endpoints, stack.api_key) as aoutbox:
                async with AsyncSession(engine) as session:
                    with pytest.raises(TransactionRequired):
                        await aoutbox.enqueue(session, kind=k, payload=b"x")
                    async with session.begin():
                        await session.execute(text("INSERT INTO orders (customer) VALUES ('eve')"))
                        kept = await aoutbox.enqueue(session, kind=k, payload={"ok": True})
                    async with session.begin():
                        failed = await aoutbox.enqueue(session, kind=k, payload={"ok": False})
                        with pytest.raises(DBAPIError):
                            await session.execute(text("SELECT 1/0"))
                        # The transaction failed: no intent can join it.
                        with pytest.raises(TransactionRequired):
                            await aoutbox.enqueue(session, kind=k, payload=b"x")
                        await session.rollback()
                async with engine.connect() as conn, conn.begin():
                    await conn.execute(text("INSERT INTO orders (customer) VALUES ('fay')"))
                    via_connection = await aoutbox.enqueue(conn, kind=k, payload={"ok": True})
                return kept.id, failed.id, via_connection.id
        finally:
            await engine.dispose()

    kept, failed, via_connection = asyncio.run(produce())
    wait_state(outbox, kept, "PENDING")
    wait_state(outbox, via_connection, "PENDING")
    wait_state(outbox, failed, "DISCARDED")


def test_the_async_producer_refuses_a_failed_asyncpg_transaction_with_transaction_required(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str], orders: None
) -> None:
    k = kind("asyncpg")
    # asyncpg reports no failed-transaction status: the token query's refusal (25P02) tells.
    url = stack.cluster.url("app").replace("postgres://", "postgresql+asyncpg://")

    async def produce() -> str:
        engine = create_async_engine(url)
        try:
            async with AsyncOutbox(stack.endpoints, stack.api_key) as aoutbox, AsyncSession(engine) as session:
                async with session.begin():
                    await session.execute(text("INSERT INTO orders (customer) VALUES ('gus')"))
                    kept = await aoutbox.enqueue(session, kind=k, payload={"ok": True})
                async with session.begin():
                    with pytest.raises(DBAPIError):
                        await session.execute(text("SELECT 1/0"))
                    with pytest.raises(TransactionRequired, match="roll it back"):
                        await aoutbox.enqueue(session, kind=k, payload=b"x")
                    await session.rollback()
                # AUTOCOMMIT: each statement commits alone, the token's too.
                autocommit = create_async_engine(url, isolation_level="AUTOCOMMIT")
                try:
                    async with autocommit.begin() as connection:
                        with pytest.raises(TransactionRequired, match="AUTOCOMMIT"):
                            await aoutbox.enqueue(connection, kind=k, payload=b"x")
                finally:
                    await autocommit.dispose()
                return kept.id
        finally:
            await engine.dispose()

    kept = asyncio.run(produce())
    wait_state(outbox, kept, "PENDING")
    assert list_intents(outbox, k).keys() == {kept}


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
def test_the_async_producer_refuses_sqlalchemy_in_autocommit_before_any_call(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str], orders: None, driver: str
) -> None:
    k = kind(f"autocommit-{driver}")
    url = stack.cluster.url("app").replace("postgres://", f"postgresql+{driver}://")
    # The client's own refusal (the server's, TXN_COMMITTED, names no AUTOCOMMIT).
    refused = pytest.raises(TransactionRequired, match="AUTOCOMMIT")

    async def produce() -> None:
        engine = create_async_engine(url)
        autocommit = create_async_engine(url, isolation_level="AUTOCOMMIT")
        try:
            async with AsyncOutbox(stack.endpoints, stack.api_key) as aoutbox:
                # An AsyncSession: SQLAlchemy calls it a transaction, with no connection yet
                # (session.begin() opens none) and once a statement ran.
                async with AsyncSession(autocommit) as session, session.begin():
                    with refused:
                        await aoutbox.enqueue(session, kind=k, payload=b"x")
                    await session.execute(text("INSERT INTO orders (customer) VALUES ('hal')"))
                    with refused:
                        await aoutbox.enqueue(session, kind=k, payload=b"x")
                # AUTOCOMMIT as the engine's execution option, and as the session's.
                async with AsyncSession(engine.execution_options(isolation_level="AUTOCOMMIT")) as session:
                    async with session.begin():
                        with refused:
                            await aoutbox.enqueue(session, kind=k, payload=b"x")
                async with AsyncSession(engine) as session, session.begin():
                    await session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
                    with refused:
                        await aoutbox.enqueue(session, kind=k, payload=b"x")
                # An AsyncConnection: of the AUTOCOMMIT engine, or set so itself.
                async with autocommit.connect() as connection, connection.begin():
                    with refused:
                        await aoutbox.enqueue(connection, kind=k, payload=b"x")
                async with engine.connect() as connection:
                    await connection.execution_options(isolation_level="AUTOCOMMIT")
                    async with connection.begin():
                        with refused:
                            await aoutbox.enqueue(connection, kind=k, payload=b"x")
        finally:
            await autocommit.dispose()
            await engine.dispose()

    asyncio.run(produce())
    assert list_intents(outbox, k) == {}


def test_refusals_carry_the_servers_reason(stack: Stack, outbox: Outbox, kind: Callable[[str], str]) -> None:
    k = kind("refused")
    outbox.enqueue_direct(k, b"a", idempotency_key=f"{k}/1")
    with pytest.raises(outboxd.OutboxError) as conflict:
        outbox.enqueue_direct(k, b"b", idempotency_key=f"{k}/1")
    assert conflict.value.reason == "IDEMPOTENCY_CONFLICT"
    with pytest.raises(outboxd.OutboxError) as invalid:
        outbox.enqueue_direct("", b"b")
    assert invalid.value.reason == "INVALID_ARGUMENT"


def test_intents_of_one_ordering_key_are_claimable_one_at_a_time_in_request_order(
    outbox: Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("ordered")
    first, second = outbox.enqueue_direct_many(
        [NewIntent(kind=k, payload=b"1", ordering_key=f"{k}/account-7") for _ in range(2)]
    )
    assert [first.state, second.state] == ["PENDING", "WAITING"]
    assert outbox.get_intent(second.id).intent.ordering_key == f"{k}/account-7"

    def claim(wait: float) -> list[pb.Lease]:
        request = pb.ClaimRequest(worker_id="ordering-test", kinds=[k], max_intents=10)
        if wait:
            request.wait.FromMilliseconds(int(wait * 1000))
        return list(outbox._client.call("Claim", request, pb.ClaimResponse, timeout=wait + 5, budget=wait + 5).leases)

    # Ten asked, one leased: the second waits behind the first.
    leases = claim(0)
    assert [lease.intent.id for lease in leases] == [first.id]
    assert claim(0) == []
    acked = outbox._client.call(
        "Ack",
        pb.AckRequest(leases=[pb.LeaseRef(intent_id=first.id, lease_id=leases[0].lease_id)]),
        pb.AckResponse,
        timeout=5,
        budget=5,
    )
    assert not acked.results[0].HasField("error")
    # The Ack made the second the key's head, in its own transaction: claimable now.
    assert [lease.intent.id for lease in claim(5)] == [second.id]


def test_higher_priorities_are_claimed_first_and_handlers_see_the_priority(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("prioritized")
    batch = outbox.enqueue_direct_many(
        [NewIntent(kind=k, payload=name, priority=p) for name, p in [("a", 0), ("b", 5), ("c", -3), ("d", 10)]]
    )
    # Enqueued later: behind the batch's intent of the same priority (oldest first).
    later = outbox.enqueue_direct(k, "e", priority=5)
    assert outbox.get_intent(later.id).intent.priority == 5
    assert [r.state for r in batch] == ["PENDING"] * 4

    # One slot: one intent claimed at a time, the handler called in claim order.
    seen: list[tuple[str, int]] = []
    worker = Worker(stack.endpoints, stack.api_key, concurrency=1, claim_wait=1)
    worker.add_handler(k, lambda intent: seen.append((intent.payload.decode(), intent.priority)))
    with Running(worker):
        wait_for("five handled", lambda: len(seen) == 5, timeout=20)
    assert seen == [("d", 10), ("b", 5), ("e", 5), ("a", 0), ("c", -3)]

    with pytest.raises(outboxd.OutboxError) as invalid:
        outbox.enqueue_direct(k, "f", priority=11)
    assert invalid.value.reason == "INVALID_ARGUMENT"
    assert "intents[0].priority" in invalid.value.message


def test_an_unkeyed_enqueue_whose_connection_was_refused_is_sent_to_the_next_endpoint(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    k = kind("failover")
    # Start on the first endpoint (normally a random one), where nothing listens: the
    # request never left, so even without an idempotency key it is sent again, once.
    monkeypatch.setattr("outboxd._rpc.random.randrange", lambda n: 0)
    dead = f"127.0.0.1:{free_port()}"
    with Outbox([dead, stack.endpoints[0]], stack.api_key) as failover:
        served = failover.enqueue_direct(k, b"sync")
    assert served.state == "PENDING"

    async def enqueue_async() -> outboxd.EnqueueResult:
        async with AsyncOutbox([dead, stack.endpoints[0]], stack.api_key) as failover:
            return await failover.enqueue_direct(k, b"async")

    served_async = asyncio.run(enqueue_async())
    assert served_async.state == "PENDING"
    assert list_intents(outbox, k).keys() == {served.id, served_async.id}
