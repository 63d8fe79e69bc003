"""Error text for users and records: the root cause kept, terminal colour codes dropped (no torch).

A failure often arrives wrapped (a worker's ``OSError`` inside Ray's ``ActorDiedError`` inside the
router's "failed to start"): the outer line says that it failed, the innermost why.
``describe_error`` keeps both, on one line."""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# the last line of a Python traceback: "OSError: [Errno 98] ..." or "torch.distributed.X: ..."
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failed|Died|"
                             r"Timeout|Mismatch)): ?(.*)$")


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (Ray colours its actor names)."""
    return _ANSI.sub("", text)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _traceback_cause(text: str) -> str | None:
    """The last ``Type: message`` line of a traceback embedded in ``text``, if any."""
    for line in reversed(text.splitlines()):
        if line.strip() and not line.startswith((" ", "\t")) and _EXCEPTION_LINE.match(line):
            return line.strip()
    return None


def root_cause(err: BaseException) -> str:
    """``Type: message`` of the innermost cause of ``err``: the end of its ``__cause__`` /
    ``__context__`` chain, or the last exception line of a traceback carried in its message
    (a Ray task or actor error), without colour codes."""
    inner, seen = err, {id(err)}
    while True:
        nxt = inner.__cause__ or inner.__context__
        if nxt is None or id(nxt) in seen:
            break
        inner, seen = nxt, seen | {id(nxt)}
    text = strip_ansi(str(inner))
    embedded = _traceback_cause(text)
    if embedded is not None:
        return embedded
    return f"{type(inner).__name__}: {_first_line(text)}".rstrip(": ")


def describe_error(err: BaseException) -> str:
    """One line for a user or a record: the error's own first line, then its root cause when
    that adds something (``... failed to start: ActorDiedError: ... (cause: OSError: [Errno 98]
    Address already in use)``)."""
    own = _first_line(strip_ansi(str(err))) or type(err).__name__
    cause = root_cause(err)
    if cause in own or cause.split(": ", 1)[-1] in own:
        return own
    return f"{own} (cause: {cause})"


def without_traceback(err: BaseException) -> BaseException:
    """``err`` with its traceback dropped (returned, to chain as a cause).

    ``ray.get``'s error is held by its own frame (a reference cycle), and that frame keeps its
    callers' locals, ObjectRefs among them, alive until the cycle collector runs: KV objects
    stayed held long after their request ended."""
    err.__traceback__ = None
    return err
