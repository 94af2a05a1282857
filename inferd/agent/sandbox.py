"""Sandboxed code execution: a persistent Python kernel per session, under bubblewrap.

The model's code runs in a child process that sees almost nothing of the host:

- ``bwrap`` (Debian's bubblewrap) gives it new namespaces of every kind (``--unshare-all``: no
  network but its own loopback, its own process tree, no host IPC), a read-only view of
  ``/usr`` and the ``/lib*`` links and nothing else of the host (no ``/etc``, ``/root``,
  ``/home``, ``/work``, host ``/tmp``), private size-bounded tmpfs for the work directory
  (``/workspace``), ``/tmp`` and ``/dev/shm``, and a read-only root; ``--die-with-parent``,
  ``--new-session``, ``--cap-drop ALL``, ``--disable-userns``, an empty environment.
- A seccomp filter, made with libseccomp (through ctypes: the library is Debian's
  ``libseccomp2``), refuses ptrace, mounts, namespaces, keyrings, bpf, perf, io_uring, module
  and reboot calls with EPERM.
- rlimits set by util-linux's ``prlimit`` before ``bwrap`` runs: address space, CPU seconds,
  processes, open files, file size; when inferd runs as root the sandbox runs as ``nobody``
  (the process limit is per user, and root is exempt from it).
- A wall-clock limit per execution and per session: past it the process tree is killed, and
  the next call starts a fresh session and says so.

The kernel (sandbox_kernel.py) keeps one namespace across a session's calls, captures stdout,
stderr and the last expression's repr (bounded) and lists the work directory's files after
each call; ``PythonKernel.read_file`` reads one back (bounded).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import ctypes.util
import errno
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from inferd.agent.tools import (
    CallLimits,
    Permission,
    SpecTable,
    ToolCallError,
    ToolSource,
    ToolSourceError,
    ToolSpec,
)

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
WORK_DIR = "/workspace"
NOBODY = 65534
KERNEL_SOURCE = Path(__file__).with_name("sandbox_kernel.py")
STARTUP_TIMEOUT_S = 15.0
MAX_CODE_BYTES = 256 * 1024
MAX_READ_BYTES = 4 * MiB

# Refused with EPERM inside the sandbox: debugging other processes, changing the mount or
# namespace layout, kernel keyrings, eBPF, perf counters, io_uring (a large attack surface),
# modules, reboot, swap, clocks. Names this libseccomp or architecture lacks are skipped.
BLOCKED_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "iopl",
    "ioperm",
    "name_to_handle_at",
    "open_by_handle_at",
    "clock_settime",
    "settimeofday",
    "adjtimex",
)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (bwrap, prlimit, libseccomp or the interpreter missing)."""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """How one session's process tree is bounded."""

    memory_bytes: int = 2 * GiB  # RLIMIT_AS of every process
    cpu_s: int = 300  # RLIMIT_CPU of every process
    processes: int = 64  # RLIMIT_NPROC: the sandbox user's processes and threads
    open_files: int = 256  # RLIMIT_NOFILE
    file_bytes: int = 256 * MiB  # RLIMIT_FSIZE: the largest file it may write
    work_bytes: int = 512 * MiB  # the work directory's tmpfs
    tmp_bytes: int = 64 * MiB  # /tmp's and /dev/shm's tmpfs, each
    exec_timeout_s: float = 60.0  # one execution's wall-clock time
    session_timeout_s: float = 3600.0  # one session's wall-clock time
    max_output_bytes: int = 64 * 1024  # stdout, stderr, the result's repr: each
    max_files: int = 256  # files listed after a call

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "cpu_s", "processes", "open_files", "file_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"sandbox limit {name} must be positive")
        if self.open_files < 16 or self.processes < 4:
            raise ValueError("the sandbox needs at least 16 open files and 4 processes")
        if min(self.work_bytes, self.tmp_bytes) < MiB:
            raise ValueError("the sandbox's tmpfs sizes must be at least 1 MiB")
        if not (0 < self.exec_timeout_s <= self.session_timeout_s):
            raise ValueError("the execution timeout must be positive and within the session's")
        if self.max_output_bytes < 256 or self.max_files < 1:
            raise ValueError("the sandbox's output bounds are too small")


