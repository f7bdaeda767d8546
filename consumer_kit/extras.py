"""The pip extras of consumer-kit's optional parts, and the error that names one.

An adapter package declares its extra in the first lines of its ``__init__``, before it imports
its SDK::

    try:
        import boto3  # noqa: F401 - the SDK of the sqs extra
    except ImportError as missing:
        raise MissingExtra("sqs", missing) from missing

so that :func:`consumer_kit.brokers.adapter_for` can say which extra to install without a table
of its own (the core never imports an adapter by name, nor any SDK).
"""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The commands that install ``extra``: ``pip install 'consumer-kit[sqs]' (from a clone: pip
    install -e '.[sqs]')``. consumer-kit is not on PyPI: the first adds the extra's packages to the
    consumer-kit already installed (pip keeps that one), the second installs from a clone's root."""
    return f"pip install 'consumer-kit[{extra}]' (from a clone: pip install -e '.[{extra}]')"


class MissingExtra(ImportError):
    """An optional part's SDK is not installed.

    Args:
        extra: the pip extra that brings it (a ``[project.optional-dependencies]`` key).
        missing: the ImportError of the SDK.

    Attributes:
        extra, missing: as given; ``hint``: :func:`install_hint` of ``extra``.
    """

    def __init__(self, extra: str, missing: ImportError) -> None:
        super().__init__(f"{missing} ({install_hint(extra)})", name=missing.name, path=missing.path)
        self.extra, self.missing = extra, missing
        self.hint = install_hint(extra)
