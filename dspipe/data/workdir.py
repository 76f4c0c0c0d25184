"""prepare-data's work directory: where an interrupted preparation is kept, locked and journaled, to be resumed.

WorkDir             `.NAME.tmp-partial-<fingerprint[:16]>` beside the output: the tokenizer, the shards, the
                    journal (rewritten atomically) and the lock (flock; the pid of the run holding it)
remove_stale_temps  temp directories of runs that died, and work directories of other fingerprints that no live
                    run holds
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
from pathlib import Path

from dspipe.atomic import write_file
from dspipe.data.shards import fsync_path
from dspipe.errors import SpecError
from dspipe.jsonio import dumps, read_object

WORK_TAG, JOURNAL_FILE, LOCK_FILE = "tmp-partial-", "journal.json", "lock"
JOURNAL_FORMAT = "dspipe-prepare-journal"


def _lock(directory: Path, *, create: bool) -> int | None:
    """An exclusive lock on directory/LOCK_FILE (its file descriptor), or None while a live process holds it.
    FileNotFoundError when the directory or (without `create`) the lock file is gone, or was renamed or replaced
    between opening and locking (by a run that found it unlocked)."""
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    try:
        if not _flock(fd):
            os.close(fd)
            return None
        held, named = os.fstat(fd), os.stat(path)
        if (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):
            raise FileNotFoundError(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _flock(fd: int) -> bool:
    """flock `fd` exclusively, without waiting: False while another process holds it. On a file system without
    flock (Lustre mounted without it), the pid the lock file holds tells whether its run lives."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        return not _holder_lives(fd)
    return True


def _holder_lives(fd: int) -> bool:
    """Whether the pid written in a lock file is a live process other than this one."""
    try:
        pid = int(os.pread(fd, 32, 0).decode().strip())
        if pid != os.getpid():
            os.kill(pid, 0)
            return True
    except (ValueError, ProcessLookupError):  # no pid, or a dead one
        pass
    except PermissionError:  # another user's live process
        return True
    return False


def set_aside(tmp: Path, out: Path) -> Path:
    """Rename a temp directory to a new name that carries this process's id (a dead one's is removed later)."""
    aside = tmp.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(tmp, aside)
    return aside


def remove_stale_temps(out: Path, *, keep: Path) -> None:
    """Temp directories of runs that died: pid-named ones whose process is gone, and work directories (but `keep`,
    this fingerprint's) that no live run holds: another fingerprint's work cannot be resumed by this run."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        if tmp == keep:
            continue
        if tmp.name.startswith(f".{out.name}.{WORK_TAG}"):
            try:
                fd = _lock(tmp, create=False)
            except FileNotFoundError:  # died before it locked, or gone meanwhile
                fd = -1
            except OSError:
                continue
            if fd is None:
                continue
            try:
                shutil.rmtree(set_aside(tmp, out), ignore_errors=True)
            except OSError:
                pass
            finally:
                if fd >= 0:
                    os.close(fd)
            continue
        try:
            pid = int(tmp.name.split(".tmp-")[1].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass


class WorkDir:
    """The work directory of a fingerprint (module docstring): the tokenizer, the shards, JOURNAL_FILE and LOCK_FILE
    (the pid of the run holding it, for the message that refuses a second run)."""

    def __init__(self, out: Path, fp: str, *, shown: Path):
        self.out, self.fp, self.shown = out, fp, shown  # shown: `out` as the user gave it, for messages
        self.path = out.parent / f".{out.name}.{WORK_TAG}{fp[:16]}"
        self.documents = 0  # in the last journal written or read
        self._fd: int | None = None

    def acquire(self) -> None:
        """Make (or find) the directory and lock it; SpecError while another live run holds it."""
        for _ in range(10):
            try:
                self.path.mkdir(exist_ok=True)
                self.path.chmod(0o755)
                self._fd = _lock(self.path, create=True)
            except FileNotFoundError:  # removed meanwhile by a run that found it unlocked: make it again
                continue
            if self._fd is None:
                try:
                    pid = (self.path / LOCK_FILE).read_text().strip() or "?"
                except OSError:
                    pid = "?"
                raise SpecError(
                    f"another prepare-data run (pid {pid}) is preparing {self.shown} from the same "
                    f"inputs and options (it holds {self.path / LOCK_FILE}); wait for it to end"
                )
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
            return
        raise SpecError(f"cannot lock {self.path}: other runs keep removing it")

    def journal(self) -> dict | None:
        """The journal an earlier run of this fingerprint left, or None: none, unreadable, or not this
        fingerprint's (the facts it holds are checked where they are used: ShardWriter.restore)."""
        path = self.path / JOURNAL_FILE
        if not path.exists():
            return None
        try:
            journal = read_object(path)
        except SpecError:
            return None
        counts = [journal.get("num_documents"), journal.get("num_bytes")]
        if (
            journal.get("format") != JOURNAL_FORMAT
            or journal.get("fingerprint") != self.fp
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
            or not isinstance(journal.get("tokenizer"), dict)
            or not isinstance(journal.get("writers"), dict)
        ):
            return None
        self.documents = journal["num_documents"]
        return journal

    def clear(self, *, keep: set[str] = frozenset()) -> None:
        """Remove what the directory holds but the lock and the names in `keep` (all of it: a fresh build)."""
        for p in self.path.iterdir():
            if p.name in keep or p.name == LOCK_FILE:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        if not keep:
            self.documents = 0

    def write_journal(self, journal: dict) -> None:
        """Replace the journal atomically (temp file, fsync, rename, then the directory synced); the files it names
        must be on disk already (ShardWriter.state syncs them)."""
        path = self.path / JOURNAL_FILE
        write_file(path, dumps({"format": JOURNAL_FORMAT, "fingerprint": self.fp, **journal}, what=str(path)))
        fsync_path(self.path)
        self.documents = journal["num_documents"]

    def finish(self) -> Path:
        """The built directory, renamed to a pid-named temp (no later run takes it for a work directory to resume),
        without its lock and journal: ready for the marker and the rename over `out`."""
        self.path = set_aside(self.path, self.out)
        self.documents = 0  # no longer resumable: a failure from here on discards it
        for name in (LOCK_FILE, JOURNAL_FILE):
            (self.path / name).unlink(missing_ok=True)
        return self.path

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
