-- A page of the policies of the transaction's tenants (store::list_queue_policies). $1 a
-- kind (or NULL: any), $2 now (or NULL), $3 and $4 the tenant and kind the page begins
-- after (or NULL: the first page), $5 the reply's budget in bytes.
--
-- The page ends before the policy whose weight (its texts and 512 bytes for the rest, more
-- than it takes on the wire) would pass the budget, but holds at least one; the live
-- figures (the queue's leases, the bucket's tokens) are read for its policies alone.
WITH weighed AS (
    SELECT p.tenant_id, p.kind,
           sum(512 + octet_length(p.tenant_id) + octet_length(p.kind)
               + octet_length(p.updated_by) + coalesce(octet_length(p.updated_by_key), 0)
               + octet_length(p.reason))
               OVER (ORDER BY p.tenant_id, p.kind ROWS UNBOUNDED PRECEDING) AS through,
           row_number() OVER (ORDER BY p.tenant_id, p.kind) AS n
    FROM outbox.queue_policy p
    WHERE ($1::text IS NULL OR p.kind = $1)
      AND ($3::text IS NULL OR (p.tenant_id, p.kind) > ($3::text, $4::text))
),
kept AS (
    SELECT tenant_id, kind FROM weighed WHERE n = 1 OR through <= $5
)
SELECT p.tenant_id, p.kind, p.paused, p.max_in_flight, p.rate_per_second, p.burst,
       p.updated_by, p.updated_by_key, p.reason, p.updated_at,
       outbox.queue_in_flight(p.tenant_id, p.kind) AS in_flight,
       outbox.bucket_tokens(p, coalesce($2, now())) AS tokens,
       (SELECT count(*) FROM weighed) > (SELECT count(*) FROM kept) AS more
FROM outbox.queue_policy p
JOIN kept USING (tenant_id, kind)
ORDER BY p.tenant_id, p.kind