@dataclass(frozen=True, slots=True)
class SandboxFile:
    """A file the code left in the work directory (path relative to it)."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class SavedFile:
    """A file a call wrote, stored for the caller (``FileSink``) under ``file_id``."""

    path: str
    file_id: str
    size: int


# Stores one file a call wrote (its path in the work directory, its bytes) where the caller
# can fetch it; answers the stored file's id (the server's /v1/files store).
FileSink = Callable[[str, bytes], Awaitable[str]]
MAX_SAVED_FILES = 8  # files stored after one call
MAX_SAVED_BYTES = MAX_READ_BYTES  # their bytes together


@dataclass(frozen=True, slots=True)
class Execution:
    """One call's outcome. ``restarted``: why this call ran in a fresh session (the previous
    one was stopped), or None; ``stopped``: why this call's session was stopped, or None."""

    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: str | None = None
    files: tuple[SandboxFile, ...] = ()
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    restarted: str | None = None
    stopped: str | None = None

    @property
    def is_error(self) -> bool:
        return self.error is not None or self.stopped is not None

    def text(self) -> str:
        """What the model reads."""
        parts = []
        if self.restarted:
            parts.append(f"[a new session was started: {self.restarted}; earlier state is lost]")
        for name, text, size in (
            ("stdout", self.stdout, self.stdout_bytes),
            ("stderr", self.stderr, self.stderr_bytes),
        ):
            if size:
                cut = len(text.encode()) < size
                parts.append(f"{name}:\n{text}" + (f"\n[{name} cut: {size} bytes]" if cut else ""))
        if self.result is not None:
            parts.append(f"result: {self.result}")
        if self.error is not None:
            parts.append(f"error:\n{self.error}")
        if self.stopped:
            parts.append(f"[the session was stopped: {self.stopped}]")
        if self.files:
            listed = ", ".join(f"{f.path} ({f.size} bytes)" for f in self.files)
            parts.append(f"files in {WORK_DIR}: {listed}")
        return "\n".join(parts) if parts else "(no output)"


@functools.cache
def seccomp_program() -> bytes:
    """The BPF program bwrap installs (``--seccomp FD``): allow all but BLOCKED_SYSCALLS."""
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise SandboxUnavailable(f"libseccomp is not installed ({exc})") from None
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_void_p,
    ]
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_export_bpf.restype = ctypes.c_int
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.restype = None
    allow, refuse = 0x7FFF0000, 0x00050000 | errno.EPERM  # SCMP_ACT_ALLOW, SCMP_ACT_ERRNO
    ctx = lib.seccomp_init(allow)
    if not ctx:
        raise SandboxUnavailable("libseccomp could not make a filter")
    try:
        for syscall in BLOCKED_SYSCALLS:
            number = lib.seccomp_syscall_resolve_name(syscall.encode())
            if number == -1:  # __NR_SCMP_ERROR: not on this architecture
                continue
            if lib.seccomp_rule_add_array(ctx, refuse, number, 0, None) < 0:
                raise SandboxUnavailable(f"libseccomp refused a rule for {syscall}")
        fd = os.memfd_create("inferd-seccomp", os.MFD_CLOEXEC)
        try:
            if lib.seccomp_export_bpf(ctx, fd) < 0:
                raise SandboxUnavailable("libseccomp could not export the filter")
            return _read_all(fd)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass(frozen=True, slots=True)
class SandboxSetup:
    """The host programs the sandbox is made of, found once."""

    bwrap: str
    prlimit: str
    python: str  # the interpreter inside the sandbox: it must live under /usr
    seccomp: bytes
    run_as: int | None  # the uid (and gid) the sandbox runs as; None: inferd's own

    @classmethod
    def find(cls, python: str = "/usr/bin/python3") -> SandboxSetup:
        """SandboxUnavailable says what is missing."""
        bwrap, prlimit = shutil.which("bwrap"), shutil.which("prlimit")
        if bwrap is None:
            raise SandboxUnavailable("bwrap is not installed (Debian: apt-get install bubblewrap)")
        if prlimit is None:
            raise SandboxUnavailable("prlimit is not installed (Debian: util-linux)")
        if not python.startswith("/usr/") or not os.access(python, os.X_OK):
            raise SandboxUnavailable(f"no interpreter at {python} (the sandbox shows only /usr)")
        run_as = NOBODY if os.geteuid() == 0 else None
        return cls(bwrap, prlimit, python, seccomp_program(), run_as)


