"""Where the Service Bus namespace is, how to sign in to it, and the adapter's own settings.

Two ways to name a namespace (``CONSUMER_KIT_BROKER_URL`` plus, for keys, one more variable):

=============================================================  ====================================
broker URL (scheme ``servicebus`` or ``sb``)                   sign-in
=============================================================  ====================================
``servicebus://`` and ``CONSUMER_KIT_SERVICEBUS_CONNECTION_    the connection string's shared access
STRING=Endpoint=sb://<ns>.servicebus.windows.net/;Shared...``  key (or the emulator's:
                                                               ``...;UseDevelopmentEmulator=true``)
``servicebus://<ns>.servicebus.windows.net``                   Microsoft Entra ID through
                                                               azure-identity's
                                                               ``DefaultAzureCredential`` (install
                                                               ``azure-identity``)
=============================================================  ====================================

A key never goes in the URL (URLs end up in logs and process lists): a URL with a user or a
password is refused. The connection string is a ``SecretStr`` and only its endpoint and key name
are ever logged (:attr:`Namespace.description`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from consumer_kit.errors import ConfigurationError
from consumer_kit.settings import BrokerSettings
from consumer_kit.settings.servicebus import ServiceBusSettings  # the settings tree's servicebus group

__all__ = ["SCHEMES", "Namespace", "ServiceBusConfig", "ServiceBusSettings", "connection_string_fields"]

SCHEMES = ("servicebus", "sb")
"""Broker URL schemes this adapter is registered for (``consumer_kit.brokers`` entry points)."""


@dataclass(frozen=True)
class Namespace:
    """How to reach one Service Bus namespace. ``repr`` and :attr:`description` never show a key.

    Attributes:
        fully_qualified_namespace: ``<ns>.servicebus.windows.net`` (``host:port`` for the emulator).
        connection_string: the shared access key connection string, or ``None`` for Microsoft
            Entra ID sign-in.
        description: what logs may say about it, e.g. ``"sb://ns.servicebus.windows.net (shared
            access key RootManageSharedAccessKey)"``.
    """

    fully_qualified_namespace: str
    connection_string: str | None = field(default=None, repr=False)
    description: str = ""

    @classmethod
    def from_settings(cls, broker_url: str, settings: ServiceBusSettings) -> Namespace:
        """The namespace that ``broker_url`` and ``settings.connection_string`` name together.

        Raises:
            ConfigurationError: another scheme, a key in the URL, neither a host nor a connection
                string, a connection string without ``Endpoint``, or a URL host that is not the
                connection string's namespace.
        """
        parts = urlsplit(broker_url)
        if parts.scheme not in SCHEMES:
            raise ConfigurationError(f"not a Service Bus URL (scheme {parts.scheme!r}); use servicebus://")
        if parts.username or parts.password:
            raise ConfigurationError(
                "a Service Bus broker URL must not carry credentials: set "
                "CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING instead"
            )
        host = parts.netloc
        secret = settings.connection_string
        if secret is not None and secret.get_secret_value().strip():
            return cls.from_connection_string(secret.get_secret_value(), expected_host=host or None)
        if not host:
            raise ConfigurationError(
                "servicebus:// needs a namespace: set CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING, or "
                "name it in the URL (servicebus://<namespace>.servicebus.windows.net) to sign in with "
                "Microsoft Entra ID"
            )
        return cls(host, None, f"sb://{host} (Microsoft Entra ID)")

    @classmethod
    def from_connection_string(cls, connection_string: str, *, expected_host: str | None = None) -> Namespace:
        """Parse ``Endpoint=sb://host[:port]/;SharedAccessKeyName=...;SharedAccessKey=...``.

        Raises:
            ConfigurationError: no ``Endpoint``, or its host is not ``expected_host``.
        """
        fields = connection_string_fields(connection_string)
        endpoint = fields.get("endpoint", "")
        host = urlsplit(endpoint).netloc if "://" in endpoint else endpoint.strip("/")
        if not host:
            raise ConfigurationError("the Service Bus connection string has no Endpoint=sb://<namespace>")
        if expected_host and expected_host.lower() != host.lower():
            raise ConfigurationError(
                f"the broker URL names namespace {expected_host!r} but the connection string "
                f"names {host!r}"
            )
        key_name = fields.get("sharedaccesskeyname", "")
        emulator = fields.get("usedevelopmentemulator", "").lower() == "true"
        how = f"shared access key {key_name}" if key_name else "shared access signature"
        return cls(host, connection_string, f"sb://{host} ({how}{', emulator' if emulator else ''})")


@dataclass(frozen=True)
class ServiceBusConfig:
    """What the adapter takes from consumer-kit's settings and its own.

    Attributes:
        namespace: the namespace the broker URL and ``CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING``
            name together.
        adapter: the ``CONSUMER_KIT_SERVICEBUS_*`` settings.
    """

    namespace: Namespace
    adapter: ServiceBusSettings

    @classmethod
    def from_settings(cls, settings: BrokerSettings) -> ServiceBusConfig:
        """Read ``settings.broker_url`` and the ``CONSUMER_KIT_SERVICEBUS_*`` environment.

        Raises:
            ConfigurationError: the URL and the connection string do not name a namespace.
        """
        adapter = ServiceBusSettings()
        return cls(Namespace.from_settings(settings.broker_url, adapter), adapter)


def connection_string_fields(connection_string: str) -> dict[str, str]:
    """``{lower-cased name: value}`` of a ``Name=value;Name=value`` connection string."""
    fields: dict[str, str] = {}
    for part in connection_string.split(";"):
        name, separator, value = part.partition("=")
        if separator and name.strip():
            fields[name.strip().lower()] = value.strip()
    return fields
