"""engine.errors: the root cause of a wrapped error survives to the user, without colour codes."""

from engine.errors import describe_error, root_cause, strip_ansi

# What Ray 2.x puts in an ActorDiedError when an actor's __init__ raises (captured verbatim,
# pid and ids shortened): colour codes around the actor name, the traceback, the cause last.
RAY_CREATION_ERROR = (
    "The actor died because of an error raised in its creation task, \x1b[36mray::PrefillWorker"
    ".__init__()\x1b[39m (pid=8742, ip=192.0.2.2, actor_id=7e67, repr=<PrefillWorker>)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/repo/kv_transfer/torchdist.py", line 7, in __init__\n'
    "    dist.init_process_group(backend, init_method=init_method)\n"
    "                          ^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    "OSError: [Errno 98] Address already in use")


class ActorDiedError(RuntimeError):
    pass


def test_strip_ansi_removes_colour_codes_only():
    assert strip_ansi("\x1b[36mray::A\x1b[39m ok \x1b[1;31mred\x1b[0m") == "ray::A ok red"


def test_ray_creation_error_keeps_the_exception_line_of_its_traceback():
    err = ActorDiedError(RAY_CREATION_ERROR)
    assert root_cause(err) == "OSError: [Errno 98] Address already in use"
    text = describe_error(err)
    assert "\x1b" not in text and "\n" not in text
    assert text.startswith("The actor died because of an error raised in its creation task, "
                           "ray::PrefillWorker.__init__()")
    assert text.endswith("(cause: OSError: [Errno 98] Address already in use)")


def test_chained_errors_name_the_innermost_cause():
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as inner:
            raise RuntimeError("prefill worker prefill-0 failed to start") from inner
    except RuntimeError as err:
        assert root_cause(err) == "ConnectionRefusedError: [Errno 111] Connection refused"
        assert describe_error(err) == ("prefill worker prefill-0 failed to start (cause: "
                                       "ConnectionRefusedError: [Errno 111] Connection refused)")


def test_a_message_that_already_has_its_cause_is_not_repeated():
    err = ValueError("max_num_seqs must be >= 1, got 0")
    assert root_cause(err) == "ValueError: max_num_seqs must be >= 1, got 0"
    assert describe_error(err) == "max_num_seqs must be >= 1, got 0"
    wrapped = RuntimeError(f"worker d0 failed to start: {describe_error(ActorDiedError(RAY_CREATION_ERROR))}")
    assert describe_error(wrapped).count("Address already in use") == 1


def test_torchdist_rendezvous_port_in_use_keeps_eaddrinuse():
    """The reported case: a rank-0 worker whose rendezvous port was taken (message of torch
    2.x's DistNetworkError inside Ray's ActorDiedError)."""
    message = ("The actor died because of an error raised in its creation task, \x1b[36mray::"
               "PrefillWorker.__init__()\x1b[39m (pid=1, ip=10.0.0.1)\n"
               '  File "/repo/kv_transfer/torchdist.py", line 81, in __init__\n'
               "    dist.init_process_group(backend, init_method=init_method, rank=rank,\n"
               "torch.distributed.DistNetworkError: The server socket has failed to listen on "
               "any local network address. port: 47599, useIpv6: false, code: -98, name: "
               "EADDRINUSE, message: address already in use")
    text = describe_error(ActorDiedError(message))
    assert "(cause: torch.distributed.DistNetworkError: " in text
    assert "port: 47599" in text and "EADDRINUSE" in text and "\x1b" not in text
