"""The pgbench transactions of scenario 5: the consumer-kit-shaped one and the naive one."""

PGBENCH_CK = r"""
\set k random(1, 2000000000)
\set c random(0, 999)
BEGIN;
INSERT INTO operations (scope, key, tenant, operation_type, fingerprint, projection_version, state,
  attempts, lease_owner, lease_expires_at, message_id)
  VALUES ('default/invoice.create/v1', 'pgb-' || CAST(:client_id AS text) || '-' || CAST(:k AS text), 'default', 'invoice.create',
  md5(CAST(:k AS text)) || md5(CAST(:c AS text)), 1, 'processing', 1, 'pgbench', now() + interval '300 seconds', 'm')
  ON CONFLICT (scope, key) DO NOTHING;
INSERT INTO invoices (order_id, revision, customer_id, amount_cents, currency)
  VALUES (CAST(:k AS bigint), 1, 'c' || CAST(:c AS text), 1000, 'EUR');
INSERT INTO customers AS cu (customer_id, invoiced_cents) VALUES ('c' || CAST(:c AS text), 1000)
  ON CONFLICT (customer_id) DO UPDATE SET invoiced_cents = cu.invoiced_cents + EXCLUDED.invoiced_cents;
INSERT INTO outbox (event_id, destination, routing_key, message_type, partition_key, payload,
  operation_scope, operation_key)
  VALUES (gen_random_uuid(), 'billing.events', 'invoice.created', 'InvoiceCreated', 'c' || CAST(:c AS text),
  jsonb_build_object('order_id', CAST(:k AS bigint), 'customer_id', 'c' || CAST(:c AS text), 'amount_cents', 1000),
  'default/invoice.create/v1', 'pgb-' || CAST(:client_id AS text) || '-' || CAST(:k AS text));
UPDATE operations SET state = 'completed', result_status = 'created', result_reference = 'x',
  lease_owner = NULL, lease_expires_at = NULL, updated_at = now(), completed_at = now()
  WHERE scope = 'default/invoice.create/v1' AND key = 'pgb-' || CAST(:client_id AS text) || '-' || CAST(:k AS text)
  AND state = 'processing';
END;
"""

PGBENCH_NAIVE = r"""
\set k random(1, 2000000000)
\set c random(0, 999)
BEGIN;
INSERT INTO invoices (order_id, revision, customer_id, amount_cents, currency)
  VALUES (CAST(:k AS bigint), 1, 'c' || CAST(:c AS text), 1000, 'EUR');
INSERT INTO customers AS cu (customer_id, invoiced_cents) VALUES ('c' || CAST(:c AS text), 1000)
  ON CONFLICT (customer_id) DO UPDATE SET invoiced_cents = cu.invoiced_cents + EXCLUDED.invoiced_cents;
INSERT INTO outbox (event_id, destination, routing_key, message_type, partition_key, payload)
  VALUES (gen_random_uuid(), 'billing.events', 'invoice.created', 'InvoiceCreated', 'c' || CAST(:c AS text),
  jsonb_build_object('order_id', CAST(:k AS bigint), 'customer_id', 'c' || CAST(:c AS text), 'amount_cents', 1000));
END;
"""
