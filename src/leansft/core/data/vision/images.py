"""Reading a conversation's images: files relative to the data file, data URIs or base64, never a download.

Every image is decoded whole (``Image.load``) when the data is prepared, so a missing, unreadable or truncated
file is one error naming its row and file there, not a crash at step 3,000.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from leansft.core.errors import DataError

_DATA_URI = re.compile(r"data:image/[\w.+-]+;base64,", re.I)
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]+")


def describe(ref: str) -> str:
    """A reference as an error names it (base64 cut short)."""
    return ref if len(ref) < 120 and not _DATA_URI.match(ref) else ref[:40] + "..."


def _decoded(ref: str) -> bytes | None:
    """The bytes of a data URI or of bare base64 text (long and of base64's alphabet only), else None."""
    m = _DATA_URI.match(ref)
    text = ref[m.end():] if m else ref
    if not m and (len(ref) < 256 or not _BASE64.fullmatch(ref)):
        return None
    try:
        return base64.b64decode(text, validate=False)
    except (binascii.Error, ValueError):
        return None


def image_path(ref: str, base: Path) -> Path | None:
    """The file a reference names, relative to ``base`` (the data file's folder); None for inline data."""
    if _decoded(ref) is not None:
        return None
    if re.match(r"[a-z][a-z0-9+.-]*://", ref, re.I) and not ref.lower().startswith("file://"):
        return Path(ref)  # a URL: refused in ``open_image`` (nothing is downloaded)
    path = Path(ref.removeprefix("file://")).expanduser()
    return path if path.is_absolute() else base / path


def open_image(ref: str, base: Path, *, file: str, row: int | None) -> Image.Image:
    """The image ``ref`` names, decoded whole and in RGB; any failure is a ``DataError`` naming row and image
    (``row`` None: read again for a batch, after the data was prepared)."""
    what = describe(ref)
    if re.match(r"https?://|s3://|gs://", ref, re.I):
        raise DataError(f"image {what} is a URL: leansft downloads nothing", file=file, row=row, field="images",
                        hint="download the images and refer to them by path (relative to the data file)")
    data = _decoded(ref)
    path = image_path(ref, base)
    try:
        if data is not None:
            image = Image.open(io.BytesIO(data))
        else:
            if not path.is_file():
                raise DataError(f"image {what} not found ({path})", file=file, row=row, field="images",
                                hint="image paths are relative to the data file's folder")
            image = Image.open(path)
        image.load()  # decodes every byte: a truncated file fails here
        return image.convert("RGB")
    except DataError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise DataError(f"image {what} cannot be read: {type(err).__name__}: {str(err)[:200]}", file=file, row=row,
                        field="images") from None
