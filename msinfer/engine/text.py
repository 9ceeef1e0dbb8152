"""A text that grows by pieces (a running request's decoded answer, a stream's deltas),
read-only views of it as it was, and searches in it that read each character once.

Why not a str grown by `+=`: a str cannot grow in place while anything else holds it (an
output of the previous step does), so each piece copies the whole text, and a long answer
costs the square of its length. Here appending costs the piece, len() nothing, a slice what
it reads, and str() joins the pieces once per length.
"""
import bisect


class GrowingText:
    """An append-only text kept as the pieces it grew by (and where each ends)."""

    __slots__ = ("pieces", "ends", "_joined")

    def __init__(self):
        self.pieces, self.ends, self._joined = [], [], ""

    def append(self, piece):
        if piece:
            self.pieces.append(piece)
            self.ends.append(len(self) + len(piece))

    def __len__(self):
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, index):
        return self.view()[index]

    def view(self):
        """The text as it is now (pieces appended later do not show), without joining it."""
        return TextSoFar(self.pieces, self.ends)

    def __str__(self):
        if len(self._joined) != len(self):
            self._joined = "".join(self.pieces)
        return self._joined

    def __repr__(self):
        return repr(str(self))


class TextSoFar:
    """The first characters of a text received in pieces (append-only lists of the pieces
    and of where each ends), as they are now, without joining them: what a running request's
    output holds as its text. len(), indexes and slices (a str of what is read) cost what is
    read, not the text's length; str() is the text; copies and pickles are str."""

    __slots__ = ("_pieces", "_ends", "_count")

    def __init__(self, pieces, ends):
        self._pieces, self._ends, self._count = pieces, ends, len(ends)

    def __len__(self):
        return self._ends[self._count - 1] if self._count else 0

    def __getitem__(self, index):
        if isinstance(index, int):
            position = index + len(self) if index < 0 else index
            if not 0 <= position < len(self):
                raise IndexError("TextSoFar index out of range")
            return self[position:position + 1]
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("TextSoFar takes indexes and slices of step 1 only")
        start, stop, _ = index.indices(len(self))
        if start >= stop:
            return ""
        ends, pieces = self._ends, self._pieces
        first = bisect.bisect_right(ends, start, 0, self._count)  # holds `start`
        last = bisect.bisect_left(ends, stop, 0, self._count)  # holds `stop - 1`
        offset = ends[first - 1] if first else 0
        if first == last:
            return pieces[first][start - offset:stop - offset]
        return "".join([pieces[first][start - offset:], *pieces[first + 1:last],
                        pieces[last][:stop - ends[last - 1]]])

    def __str__(self):
        return self[:]

    def __eq__(self, other):
        return str(self) == (str(other) if isinstance(other, TextSoFar) else other)

    def __repr__(self):
        return repr(str(self))

    def __reduce__(self):
        return str, (str(self),)


class Search:
    """Where `needle` first occurs at or after `start` in a text that only grows (a
    GrowingText, or a str that grows by appending): each call reads what the text gained
    since the last, and the len(needle) - 1 characters before that (an occurrence split
    across the two)."""

    __slots__ = ("needle", "start", "_searched", "found")

    def __init__(self, needle, start=0):
        self.needle = needle
        self.restart(start)

    def restart(self, start):
        """Search anew, from `start` on."""
        self.start, self._searched, self.found = start, start, None

    def __call__(self, text, end):
        """The first occurrence's start in text[start:end], or None (`end` never goes
        back)."""
        if self.found is None and end > self._searched:
            begin = max(self._searched - len(self.needle) + 1, self.start)
            at = text[begin:end].find(self.needle)
            if at >= 0:
                self.found = begin + at
            self._searched = end
        return self.found
