"""Skills: folders of instructions (and files) the agent loop loads when the model asks.

A skill is a folder ``DIR/NAME`` of the ``--skills-dir`` holding ``SKILL.md``: YAML front
matter between two ``---`` lines with ``name`` (the folder's name: 1-64 of ``a-z 0-9 -``,
starting with a letter or digit) and ``description`` (one string, at most 1,024 characters),
then the instructions in markdown; any other files beside it (scripts, references,
templates) are read only when asked for, as text.

Everything here is untrusted text: an upload (``create``) is checked before anything is
written (sizes, file count, path names, the front matter), written to a hidden folder and
renamed into place, so a skill is all there or not at all. Reads are bounded and never follow
a symlink; nothing in a skill is executed. A folder laid out by hand that breaks the rules is
skipped (and logged), not fatal: the others are listed.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import shutil
import stat
import threading
import uuid
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

SKILL_FILE = "SKILL.md"
NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
MAX_DESCRIPTION_CHARS = 1024
MAX_FRONT_MATTER_BYTES = 16 * 1024
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # tab and newline are text
_HIDDEN = "."  # folders of the skills dir starting with it are the store's own (uploads, deletes)


class SkillError(ValueError):
    """An upload, a name or a path refused; the message says why (a 400)."""


class SkillNotFound(SkillError):
    """No skill of that name (a 404)."""


class SkillExists(SkillError):
    """A skill of that name is there already (a 409)."""


@dataclass(frozen=True, slots=True)
class SkillLimits:
    """How large an uploaded skill may be, and how much of a file a read returns."""

    max_files: int = 64
    max_file_bytes: int = 1024 * 1024  # one file, SKILL.md included
    max_total_bytes: int = 8 * 1024 * 1024  # all files together, unpacked
    max_depth: int = 8  # folders a path may go down
    max_path_chars: int = 255


@dataclass(frozen=True, slots=True)
class SkillInfo:
    """What the model is shown of a skill before it loads it, and when it was written."""

    name: str
    description: str
    created_at: int  # SKILL.md's modification time, Unix seconds


@dataclass(frozen=True, slots=True)
class SkillFile:
    path: str  # relative, with '/'
    size: int


@dataclass(frozen=True, slots=True)
class FrontMatter:
    name: str
    description: str
    body: str  # the markdown after the front matter


def parse_skill_md(text: str) -> FrontMatter:
    """SKILL.md's front matter and body; SkillError says what is wrong with it."""
    lines = text.split("\n")
    if not lines or lines[0].rstrip("\r") != "---":
        raise SkillError(f"{SKILL_FILE} must start with a '---' line opening its front matter")
    end = next((i for i in range(1, len(lines)) if lines[i].rstrip("\r") == "---"), None)
    if end is None:
        raise SkillError(f"{SKILL_FILE}: the front matter has no closing '---' line")
    raw = "\n".join(lines[1:end])
    if len(raw.encode("utf-8")) > MAX_FRONT_MATTER_BYTES:
        raise SkillError(f"{SKILL_FILE}: the front matter is over {MAX_FRONT_MATTER_BYTES} bytes")
    try:
        meta = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = str(getattr(exc, "problem", "") or "not valid YAML")
        raise SkillError(f"{SKILL_FILE}: the front matter is not valid YAML ({problem})") from None
    if not isinstance(meta, dict):
        raise SkillError(
            f"{SKILL_FILE}: the front matter must be a mapping with name and description"
        )
    name, description = meta.get("name"), meta.get("description")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SkillError(
            f"{SKILL_FILE}: 'name' must be 1-64 of a-z, 0-9 and '-', not starting with '-'"
        )
    if not isinstance(description, str) or not description.strip():
        raise SkillError(f"{SKILL_FILE}: 'description' must be a non-empty string")
    if len(description) > MAX_DESCRIPTION_CHARS or _CONTROL.search(description):
        raise SkillError(
            f"{SKILL_FILE}: 'description' must be at most {MAX_DESCRIPTION_CHARS} characters "
            "of text (no control characters)"
        )
    body = "\n".join(lines[end + 1 :]).lstrip("\r\n")
    return FrontMatter(name, " ".join(description.split()), body)


