-- The locks of the ordering keys of the intents a CANCEL by filter is for
-- (store::resolve_intents): among the first $7 that match resolve_by_filter.sql's filter
-- (the rows it would walk), the ordered ones; taken sorted and in one round before that
-- statement locks any row; the lock ids. $1 the states a CANCEL applies to, $2 states to
-- match, $3 kind (or NULL), $4 region (or NULL), $5 enqueued before (or NULL), $6 the API
-- key's regions (empty: any), $7 most intents.
--
-- An Ack that delivered a key's head holds the key's lock and then makes the key's next
-- WAITING intent PENDING, so a CANCEL that locked that intent first and then asked for
-- the key deadlocked with it. Sorted, then locked: PostgreSQL evaluates a volatile
-- select-list function after the sort below it.
SELECT k.lock_id, pg_advisory_xact_lock(k.lock_id)
FROM (
    SELECT DISTINCT outbox.ordering_lock(c.tenant_id, c.ordering_key) AS lock_id
    FROM (
        SELECT i.tenant_id, i.ordering_key
        FROM outbox.intent i
        WHERE i.state = ANY($1)
          AND i.state = ANY($2)
          AND ($3::text IS NULL OR i.kind = $3)
          AND ($4::text IS NULL OR i.region = $4)
          AND ($5::timestamptz IS NULL OR i.created_at < $5)
          AND (cardinality($6::text[]) = 0 OR i.region = '' OR i.region = ANY($6::text[]))
        ORDER BY i.id
        LIMIT $7
    ) c
    WHERE c.ordering_key IS NOT NULL
) k
ORDER BY k.lock_id
