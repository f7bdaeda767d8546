"""PostgreSQL plumbing: the pool, bounded statements, prepared statements, the embedded server."""
