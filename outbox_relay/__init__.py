"""outbox-relay: publishes consumer-kit outbox rows to a broker and marks them published.

Run it as ``outbox-relay`` (see :mod:`consumer_kit.outbox_relay.cli`) next to the workers; any number of relays
may run on one outbox.

Guarantees
==========

* **At least once, stable identity.** Every row is published until the broker confirms it and the
  row is marked published. Every attempt uses the row's event ID as the broker message id (and
  header ``event-id``), so a republish after a crash between confirm and mark is recognisable.
* **One holder per row.** A row is claimed with ``FOR UPDATE SKIP LOCKED`` under a lease
  (``claimed_by``, ``claimed_until``). A relay publishes only within 80 % of its lease, so two
  live relays never publish the same row at the same time; a dead relay's rows are taken over
  when the lease runs out (``relay_claim_timeout``) and picked up within one poll interval after.
* **Failures back off, then park.** A failed publish sets ``attempts + 1``, ``last_error`` and
  ``available_at = now() + min(backoff_max, backoff_base * 2**(attempts-1))``. After
  ``relay_max_attempts`` the row is *parked*: never deleted, never retried until an operator runs
  ``outbox-relay requeue``; ``outbox-relay status`` lists it. A row that can never be published as
  it is (an unknown destination, a permanent ``PublishError``: too large for the broker's frame or
  message size, a destination of another type, access refused) is parked at once, with the
  broker's reply text in ``last_error`` (counter ``parked_permanent``).

Ordering (``relay_ordered``, on by default)
===========================================

Rows with the same ``partition_key`` are published **one at a time, in commit order** of the
transactions that wrote them; different keys proceed in parallel; rows without a key are
unordered. How:

1. *Commit order is recorded at write time* (outbox migration 102). A ``BEFORE INSERT`` trigger
   takes a transaction-scoped advisory lock on (schema, partition key) and only then draws
   ``commit_seq`` from a sequence. Two transactions writing the same key are therefore serialised
   from that insert until COMMIT, so ``commit_seq`` order is their commit order. The identity
   ``id`` is *not*: it is drawn before the trigger, so under concurrent transactions id order can
   differ from commit order (T1 takes id 5, T2 takes id 6, T2 commits first).
2. *No gap for in-flight writers.* While a transaction holding key K's lock is open, no other
   transaction can insert a row for K, so every committed row of K the relay can see precedes any
   row of K still to commit. The relay never has to wait for snapshot horizons (``xmin``); an
   unrelated long transaction does not stall it.
3. *One row per key at a time.* A keyed row is claimable only when no unpublished row of its key
   has a smaller ``commit_seq`` (claimed, in backoff or parked rows included). So each batch holds
   at most one row per key, and the next row of a key becomes claimable only after the previous
   one is confirmed **and** marked published, across any number of relays.

What is guaranteed: per key, the *first* publish of each event happens in commit order. What is
not: after a crash between confirm and mark, the event is published again later (same event ID),
so a consumer can see K1, K1 again; a failing row blocks only its own key until it succeeds, and a
parked row blocks its key until requeued (ordering is never silently broken); there is no order
across keys or for rows without a key; rows inserted before migration 102 are ordered by id.
Costs: writers of one key wait for each other's COMMIT (like a row lock on the aggregate, which
they usually hold anyway; the runtime's ``lock_timeout`` bounds the wait and the delivery is then
retried); a transaction writing keys A then B while another writes B then A can deadlock, and
PostgreSQL aborts one of them (retried like any transient error); distinct keys whose
``hashtext`` collide serialise their writers, harmlessly.
"""

from .counters import RelayCounters
from .relay import Relay, relay_pending
from .routing import Routing
from .settings import RelaySettings, RouteTarget
from .store import OutboxStatus, OutboxStore

__all__ = [
    "OutboxStatus",
    "OutboxStore",
    "Relay",
    "RelayCounters",
    "RelaySettings",
    "RouteTarget",
    "Routing",
    "relay_pending",
]
