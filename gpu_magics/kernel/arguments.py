"""The magics' option types (the same parsers and ranges as the hub's form, API and CLI), and
:func:`parse_line`, how every magic reads its line: split as a shell would (``--dir 'my
runs'`` is the directory ``my runs``, without its quotes), a line that cannot be split (an
unbalanced quote) a :class:`UsageError` saying so, with the magic's usage."""

from __future__ import annotations

import shlex

from IPython.core.error import UsageError

from spawner.policy import values
from spawner.policy.limits import MAX_COUNT

MAX_TIMEOUT_SECONDS = 7 * 86400.0


def COUNT(option: str):
    """``type=`` for a count option of 1 or more: ``--gpus``, ``--nodes``, ``--workers``."""
    return values.argparse_type(values.parse_count, option, lo=1, hi=MAX_COUNT)


def SECONDS(option: str, lo: float = 0.1, hi: float = MAX_TIMEOUT_SECONDS):
    return values.argparse_type(values.parse_seconds, option, lo=lo, hi=hi)


def split_line(line: str, usage: str) -> list[str]:
    """``line`` as a shell splits it (quotes removed); an unbalanced quote is a UsageError."""
    try:
        return shlex.split(line)
    except ValueError as e:  # "No closing quotation", "No escaped character"
        quote = next((q for q in "'\"" if line.count(q) % 2), None)
        what = f"a {quote} quote that is not closed" if quote else f"it cannot be split ({e})"
        raise UsageError(
            f"this line has {what}: close it, or leave the quote out "
            f"(quote a value with spaces as 'my runs')\n{usage}"
        ) from None


def parse_line(magic, line: str, usage: str):
    """The arguments of ``magic`` (a method decorated with ``magic_arguments``) in ``line``;
    a UsageError, with ``usage``, for a line it cannot read."""
    try:
        return magic.parser.parse_args(split_line(line, usage))
    except UsageError as e:
        if str(e).endswith(usage):
            raise
        raise UsageError(f"{e}\n{usage}") from None
