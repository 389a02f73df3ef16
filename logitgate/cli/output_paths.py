"""Where a command writes what the user asked for (`--out`): a path that cannot be written is the
user's mistake, so it is a ValueError naming the option and the path (exit status 2), never an
OSError's traceback; it is checked before the command's work, and nothing is written on failure."""
from __future__ import annotations

from pathlib import Path


def _refuse(option: str, path: Path, reason: str) -> ValueError:
    return ValueError(f"{option} {str(path)!r} cannot be written: {reason}")


def check_output_file(path: str | Path, option: str = "--out") -> Path:
    """The file `path` as a Path, once its folder exists and it is not a folder itself."""
    path = Path(path)
    if path.is_dir():
        raise _refuse(option, path, "it is a folder; name a file")
    folder = path.parent
    if not folder.is_dir():
        reason = "its folder is a file" if folder.exists() else f"its folder {str(folder)!r} does not exist"
        raise _refuse(option, path, reason)
    return path


def write_output_file(path: str | Path, text: str, option: str = "--out") -> None:
    """Write `text` (UTF-8) to the file `path`; ValueError naming it when that fails."""
    path = check_output_file(path, option)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise _refuse(option, path, err.strerror or str(err)) from None


def make_output_folder(path: str | Path, option: str = "--out") -> Path:
    """The folder `path`, created with its parents when missing; ValueError naming it when it
    cannot be (a file is in the way, no permission)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        reason = "a file is in the way" if isinstance(err, (FileExistsError, NotADirectoryError)) else err.strerror
        raise _refuse(option, path, reason or str(err)) from None
    return path
