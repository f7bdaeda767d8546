"""Topics and the namespace that finds every entity by path.

A topic copies each message into every subscription whose rules match it (``rules.py``: SQL and
correlation filters, ``$Default`` on a new subscription); the namespace looks entities up case-insensitively, as Service Bus does. Queues, subscriptions and
dead-letter queues are ``queues.Queue``; the producer side of queues and topics is
``send_target.SendTarget``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator

from . import wire
from .errors import EntityNotFound, NotAllowed
from .messages import StoredMessage
from .queues import Queue
from .rules import Rule, any_rule_matches, rules_from
from .send_target import EntityOptions, SendTarget


class Topic(SendTarget):
    """A topic: a message is copied into each subscription with a rule that matches it."""

    def __init__(self, path: str, options: EntityOptions, lock: threading.RLock) -> None:
        super().__init__(path, options, lock)
        self.subscriptions: dict[str, Queue] = {}
        self.rules: dict[str, dict[str, Rule]] = {}  # by subscription name (casefolded), then rule name

    def _accept(self, stored: StoredMessage) -> None:
        # A topic's default TTL bounds what its subscriptions keep ("Message expiration": the
        # entity's default is the default and the ceiling); each subscription's own applies too.
        default = self.options.default_message_time_to_live
        if default is not None:
            stored.time_to_live = min(stored.time_to_live, default)
        for key, subscription in self.subscriptions.items():
            if any_rule_matches(self.rules.get(key, {}), stored.content):
                subscription.enqueue_copy(stored)

    def set_rules(self, subscription: str, rules: Iterable[Rule] | None) -> None:
        """Replace a subscription's rules (None: only ``$Default``, the true filter; an empty list:
        it takes nothing). Raises EntityNotFound, or ValueError for rules Service Bus would refuse."""
        with self._lock:
            key = subscription.casefold()
            if key not in self.subscriptions:
                raise EntityNotFound(f"no subscription {subscription} on {self.path}")
            self.rules[key] = rules_from(rules)

    def add_rule(self, subscription: str, rule: Rule) -> None:
        """Add one rule (Service Bus refuses a name the subscription already has: ValueError)."""
        with self._lock:
            self.set_rules(subscription, [*self.rules_of(subscription).values(), rule])

    def remove_rule(self, subscription: str, name: str) -> None:
        """Remove the rule ``name`` (``$Default`` too); raises EntityNotFound when there is none."""
        with self._lock:
            rules = self.rules_of(subscription)
            kept = [r for r in rules.values() if r.name.casefold() != name.casefold()]
            if len(kept) == len(rules):
                raise EntityNotFound(f"no rule {name} on {self.path}/Subscriptions/{subscription}")
            self.set_rules(subscription, kept)

    def rules_of(self, subscription: str) -> dict[str, Rule]:
        with self._lock:
            return dict(self.rules.get(subscription.casefold(), {}))

    def expire(self, now: float) -> list[tuple[object, str]]:
        self.release_due(now)
        lost: list[tuple[object, str]] = []
        for subscription in self.subscriptions.values():
            lost.extend(subscription.expire(now))
        return lost


class Namespace:
    """All entities of one server, looked up by path the way Service Bus does (case-insensitively).

    Paths: ``q``, ``q/$DeadLetterQueue``, ``t``, ``t/Subscriptions/s``, ``t/Subscriptions/s/$DeadLetterQueue``.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.clock_skew = 0.0  # seconds the broker's clock is ahead of the host's (negative: behind)
        self._queues: dict[str, Queue] = {}
        self._topics: dict[str, Topic] = {}

    def create_queue(self, name: str, options: EntityOptions) -> Queue:
        with self.lock:
            queue = Queue(name, options, self.lock, clock=self.now)
            self._queues[name.casefold()] = queue
            return queue

    def create_topic(self, name: str, options: EntityOptions) -> Topic:
        with self.lock:
            topic = Topic(name, options, self.lock)
            self._topics[name.casefold()] = topic
            return topic

    def create_subscription(
        self, topic_name: str, name: str, options: EntityOptions, rules: Iterable[Rule] | None = None
    ) -> Queue:
        """A subscription with ``rules`` (None: ``$Default``, every message)."""
        with self.lock:
            topic = self._topics.get(topic_name.casefold())
            if topic is None:
                raise EntityNotFound(f"no topic {topic_name}")
            path = f"{topic.path}{wire.SUBSCRIPTIONS_INFIX}{name}"
            # A subscription holds its topic's messages, numbered (and partitioned) by the topic.
            options = dataclasses.replace(options, enable_partitioning=topic.options.enable_partitioning)
            subscription = Queue(path, options, self.lock, kind=Queue.SUBSCRIPTION, clock=self.now)
            topic.subscriptions[name.casefold()] = subscription
            topic.set_rules(name, rules)
            return subscription

    def now(self) -> float:
        """The broker's clock: epoch seconds, ``clock_skew`` off the host's."""
        return time.time() + self.clock_skew

    def entity(self, path: str) -> Queue | Topic:
        """The queue, topic, subscription or dead-letter queue at ``path``; raises EntityNotFound."""
        with self.lock:
            dead_letter = path.casefold().endswith(wire.DEAD_LETTER_SUFFIX.casefold())
            base = path[: -len(wire.DEAD_LETTER_SUFFIX)] if dead_letter else path
            parts = base.split("/")
            found: Queue | Topic | None
            if len(parts) == 1:
                found = self._queues.get(base.casefold()) or self._topics.get(base.casefold())
            elif len(parts) == 3 and parts[1].casefold() == "subscriptions":
                topic = self._topics.get(parts[0].casefold())
                found = topic.subscriptions.get(parts[2].casefold()) if topic else None
            else:
                found = None
            if dead_letter:
                found = found.dead_letter_queue if isinstance(found, Queue) else None
            if found is None:
                raise EntityNotFound(f"The messaging entity '{path}' could not be found.")
            return found

    def receive_source(self, path: str) -> Queue:
        entity = self.entity(path)
        if not isinstance(entity, Queue):
            raise NotAllowed(f"cannot receive from topic {path}: receive from one of its subscriptions")
        return entity

    def send_target(self, path: str) -> SendTarget:
        entity = self.entity(path)
        if isinstance(entity, Queue) and entity.kind != Queue.QUEUE:
            raise NotAllowed(f"cannot send to the {entity.kind} {path}")
        return entity

    def entities(self) -> Iterator[Queue | Topic]:
        yield from self._queues.values()
        yield from self._topics.values()

    def expire(self, now: float) -> list[tuple[object, str]]:
        """Advance time for every entity; returns the (owner, session id) pairs that lost their session lock."""
        with self.lock:
            lost: list[tuple[object, str]] = []
            for entity in self.entities():
                lost.extend(entity.expire(now))
            return lost
