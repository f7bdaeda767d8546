"""The worker process: its run loop, health endpoints and the multi-process supervisor."""
