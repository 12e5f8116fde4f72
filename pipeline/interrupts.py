"""Ctrl-C (SIGINT) and SIGTERM for `python -m pipeline.run`: the signal is raised in the main thread, never lost,
and the process then leaves at once with 128 + the signal.

Why it is more than `signal.signal(SIGINT, raise)`:
- Before the job's modules are imported (Beam, JAX, torch through Beam: seconds), `install_while_starting` answers a
  signal with one line and the exit status: nothing has been written yet.
- A Python signal handler runs in the main thread at the next bytecode, which may be inside a garbage collector
  callback (JAX registers one), a `__del__` or a weakref callback: an exception raised there is "ignored" (printed
  as `Exception ignored in ...`) and the job went on to exit 0. `install`'s unraisable hook catches such a lost
  interrupt (printing nothing), and a re-delivery thread raises it again in the main thread
  (`_thread.interrupt_main`); it also re-delivers it every few seconds until the main thread reaches the stop path
  (code that catches BaseException and goes on would lose it otherwise; a `finally` that waits for Beam's worker
  threads is cut short the same way).
- `leave` ends the process with os._exit. Beam runs the job's steps on daemon threads, which may be inside jaxlib
  (generating, compiling, placing weights) when the main thread stops. A normal exit finalizes the interpreter
  under them: a daemon thread that then re-takes the GIL is ended by pthread_exit, whose forced unwinding runs
  jaxlib's C++ destructors without the GIL, and the process aborts (`Check failed: PyGILState_Check()` in
  py_array.cc, exit 134) or terminates ("FATAL: exception not rethrown"). Nothing is left to finalize: images and
  row files are written atomically, and the stop path has removed Beam's temporary folders.
"""

from __future__ import annotations

import _thread
import logging
import os
import signal
import sys
import threading
import time

from .errors import exception_chain

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REDELIVER_S = 2.0  # how often a raised interrupt is raised again until the main thread reaches the stop path
LOST_DELAY_S = 0.05  # after an ignored one: time for the main thread to leave the callback that ignored it


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt is for SIGINT."""


class _State:
    received: int | None = None  # the first signal received
    stopping = False  # the main thread is in the stop path: later signals do not raise
    redelivering = False  # an interrupt_main() of ours is pending (not the user's second Ctrl-C)
    watchdog: threading.Thread | None = None
    watchdog_done: threading.Event | None = None  # set: that re-delivery thread stops (its run is over)
    lost = threading.Event()  # the interrupt was raised where Python ignored it: re-deliver it now
    installed = False  # install() ran: the job's own handling began (what is left after it is the exit)


STATE = _State()


def status(signum: int) -> int:
    """The exit status after `signum`: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return "SIGINT" if signum == signal.SIGINT else "SIGTERM"


def leave(code: int) -> None:
    """End the process now with `code`, stdout and stderr flushed, without finalizing the interpreter (see above)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing more can be said
            pass
    os._exit(code)


def install_while_starting() -> None:
    """Until `install` (and again once main() is done, the process exiting): a signal prints one line and ends the
    process at once (the job's modules are still importing, or nothing is left to do)."""

    def interrupted(signum, frame):
        when = "while exiting" if STATE.installed else "while starting: nothing was written"
        print(f"interrupted ({signal_name(signum)}) {when}", file=sys.stderr)
        leave(status(signum))

    for signum in SIGNALS:
        signal.signal(signum, interrupted)


def install():
    """Raise KeyboardInterrupt (SIGINT) or Terminated (SIGTERM) in the main thread, and keep it from being lost.
    Returns what `restore` puts back (the handlers and unraisable hook before)."""
    _stop_watchdog()  # one left by an earlier in-process run must not interrupt this one
    STATE.received, STATE.stopping, STATE.redelivering, STATE.installed = None, False, False, True
    STATE.lost.clear()
    previous = ({signum: signal.signal(signum, raise_interrupted) for signum in SIGNALS}, sys.unraisablehook)
    if not getattr(sys.unraisablehook, "_flux2_interrupts", False):
        sys.unraisablehook = _unraisable_hook(sys.unraisablehook)
    return previous


def restore(previous) -> None:
    """Put back the handlers and the unraisable hook `install` replaced (a caller of main() in-process)."""
    handlers, hook = previous
    _stop_watchdog()
    for signum, handler in handlers.items():
        if handler is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signum, handler)
    sys.unraisablehook = hook


def raise_interrupted(signum, frame):
    """Stop the run where it is: Beam's own reports of the interrupt (tracebacks from its threads) are silenced, the
    one line of the stop path says what happened. In the stop path a re-delivered interrupt is dropped, and the
    user's second signal ends the process at once."""
    redelivered, STATE.redelivering = STATE.redelivering, False
    if STATE.stopping:
        if redelivered:
            return
        leave(status(STATE.received or signum))
    if STATE.received is None:
        STATE.received = signum
        STATE.watchdog_done = threading.Event()
        STATE.watchdog = threading.Thread(target=_redeliver_until_stopping, args=(signum, STATE.watchdog_done),
                                          name="interrupt-redeliver", daemon=True)
        STATE.watchdog.start()
    logging.disable(logging.CRITICAL)
    raise KeyboardInterrupt() if STATE.received == signal.SIGINT else Terminated()


def exit_process(code: int) -> None:
    """The command line's exit: after a signal at once (`leave`), else as usual (sys.exit)."""
    if STATE.received is not None:
        leave(code)
    sys.exit(code)


def interrupting_signal(error: BaseException) -> int | None:
    """SIGINT or SIGTERM when `error` is the interrupt (or Beam's RuntimeError wrapping one), else None."""
    for error in exception_chain(error):
        if isinstance(error, KeyboardInterrupt) or "KeyboardInterrupt" in str(error):
            return signal.SIGINT
        if isinstance(error, Terminated) or "Terminated" in type(error).__name__:
            return signal.SIGTERM
    return None


def _redeliver(signum: int) -> None:
    STATE.redelivering = True
    _thread.interrupt_main(signum)


def _redeliver_until_stopping(signum: int, done: threading.Event) -> None:
    """The re-delivery thread: from another thread, since interrupt_main() in the main thread runs the handler
    right there (inside the very callback that ignored it). It ends with its run (`done`)."""
    while not (STATE.stopping or done.is_set()):
        if STATE.lost.wait(REDELIVER_S):
            STATE.lost.clear()
            time.sleep(LOST_DELAY_S)
        if not (STATE.stopping or done.is_set()):
            _redeliver(signum)


def _stop_watchdog() -> None:
    """End the re-delivery thread of the run before, if any, and wait for it (a few seconds at most)."""
    if STATE.watchdog_done is not None:
        STATE.watchdog_done.set()
        STATE.lost.set()  # wakes it from its wait
    if STATE.watchdog is not None and STATE.watchdog is not threading.current_thread():
        STATE.watchdog.join(REDELIVER_S + 1)
    STATE.watchdog, STATE.watchdog_done = None, None
    STATE.lost.clear()


def _unraisable_hook(previous):
    """sys.unraisablehook that hands our interrupt, raised where Python can only ignore it, back to the main thread
    (and prints nothing for it); every other unraisable exception goes to `previous`."""

    def hook(unraisable):
        if isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)) and STATE.received is not None:
            STATE.lost.set()  # the re-delivery thread raises it again in the main thread
            return
        previous(unraisable)

    hook._flux2_interrupts = True
    return hook
