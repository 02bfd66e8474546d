"""What the kvcert CLI reads and writes, checked before any model is loaded.

    ap = Parser(prog="kvcert")             # argparse that raises UsageError (one line) instead of exiting
    p.add_argument("--sinks", type=integer)  # ASCII integers / finite ASCII floats only
    text = read_prompt(path)               # UTF-8, non-empty, readable, else UsageError
    check_out(path)                        # --out writable, not a file, not a directory of someone else's files
    with staged(path) as tmp: write(tmp)   # written to a sibling temp dir, renamed onto `path` at the end

Every failure is a UsageError with a one-line message; `one_line` makes any message safe to print.
"""

import argparse
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

# The shipped model's shape (fast.integrations.model), for the checks made before it loads;
# the loaded model's own config is checked again before generation starts.
SMOLLM2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                          hidden_size=576, max_position_embeddings=8192)


class UsageError(Exception):
    """Bad input: reported as one line on stderr and exit status 2, no traceback."""


def one_line(msg):
    """msg with every control character (newlines included) escaped: always one printable line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(msg))


class Parser(argparse.ArgumentParser):
    """argparse whose errors are UsageError (one line, no usage block, no SystemExit)."""

    def error(self, message):
        raise UsageError(message)


def integer(text):
    """An integer written in ASCII digits ('-12', '3'); int() would also take '٣', ' 3 ' or '1_0'."""
    body = text[1:] if text[:1] in "+-" else text
    if not (body.isascii() and body.isdigit()):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    return int(text)


def real(text):
    """A finite number written in ASCII ('1e-3', '0.2'); float() would also take 'nan', 'inf' or '٠.٢'."""
    try:
        if not text.isascii() or "_" in text:
            raise ValueError
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def read_prompt(path, what="prompt file"):
    """The text of a prompt file: it must exist, be readable, be UTF-8 and hold more than whitespace."""
    p = Path(path)
    try:
        if not p.is_file():
            raise UsageError(f"{what} not found (or not a regular file): {path}")
        data = p.read_bytes()
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise UsageError(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    if not text.strip():
        raise UsageError(f"{what} {path} is empty: give a prompt")
    return text


# ---- output directories ----

TRACE_FILES = frozenset({"trace.npz", "trace.json", "bound_heatmap.png", "head_profile.png", "eviction_heatmap.png"})


def _ours(d, depth=1):
    """True when directory d holds nothing but kvcert trace files (or, up to `depth` levels down,
    directories of them): something a new run may replace without losing anyone's data."""
    for e in d.iterdir():
        if e.is_symlink() or not (e.name in TRACE_FILES and e.is_file() or depth and e.is_dir() and _ours(e, depth - 1)):
            return False
    return True


def _writable_place(out, path, flag):
    """The nearest existing ancestor of `out` is a directory we can create entries in."""
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is not a directory")
    # the real test (os.access says yes to root on a read-only file system); leaves nothing behind
    os.rmdir(tempfile.mkdtemp(prefix=".kvcert-check-", dir=parent))


def _absolute(path, flag):
    try:
        out = Path(os.path.abspath(path))  # '..' resolved by name, as the shell would
    except ValueError as e:  # a NUL byte in the path
        raise UsageError(f"{flag} {path!r}: {e}") from None
    if out == out.parent or out in Path.cwd().parents or out == Path.cwd():
        raise UsageError(f"{flag} {path}: refusing to replace the current directory or one above it")
    return out


def check_out(path, flag="--out"):
    """Refuse, before any work, an output directory that cannot be written or would destroy data:
    a file, a path under a file, an unwritable place, or a directory holding other files than
    kvcert traces (an existing trace directory, e.g. runs/latest, is replaced at the end)."""
    out = _absolute(path, flag)
    try:
        if out.is_symlink() or out.exists() and not out.is_dir():
            raise UsageError(f"{flag} {path}: exists and is not a directory")
        if out.is_dir() and not _ours(out):
            raise UsageError(f"{flag} {path}: the directory holds files that are not a kvcert trace; "
                             "give a new or an empty directory")
        _writable_place(out, path, flag)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise UsageError(f"{flag} {path}: cannot write there ({getattr(e, 'strerror', None) or e})") from None
    return out


def check_out_file(path, flag="--out"):
    """Refuse, before any work, an output file that cannot be written: a directory, a path under
    a file, an unwritable place. An existing file is replaced (atomically) at the end."""
    p = _absolute(path, flag)
    try:
        if p.is_dir():
            raise UsageError(f"{flag} {path}: is a directory, expected a file name")
        if p.is_symlink() or p.exists() and not p.is_file():
            raise UsageError(f"{flag} {path}: exists and is not a regular file")
        _writable_place(p, path, flag)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise UsageError(f"{flag} {path}: cannot write there ({getattr(e, 'strerror', None) or e})") from None
    return p


def usual_mode(path, base):
    """mkdtemp / mkstemp make 0700 / 0600: give path the mode mkdir / open would (base & ~umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, base & ~umask)


@contextmanager
def staged(path, flag="--out"):
    """Yield a fresh temp directory next to `path`; on success it replaces `path` (an existing
    trace directory is swapped out and removed), on any failure it is removed: a reader of
    `path` never sees a half-written result."""
    out = check_out(path, flag)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        usual_mode(tmp, 0o777)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    try:
        yield tmp
        old = None
        if out.is_dir():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "x")
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"{flag} {path}: writing failed ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_file_atomic(path, text, flag="--out"):
    """Write text to a file: a temp file in the same directory renamed onto `path` at the end."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.tmp-", dir=p.parent)
        try:
            usual_mode(tmp, 0o666)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, p)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise UsageError(f"{flag} {path}: writing failed ({e.strerror or e})") from None
