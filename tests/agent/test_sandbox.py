"""The code-execution sandbox (inferd/agent/sandbox.py), on the real bwrap and interpreter.

Each escape is tried from inside a session and must fail in the precise way the sandbox
makes it fail; after each, the same tool still answers ``1+1`` (in a fresh session when the
escape got the old one killed), so the parent and the tool stay healthy.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

import inferd
from inferd.agent.sandbox import CodeExecutionTools, SandboxLimits
from inferd.agent.toolbox import ToolBox
from inferd.agent.tools import ToolCallError, ToolResult

T = TypeVar("T")
MiB = 1 << 20
FAST = SandboxLimits(
    exec_timeout_s=5, work_bytes=8 * MiB, tmp_bytes=4 * MiB, file_bytes=2 * MiB, processes=32
)


def with_tool(
    body: Callable[[CodeExecutionTools], Awaitable[T]], limits: SandboxLimits = FAST
) -> T:
    """Run ``body`` against a started tool, closed afterwards."""

    async def main() -> T:
        tools = CodeExecutionTools(limits=limits, permission="allow")
        await tools.start()
        try:
            return await body(tools)
        finally:
            await tools.close()

    return asyncio.run(main())


def run_codes(*codes: str, limits: SandboxLimits = FAST) -> list[ToolResult]:
    """Each code in turn in one session, then ``1+1``: the results (the last one checked)."""

    async def body(tools: CodeExecutionTools) -> list[ToolResult]:
        results = [await tools.call("python", {"code": code}) for code in codes]
        after = await tools.call("python", {"code": "1+1"})
        assert not after.is_error and "result: 2" in after.content.splitlines(), after
        return [*results, after]

    return with_tool(body, limits)


def result_of(res: ToolResult) -> str:
    """The ``result:`` line of a successful call."""
    assert not res.is_error, res.content
    return res.content.split("\nfiles in /workspace:")[0].rsplit("result: ", 1)[1]


# --- the kernel ----------------------------------------------------------------------------


def test_state_persists_and_output_is_captured() -> None:
    first, second, shell, after = run_codes(
        "x = 20\nprint('hello')\nimport sys; print('oops', file=sys.stderr)\nx + 1",
        "x * 2",
        "import subprocess; subprocess.run(['sh', '-c', 'echo from-child; echo e >&2'])\nNone",
    )
    assert first.content == "stdout:\nhello\n\nstderr:\noops\n\nresult: 21"
    assert second.content == "result: 40"
    # output written by a child process straight to fd 1/2 is captured too
    assert shell.content == "stdout:\nfrom-child\n\nstderr:\ne\n"
    assert not after.content.startswith("[a new session")


def test_exceptions_are_error_results_and_the_session_goes_on() -> None:
    syntax, zero, leave, after = run_codes("def (", "y = 5\n1/0", "raise SystemExit(3)")
    assert syntax.is_error and "SyntaxError" in syntax.content
    assert zero.is_error and zero.content.endswith("ZeroDivisionError: division by zero\n")
    assert 'File "<cell>", line 2' in zero.content
    assert leave.is_error and "SystemExit: 3" in leave.content
    assert not after.content.startswith("[a new session")


def test_files_are_listed_and_read_back_bounded() -> None:
    async def body(tools: CodeExecutionTools) -> None:
        code = "import os; os.makedirs('out', exist_ok=True)\n"
        code += "open('out/data.bin', 'wb').write(bytes(range(256)) * 4)\n"
        code += "open('note.txt', 'w').write('hi')\nos.symlink('/usr/bin/python3', 'link')"
        res = await tools.call("python", {"code": code})
        assert not res.is_error, res.content
        assert res.content == "files in /workspace: note.txt (2 bytes), out/data.bin (1024 bytes)"
        assert tools.kernel is not None
        data = bytes(range(256)) * 4
        listed = {f.path: f for f in tools.kernel.files}
        assert listed["out/data.bin"].sha256 == hashlib.sha256(data).hexdigest()
        assert listed["note.txt"].size == 2 and "link" not in listed
        assert await tools.kernel.read_file("out/data.bin") == data
        assert await tools.kernel.read_file("out/data.bin", max_bytes=10) == data[:10]
        for bad, says in (
            ("../etc/passwd", "relative to it"),
            ("/etc/passwd", "relative to it"),
            ("link", "outside the work directory"),
            ("missing.txt", "No such file"),
        ):
            with pytest.raises(ToolCallError, match=says):
                await tools.kernel.read_file(bad)

    with_tool(body)


def test_bad_arguments_are_error_results() -> None:
    async def body(tools: CodeExecutionTools) -> list[ToolResult]:
        box = ToolBox([tools])
        return [
            await box.call("python", {}),
            await box.call("python", {"code": 5}),
            await box.call("python", {"code": "1", "extra": 1}),
            await box.call("python", {"code": "  "}),
            await box.call("python", {"code": "6*7"}),
        ]

    *bad, good = with_tool(body)
    assert [r.is_error for r in bad] == [True] * 4
    assert "one argument: code, a string" in bad[0].content and "empty" in bad[3].content
    assert good.content == "result: 42" and not good.is_error


def test_a_host_without_the_sandbox_leaves_the_tool_unavailable() -> None:
    async def main() -> tuple[dict[str, str], ToolResult]:
        box = ToolBox([CodeExecutionTools(python="/usr/bin/no-such-python")])
        await box.start()
        try:
            return box.failures, await box.call("python", {"code": "1"})
        finally:
            await box.close()

    failures, res = asyncio.run(main())
    assert failures == {
        "code_execution": "code execution is unavailable: no interpreter at "
        "/usr/bin/no-such-python (the sandbox shows only /usr)"
    }
    # the tool stays listed (a request's session starts on its first call), and a call says
    # why it cannot run
    assert res.is_error and res.content == failures["code_execution"]


# --- escapes that must fail ----------------------------------------------------------------


def test_host_files_are_not_visible(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the parent's secret")
    repo = Path(inferd.__file__).resolve().parent
    probe = "import os\n[os.path.exists(p) for p in {paths!r}]"
    paths = [str(secret), str(tmp_path), "/root/.ssh", "/root", "/home", "/etc/shadow", "/etc"]
    paths += [str(repo), str(repo / "agent" / "sandbox.py"), "/work", "/sys"]
    res, read, _ = run_codes(
        probe.format(paths=paths),
        f"open({str(secret)!r}).read()",
    )
    assert result_of(res) == repr([False] * len(paths))
    assert read.is_error and "FileNotFoundError" in read.content
    # the system the interpreter needs is there, read-only
    (listing, _) = run_codes("import os; sorted(os.listdir('/'))")
    top = eval(result_of(listing))
    assert "usr" in top and "workspace" in top and not {"etc", "root", "home", "work"} & set(top)


def test_the_parents_environment_is_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_SANDBOX_TEST_SECRET", "s3cr3t-value")
    code = "import os, glob\n"
    code += "seen = [open(p, 'rb').read() for p in glob.glob('/proc/*/environ')]\n"
    code += "[b's3cr3t' in e for e in seen], 'INFERD_SANDBOX_TEST_SECRET' in os.environ"
    res, _ = run_codes(code)
    environs, in_env = eval(result_of(res))
    assert environs and not any(environs) and in_env is False


def test_writes_outside_the_work_directory_fail() -> None:
    code = "import errno\nout = []\n"
    code += "for p in ['/usr/evil', '/evil', '/dev/evil', '/proc/evil', '/usr/lib/evil']:\n"
    code += "    try:\n        open(p, 'w'); out.append('wrote')\n"
    code += "    except OSError as e:\n        out.append(errno.errorcode[e.errno])\nout"
    res, _ = run_codes(code)
    assert eval(result_of(res)) == ["EROFS", "EROFS", "EROFS", "ENOENT", "EROFS"]
    assert not Path("/usr/evil").exists() and not Path("/evil").exists()


def test_no_socket_reaches_a_host_port() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = "import socket, errno\nout = []\n"
        code += f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('10.0.0.1', 80)]:\n"
        code += "    s = socket.socket(); s.settimeout(2)\n"
        code += "    try:\n        s.connect(addr); out.append('connected')\n"
        code += "    except OSError as e:\n        out.append(errno.errorcode.get(e.errno, e))\n"
        code += "out"
        res, _ = run_codes(code)
        assert eval(result_of(res)) == ["ECONNREFUSED", "ENETUNREACH", "ENETUNREACH"]
        with pytest.raises(BlockingIOError):  # nothing ever knocked
            server.accept()


def test_a_fork_bomb_hits_the_process_limit() -> None:
    code = "import os, time, errno\npids = []\nerr = None\n"
    code += "try:\n    for _ in range(10000):\n        pid = os.fork()\n"
    code += "        if pid == 0:\n            time.sleep(30); os._exit(0)\n"
    code += "        pids.append(pid)\nexcept OSError as e:\n    err = errno.errorcode[e.errno]\n"
    code += "for p in pids:\n    os.kill(p, 9); os.waitpid(p, 0)\n(len(pids) < 32, err)"
    res, _ = run_codes(code)
    assert result_of(res) == "(True, 'EAGAIN')"


def test_a_huge_allocation_fails() -> None:
    res, small, _ = run_codes("b = bytearray(20 * 2**30)", "len(bytearray(100 * 2**20))")
    assert res.is_error and res.content.endswith("MemoryError\n")
    assert result_of(small) == str(100 * 2**20)  # the limit is the address space, not less


def test_the_disk_cannot_be_filled() -> None:
    code = "import errno\nn = 0\ntry:\n    while n < 1000:\n"
    code += "        with open(f'f{n}', 'wb') as f: f.write(b'x' * 2**20)\n        n += 1\n"
    code += "except OSError as e:\n    err = errno.errorcode[e.errno]\n(n <= 8, err)"
    big = "import errno\ntry:\n    open('/tmp/big', 'wb').write(b'x' * (3 * 2**20))\n"
    big += "except OSError as e:\n    err = errno.errorcode[e.errno]\nerr"
    shm = "try:\n    open('/dev/shm/s', 'wb').write(b'x' * (5 * 2**20))\n"
    shm += "except OSError as e:\n    err = errno.errorcode[e.errno]\nerr"
    fill, one_file, dev_shm, _ = run_codes(code, big, shm)
    assert result_of(fill) == "(True, 'ENOSPC')"  # the work directory's tmpfs is full
    assert result_of(one_file) == "'EFBIG'"  # RLIMIT_FSIZE
    assert result_of(dev_shm) == "'EFBIG'"


def test_ptrace_and_namespace_calls_are_refused() -> None:
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nout = []\n"
    # PTRACE_TRACEME needs no privilege: only the seccomp filter refuses it
    code += "for nr, args in [(101, (0, 0, 0, 0)), (272, (0x10000000,)), (321, (0, 0, 0))]:\n"
    code += "    ctypes.set_errno(0)\n"
    code += "    out.append((libc.syscall(nr, *args), ctypes.get_errno()))\n"
    code += "out"
    res, _ = run_codes(code)  # ptrace, unshare(CLONE_NEWUSER), bpf
    assert eval(result_of(res)) == [(-1, errno.EPERM)] * 3


def test_code_that_runs_forever_is_stopped() -> None:
    limits = SandboxLimits(exec_timeout_s=2, session_timeout_s=60)
    _, forever, after, _ = run_codes("x = 1", "while True: pass", "x", limits=limits)
    assert forever.is_error
    stopped = "[the session was stopped: it ran past the 2 s limit of one execution]"
    assert forever.content == stopped
    assert after.content.startswith(
        "[a new session was started: it ran past the 2 s limit of one execution; "
    )
    assert after.is_error and "NameError: name 'x' is not defined" in after.content


def test_the_cpu_limit_kills_a_busy_session() -> None:
    limits = SandboxLimits(cpu_s=1, exec_timeout_s=30)
    busy, _ = run_codes("while True: pass", limits=limits)
    assert busy.is_error and busy.content.startswith("[the session was stopped: its process ended")


def test_a_session_past_its_wall_clock_limit_starts_again() -> None:
    limits = SandboxLimits(exec_timeout_s=1, session_timeout_s=1.5)

    async def body(tools: CodeExecutionTools) -> list[Any]:
        first = await tools.call("python", {"code": "x = 1"})
        await asyncio.sleep(2)
        return [first, await tools.call("python", {"code": "x"})]

    first, later = with_tool(body, limits)
    assert not first.is_error
    assert later.content.startswith(
        "[a new session was started: it ran past the session's 1.5 s wall-clock limit"
    )


def test_sandbox_runs_as_nobody_without_capabilities() -> None:
    code = "import os\nstatus = open('/proc/self/status').read().splitlines()\n"
    code += "(os.getuid(), [l.split()[1] for l in status if l.startswith('CapEff')])"
    res, _ = run_codes(code)
    assert result_of(res) == "(65534, ['0000000000000000'])"
    assert os.getpid() > 0  # the parent is untouched (it would not get here otherwise)


def test_code_that_ends_the_kernel_gets_a_fresh_session_next() -> None:
    ended, after, _ = run_codes("import os; os._exit(7)", "'x' in globals()")
    assert ended.is_error and ended.content.startswith(
        "[the session was stopped: its process ended"
    )
    assert after.content.startswith("[a new session was started: its process ended")
    assert result_of(after) == "False"


# --- files the code writes come back ----------------------------------------------------------


def test_written_files_are_stored_for_the_caller_and_named_in_the_result(tmp_path: Path) -> None:
    """New and changed files go to the server's file store (a real one, in a folder) after each
    call, once each; the result names their ids; the store holds their bytes."""
    from inferd.server.file_store import FileStore

    store = FileStore(tmp_path)

    async def main() -> tuple[list[ToolResult], CodeExecutionTools]:
        tools = CodeExecutionTools(
            limits=FAST, permission="allow", save_files=store.sink("owner-a")
        )
        await tools.start()
        try:
            codes = [
                "open('report.csv', 'w').write('a,b\\n1,2\\n')",
                "1+1",  # nothing new: nothing stored again
                "open('report.csv', 'a').write('3,4\\n'); open('n.txt', 'w').write('x')",
            ]
            return [await tools.call("python", {"code": c}) for c in codes], tools
        finally:
            await tools.close()

    results, tools = asyncio.run(main())
    saved = tools.saved
    assert sorted((s.path, s.size) for s in saved) == [
        ("n.txt", 1),
        ("report.csv", 8),
        ("report.csv", 12),
    ]
    first = saved[0]
    assert (first.path, first.size) == ("report.csv", 8)
    assert f"report.csv -> {first.file_id} (8 bytes)" in results[0].content
    assert "files saved" not in results[1].content
    for s in saved[1:]:
        assert f"{s.path} -> {s.file_id} ({s.size} bytes)" in results[2].content
    for s in saved:
        record = store.get(s.file_id, "owner-a")
        assert record is not None and record.purpose == "assistants"
        assert store.get(s.file_id, "owner-b") is None  # the request's key owns them
    final = next(s for s in reversed(saved) if s.path == "report.csv")
    record = store.get(final.file_id, "owner-a")
    assert record is not None and store.content(record) == b"a,b\n1,2\n3,4\n"
