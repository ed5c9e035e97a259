-- PostgreSQL cannot drop a value of an enum. …08's down turns every CANCELLED intent into a
-- DISCARDED one, so the value is left in the type, unused.
SELECT 1;
