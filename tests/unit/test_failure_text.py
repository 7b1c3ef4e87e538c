"""What a failing rank says about its own error (`strategy/failure_monitor.py`): the whole exception chain is read,
so a wrapper with an empty first line (the pipeline schedule re-raises a peer's broken connection as a bare
``RuntimeError``) neither hides the cause nor turns a waiting rank into a culprit."""

from __future__ import annotations

from lightning_nd.strategy.failure_monitor import COMMUNICATION_ERRORS, _describe


def _wrapped() -> BaseException:
    try:
        try:
            raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:30337: Connection reset by peer.")
        except RuntimeError as cause:
            raise RuntimeError("\n        Failed to run stage backward:\n        Stage output: ...") from cause
    except RuntimeError as error:
        return error


def test_a_wrapped_broken_connection_is_a_communication_error_with_a_readable_summary():
    summary, text = _describe(_wrapped())
    assert summary == "RuntimeError: Failed to run stage backward:"
    assert "connection reset" in text.lower() and any(words in text.lower() for words in COMMUNICATION_ERRORS)


def test_an_own_error_is_not_a_communication_error():
    summary, text = _describe(ValueError("labels out of range: 300 >= vocab 256"))
    assert summary == "ValueError: labels out of range: 300 >= vocab 256"
    assert not any(words in text.lower() for words in COMMUNICATION_ERRORS)
    assert _describe(RuntimeError(""))[0] == "RuntimeError"
