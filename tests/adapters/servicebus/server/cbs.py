"""The ``$cbs`` node: claims-based security, where the SDK puts a token before it opens any entity link.

Service Bus checks the SAS or JWT token against the audience (``sb://host/entity``). This server
accepts every token: it answers ``put-token`` with ``status-code: 202`` and the request's message
id as correlation id, which is all the SDK waits for. The request has no ``reply_to``: the answer
goes on the link in the same AMQP session whose source is ``$cbs``.
"""

from __future__ import annotations

import logging

from proton import Message

CBS_ADDRESS = "$cbs"
PUT_TOKEN = "put-token"

_LOGGER = logging.getLogger(__name__)


def answer_put_token(request: Message) -> Message:
    """The reply to one ``$cbs`` request: 202 for ``put-token``, 400 for anything else."""
    properties = request.properties or {}
    operation = properties.get("operation")
    if operation != PUT_TOKEN:
        _LOGGER.info("$cbs: unsupported operation %s", operation)
        return _reply(request, 400, f"unsupported $cbs operation {operation!r}")
    _LOGGER.debug("$cbs: token accepted for audience %s", properties.get("name"))
    return _reply(request, 202, "Accepted")


def _reply(request: Message, status_code: int, description: str) -> Message:
    return Message(
        correlation_id=request.id,
        properties={"status-code": status_code, "status-description": description},
    )
