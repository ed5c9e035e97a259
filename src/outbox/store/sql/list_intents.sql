-- A page of ListIntents (store::list_intents). $1 states (empty: any), $2 kind (or NULL),
-- $3 region (or NULL), $4 the cursor (ids above it; the nil UUID for none), $5 page size,
-- $6 the API key's regions (empty: any), $7 the byte budget, $8 include payloads, $9
-- ordering key (or NULL: any), $10 only what awaits a decision (no finished dead letter).
--
-- Each part is read in id order up to the page's size, then the parts are merged: the live
-- table by its primary key, the batch history by its bucket index (ids are ordered as
-- their buckets are), sorted within a bucket. The filters are in both parts, so that a
-- part stops at the page's size of matches. The cursor is a bare bound, so that a cached
-- plan still starts each scan at it. Then the page stops where the weight of the intents
-- before one reaches the budget (`candidates`: the rows before that cut, so that the
-- caller knows a short page was cut, not the end), and payloads are read only if asked
-- for (their size is the stored one, not read). A filter of states that are few however large the table
-- (outbox.few_intents) reads them through their partial indexes instead of the primary key.
SELECT i.id, i.state, i.kind,
       CASE WHEN $8 THEN i.payload ELSE ''::bytea END AS payload,
       i.content_type, i.region, i.idempotency_key, i.headers, i.attempts,
       i.max_attempts, i.available_at, i.created_at, i.updated_at, i.lease_id,
       i.lease_expires_at, i.worker_id, i.last_error, i.ordering_key, i.priority,
       i.tenant_id AS tenant, i.candidates
FROM (
    SELECT u.*, w.weight,
           sum(w.weight) OVER (ORDER BY u.id ROWS UNBOUNDED PRECEDING) AS through,
           count(*) OVER () AS candidates
    FROM (
        (
            SELECT *
            FROM outbox.intent i
            WHERE NOT outbox.are_few($1)
              AND (cardinality($1::outbox.intent_state[]) = 0 OR i.state = ANY($1))
              AND ($2::text IS NULL OR i.kind = $2)
              AND ($3::text IS NULL OR i.region = $3)
              AND (cardinality($6::text[]) = 0 OR i.region = '' OR i.region = ANY($6::text[]))
              AND ($9::text IS NULL OR i.ordering_key = $9)
              AND (NOT $10 OR i.finished_at IS NULL)
              AND i.id > $4
            ORDER BY i.id
            LIMIT $5
        )
        UNION ALL
        (
            SELECT f.*
            FROM outbox.few_intents($1, $2, $3, $6, $9, $10, $4, $5) f
            WHERE outbox.are_few($1)
        )
        UNION ALL
        (
            -- i.unnest: the item's ordering key (outbox.intents_by_id in migration …02_baseline_functions).
            SELECT i.*, NULL::timestamptz, NULL::bigint, 0::smallint, NULL::bigint
            FROM outbox.delivered_batch b
            CROSS JOIN LATERAL unnest(b.items, b.ordering_keys) i
            WHERE (cardinality($1::outbox.intent_state[]) = 0 OR 'delivered' = ANY($1))
              AND ($9::text IS NULL OR $9 = ANY (b.ordering_keys))
              AND b.bucket >= (SELECT outbox.history_bucket($4))
              AND ($3::text IS NULL OR b.region = $3)
              AND (cardinality($6::text[]) = 0 OR b.region = '' OR b.region = ANY($6::text[]))
              AND (cardinality($1::outbox.intent_state[]) = 0 OR i.state = ANY($1))
              AND ($2::text IS NULL OR i.kind = $2)
              AND ($3::text IS NULL OR i.region = $3)
              AND (cardinality($6::text[]) = 0 OR i.region = '' OR i.region = ANY($6::text[]))
              AND ($9::text IS NULL OR i.unnest = $9)
              AND i.id > $4
            ORDER BY b.bucket, i.id
            LIMIT $5
        )
    ) u
    CROSS JOIN LATERAL (
        SELECT outbox.reply_weight(CASE WHEN $8 THEN u.payload END, u.headers,
                                   u.last_error) AS weight
    ) w
    ORDER BY u.id
    LIMIT $5
) i
WHERE i.through - i.weight < greatest($7, 1)
ORDER BY i.id
