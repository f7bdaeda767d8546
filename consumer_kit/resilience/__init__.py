"""Background tasks that are restarted when they die, and the one backoff every retry loop uses."""
