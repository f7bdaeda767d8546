"""pytest plugin registered by the ``consumer-kit`` distribution (entry point ``pytest11``).

It loads in every pytest run of every project that installs consumer-kit, so importing it costs
nothing: the fixtures import the harness, psycopg and pgserver only when a test asks for them.
Every fixture name starts with ``ck_`` or ``consumer_kit_`` so it cannot shadow a project's own.

Fixtures:
    ck_database_url (session): ``CONSUMER_KIT_TEST_DATABASE_URL``, else
        ``CONSUMER_KIT_DATABASE_URL``, else an embedded PostgreSQL (pgserver) in a temporary
        directory, started once per session.
    ck_memory_broker: a fresh in-process broker (``consumer_kit.adapters.memory.MemoryBroker``), lock 1 s.
    consumer_kit_harness: a factory ``consumer_kit_harness(*handlers, setup_sql=..., **settings)``
        returning a :class:`consumer_kit.testing.Harness` (use it with ``async with``) on a
        throwaway schema of ``ck_database_url``.

``async def`` tests that take one of these fixtures run on pytest-asyncio (installed with the
``consumer-kit[testing]`` extra) without a marker or an ``asyncio_mode`` setting: the plugin marks
them ``asyncio`` as they are collected, in strict mode too. Other async tests are left to your own
configuration.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from consumer_kit.testing.harness import Harness

KIT_FIXTURES = frozenset({"ck_database_url", "ck_memory_broker", "consumer_kit_harness"})
_LOOP_SCOPE_INI = "asyncio_default_fixture_loop_scope"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Give pytest-asyncio the fixture loop scope it will default to, ``function``, when the
    project sets none: otherwise pytest-asyncio (>= 0.24) prints a PytestDeprecationWarning on
    every run of a project that merely installed ``consumer-kit[testing]`` (an error under
    ``-W error``). A project's own ``asyncio_default_fixture_loop_scope`` setting wins."""
    if not config.pluginmanager.hasplugin("asyncio"):
        return
    try:
        if config.getini(_LOOP_SCOPE_INI):
            return
    except ValueError:  # a pytest-asyncio too old to know the setting: it does not warn either
        return
    # pytest has no public setter for an ini value; getini reads this cache first (pytest >= 3).
    # tests/product/test_packaging.py runs the user project with -W error, so a change here fails there.
    config._inicache[_LOOP_SCOPE_INI] = "function"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    """Mark ``async def`` tests that take a kit fixture ``asyncio`` before pytest-asyncio sees
    them (its strict mode runs only marked tests). Returns nothing: collection goes on as usual."""
    if not inspect.iscoroutinefunction(obj) or not collector.config.pluginmanager.hasplugin("asyncio"):
        return
    try:
        parameters = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return
    marks = getattr(obj, "pytestmark", [])
    if KIT_FIXTURES.intersection(parameters) and not any(m.name == "asyncio" for m in marks):
        pytest.mark.asyncio(obj)


@pytest.fixture(scope="session")
def ck_database_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The PostgreSQL URL the testing kit creates its throwaway schemas in."""
    for name in ("CONSUMER_KIT_TEST_DATABASE_URL", "CONSUMER_KIT_DATABASE_URL"):
        url = (os.environ.get(name) or "").strip()  # blank is unset, as in the settings
        if url and url.lower() != "embedded":
            yield url
            return
    from consumer_kit.db.embedded import embedded_database_url

    yield embedded_database_url(tmp_path_factory.mktemp("consumer-kit-pgdata"), throwaway=True)


@pytest.fixture
def ck_memory_broker() -> Any:
    """A fresh in-process broker with peek-lock semantics (lock timeout 1 s)."""
    from consumer_kit.broker.registry import adapter_for

    return adapter_for("memory://").MemoryBroker("ck-test", lock_timeout=1.0)


@pytest.fixture
def consumer_kit_harness(ck_database_url: str) -> Callable[..., Harness]:
    """Factory of :class:`~consumer_kit.testing.Harness` objects on ``ck_database_url``::

        async with consumer_kit_harness(MyHandler(), setup_sql=MY_TABLES) as kit:
            await kit.deliver(message, times=3)
    """
    from consumer_kit.testing.harness import Harness

    def make(*handlers: Any, **options: Any) -> Harness:
        return Harness(*handlers, database_url=ck_database_url, **options)

    return make
