"""Config warnings on the command line: one ``shardwise: warning: ...`` line each on stderr.

`shardwise.config` reports what it accepts but ignores as `ConfigWarning`s (Python's `warnings`); Python's own
format spreads each over two lines with a source line, so the commands print them in their own format.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Iterator

from shardwise.config import ConfigWarning


@contextlib.contextmanager
def printed_config_warnings() -> Iterator[None]:
    """Print each `ConfigWarning` raised inside as one line on stderr (after the block, and only if it ends
    without an error: a refused config's errors say what matters); other warnings go on as usual."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        yield
    for warning in caught:
        if issubclass(warning.category, ConfigWarning):
            print(f"shardwise: warning: {warning.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
