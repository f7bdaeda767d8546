"""A local AMQP 1.0 server imitating the part of Azure Service Bus the azure-servicebus SDK uses.

See README.md beside this file for what is imitated and what is not.
"""

from .entities import Namespace, Topic
from .messages import MessageSnapshot, MessageState
from .queues import Queue
from .rules import CorrelationFilter, FalseFilter, Rule, SqlFilter, TrueFilter
from .send_target import EntityOptions
from .server import ServiceBusTestServer

__all__ = [
    "CorrelationFilter",
    "FalseFilter",
    "Rule",
    "SqlFilter",
    "TrueFilter",
    "EntityOptions",
    "MessageSnapshot",
    "MessageState",
    "Namespace",
    "Queue",
    "ServiceBusTestServer",
    "Topic",
]
