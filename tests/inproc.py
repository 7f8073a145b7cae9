"""`producer` commands run inside the test process (tests/conftest.py cli()), as a fresh process
would run them: starting a `producer` subprocess costs ~0.3 s of CPU in interpreter start and
imports alone, and the suite starts about a thousand of them.

A call runs genqueue.producer.cli's `main` group under click's CliRunner isolation (stdin from
INPUT, stdout and stderr captured apart, ENV over os.environ) and answers what subprocess.run
would: a CompletedProcess[str] with the exit code and both streams (universal newlines, as
text=True decodes a pipe). What a fresh process would not share with the test is set aside for
the call and put back after it: the working directory, the whole environment (a command may set
a variable), the logging configuration (setup_logging's basicConfig configures nothing while a
handler is on the root logger), the warning filters, signal handlers, excepthooks, the temporary
folder tempfile chose (TMPDIR is read once), click's help width. An exception escaping the
command is a traceback on stderr and exit code 1, as the interpreter would print it. A thread
the command leaves running is a bug in the command: the call fails naming it.

An in-process call cannot be stopped: a call that ran past its TIMEOUT fails after the fact
(InProcessTimeout, a subprocess.TimeoutExpired). Tests that need a hang stopped, signals, a
terminal or the real process's streams pass cli(..., subprocess_=True); a call that sets a PYTHON*
variable (read by a new interpreter only) is a subprocess by itself; GENQUEUE_TEST_CLI=subprocess
in the environment makes every call a subprocess again.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from click import formatting, termui
from click.testing import CliRunner

#: The environment variable that, set to "subprocess", runs every cli() call as a subprocess.
SWITCH = "GENQUEUE_TEST_CLI"

#: Commands run in-process: only `producer` (the consumer's commands serve, sign and wait).
IN_PROCESS = frozenset({"producer"})

_busy = threading.Lock()  # one in-process call at a time: the isolation swaps process-wide state

#: Seconds a thread the command started (and left running) is waited for before the call fails.
_THREAD_GRACE = 5.0


class InProcessTimeout(subprocess.TimeoutExpired):
    """An in-process call that ran past its timeout: it could not be stopped, so it is reported
    once it returned. A test that relies on the timeout to end a hang passes subprocess_=True."""

    def __str__(self) -> str:
        return (f"{' '.join(map(str, self.cmd))} ran in-process past its timeout of {self.timeout} s "
                "(it cannot be stopped there; pass subprocess_=True if the test relies on the timeout)")


def wanted(name: str, subprocess_: bool, env: dict[str, str] | None) -> bool:
    """Whether cli(NAME, ...) runs in-process: a `producer` command, not asked to be a subprocess
    (by the call or GENQUEUE_TEST_CLI), from the main thread (the isolation is process-wide: a
    call from a test's own thread, or during another call, is a subprocess), and not given a
    PYTHON* variable of its own (PYTHONPATH and the rest are read by a new interpreter only)."""
    return (name in IN_PROCESS and not subprocess_ and os.environ.get(SWITCH, "") != "subprocess"
            and threading.current_thread() is threading.main_thread() and not _busy.locked()
            and not any(k.startswith("PYTHON") and os.environ.get(k) != v for k, v in (env or {}).items()))


def run(name: str, args: Sequence[str], *, env: dict[str, str] | None, timeout: float, input: bytes | None,
        cwd: Path | None) -> subprocess.CompletedProcess[str]:
    """`NAME ARGS` run in-process (the module docstring), answered as subprocess.run answers."""
    from genqueue.producer.cli import main

    argv = [name, *args]
    with _busy:
        start = time.monotonic()
        with _fresh_process(cwd, argv) as _, _Runner().isolation(input=input, env=env) as (out, err, _mixed):
            code = 0
            try:
                main.main(args=list(args), prog_name=name)
            except SystemExit as e:
                code = _exit_code(e.code)
            except Exception as e:  # noqa: BLE001 (the interpreter would print it and exit 1)
                traceback.print_exception(e, file=sys.stderr)
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            stdout, stderr = out.getvalue(), err.getvalue()
        took = time.monotonic() - start
    result = subprocess.CompletedProcess(argv, code, _text(stdout), _text(stderr))
    if took > timeout:
        raise InProcessTimeout(argv, timeout, result.stdout, result.stderr)
    return result


def _exit_code(code: object) -> int:
    """The exit status a process gets from sys.exit(CODE): a message is printed (on stderr, where
    the interpreter prints it) and is status 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _text(data: bytes) -> str:
    """DATA as subprocess.run(text=True) decodes a pipe: UTF-8, universal newlines."""
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


class _Runner(CliRunner):
    """CliRunner's isolation with what a real process has instead of its test doubles: click's
    help as wide as a pipe makes it (CliRunner fixes 80 columns; a process into a pipe has 78), and
    prompts read by input() (CliRunner echoes the answer into stdout, a pipe does not)."""

    @contextlib.contextmanager
    def isolation(self, *args: Any, **kwargs: Any) -> Iterator[tuple[io.BytesIO, io.BytesIO, io.BytesIO]]:
        with super().isolation(*args, **kwargs) as streams:
            formatting.FORCED_WIDTH = None  # both put back by super()
            termui.visible_prompt_func = input
            yield streams


@contextlib.contextmanager
def _fresh_process(cwd: Path | None, argv: list[str]) -> Iterator[None]:
    """What a fresh process would have to itself, set aside for the call and put back after it."""
    old_cwd = os.getcwd()
    old_env = dict(os.environ)
    old_argv = sys.argv
    old_tempdir = tempfile.tempdir
    old_hooks = (sys.excepthook, threading.excepthook)
    old_signals = _signals()
    threads_before = set(threading.enumerate())
    logs = _Logging()
    try:
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = argv
        tempfile.tempdir = None  # chosen again from TMPDIR and the rest, as a new process does
        with warnings.catch_warnings():
            _fresh_warnings()
            yield
    finally:
        logs.restore()
        for sig, handler in old_signals.items():
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        sys.excepthook, threading.excepthook = old_hooks
        tempfile.tempdir = old_tempdir
        sys.argv = old_argv
        _restore_environ(old_env)
        os.chdir(old_cwd)
    _no_threads_left(threads_before, argv)


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers


def _signals() -> dict[signal.Signals, _Handler]:
    handlers: dict[signal.Signals, _Handler] = {}
    for sig in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            handler = signal.getsignal(sig)
            if handler is not None:
                handlers[signal.Signals(sig)] = handler
    return handlers


def _restore_environ(old: dict[str, str]) -> None:
    for key in [k for k in os.environ if k not in old]:
        del os.environ[key]
    for key, value in old.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _fresh_warnings() -> None:
    """The warning filters and printer of a new interpreter (no -W, no PYTHONWARNINGS): pytest
    records warnings instead of printing them, and shows each once per place per process."""
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    warnings.showwarning = _show_original


def _show_original(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   file: object = None, line: str | None = None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


class _Logging:
    """The logging configuration before a call: the root logger bare for the call (so that the
    command's basicConfig configures it, onto the captured stderr), every logger's level,
    handlers and switches put back after it. What threads that were running before the call log
    during it (a consumer thread or lock keeper another test left) goes where it went before the
    call, not into the command's stderr: a fresh process has no such threads."""

    def __init__(self) -> None:
        manager = logging.Logger.manager
        self.disable = manager.disable
        self.loggers = [logging.getLogger(), *(lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger))]
        self.saved = [(lg, lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in self.loggers]
        root = logging.getLogger()
        root_handlers = list(root.handlers)
        foreign = {t.ident for t in threading.enumerate() if t is not threading.main_thread()}
        call_handlers = self.call_handlers = logging.Logger.callHandlers

        def own_threads_only(logger: logging.Logger, record: logging.LogRecord) -> None:
            if record.thread not in foreign:
                call_handlers(logger, record)
                return
            for h in root_handlers:
                if record.levelno >= h.level:
                    h.handle(record)

        logging.Logger.callHandlers = own_threads_only  # type: ignore[method-assign,assignment]
        root.handlers = []
        root.setLevel(logging.WARNING)

    def restore(self) -> None:
        logging.Logger.callHandlers = self.call_handlers  # type: ignore[method-assign]
        manager = logging.Logger.manager
        for lg, level, handlers, propagate, disabled in self.saved:
            for h in lg.handlers:
                if h not in handlers:
                    h.close()
            lg.handlers = handlers
            lg.propagate, lg.disabled = propagate, disabled
            if lg.level != level:
                lg.setLevel(level)
        manager.disable = self.disable
        manager._clear_cache()  # type: ignore[attr-defined]


def _no_threads_left(before: set[threading.Thread], argv: list[str]) -> None:
    """A thread the command started and left running outlives a real process's exit only as a
    daemon, and keeps running here: fail the call naming it. Its own non-daemon threads (an
    executor's workers) get a moment to end."""
    deadline = time.monotonic() + _THREAD_GRACE
    left = []
    for t in threading.enumerate():
        if t in before or not t.is_alive():
            continue
        if not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
        target = getattr(t, "_target", None)
        if t.is_alive() and (not t.daemon or getattr(target, "__module__", "").startswith("genqueue")):
            left.append(t.name)
    if left:
        raise AssertionError(f"{' '.join(argv)} left threads running after it returned: {', '.join(left)}")
