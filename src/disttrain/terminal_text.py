"""Text from a folder someone else wrote, made safe to print (docs/security.md).

A manifest's file names, keys and values, and every message that quotes them, are
the folder author's text. Printed as they are, an escape sequence in them reaches the
terminal: `ESC [ 31 m` recolours what follows, others move the cursor, rewrite the
window's title or hide a link (OSC 8), and a carriage return overwrites what came
before on the line. `shown` writes each character that is not printable as its Python
escape (`\\x1b`, `\\r`, `\\u202e`), so the terminal shows the text exactly, control
characters included, and acts on none of them. Every place disttrain prints such text
goes through it: the one-line errors (`worker_notes.write_user_error`), `disttrain
ckpt verify` and `disttrain ckpt inspect`.
"""

from __future__ import annotations


def shown(text: object, *, lines: bool = False) -> str:
    """`str(text)` with every character `str.isprintable` refuses written as its
    Python escape, as `repr` writes it: C0 and C1 controls (ESC, BEL, CR, tab, ...),
    DEL, Unicode format characters (the bidirectional overrides), line and paragraph
    separators. With `lines`, a newline is kept (a message of several lines); every
    other one stays escaped. The result holds no control character but those newlines."""
    s = str(text)
    if s.isprintable():
        return s  # the common case: nothing to escape
    return "".join(c if c.isprintable() or (lines and c == "\n") else repr(c)[1:-1] for c in s)
