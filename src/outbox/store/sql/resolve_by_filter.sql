-- An operator's decision on every intent matching a filter, oldest first
-- (store::resolve_intents), each recorded in outbox.resolution in the same statement.
-- $1-$7 as in resolve_by_ids.sql; $8 states to match, $9 kind (or NULL), $10 region (or
-- NULL), $11 enqueued before (or NULL), $12 most intents, $13 for a CANCEL the locks of
-- ordering keys filter_key_locks.sql took (an ordered intent of another key is left for
-- the next call), otherwise NULL, $14 the caller's API key (its name). One row per intent
-- resolved.
WITH target AS (
    SELECT i.id, i.state
    FROM outbox.intent i
    WHERE (i.state = ANY($1)
           -- DEAD on a DEAD_LETTERED intent that holds its ordering key releases the key.
           OR ($2 = 'dead' AND i.state = 'dead_lettered' AND i.ordering_key IS NOT NULL
               AND i.finished_at IS NULL))
      -- An ordered dead letter given up (DEAD) let its key move on: that decision is final.
      AND NOT (i.state = 'dead_lettered' AND i.ordering_key IS NOT NULL
               AND i.finished_at IS NOT NULL)
      AND i.state = ANY($8)
      AND ($9::text IS NULL OR i.kind = $9)
      AND ($10::text IS NULL OR i.region = $10)
      AND ($11::timestamptz IS NULL OR i.created_at < $11)
      AND (cardinality($7::text[]) = 0 OR i.region = '' OR i.region = ANY($7::text[]))
      AND ($13::bigint[] IS NULL OR i.ordering_key IS NULL
           OR outbox.ordering_lock(i.tenant_id, i.ordering_key) = ANY($13::bigint[]))
    ORDER BY i.id
    LIMIT $12
    FOR UPDATE SKIP LOCKED
),
resolved AS (
    UPDATE outbox.intent i
    SET state = CASE $2
            WHEN 'delivered' THEN 'delivered'
            -- An ordered one waits for its key (outbox.advance_keys, run next).
            WHEN 'requeue' THEN CASE WHEN i.ordering_key IS NULL THEN 'pending' ELSE 'waiting' END
            WHEN 'cancel' THEN 'cancelled'
            ELSE 'dead_lettered'
        END::outbox.intent_state,
        attempts = CASE WHEN $2 = 'requeue' THEN 0 ELSE i.attempts END,
        available_at = CASE WHEN $2 = 'requeue' THEN coalesce($5::timestamptz, now())
                            ELSE i.available_at END,
        -- A DEAD_LETTERED ordered intent with a finish time no longer holds its key.
        finished_at = CASE WHEN $2 IN ('delivered', 'cancel')
                                OR ($2 = 'dead' AND i.ordering_key IS NOT NULL)
                           THEN coalesce($5::timestamptz, now()) END,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = coalesce($5::timestamptz, now())
    FROM target
    WHERE i.id = target.id
    RETURNING i.id, i.tenant_id, i.state, target.state AS from_state, i.ordering_key
),
recorded AS (
    INSERT INTO outbox.resolution (tenant_id, intent_id, from_state, decision, actor, reason,
                                   resolved_at, api_key)
    SELECT tenant_id, id, from_state, $2, $3, $4, coalesce($5::timestamptz, now()), $14
    FROM resolved
    RETURNING intent_id
),
woken AS (
    SELECT pg_notify($6, '') WHERE $2 = 'requeue' AND EXISTS (SELECT 1 FROM resolved)
)
SELECT resolved.id, true AS applied, resolved.state, resolved.tenant_id,
       resolved.ordering_key
FROM resolved
CROSS JOIN (SELECT count(*) FROM recorded) AS r
CROSS JOIN (SELECT count(*) FROM woken) AS w
ORDER BY resolved.id