def check_path(path: str, limits: SkillLimits) -> str:
    """A file's path in an upload, as written in the skill: relative, '/'-separated, no '.' or
    '..' part, no control characters or backslashes; SkillError otherwise."""
    shown = _q(path)
    if not path or len(path) > limits.max_path_chars:
        raise SkillError(f"the path {shown} must be 1 to {limits.max_path_chars} characters")
    if _CONTROL.search(path) or "\\" in path or "\t" in path or "\n" in path:
        raise SkillError(f"the path {shown} holds a control character or a backslash")
    if path.startswith("/") or re.match(r"[A-Za-z]:", path):
        raise SkillError(f"the path {shown} is absolute; paths are relative to the skill's folder")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise SkillError(f"the path {shown} has an empty, '.' or '..' part")
    try:  # a file system takes names of at most 255 bytes
        too_long = any(len(part.encode("utf-8")) > 255 for part in parts)
    except UnicodeEncodeError:
        raise SkillError(f"the path {shown} is not valid Unicode text") from None
    if too_long:
        raise SkillError(f"the path {shown} has a part over 255 bytes")
    if len(parts) > limits.max_depth + 1:
        raise SkillError(f"the path {shown} is more than {limits.max_depth} folders deep")
    return path


def entries_from_zip(data: bytes, limits: SkillLimits) -> list[tuple[str, bytes]]:
    """The files of a zip archive, bounded as they are read (a header's sizes are not
    trusted); symlinks, special files and encrypted entries are refused."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError) as exc:
        raise SkillError(f"the upload is not a readable zip archive ({exc})") from None
    infos = archive.infolist()
    if len(infos) > 4 * limits.max_files:
        raise SkillError(
            f"the archive holds {len(infos)} entries; a skill has at most {limits.max_files} files"
        )
    entries = []
    for info in infos:
        mode = info.external_attr >> 16
        kind = stat.S_IFMT(mode)
        if stat.S_ISLNK(mode):
            raise SkillError(f"the archive's entry {_q(info.filename)} is a symlink")
        if info.is_dir():
            continue
        if kind not in (0, stat.S_IFREG):
            raise SkillError(f"the archive's entry {_q(info.filename)} is not a regular file")
        if info.flag_bits & 0x1:
            raise SkillError(f"the archive's entry {_q(info.filename)} is encrypted")
        if info.file_size > limits.max_file_bytes:
            raise _too_large(info.filename, limits)
        try:
            with archive.open(info) as member:
                content = member.read(limits.max_file_bytes + 1)
        except (zipfile.BadZipFile, NotImplementedError, OSError, ValueError, EOFError) as exc:
            raise SkillError(
                f"the archive's entry {_q(info.filename)} cannot be read ({exc})"
            ) from None
        if len(content) > limits.max_file_bytes:
            raise _too_large(info.filename, limits)
        entries.append((info.filename, content))
    return entries


def _q(path: str) -> str:
    """A path quoted in a message (its head: a hostile one may be long)."""
    return repr(path[:80])


def _too_large(path: str, limits: SkillLimits) -> SkillError:
    return SkillError(f"the file {_q(path)} is over {limits.max_file_bytes} bytes")


@dataclass(frozen=True, slots=True)
class CheckedUpload:
    front: FrontMatter
    files: tuple[tuple[str, bytes], ...]


def check_upload(entries: Sequence[tuple[str, bytes]], limits: SkillLimits) -> CheckedUpload:
    """An upload's files checked as a skill: counts, sizes, paths, and SKILL.md at its top
    (a single top folder around everything, as zipping a folder makes, is taken off)."""
    if not entries:
        raise SkillError("the upload holds no files")
    if len(entries) > limits.max_files:
        raise SkillError(
            f"a skill has at most {limits.max_files} files; the upload has {len(entries)}"
        )
    total = 0
    for path, content in entries:
        check_path(path, limits)
        if len(content) > limits.max_file_bytes:
            raise _too_large(path, limits)
        total += len(content)
    if total > limits.max_total_bytes:
        raise SkillError(
            f"the skill's files come to {total} bytes; at most {limits.max_total_bytes}"
        )
    files = _strip_top_folder([(p, c) for p, c in entries])
    seen: set[str] = set()
    folders: set[str] = set()
    for path, _ in files:
        if path in seen:
            raise SkillError(f"the path {_q(path)} is given twice")
        seen.add(path)
        parts = path.split("/")
        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = sorted(seen & folders)
    if clash:
        raise SkillError(f"the path {_q(clash[0])} is both a file and a folder")
    skill_md = dict(files).get(SKILL_FILE)
    if skill_md is None:
        raise SkillError(f"the upload has no {SKILL_FILE} at its top")
    try:
        text = skill_md.decode("utf-8")
    except UnicodeDecodeError:
        raise SkillError(f"{SKILL_FILE} is not UTF-8 text") from None
    return CheckedUpload(parse_skill_md(text), tuple(files))


def _strip_top_folder(files: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    if any(path == SKILL_FILE for path, _ in files):
        return files
    tops = {path.split("/", 1)[0] for path, _ in files}
    if len(tops) != 1 or any("/" not in path for path, _ in files):
        return files
    return [(path.split("/", 1)[1], content) for path, content in files]


class SkillStore:
    """The skills of one folder. The folder is the truth: what is listed is read from it (each
    SKILL.md parsed again only when it changed), so skills added or removed by hand show up
    too, and several stores over one folder agree."""

    def __init__(self, root: str | os.PathLike[str], limits: SkillLimits | None = None) -> None:
        self.root = Path(root)
        self.limits = limits or SkillLimits()
        self._seen: dict[str, tuple[tuple[int, int, int], SkillInfo | None]] = {}
        self._lock = threading.Lock()  # one create or delete at a time, and the cache

    def check_root(self) -> None:
        """SkillError unless the folder is a directory this process can read."""
        if not self.root.is_dir():
            raise SkillError(f"the skills folder {str(self.root)!r} is not a directory")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise SkillError(f"the skills folder {str(self.root)!r} cannot be read")

    # -- reading -------------------------------------------------------------------------------
    def listing(self) -> list[SkillInfo]:
        """The valid skills, by name."""
        try:
            names = sorted(e.name for e in os.scandir(self.root) if NAME.fullmatch(e.name))
        except OSError as exc:
            log.warning("skills folder %s: %s", self.root, exc)
            return []
        found = [self._info(name) for name in names]
        with self._lock:
            for gone in set(self._seen) - set(names):
                del self._seen[gone]
        return [info for info in found if info is not None]

    def info(self, name: str) -> SkillInfo:
        """The skill ``name``; SkillNotFound when there is no valid one."""
        found = self._info(name) if NAME.fullmatch(name) else None
        if found is None:
            raise SkillNotFound(f"no skill named {_q(name)}")
        return found

    def body(self, name: str) -> str:
        """SKILL.md's markdown after the front matter."""
        self.info(name)
        return parse_skill_md(self._read_text(name, SKILL_FILE)).body

    def files(self, name: str) -> list[SkillFile]:
        """The skill's regular files (SKILL.md included), by path; symlinks are left out."""
        folder = self._folder(name)
        out: list[SkillFile] = []
        cap = 4 * self.limits.max_files  # a folder laid out by hand may hold more
        for top, dirs, names in os.walk(folder, followlinks=False):
            dirs.sort()
            for file in sorted(names):
                full = Path(top, file)
                st = full.lstat()
                if stat.S_ISREG(st.st_mode) and len(out) < cap:
                    out.append(SkillFile(full.relative_to(folder).as_posix(), st.st_size))
        return sorted(out, key=lambda f: f.path)

    def read_file(self, name: str, path: str) -> str:
        """A file of the skill as text, at most ``max_file_bytes`` of it; SkillError for a
        path that leaves the folder, passes a symlink, or names no text file."""
        self.info(name)
        check_path(path, self.limits)
        return self._read_text(name, path)

    def _folder(self, name: str) -> Path:
        self.info(name)
        return self.root / name

    def _read_text(self, name: str, path: str) -> str:
        folder = self.root / name
        if not stat.S_ISDIR(_lstat_mode(folder)):  # not a folder, or a link to one elsewhere
            raise SkillNotFound(f"no skill named {_q(name)}")
        current = folder
        for part in path.split("/"):  # no part may be a symlink: nothing outside is reached
            current = current / part
            try:
                st = current.lstat()
            except FileNotFoundError:
                raise SkillError(f"the skill {name!r} has no file {_q(path)}") from None
            if stat.S_ISLNK(st.st_mode):
                raise SkillError(f"the skill's path {_q(path)} passes a symlink")
        if not current.resolve().is_relative_to(folder.resolve()):
            raise SkillError(f"the path {_q(path)} leaves the skill's folder")
        try:
            fd = os.open(current, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise SkillError(
                f"the skill's file {_q(path)} cannot be read ({exc.strerror})"
            ) from None
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise SkillError(f"the skill's path {_q(path)} is not a regular file")
            data = handle.read(self.limits.max_file_bytes + 1)
        cut = len(data) > self.limits.max_file_bytes
        try:
            text = data[: self.limits.max_file_bytes].decode(
                "utf-8", "strict" if not cut else "ignore"
            )
        except UnicodeDecodeError:
            raise SkillError(f"the skill's file {_q(path)} is not UTF-8 text") from None
        if cut:
            text += f"\n[file cut at {self.limits.max_file_bytes} bytes]"
        return text

    def _info(self, name: str) -> SkillInfo | None:
        """The skill's front matter, read again only when SKILL.md changed; None (logged once)
        for a folder that is not a valid skill."""
        skill_md = self.root / name / SKILL_FILE
        try:
            if not stat.S_ISDIR((self.root / name).lstat().st_mode):
                return None
            st = skill_md.lstat()
        except OSError:
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        with self._lock:
            cached = self._seen.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        info = None
        try:
            if not stat.S_ISREG(st.st_mode):
                raise SkillError(f"{SKILL_FILE} is not a regular file")
            if st.st_size > self.limits.max_file_bytes:
                raise SkillError(f"{SKILL_FILE} is over {self.limits.max_file_bytes} bytes")
            front = parse_skill_md(self._read_text(name, SKILL_FILE))
            if front.name != name:
                raise SkillError(f"its name {front.name!r} is not the folder's")
            info = SkillInfo(name, front.description, int(st.st_mtime))
        except SkillError as exc:
            log.warning("skill folder %s is skipped: %s", self.root / name, exc)
        with self._lock:
            self._seen[name] = (key, info)
        return info

    # -- changing ------------------------------------------------------------------------------
    def create(self, entries: Sequence[tuple[str, bytes]]) -> SkillInfo:
        """A new skill from an upload's files (checked first: SkillError; SkillExists when the
        name is taken). Written under a hidden name, then renamed into place."""
        upload = check_upload(entries, self.limits)
        name = upload.front.name
        staging = self.root / f"{_HIDDEN}upload-{uuid.uuid4().hex}"
        try:
            staging.mkdir(mode=0o755)
            _write_files(staging, upload.files)
            with self._lock:
                target = self.root / name
                if os.path.lexists(target):
                    raise SkillExists(f"a skill named {name!r} exists")
                try:
                    os.rename(staging, target)
                except OSError as exc:
                    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                        raise SkillExists(f"a skill named {name!r} exists") from None
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self.info(name)

    def delete(self, name: str) -> None:
        """Remove the skill (SkillNotFound when there is none): renamed away first, so it is
        gone from listings at once, then its files removed."""
        with self._lock:
            if not NAME.fullmatch(name) or not stat.S_ISDIR(_lstat_mode(self.root / name)):
                raise SkillNotFound(f"no skill named {_q(name)}")
            doomed = self.root / f"{_HIDDEN}deleted-{uuid.uuid4().hex}"
            os.rename(self.root / name, doomed)
            self._seen.pop(name, None)
        shutil.rmtree(doomed, ignore_errors=True)


def _lstat_mode(path: Path) -> int:
    try:
        return path.lstat().st_mode
    except OSError:
        return 0


def _write_files(folder: Path, files: Iterable[tuple[str, bytes]]) -> None:
    """Write each file under ``folder`` (paths already checked), never through a link."""
    for path, content in files:
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(target, flags, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
