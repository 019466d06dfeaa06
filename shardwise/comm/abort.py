"""A backend's abort as the run's own report: a last word before `std::terminate` ends the process.

gloo checks the size of every message it receives, and a rank whose collective does not match its peer's (an
extra collective on one rank) fails that check on gloo's own I/O thread, where the C++ exception has nowhere to go:
`std::terminate` aborts the process with the backend's text ("terminate called after throwing an instance of
'gloo::EnforceNotMet' ... Is there a distributed collective mismatch in your code?"), never reaching Python. NCCL's
watchdog ends a process the same way. So the process's terminate handler is ours (`on_terminate`): it runs the
callbacks (the hang watchdog's: post this rank's report and let the peers name the desync), then hands over to the
handler it replaced, which prints the backend's text and aborts, unless a callback ended the process first.

Linux with libstdc++ only (torch's own builds); elsewhere `on_terminate` does nothing and says so.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any, Callable

_HANDLER = ctypes.CFUNCTYPE(None)
_callbacks: list[Callable[[str | None], None]] = []
_installed: dict[str, Any] = {}
_lock = threading.Lock()


def _set_terminate() -> Any | None:
    """libstdc++'s `std::set_terminate`, or None where it cannot be found."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL("libstdc++.so.6")._ZSt13set_terminatePFvvE
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p]
    return fn


def on_terminate(callback: Callable[[str | None], None]) -> bool:
    """Run `callback(exception type)` (on whichever thread terminates, with the GIL) before the process aborts;
    the type is the C++ exception's mangled name ("N4gloo14EnforceNotMetE"), None without one. Returns whether
    the handler is in place. Callbacks must not raise (what they raise is printed and ignored) and should be quick:
    the process is going down."""
    with _lock:
        _callbacks.append(callback)
        if "handler" in _installed:
            return True
        set_terminate = _set_terminate()
        if set_terminate is None:
            return False
        handler = _HANDLER(_run_callbacks)
        _installed["handler"] = handler        # referenced for the life of the process
        _installed["previous"] = set_terminate(ctypes.cast(handler, ctypes.c_void_p))
        return True


def current_exception_type() -> str | None:
    """The mangled type name of the C++ exception being handled (inside the terminate handler), or None.

    `__cxa_current_exception_type` (the Itanium C++ ABI, libstdc++'s and libc++'s) returns its `std::type_info`,
    whose layout is a vtable pointer followed by the `const char*` name."""
    try:
        fn = ctypes.CDLL("libstdc++.so.6").__cxa_current_exception_type
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    info = fn()
    if not info:
        return None
    name = ctypes.c_char_p.from_address(info + ctypes.sizeof(ctypes.c_void_p)).value
    return name.decode(errors="replace").lstrip("*") if name else None


def is_gloo_check(exception_type: str | None) -> bool:
    """Whether the exception is gloo's failed check (`gloo::EnforceNotMet`: a message of another size than the
    receive posted for it, among others)."""
    return exception_type is not None and "gloo" in exception_type and "EnforceNotMet" in exception_type


def _run_callbacks() -> None:
    reason = current_exception_type()
    for callback in list(_callbacks):
        try:
            callback(reason)
        except BaseException as e:   # noqa: BLE001 - the process aborts next; say why the report is missing
            print(f"shardwise: while aborting: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    previous = _installed.get("previous")
    if previous:
        _HANDLER(previous)()         # the replaced handler: the backend's text, then abort()
    import os
    os.abort()
