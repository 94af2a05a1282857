"""The Python kernel that runs inside the code-execution sandbox (see sandbox.py).

This file is not imported by inferd: its source is handed to the sandbox's interpreter with
``python3 -I -c``, so it uses the standard library only and nothing of the host. It speaks
JSON lines on its original stdin/stdout (moved to private descriptors first); the code it runs
gets /dev/null as stdin and, for each call, files under /tmp as stdout and stderr, so output
written by child processes or straight to fd 1 is captured too and cannot forge a reply.

Requests:  {"op": "exec", "code": "..."}  {"op": "read", "path": "...", "max_bytes": N}
Replies:   one JSON object per request (see ``execute`` and ``read``).
"""

import ast
import base64
import hashlib
import json
import os
import stat
import sys
import traceback

# set by main() from the command line
WORK = "/workspace"
MAX_TEXT = 64 * 1024  # bytes of stdout, of stderr, of the result's repr
MAX_FILES = 256  # files listed after a call

_namespace: dict[str, object] = {"__name__": "__main__", "__builtins__": __builtins__}


def _bounded(data: bytes) -> tuple[str, int]:
    """(text, the full size in bytes) of ``data`` cut to MAX_TEXT bytes."""
    return data[:MAX_TEXT].decode("utf-8", "replace"), len(data)


def _read_capture(fd: int) -> tuple[str, int]:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, MAX_TEXT + 1)
    size = os.fstat(fd).st_size
    return data[:MAX_TEXT].decode("utf-8", "replace"), size


def _run(code: str) -> object:
    """Run ``code`` in the session's namespace; the value of a last bare expression is kept."""
    tree = ast.parse(code, "<cell>", "exec")
    last = None
    tail = tree.body[-1] if tree.body else None
    if isinstance(tail, ast.Expr):
        tree.body.pop()
        last = ast.Expression(tail.value)
    exec(compile(tree, "<cell>", "exec"), _namespace)
    if last is not None:
        return eval(compile(last, "<cell>", "eval"), _namespace)
    return None


def execute(code: str) -> dict[str, object]:
    out = os.open("/tmp/.kernel-stdout", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open("/tmp/.kernel-stderr", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    reply: dict[str, object] = {"result": None, "error": None}
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(err, 2)
    try:
        value = _run(code)
        if value is not None:
            reply["result"] = _bounded(repr(value).encode("utf-8", "replace"))[0]
    except BaseException as exc:  # the model's code may raise anything, SystemExit included
        # the kernel's own frames are not the model's business
        frames = [
            f
            for f in traceback.extract_tb(exc.__traceback__)
            if f.filename == "<cell>" or not f.filename.startswith("<")
        ]
        lines = traceback.format_list(frames[-8:])
        lines += traceback.format_exception_only(type(exc), exc)
        reply["error"] = _bounded("".join(lines).encode("utf-8", "replace"))[0]
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
    reply["stdout"], reply["stdout_bytes"] = _read_capture(out)
    reply["stderr"], reply["stderr_bytes"] = _read_capture(err)
    os.close(out)
    os.close(err)
    reply["files"] = list_files()
    return reply


def list_files() -> list[dict[str, object]]:
    """The regular files under WORK (symbolic links are not followed): path, size, sha256."""
    found = []
    for root, dirs, names in os.walk(WORK):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            try:
                info = os.lstat(path)
                if not stat.S_ISREG(info.st_mode):
                    continue
                digest = hashlib.sha256()
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        digest.update(chunk)
            except OSError:
                continue
            rel = os.path.relpath(path, WORK)
            found.append({"path": rel, "size": info.st_size, "sha256": digest.hexdigest()})
            if len(found) >= MAX_FILES:
                return found
    return found


def read(path: str, max_bytes: int) -> dict[str, object]:
    full = os.path.realpath(os.path.join(WORK, path))
    if os.path.commonpath([full, WORK]) != WORK or full == WORK:
        return {"error": "the path is outside the work directory"}
    try:
        info = os.lstat(full)
        if not stat.S_ISREG(info.st_mode):
            return {"error": "not a regular file"}
        with open(full, "rb") as f:
            data = f.read(max_bytes)
    except OSError as exc:
        return {"error": exc.strerror or "cannot read it"}
    return {"data": base64.b64encode(data).decode("ascii"), "size": info.st_size}


def main() -> None:
    global WORK, MAX_TEXT, MAX_FILES
    WORK, MAX_TEXT, MAX_FILES = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.chdir(WORK)
    replies.write(b'{"ready": true}\n')
    replies.flush()
    for line in requests:
        try:
            request = json.loads(line)
            if request.get("op") == "read":
                reply = read(str(request["path"]), int(request["max_bytes"]))
            else:
                reply = execute(str(request["code"]))
        except Exception as exc:
            reply = {"error": "kernel: " + type(exc).__name__ + ": " + str(exc)}
        replies.write(json.dumps(reply).encode("utf-8") + b"\n")
        replies.flush()


if __name__ == "__main__":  # python -c runs it as __main__; an import does nothing
    main()
