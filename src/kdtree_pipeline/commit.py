"""Commit the plan files, and nothing else, with GitPython.

Refuses on a detached HEAD or when other changes are staged; skips a commit
that would change nothing; lets git and hook errors surface as
:class:`CommitError`; and on any failure puts the plan files, the index and
HEAD back exactly as they were.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import git


class CommitError(RuntimeError):
    """The plan commit was refused or failed; nothing was changed."""


@dataclass(frozen=True)
class CommitResult:
    """What :func:`write_and_commit` did: the new commit (None when skipped or not
    asked for) and whether the files changed on disk."""

    commit: str | None
    changed: bool
    skipped: bool


def _hook_output(e: git.HookExecutionError) -> str:
    """What the hook printed, without GitPython's ``stderr: '...'`` wrapping."""
    text = ""
    for part in (e.stderr, e.stdout):
        part = re.sub(r"^\s*(stderr|stdout): '", "", str(part or "")).rstrip().rstrip("'")
        text = text or part.strip()
    return text


def open_repo(root: Path) -> git.Repo:
    try:
        return git.Repo(root, search_parent_directories=False)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise CommitError(f"{root} is not a git repository; cannot commit the plan") from None


def _rel(root: Path, paths: list[Path]) -> list[str]:
    return [p.resolve().relative_to(root.resolve()).as_posix() for p in paths]


def staged_paths(repo: git.Repo) -> list[str]:
    """Paths whose staged content differs from HEAD (every index entry on an unborn branch)."""
    if not repo.head.is_valid():
        return sorted({path for path, _stage in repo.index.entries})
    return sorted({d.a_path or d.b_path for d in repo.index.diff("HEAD")})


def preflight(root: Path, paths: list[Path]) -> git.Repo:
    """Refuse early (before any gate runs) what would make the commit impossible."""
    repo = open_repo(root)
    if repo.head.is_detached:
        raise CommitError(
            f"HEAD is detached at {repo.head.commit.hexsha[:12]}; check out a branch before "
            "recording a phase (or pass --no-commit)"
        )
    mine = set(_rel(root, paths))
    others = [p for p in staged_paths(repo) if p not in mine]
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise CommitError(
            f"other changes are staged ({shown}); the plan commit stages only the plan files, "
            "so commit or unstage those first"
        )
    return repo


def _data(content: str | bytes) -> bytes:
    return content if isinstance(content, bytes) else content.encode()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file beside it, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class _Before:
    """The plan files, the index and HEAD before a write, and the folders the write made:
    what :meth:`restore` puts back when the write or the commit fails."""

    files: dict[Path, bytes | None]
    repo: git.Repo | None
    index_path: Path | None
    index: bytes | None
    head: str | None
    made_dirs: list[Path] = field(default_factory=list)

    @classmethod
    def take(cls, repo: git.Repo | None, paths: list[Path]) -> _Before:
        files = {p: (p.read_bytes() if p.exists() else None) for p in paths}
        index_path = Path(repo.index.path) if repo is not None else None
        index = index_path.read_bytes() if index_path and index_path.exists() else None
        head = repo.head.commit.hexsha if repo is not None and repo.head.is_valid() else None
        return cls(files, repo, index_path, index, head)

    def restore(self) -> None:
        for p, data in self.files.items():
            if data is None:
                with contextlib.suppress(OSError):
                    p.unlink()
            else:
                p.write_bytes(data)
        for d in reversed(self.made_dirs):
            with contextlib.suppress(OSError):
                d.rmdir()
        if self.repo is None:
            return
        if self.index_path is not None:
            if self.index is None:
                self.index_path.unlink(missing_ok=True)
            else:
                self.index_path.write_bytes(self.index)
        now = self.repo.head.commit.hexsha if self.repo.head.is_valid() else None
        if now != self.head and self.head is not None:
            self.repo.head.reset(self.head, index=False, working_tree=False)


def _write_files(contents: dict[Path, bytes], made_dirs: list[Path]) -> None:
    """Write each file atomically, making its folders (appended to ``made_dirs``, outermost first)."""
    for p, data in contents.items():
        missing = [d for d in (p.parent, *p.parent.parents) if not d.exists()]
        p.parent.mkdir(parents=True, exist_ok=True)
        made_dirs += [d for d in reversed(missing) if d not in made_dirs]
        _write_atomic(p, data)


def _commit_files(repo: git.Repo, rel: list[str], message: str, changed: bool) -> CommitResult:
    """Commit exactly ``rel``; skipped when none of them differs from HEAD (a commit would change nothing)."""
    if repo.head.is_valid() and not repo.git.status("--porcelain", "--", *rel):
        return CommitResult(None, changed, skipped=True)
    index = repo.index
    index.add(rel)
    new = index.commit(message)
    return CommitResult(new.hexsha, changed, skipped=False)


def _hook_failed(e: git.HookExecutionError) -> CommitError:
    hook = Path(str(e.command[0])).name if e.command else "?"
    detail = " ".join(_hook_output(e).split())
    return CommitError(
        f"git hook {hook} failed (exit {e.status}), so the plan was not committed and the "
        f"plan files and history are as they were{': ' + detail if detail else ''}"
    )


def write_and_commit(
    root: Path,
    contents: dict[Path, str | bytes],
    message: str,
    *,
    commit: bool = True,
) -> CommitResult:
    """Write ``contents`` (path -> text or bytes), each file atomically, and, when ``commit``, commit exactly those
    files. On any error the files, the index and HEAD are restored and
    :class:`CommitError` is raised."""
    root = root.resolve()
    data = {Path(p).resolve(): _data(c) for p, c in contents.items()}
    paths = list(data)
    repo = preflight(root, paths) if commit else None
    before = _Before.take(repo, paths)
    changed = any(before.files[p] != d for p, d in data.items())
    try:
        _write_files(data, before.made_dirs)
        if repo is None:
            return CommitResult(None, changed, skipped=False)
        return _commit_files(repo, _rel(root, paths), message, changed)
    except git.HookExecutionError as e:
        before.restore()
        raise _hook_failed(e) from None
    except (git.GitError, OSError, ValueError) as e:
        before.restore()
        raise CommitError(f"git commit of the plan failed; plan files and history left as they "
                          f"were: {type(e).__name__}: {e}") from None
    except BaseException:
        before.restore()
        raise
