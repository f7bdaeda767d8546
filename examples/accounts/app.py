"""Credit limits: ordering, versions and retention (the issue-14 example).

``SetCreditLimit`` carries the account's *desired* limit as of a version, not a change ("raise it
by 100"): applied with :func:`consumer_kit.apply_if_newer`, a late or repeated older event leaves the
newer limit alone. Messages of one account run one at a time in delivery order (its lane is the
account id), different accounts in parallel. Each operation's identity is kept 90 days and its
result body 7 days (``consumer-kit prune``); a message older than 90 days whose operation is gone
is refused as ``key_expired``.

Queue ``accounts.commands``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from psycopg import AsyncConnection
from pydantic import BaseModel, Field

from consumer_kit import App, Context, Envelope, Handler, Result, apply_if_newer

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS credit_limits (
    account_id  text PRIMARY KEY,
    limit_cents bigint NOT NULL,
    version     bigint NOT NULL
);
"""


class SetCreditLimit(BaseModel):
    account_id: str = Field(min_length=1, max_length=100)
    limit_cents: int = Field(ge=0)
    version: int = Field(ge=1)


class CreditLimitHandler(Handler[SetCreditLimit]):
    operation_type = "account.set_limit"
    key_retention = dt.timedelta(days=90)
    result_retention = dt.timedelta(days=7)

    def operation_key(self, message: SetCreditLimit, envelope: Envelope) -> str:
        return f"{message.account_id}-v{message.version}"

    def partition_key(self, message: SetCreditLimit, envelope: Envelope) -> str:
        return message.account_id  # one account's changes one at a time, in delivery order

    async def handle(self, message: SetCreditLimit, ctx: Context) -> Result:
        applied = await apply_if_newer(
            ctx.connection, "credit_limits", {"account_id": message.account_id},
            version=message.version, values={"limit_cents": message.limit_cents},
        )
        return Result("applied" if applied else "stale_ignored", reference=str(message.version))


async def create_tables(conn: AsyncConnection[Any]) -> None:
    await conn.execute(SCHEMA_SQL)


app = App("accounts")
app.subscribe("accounts.commands", CreditLimitHandler())
app.on_startup(create_tables)
