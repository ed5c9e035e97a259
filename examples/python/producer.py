"""An outboxd producer in Python: a business row and its outbox intent, in one transaction.

It uses the SDK in clients/python (`outboxd.Outbox`). The orders table lives in the same
database as the outbox (the `outbox` schema), so the SDK takes the token from
`outbox.txn_token()`, which also makes outboxd promote the intent the moment we commit.
(From another database of the same cluster the SDK takes the plain-SQL token instead,
automatically; ../node/producer.js shows that token by hand.)

Setup, from the repository root:

    python3 -m venv examples/python/.venv
    examples/python/.venv/bin/pip install -r examples/python/requirements.txt

Run, with outboxd serving on its embedded cluster at a known port (`OUTBOX_EMBEDDED__PORT=5433
cargo run`; a key from `cargo run -q -- keys create --name examples --tenant default
--scope produce --scope consume`):

    OUTBOX_PRODUCER_DATABASE_URL=postgres://postgres@127.0.0.1:5433/outbox \
    OUTBOX_SERVER=127.0.0.1:50051 OUTBOX_API_KEY=obx_… \
    examples/python/.venv/bin/python examples/python/producer.py

It places one order that commits and one that rolls back, prints what happened, and ends
with one JSON line: {"committed": [...], "rolled_back": [...]}.
"""

import argparse
import json
import os

import psycopg

from outboxd import Outbox


def place_order(conn, outbox, customer, total_cents, *, commit=True):
    """Inserts an order and enqueues its "order.created" intent, atomically.

    Either both exist (COMMIT) or neither does (ROLLBACK): outboxd ties the intent to
    this transaction and only hands it to workers once PostgreSQL says it committed.
    """
    with conn.transaction():  # BEGIN ... COMMIT, or ROLLBACK on an exception
        order_id = conn.execute(
            "INSERT INTO orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
            (customer, total_cents),
        ).fetchone()[0]

        # Phase 1: the SDK takes a token naming this still-open transaction and enqueues
        # with it (outside a transaction it raises instead of enqueuing directly).
        intent = outbox.enqueue(
            conn,
            kind="order.created",
            # JSON-encoded, content type application/json.
            payload={"order_id": order_id, "customer": customer, "total_cents": total_cents},
            # Derived from the business fact: retrying this enqueue (say, after a
            # timeout) returns the same intent instead of a second one.
            idempotency_key=f"orders/{order_id}/created",
        )  # STAGED: recorded, but invisible to workers for now

        if not commit:
            raise psycopg.Rollback()  # e.g. a later step failed: the intent is discarded

    # Phase 2 was our own COMMIT (or ROLLBACK); outboxd learns the outcome from PostgreSQL.
    # Workers then get the intent at least once, so they must tolerate a repeat.
    return {"order_id": order_id, "intent_id": intent.id, "state": f"INTENT_STATE_{intent.state}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_PRODUCER_DATABASE_URL"),
        help="PostgreSQL URL of the outbox database [$OUTBOX_PRODUCER_DATABASE_URL]",
    )
    parser.add_argument(
        "--server",
        # Same variable as the outboxd CLI, which takes a URL: the SDK accepts both forms.
        default=os.environ.get("OUTBOX_SERVER", "127.0.0.1:50051"),
        help="outboxd gRPC address, host:port [$OUTBOX_SERVER, 127.0.0.1:50051]",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OUTBOX_API_KEY"),
        help="API key with the produce scope (outboxd keys create) [$OUTBOX_API_KEY]",
    )
    args = parser.parse_args()
    if not args.database_url:
        parser.error("set OUTBOX_PRODUCER_DATABASE_URL or pass --database-url")
    if not args.api_key:
        parser.error("set OUTBOX_API_KEY or pass --api-key")

    # timeout: each enqueue, retries included, is bounded: the transaction is never held
    # open on a stuck call. autocommit: each `conn.transaction()` block is one transaction.
    with (
        Outbox(endpoints=[args.server], api_key=args.api_key, timeout=10) as outbox,
        psycopg.connect(args.database_url, autocommit=True) as conn,
    ):
        conn.execute(
            "CREATE TABLE IF NOT EXISTS orders"
            " (id bigserial PRIMARY KEY, customer text NOT NULL, total_cents int NOT NULL)"
        )
        committed = place_order(conn, outbox, "ada", 4200)
        rolled_back = place_order(conn, outbox, "bob", 1700, commit=False)

    for outcome, r in (("committed:  ", committed), ("rolled back:", rolled_back)):
        print(f"{outcome} order {r['order_id']}, intent {r['intent_id']} ({r['state']} at enqueue)")
    print(json.dumps({"committed": [committed], "rolled_back": [rolled_back]}))


if __name__ == "__main__":
    main()
