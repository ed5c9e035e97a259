-- PostgreSQL cannot drop a value of an enum. …06's down turns every WAITING intent back
-- into PENDING, so the value is left in the type, unused.
SELECT 1;