def sandbox_command(setup: SandboxSetup, limits: SandboxLimits, seccomp_fd: int) -> list[str]:
    """prlimit (the rlimits) exec'ing bwrap (the namespaces and mounts) exec'ing the kernel."""
    rlimits = [
        f"--as={limits.memory_bytes}",
        f"--cpu={limits.cpu_s}",
        f"--nproc={limits.processes}",
        f"--nofile={limits.open_files}",
        f"--fsize={limits.file_bytes}",
        "--core=0",
    ]
    command = [setup.prlimit, *rlimits, "--", setup.bwrap]
    command += ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    command += ["--new-session", "--cap-drop", "ALL", "--hostname", "sandbox"]
    command += ["--uid", str(NOBODY), "--gid", str(NOBODY)]
    command += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: the same links inside
            command += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            command += ["--ro-bind", top, top]
    command += ["--proc", "/proc", "--dev", "/dev"]
    command += ["--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm"]
    command += ["--size", str(limits.tmp_bytes), "--tmpfs", "/tmp"]
    command += ["--size", str(limits.work_bytes), "--tmpfs", WORK_DIR]
    # bwrap's own /dev and / are unbounded tmpfs: read-only, so nothing fills memory there
    command += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK_DIR]
    command += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORK_DIR]
    command += ["--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8"]
    command += ["--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
    command += ["--seccomp", str(seccomp_fd), "--", setup.python, "-I", "-c"]
    command += [KERNEL_SOURCE.read_text(encoding="utf-8"), WORK_DIR]
    command += [str(limits.max_output_bytes), str(limits.max_files)]
    return command


class PythonKernel:
    """One session: a sandboxed interpreter whose state persists between ``execute`` calls.
    A call that runs too long, or a process that dies, ends the session; the next call starts
    a fresh one and its Execution says so (``restarted``)."""

    def __init__(self, setup: SandboxSetup, limits: SandboxLimits | None = None) -> None:
        self.setup = setup
        self.limits = limits or SandboxLimits()
        self._proc: asyncio.subprocess.Process | None = None
        self._session_timer: asyncio.TimerHandle | None = None
        self._ended: str | None = None  # why the last session ended, until a new one starts
        self._lock = asyncio.Lock()
        self.files: tuple[SandboxFile, ...] = ()  # as listed after the last call

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        """Start the session now rather than at the first call (ToolCallError says why it
        could not)."""
        async with self._lock:
            if not self.running:
                await self._start()

    async def execute(self, code: str) -> Execution:
        """Run ``code``; an Execution whatever the code does (only cancellation propagates,
        and it stops the session, whose state is then unknown)."""
        async with self._lock:
            restarted = None
            if not self.running:
                restarted = await self._start()
            try:
                reply = await self._ask({"op": "exec", "code": code}, self.limits.exec_timeout_s)
            except BaseException as exc:
                await self._stop(_stop_reason(exc, self.limits.exec_timeout_s, self._proc))
                if not isinstance(exc, Exception):
                    raise
                return Execution(restarted=restarted, stopped=self._ended)
            self.files = tuple(
                SandboxFile(str(f["path"]), int(f["size"]), str(f["sha256"]))
                for f in reply.get("files", ())
            )
            return Execution(
                stdout=str(reply.get("stdout", "")),
                stderr=str(reply.get("stderr", "")),
                result=_optional_str(reply.get("result")),
                error=_optional_str(reply.get("error")),
                files=self.files,
                stdout_bytes=int(reply.get("stdout_bytes", 0)),
                stderr_bytes=int(reply.get("stderr_bytes", 0)),
                restarted=restarted,
            )

    async def read_file(self, path: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """A file of the work directory (``path`` relative to it), at most ``max_bytes``;
        ToolCallError when the session is gone, the path is bad or the file is not there."""
        rel = PurePosixPath(path)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ToolCallError(f"{path!r}: give a path inside {WORK_DIR}, relative to it")
        max_bytes = max(0, min(max_bytes, MAX_READ_BYTES))
        async with self._lock:
            if not self.running:
                raise ToolCallError("the session has ended; its files are gone")
            try:
                reply = await self._ask(
                    {"op": "read", "path": str(rel), "max_bytes": max_bytes}, STARTUP_TIMEOUT_S
                )
            except Exception as exc:
                await self._stop(_stop_reason(exc, STARTUP_TIMEOUT_S, self._proc))
                raise ToolCallError(f"the session was stopped: {self._ended}") from None
        if "error" in reply:
            raise ToolCallError(f"{path}: {reply['error']}")
        return base64.b64decode(reply["data"])[:max_bytes]

    async def close(self) -> None:
        async with self._lock:
            await self._stop("closed")

    async def _start(self) -> str | None:
        """A fresh session; returns why the previous one ended (None for the first)."""
        previous, self._ended = self._ended, None
        fd = os.memfd_create("inferd-seccomp")  # inherited by bwrap, which reads it once
        try:
            os.write(fd, self.setup.seccomp)
            os.lseek(fd, 0, os.SEEK_SET)
            run_as = self.setup.run_as
            self._proc = await asyncio.create_subprocess_exec(
                *sandbox_command(self.setup, self.limits, fd),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(fd,),
                env={"PATH": "/usr/bin:/bin"},  # bwrap's own environment shows in /proc/1
                cwd="/",
                start_new_session=True,
                user=run_as,
                group=run_as,
                extra_groups=[] if run_as is not None else None,
                limit=4 * self.limits.max_output_bytes + MAX_READ_BYTES * 2 + 64 * 1024,
            )
        finally:
            os.close(fd)
        try:
            await self._ask(None, STARTUP_TIMEOUT_S)
        except Exception as exc:
            why = await self._startup_failure(exc)
            raise ToolCallError(f"the sandbox did not start: {why}") from None
        self._session_timer = asyncio.get_running_loop().call_later(
            self.limits.session_timeout_s, self._expire
        )
        return previous

    async def _startup_failure(self, exc: Exception) -> str:
        proc = self._proc
        await self._stop("it did not start")
        text = ""
        if proc is not None and proc.stderr is not None:
            text = (await proc.stderr.read(2000)).decode("utf-8", "replace").strip()
        return text or type(exc).__name__

    async def _ask(self, request: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
        """Send ``request`` (None: only read, the ready line) and read one reply line."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        if request is not None:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
        async with asyncio.timeout(timeout_s):
            if request is not None:
                await proc.stdin.drain()
            line = await proc.stdout.readline()
        if not line:
            raise EOFError
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError("the kernel's reply is not an object")
        return reply

    def _expire(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            limit = self.limits.session_timeout_s
            self._ended = f"it ran past the session's {limit:g} s wall-clock limit"
            self._proc.kill()

    async def _stop(self, reason: str) -> None:
        """Kill the session's process tree (bwrap's death takes its namespace with it)."""
        if self._session_timer is not None:
            self._session_timer.cancel()
            self._session_timer = None
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it died on its own meanwhile
                proc.kill()
        await proc.wait()
        if self._ended is None:
            self._ended = reason
        self.files = ()


def _stop_reason(
    exc: BaseException, timeout_s: float, proc: asyncio.subprocess.Process | None
) -> str:
    if isinstance(exc, TimeoutError):
        return f"it ran past the {timeout_s:g} s limit of one execution"
    if isinstance(exc, asyncio.CancelledError):
        return "the call was cancelled"
    if isinstance(exc, EOFError | ConnectionError | BrokenPipeError):
        code = None if proc is None else proc.returncode
        return "its process ended" + (f" (status {code})" if code is not None else "")
    return f"its reply was unreadable ({type(exc).__name__})"


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


class CodeExecutionTools(ToolSource):
    """The ``python`` tool: one sandboxed session per instance (the agent loop makes one per
    conversation and closes it at the end)."""

    def __init__(
        self,
        name: str = "code_execution",
        limits: SandboxLimits | None = None,
        *,
        permission: Permission = "ask",
        python: str = "/usr/bin/python3",
        save_files: FileSink | None = None,
    ) -> None:
        self.sandbox_limits = limits or SandboxLimits()
        # new or changed files after each call go to save_files; what was stored, in order
        self.save_files = save_files
        self.saved: list[SavedFile] = []
        self._kept: dict[str, str] = {}  # path -> sha256 of the files stored or seen
        # the call bound covers a fresh session's start and one execution; the kernel's own
        # timeout fires first and stops the process
        super().__init__(
            name,
            CallLimits(
                self.sandbox_limits.exec_timeout_s + STARTUP_TIMEOUT_S + 5,
                max_concurrent=1,
                max_output_bytes=4 * self.sandbox_limits.max_output_bytes,
            ),
        )
        self._table = SpecTable(name, default=permission)
        self.python = python
        self.kernel: PythonKernel | None = None
        # listed before the session starts: the loop offers the tool to every request and
        # starts a session only for one that calls it
        spec = self._table.spec("python", _DESCRIPTION, _SCHEMA)
        self._specs = {spec.name: spec}

    @property
    def kind(self) -> str:
        return "code execution"

    async def start(self) -> None:
        """Start the session (so a host where the sandbox cannot run is found at startup:
        ToolSourceError says why) and list the tool."""
        try:
            setup = await asyncio.to_thread(SandboxSetup.find, self.python)
            if self.kernel is None:
                self.kernel = PythonKernel(setup, self.sandbox_limits)
            await self.kernel.start()
        except (SandboxUnavailable, ToolCallError) as exc:
            raise ToolSourceError(f"code execution is unavailable: {exc}") from None

    async def _invoke(self, tool: ToolSpec, arguments: dict[str, Any]) -> tuple[str, bool]:
        code = arguments.get("code")
        if set(arguments) - {"code"} or not isinstance(code, str):
            raise ToolCallError("the python tool takes one argument: code, a string")
        if not code.strip():
            raise ToolCallError("the code is empty")
        if len(code.encode("utf-8", "replace")) > MAX_CODE_BYTES:
            raise ToolCallError(f"the code is over {MAX_CODE_BYTES} bytes")
        if self.kernel is None:  # the session starts with its first call
            try:
                await self.start()
            except ToolSourceError as exc:
                raise ToolCallError(str(exc)) from None
        assert self.kernel is not None
        started = time.monotonic()
        execution = await self.kernel.execute(code)
        log.debug("python tool: %.3f s, error=%s", time.monotonic() - started, execution.is_error)
        text = execution.text()
        if self.save_files is not None and execution.files:
            text += await self._save(execution.files)
        return text, execution.is_error

    async def _save(self, files: tuple[SandboxFile, ...]) -> str:
        """Store the files this call made or changed (at most MAX_SAVED_FILES, MAX_SAVED_BYTES
        together; the rest are named as not stored) and say where they are."""
        assert self.save_files is not None and self.kernel is not None
        lines: list[str] = []
        skipped: list[str] = []
        left = MAX_SAVED_BYTES
        for f in files:
            if self._kept.get(f.path) == f.sha256:
                continue
            if len(lines) >= MAX_SAVED_FILES or f.size > left:
                skipped.append(f.path)
                continue
            try:
                data = await self.kernel.read_file(f.path, left)
                file_id = await self.save_files(f.path, data)
            except (ToolCallError, OSError, ValueError) as exc:
                skipped.append(f"{f.path} ({exc})")
                continue
            left -= len(data)
            self._kept[f.path] = f.sha256
            self.saved.append(SavedFile(f.path, file_id, len(data)))
            lines.append(f"{f.path} -> {file_id} ({len(data)} bytes)")
        out = ""
        if lines:
            out += "\nfiles saved for the user (GET /v1/files/ID/content): " + ", ".join(lines)
        if skipped:
            out += "\nfiles not saved (over the bounds of one call): " + ", ".join(skipped)
        return out

    async def close(self) -> None:
        if self.kernel is not None:
            await self.kernel.close()


_DESCRIPTION = (
    "Run Python code in a persistent sandboxed session (no network; variables persist between "
    f"calls). The value of the last expression is shown; files written under {WORK_DIR} (the "
    "working directory) are listed and returned to the user."
)
_SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "the Python code to run"}},
    "required": ["code"],
    "additionalProperties": False,
}
