"""Re-create ``assets/corpus.txt`` from the Debian package ``r-cran-janeaustenr``.

The novel is stored there as an R character vector (one element per line) in
R's lazy-load database ``data/Rdata.rdb`` (index in ``data/Rdata.rdx``).  This
script reads that database with a tiny R-serialization (XDR) reader using the
standard library only, so neither R nor any extra Python package is needed::

    apt-get download r-cran-janeaustenr          # 1.0.0-1 (Debian 12)
    dpkg -x r-cran-janeaustenr_1.0.0-1_all.deb pkg
    python assets/extract_corpus.py \
        pkg/usr/lib/R/site-library/janeaustenr/data/Rdata persuasion \
        assets/corpus.txt

The lines are joined with ``\\n`` and a final newline is added; nothing else
is changed.  See ``assets/README.md`` for provenance.
"""

import gzip
import struct
import sys
import zlib

_NILVALUE, _EMPTYENV, _REF = 254, 242, 255
_SYM, _LIST, _CHAR = 1, 2, 9
_LGL, _INT, _REAL, _STR, _VEC = 10, 13, 14, 16, 19


class _Reader:
    def __init__(self, data):
        self.data, self.pos, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.pos = 2
        version = self._int()
        self._int(), self._int()  # writer / min reader R versions
        if version == 3:
            n = self._int()
            self.pos += n  # native encoding name

    def _int(self):
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def _real(self):
        (v,) = struct.unpack_from(">d", self.data, self.pos)
        self.pos += 8
        return v

    def item(self):
        flags = self._int()
        kind = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        if kind in (_NILVALUE, _EMPTYENV):
            return None
        if kind == _REF:
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if kind == _SYM:
            sym = ("sym", self.item())
            self.refs.append(sym)
            return sym
        if kind == _LIST:  # pairlist -> list of (tag, value)
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            return [(tag, car)] + (cdr or [])
        if kind == _CHAR:
            n = self._int()
            if n == -1:
                return None
            s = self.data[self.pos : self.pos + n].decode("utf-8")
            self.pos += n
            return s
        if kind in (_LGL, _INT, _REAL, _STR, _VEC):
            n = self._int()
            if kind in (_STR, _VEC):
                values = [self.item() for _ in range(n)]
            elif kind == _REAL:
                values = [self._real() for _ in range(n)]
            else:
                values = [self._int() for _ in range(n)]
            attrs = self.item() if has_attr else None
            return {"values": values, "attrs": attrs}
        raise ValueError(f"unsupported R SEXP type {kind}")


def _names(obj):
    return dict(obj["attrs"])[("sym", "names")]["values"]


def load_variable(base, name):
    with open(base + ".rdx", "rb") as f:
        index = _Reader(gzip.decompress(f.read())).item()
    index = dict(zip(_names(index), index["values"], strict=True))
    variables = index["variables"]
    entry = dict(zip(_names(variables), variables["values"], strict=True))[name]
    offset, length = entry["values"]
    with open(base + ".rdb", "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    # each record: 4-byte big-endian uncompressed length + zlib stream
    return _Reader(zlib.decompress(blob[4:])).item()["values"]


def main(argv):
    base, name, out = argv
    lines = load_variable(base, name)
    text = "\n".join("" if line is None else line for line in lines) + "\n"
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    print(f"wrote {out}: {len(lines)} lines, {len(text.encode('utf-8'))} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
