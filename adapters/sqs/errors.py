"""What an SQS failure means: error codes, one-line descriptions, PublishError kinds.

SQS names an error twice: the JSON protocol's code and the older query code
(``AWS.SimpleQueueService.NonExistentQueue`` / ``QueueDoesNotExist``); both are read.

Classification of a failed publish (``consumer_kit.broker.publishing.PublishError``):

=============================================================  ==========  =========================
cause                                                          kind        why
=============================================================  ==========  =========================
larger than the queue's ``MaximumMessageSize`` (checked        permanent   the same bytes fail the
before sending), a body that is not UTF-8 text, SQS's                      same way every time
``InvalidParameterValue``/``InvalidMessageContents``/
``InvalidAttributeName``/``UnsupportedOperation``, access or
KMS key refused, any per-entry failure with ``SenderFault``
no such queue (``NonExistentQueue``)                           row         it may be created later
throttling, SQS's own fault (``SenderFault: false``), no       transient   SQS or the network is at
reply, a batch the endpoint found too long                                 fault; retry soon
=============================================================  ==========  =========================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from consumer_kit.errors import PublishError

_PREFIX = "AWS.SimpleQueueService."

NON_EXISTENT_QUEUE = frozenset({"NonExistentQueue", "QueueDoesNotExist"})
STALE_RECEIPT = frozenset({"ReceiptHandleIsInvalid", "MessageNotInflight", "InvalidReceiptHandle"})
"""The receipt handle no longer names a held message: its visibility lapsed (another receive took
it over), it was deleted, or it is not one of ours. Retrying cannot help."""
THROTTLED = frozenset(
    {"RequestThrottled", "ThrottlingException", "Throttling", "KmsThrottled", "KMS.ThrottlingException"}
)
BATCH_TOO_LONG = frozenset({"BatchRequestTooLong"})
_PERMANENT_SEND = frozenset(
    {
        "InvalidParameterValue", "InvalidMessageContents", "InvalidAttributeName",
        "InvalidAttributeValue", "UnsupportedOperation", "AccessDenied", "AccessDeniedException",
        "InvalidSecurity", "KmsAccessDenied", "KmsDisabled", "KmsInvalidKeyUsage", "KmsInvalidState",
        "KmsNotFound", "KmsOptInRequired", "MessageTooLong",
    }
)


def codes_of(exc: BaseException) -> frozenset[str]:
    """The error codes of a ``ClientError`` (without the ``AWS.SimpleQueueService.`` prefix);
    empty for anything else."""
    if not isinstance(exc, ClientError):
        return frozenset()
    error = exc.response.get("Error", {})
    return frozenset(_bare(c) for c in (error.get("Code"), error.get("QueryErrorCode")) if c)


def entry_code(failed: Mapping[str, Any]) -> str:
    """The code of one ``Failed`` entry of a batch reply."""
    return _bare(str(failed.get("Code", "")))


def is_code(exc: BaseException, codes: frozenset[str]) -> bool:
    return bool(codes_of(exc) & codes)


def is_stale_receipt(code: str, message: str) -> bool:
    """True when SQS refused a receipt handle as no longer valid: :data:`STALE_RECEIPT`, or
    ``InvalidParameterValue`` saying the receipt handle expired."""
    return code in STALE_RECEIPT or (code == "InvalidParameterValue" and "receipt handle" in message.lower())


def is_stale(exc: BaseException) -> bool:
    """:func:`is_stale_receipt` for a ``ClientError``."""
    if not isinstance(exc, ClientError):
        return False
    message = str(exc.response.get("Error", {}).get("Message", ""))
    return any(is_stale_receipt(code, message) for code in codes_of(exc))


def describe(exc: BaseException | None) -> str:
    """``"Code: message"`` of an SQS error, ``"ErrorClass: first line"`` otherwise (one line)."""
    if exc is None:
        return "unknown error"
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        return f"{_bare(str(error.get('Code', 'ClientError')))}: {str(error.get('Message', ''))[:200]}"
    if isinstance(exc, NoCredentialsError):  # nothing was sent: say where credentials come from
        return (
            "NoCredentialsError: the AWS credential chain found none (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, a role); a local server such as moto or "
            "ElasticMQ accepts any values"
        )
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def is_unreachable(exc: BaseException) -> bool:
    """True when SQS gave no answer (connection refused or lost, timeout, endpoint unknown)."""
    return isinstance(exc, (BotoCoreError, OSError, TimeoutError)) and not isinstance(exc, ClientError)


def publish_error(exc: BaseException, message_id: str, queue: str) -> PublishError:
    """The :class:`PublishError` for ``exc``, raised sending ``message_id`` to ``queue`` (table in
    the module docstring)."""
    if isinstance(exc, PublishError):
        return exc
    codes = codes_of(exc)
    if codes & NON_EXISTENT_QUEUE:
        return PublishError(f"no SQS queue {queue!r} for message_id={message_id}", transient=False)
    if codes & _PERMANENT_SEND:
        return PublishError(
            f"SQS refused message_id={message_id} to {queue!r}: {describe(exc)}", permanent=True
        )
    return PublishError(f"publish of message_id={message_id} to {queue!r} not confirmed: {describe(exc)}")


def entry_publish_error(failed: Mapping[str, Any], message_id: str, queue: str) -> PublishError:
    """The :class:`PublishError` for one ``Failed`` entry of a ``SendMessageBatch`` reply:
    ``SenderFault`` means this message as sent (permanent), otherwise SQS's own fault
    (transient)."""
    code = entry_code(failed)
    text = f"{code}: {str(failed.get('Message', ''))[:200]}"
    if code in NON_EXISTENT_QUEUE:
        return PublishError(f"no SQS queue {queue!r} for message_id={message_id}", transient=False)
    if code in THROTTLED or not failed.get("SenderFault", False):
        return PublishError(f"SQS did not take message_id={message_id} to {queue!r}: {text}")
    return PublishError(f"SQS refused message_id={message_id} to {queue!r}: {text}", permanent=True)


def _bare(code: str) -> str:
    return code[len(_PREFIX):] if code.startswith(_PREFIX) else code
