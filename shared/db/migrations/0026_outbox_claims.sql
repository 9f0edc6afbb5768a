-- reaper migration 26: the relay claims outbox rows with a lease instead of holding row locks
-- while it waits for the broker's confirms (issue 40, invariant 18: no transaction stays open
-- across a wait on another system). A claim is one short UPDATE; the relay publishes with no
-- transaction open and then deletes the rows it still holds the claim on. A relay that dies keeps
-- its rows only until `claimed_until`, then any relay takes them again (at-least-once, as before).
ALTER TABLE cleanup_outbox ADD COLUMN IF NOT EXISTS claimed_by text;
ALTER TABLE cleanup_outbox ADD COLUMN IF NOT EXISTS claimed_until timestamptz;
