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


def _stage_out_of_memory() -> BaseException:
    """What torch's pipeline schedule raises when a stage's forward runs out of CPU memory."""
    try:
        try:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:124] data. DefaultCPUAllocator: can't allocate memory:"
                               " you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)")
        except RuntimeError as cause:
            raise RuntimeError("[Stage 0] failed to run forward:\nargs: ('Tensor(torch.Size([2, 64]))',)") from cause
    except RuntimeError as error:
        return error


class _Bus:
    def __init__(self) -> None:
        self.events: list = []

    def emit(self, event) -> None:
        self.events.append(event)


def test_an_out_of_memory_error_a_stage_wrapped_is_an_out_of_memory_event_with_the_allocators_message():
    from lightning_nd.strategy.lifecycle import out_of_memory

    bus = _Bus()
    out_of_memory(bus, 3, _stage_out_of_memory(), None)  # type: ignore[arg-type]
    [event] = bus.events
    assert (event.rank, type(event).__name__) == (3, "OutOfMemory")
    assert event.message.startswith("[enforce fail at alloc_cpu.cpp:124] data. DefaultCPUAllocator: can't allocate")
    out_of_memory(bus, 3, _wrapped(), None)  # type: ignore[arg-type]
    assert len(bus.events) == 1  # a broken connection is not one


def test_a_relayed_stage_failure_says_it_ran_out_of_memory():
    from lightning_nd.runtime.errors import says_out_of_memory

    summary, text = _describe(_stage_out_of_memory())
    assert summary.startswith("RuntimeError: [Stage 0] failed to run forward: (from RuntimeError: [enforce fail")
    assert says_out_of_memory(summary) and not any(words in text.lower() for words in COMMUNICATION_ERRORS)
    assert not says_out_of_memory(_describe(_wrapped())[0])
