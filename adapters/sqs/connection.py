"""boto3 off the event loop: one SQS client per adapter object, called from worker threads.

botocore's low-level clients are thread-safe once created (boto3's documentation: "Low-level
clients are thread safe ... instantiate your client then pass that client object to each of your
threads"; sessions and resources are not). So each consumer or publisher makes **one** client, in
a worker thread (creating it resolves credentials, which may call the instance metadata service),
and every call runs in a thread of the adapter's own pool, never on the event loop:

* ``threads`` calls at once for settlements, heartbeats and publishes;
* one more thread per subscription for its long poll (a poll holds its thread for up to
  ``wait`` seconds, so it gets a thread of its own instead of starving settlements).

The client's connection pool (botocore ``Config(max_pool_connections=...)``) is sized to the same
number of threads, so no call waits for a pooled HTTP connection. Credentials come from boto3's
standard chain and are never read, printed or logged here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import boto3
from botocore.config import Config

from .config import SQSConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CONNECT_TIMEOUT = 5.0  # seconds
_READ_MARGIN = 10.0  # seconds a reply may take beyond a long poll's wait


class SQSClient:
    """One botocore SQS client and the threads that call it.

    Args:
        config: the parsed ``sqs://`` URL (endpoint, region).
        threads: calls at once besides long polls (>= 1).
        pollers: long polls at once (one per subscription).

    Attributes:
        calls: API calls made, by operation name (``receive_message``, ...).
    """

    def __init__(self, config: SQSConfig, *, threads: int = 8, pollers: int = 4) -> None:
        if threads < 1 or pollers < 0:
            raise ValueError("threads must be >= 1 and pollers >= 0")
        self.config = config
        self._threads = threads
        self._pollers = pollers
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="consumer-kit-sqs")
        self._poll_executor = ThreadPoolExecutor(max(1, pollers), thread_name_prefix="consumer-kit-sqs-poll")
        self._client: Any = None
        self._creating = asyncio.Lock()
        self.calls: dict[str, int] = {}

    async def call(self, operation: str, **params: Any) -> dict[str, Any]:
        """Run ``client.<operation>(**params)`` in a worker thread and return its reply.

        Raises:
            botocore.exceptions.ClientError: SQS refused the request (code in
                ``error.response["Error"]["Code"]``, see :mod:`consumer_kit.adapters.sqs.errors`).
            botocore.exceptions.BotoCoreError: no reply (connection, timeout, credentials).
        """
        client = await self._ready()
        self.calls[operation] = self.calls.get(operation, 0) + 1
        method: Callable[..., dict[str, Any]] = getattr(client, operation)
        return await self._run(self._executor, functools.partial(method, **params))

    async def poll(self, **params: Any) -> dict[str, Any]:
        """``ReceiveMessage`` on the long-poll threads (errors as :meth:`call`)."""
        client = await self._ready()
        self.calls["receive_message"] = self.calls.get("receive_message", 0) + 1
        return await self._run(self._poll_executor, functools.partial(client.receive_message, **params))

    async def close(self) -> None:
        """Close the HTTP connections and stop the threads (calls still running finish first)."""
        for executor in (self._executor, self._poll_executor):
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
        if self._client is not None:
            self._client.close()
            self._client = None

    async def _ready(self) -> Any:
        if self._client is None:
            async with self._creating:
                if self._client is None:
                    self._client = await self._run(self._executor, self._create)
        return self._client

    def _create(self) -> Any:
        config = Config(
            max_pool_connections=self._threads + self._pollers,
            connect_timeout=_CONNECT_TIMEOUT,
            read_timeout=self.config.wait_seconds + _READ_MARGIN,
            retries={"mode": "standard", "max_attempts": 3},
        )
        # A session of its own: boto3's default session is shared module state, not thread-safe.
        session = boto3.session.Session()
        return session.client(
            "sqs", region_name=self.config.region, endpoint_url=self.config.endpoint_url, config=config
        )

    @staticmethod
    async def _run(executor: ThreadPoolExecutor, job: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(executor, job)
