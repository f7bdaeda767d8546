"""Which kind of fault an exception is (docs/explanation/faults-and-attempts.md).

Only a fault of the message may cost it an attempt. Every error the runtime sees while processing
a delivery is one of:

=============  ==============================================  ==================================
kind           examples                                        what the worker does
=============  ==============================================  ==================================
message        deterministic database rejection: SQLSTATE      dead-letter at once with a reason
               class 22 (data exception), 23502 NOT NULL,
               23514 CHECK
handler        any other exception of the handler's own code   roll back, retry with backoff;
               (a bug, a remote API down, a unique violation   counts toward ``max_deliveries``
               from a race)
contention     lock timeout 55P03, deadlock 40P01,             roll back, retry with jitter;
               serialization failure 40001                     counted apart (``max_contentions``)
environment    database unreachable or shutting down (class    give the delivery back uncounted,
               08, 57P01-57P05), read-only (25006), too many   pause consuming, probe, resume
               connections (53300), disk full (53100), a
               system error (class 58), pool exhausted, a
               framework statement that did not answer in time,
               a pooler's lost prepared statement (26000,
               42P05 on psycopg's or consumer-kit's own)
=============  ==============================================  ==================================

A unique violation (23505) stays a handler fault: it is usually a race with another operation,
which a retry resolves. A foreign-key violation (23503) likewise: the parent row may be written
by a message that has not arrived yet.

**Who caused it decides, not the class alone.** SQLSTATE class 53 (insufficient resources) holds
both kinds. A full disk and a server out of connections are the environment's. The rest of the
class (``53400`` a statement's temporary files over ``temp_file_limit``, ``53200`` out of memory,
``53000``) is raised for one statement, so it follows the delivery that sent it: a handler fault,
counted. What tells the two apart is the next write: counting the attempt is a write of its own,
on another connection, right after the failure (``Runtime`` does it for every handler fault), and
a count that cannot be written because the database is unavailable gives the delivery back
uncounted and pauses the worker, as any environment fault does. On the batch path the item whose
statement failed runs on its own (docs/how-to/batches.md): its batch-mates never share its fate.
"""

from __future__ import annotations

import enum
import re

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import PoolTimeout

from consumer_kit.errors import StatementTimeout


class FaultKind(enum.StrEnum):
    MESSAGE = "message"
    HANDLER = "handler"
    CONTENTION = "contention"
    ENVIRONMENT = "environment"


# SQLSTATEs whose rejection is a property of the values (the same input fails the same way).
_DETERMINISTIC = frozenset({"23502", "23514"})
_CONTENTION = frozenset({"55P03", "40P01", "40001"})
# 57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now, 57P04 database_dropped,
# 57P05 idle_session_timeout; 25006 read_only_sql_transaction; 53100 disk_full, 53300
# too_many_connections (the rest of class 53 follows one statement: module docstring).
_ENVIRONMENT = frozenset({"57P01", "57P02", "57P03", "57P04", "57P05", "25006", "53100", "53300"})
_ENVIRONMENT_CLASSES = ("08", "58")  # connection exception, system error
# 26000 invalid_sql_statement_name, 42P05 duplicate_prepared_statement on a statement of psycopg's
# (``_pg3_N``) or of consumer-kit's (``ck_``): a transaction-mode pooler sent it to another server
# (docs/scaling.md), not a fault of the message. A handler's own statement names stay its own.
_LOST_STATEMENT = frozenset({"26000", "42P05"})
_OWN_STATEMENT = re.compile(r'prepared statement "(_pg3_|ck_)')


def classify(exc: BaseException) -> FaultKind:
    """The kind of fault ``exc`` is (table in the module docstring).

    A psycopg error is classified by its SQLSTATE; an ``OperationalError`` without one (the
    connection broke, the server closed it) is an environment fault, as are ``PoolTimeout`` and
    :class:`StatementTimeout`. Anything else is a handler fault.
    """
    if isinstance(exc, (PoolTimeout, StatementTimeout)):
        return FaultKind.ENVIRONMENT
    if isinstance(exc, psycopg.Error):
        sqlstate = exc.sqlstate or ""
        if sqlstate in _CONTENTION:
            return FaultKind.CONTENTION
        if sqlstate in _ENVIRONMENT or sqlstate.startswith(_ENVIRONMENT_CLASSES):
            return FaultKind.ENVIRONMENT
        if sqlstate in _LOST_STATEMENT and _OWN_STATEMENT.search(str(exc)):
            return FaultKind.ENVIRONMENT
        if sqlstate.startswith("22") or sqlstate in _DETERMINISTIC or isinstance(exc, psycopg.DataError):
            return FaultKind.MESSAGE  # psycopg raises DataError itself for a value it cannot send (NUL)
        if isinstance(exc, pg_errors.InFailedSqlTransaction):
            return FaultKind.HANDLER  # the handler swallowed an error and carried on
        if not sqlstate and isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
            return FaultKind.ENVIRONMENT  # connection lost: no server reply to classify
    return FaultKind.HANDLER
