"""The restricted unpickler of a first-format checkpoint's `.metadata` (`dcp_read`).

A pickle is a program: besides naming globals it calls them (REDUCE, NEWOBJ) and sets
state on whatever object is on its stack (BUILD). So, beyond resolving only the globals
DCP's metadata is made of (`allowed_globals`), `MetadataUnpickler` runs pickle's own
interpreter (the pure-Python one, whose opcodes can be replaced one by one) with each
opcode that calls or sets something checked first:

- a call (REDUCE, NEWOBJ) is made only to an allowed class (or torch's `_get_layout`),
  with arguments that are allowed values;
- BUILD sets state only on an instance (never on a class) of an allowed class: the
  fields its dataclass declares, or the tuple of its own `__setstate__`;
- APPEND, SETITEM and ADDITEMS fill only lists, dicts and sets, and a dict's key or a
  set's item (hashed as it goes in) holds at most `MAX_KEY` objects;
- the opcodes DCP's metadata never holds (INST, OBJ, NEWOBJ_EX, the extension
  registry, persistent ids) are refused.

Allowed values are None, bools, numbers, strings, bytes, torch dtypes, layouts and
memory formats, and lists, tuples, dicts and sets of them and of instances of the
allowed classes. Any refusal raises `CheckpointUnsafe` naming the file and what it
asked for, before that opcode did anything.

What `load` returns is checked the same way once more, as a whole: an APPEND or
SETITEM may fill a list or dict after a call or BUILD was handed it. A pickle may
share one object between many places (its memo), so a check visits each object once
per depth it is reached at, and all checks of one pickle together visit at most
`VISITS_PER_BYTE` objects per byte of it (plus `MIN_VISITS`): a pickle of a few
hundred bytes that shares its way to 2^40 paths is refused, not walked.
"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import reprlib
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import torch

from disttrain.checkpoint.checkpoint_errors import CheckpointUnsafe
from disttrain.runtime import torch_compat

_BASE: dict[int, Any] = dict(torch_compat.PythonUnpickler.dispatch)  # pickle's own opcodes, called after a check

MAX_DEPTH = 32
"""How deeply a value in DCP's metadata may nest (it nests three or four levels)."""

VISITS_PER_BYTE = 8
"""How many objects the checks of one pickle may visit per byte of it; DCP's own
metadata needs less than one (each object is checked by the call or BUILD that takes it
and by each one around it, three or four levels)."""

MIN_VISITS = 100_000
"""Visits any pickle may make, however short."""

MAX_KEY = 256
"""The most objects a dict key or set item may hold, counted along every path (a
tuple hashes and compares every path through it, shared objects again each time);
DCP's keys are strings and `MetadataIndex`es of a dozen."""

_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.layout, torch.memory_format)


def allowed_globals() -> dict[tuple[str, str], object]:
    """Every global DCP's pickled metadata names, (module, name) -> the object: its
    dataclasses, dtypes, `torch.Size`, the `PosixPath` of `StorageMeta.checkpoint_id`,
    and the private ones (`torch_compat.dcp_metadata_private_globals`). None of them
    runs anything but building a value, whatever arguments a pickle gives it."""
    from torch.distributed.checkpoint import metadata

    found: dict[tuple[str, str], object] = {("torch", "Size"): torch.Size, ("pathlib", "PosixPath"): pathlib.PosixPath}
    found.update((("torch", name), value) for name, value in vars(torch).items() if isinstance(value, torch.dtype))
    for name in (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
    ):
        found[(metadata.__name__, name)] = getattr(metadata, name)
    found.update(torch_compat.dcp_metadata_private_globals())
    return found


class _Brief(reprlib.Repr):
    """`reprlib`'s repr (a few items of each container, a few levels deep), which walks
    dataclasses the same way instead of through their own unbounded `repr`."""

    def repr_instance(self, x: Any, level: int) -> str:
        if not dataclasses.is_dataclass(x) or isinstance(x, type):
            return super().repr_instance(x, level)
        if level <= 0:
            return f"{type(x).__name__}(...)"
        parts = (f"{f.name}={self.repr1(getattr(x, f.name, None), level - 1)}" for f in dataclasses.fields(x))
        return f"{type(x).__name__}({', '.join(parts)})"


def brief(value: Any, limit: int = 60) -> str:
    """A short text of `value`, which a checkpoint's author built, for a message: a
    string's first `limit` characters, anything else a repr of a few of its items a
    few levels deep, cut to `limit`. Its work is bounded whatever `value` shares or
    nests (`str` of a list shared down 40 levels walks 2^40 paths); a value whose
    repr raises is named by its type."""
    if isinstance(value, str):
        return value[:limit]
    short = _Brief()
    short.maxlevel, short.maxstring, short.maxother = 3, limit, limit
    try:
        return short.repr(value)[:limit]
    except (ValueError, OverflowError, TypeError, RecursionError):
        return f"a {type(value).__name__}"


def _own_setstate(cls: type):
    """`cls.__setstate__` when a class of its own defines one (not `object`), else None."""
    for base in cls.__mro__[:-1]:
        if "__setstate__" in vars(base):
            return vars(base)["__setstate__"]
    return None


class MetadataUnpickler(torch_compat.PythonUnpickler):
    """Unpickles DCP's metadata from `file` (the module docstring says what it
    allows); any other global, call or state raises `CheckpointUnsafe` naming
    `path`, before anything of it ran."""

    dispatch: ClassVar[dict[int, Any]] = dict(torch_compat.PythonUnpickler.dispatch)
    stack: list[Any]  # pickle's own, declared for the type checker
    metastack: list[list[Any]]

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path, self.allowed = path, allowed_globals()
        start = file.tell()
        self.visits_left = MIN_VISITS + VISITS_PER_BYTE * (file.seek(0, 2) - start)
        file.seek(start)
        self.classes: set[Any] = {v for v in self.allowed.values() if isinstance(v, type)}
        self.callables: set[Any] = self.classes | {
            v for v in self.allowed.values() if callable(v) and not isinstance(v, type)
        }

    def refuse(self, what: str) -> NoReturn:
        raise CheckpointUnsafe(
            f"{self.path} {what}, which is no part of DCP's checkpoint metadata: refused, "
            f"nothing of it ran. The folder was altered or not written by disttrain; do not load it.",
            self.path.name,
        )

    def find_class(self, module: str, name: str):
        found = self.allowed.get((module, name))
        if found is None:
            self.refuse(f"asks its unpickler for {module}.{name}")
        return found

    def persistent_load(self, pid):
        self.refuse(f"holds a persistent id ({brief(pid)!r})")

    def load(self) -> Any:
        """The unpickled value, checked as a whole by `check_value` after the last
        opcode ran. Raises `CheckpointUnsafe` as the module docstring says."""
        value = super().load()
        self.check_value(value)
        return value

    def check_value(self, value: Any) -> None:
        """Refuse `value` unless it is an allowed value (the module docstring), nested
        at most `MAX_DEPTH` deep along every path. Checked without recursion; an
        object is walked again only when reached deeper than before, and each visit
        spends one of `visits_left` (none left: refused)."""
        deepest: dict[int, int] = {}  # id -> the deepest level it was walked at
        todo = [(value, 0)]
        while todo:
            item, depth = todo.pop()
            self.visits_left -= 1
            if self.visits_left < 0:
                self.refuse("takes more work to check than its size allows (objects shared by many paths)")
            if depth > MAX_DEPTH:
                self.refuse(f"nests a value more than {MAX_DEPTH} levels deep")
            kind = type(item)
            if kind in _LEAVES:
                continue
            if deepest.get(id(item), -1) >= depth:  # no leaf: alive as long as `value`, its id its own
                continue
            deepest[id(item)] = depth
            if kind in (list, tuple, set, frozenset, torch.Size):
                todo += [(v, depth + 1) for v in item]
            elif kind is dict:
                todo += [(v, depth + 1) for pair in item.items() for v in pair]
            elif kind in self.classes:
                if dataclasses.is_dataclass(item):
                    todo += [(v, depth + 1) for v in vars(item).values()]
            else:
                self.refuse(f"builds from a {kind.__name__} ({brief(item)!r})")

    def check_keys(self, keys: list[Any]) -> None:
        """Refuse any of `keys` (about to be hashed into a dict or set) that holds more
        than `MAX_KEY` objects along every path; each object spends one of `visits_left`."""
        for key in keys:
            todo, count = [key], 0
            while todo:
                item = todo.pop()
                count, self.visits_left = count + 1, self.visits_left - 1
                if count > MAX_KEY or self.visits_left < 0:
                    self.refuse(f"uses a key of more than {MAX_KEY} objects (counted along every path)")
                if type(item) in (tuple, frozenset):
                    todo += item
                elif dataclasses.is_dataclass(item) and not isinstance(item, type):
                    todo += vars(item).values()

    def load_reduce(self) -> None:
        args, func = self.stack[-1], self.stack[-2]
        if not any(func is c for c in self.callables) or type(args) is not tuple:
            self.refuse(f"calls {brief(func)}")
        self.check_value(args)
        _BASE[pickle.REDUCE[0]](self)

    def load_newobj(self) -> None:
        args, cls = self.stack[-1], self.stack[-2]
        if not any(cls is c for c in self.classes) or type(args) is not tuple:
            self.refuse(f"makes an object of {brief(cls)}")
        self.check_value(args)
        _BASE[pickle.NEWOBJ[0]](self)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        cls = type(inst)
        if isinstance(inst, type) or cls not in self.classes:
            self.refuse(f"sets state on {brief(inst)}")
        setstate = _own_setstate(cls)
        if setstate is not None and type(state) is tuple:
            self.check_value(state)
            self.stack.pop()
            setstate(inst, state)
            return
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        if type(state) is not dict or not set(state) <= fields:
            self.refuse(f"sets {brief(state)} on a {cls.__name__}, not the fields it declares")
        self.check_value(state)
        self.stack.pop()
        vars(inst).update(state)  # a frozen dataclass's fields too, as pickle does

    def _fill(self, target: Any, kind: type) -> None:
        if type(target) is not kind:
            self.refuse(f"adds items to a {type(target).__name__}, not a {kind.__name__}")

    # APPEND and SETITEM fill the object below their operands; APPENDS, SETITEMS and
    # ADDITEMS the one below their mark (the top of the stack the mark put aside)
    def load_append(self) -> None:
        self._fill(self.stack[-2], list)
        _BASE[pickle.APPEND[0]](self)

    def load_appends(self) -> None:
        self._fill(self.metastack[-1][-1], list)
        _BASE[pickle.APPENDS[0]](self)

    def load_setitem(self) -> None:
        self._fill(self.stack[-3], dict)
        self.check_keys(self.stack[-2:-1])
        _BASE[pickle.SETITEM[0]](self)

    def load_setitems(self) -> None:
        self._fill(self.metastack[-1][-1], dict)
        self.check_keys(self.stack[::2])
        _BASE[pickle.SETITEMS[0]](self)

    def load_additems(self) -> None:
        self._fill(self.metastack[-1][-1], set)
        self.check_keys(self.stack)
        _BASE[pickle.ADDITEMS[0]](self)

    # DICT and FROZENSET build theirs from what lies above their mark
    def load_dict(self) -> None:
        self.check_keys(self.stack[::2])
        _BASE[pickle.DICT[0]](self)

    def load_frozenset(self) -> None:
        self.check_keys(self.stack)
        _BASE[pickle.FROZENSET[0]](self)

    def load_refused(self) -> None:
        self.refuse("uses an opcode (INST, OBJ, NEWOBJ_EX or an extension code) that DCP's pickle never does")


for _code, _method in (
    (pickle.REDUCE, MetadataUnpickler.load_reduce),
    (pickle.NEWOBJ, MetadataUnpickler.load_newobj),
    (pickle.BUILD, MetadataUnpickler.load_build),
    (pickle.APPEND, MetadataUnpickler.load_append),
    (pickle.APPENDS, MetadataUnpickler.load_appends),
    (pickle.SETITEM, MetadataUnpickler.load_setitem),
    (pickle.SETITEMS, MetadataUnpickler.load_setitems),
    (pickle.ADDITEMS, MetadataUnpickler.load_additems),
    (pickle.DICT, MetadataUnpickler.load_dict),
    (pickle.FROZENSET, MetadataUnpickler.load_frozenset),
    *((code, MetadataUnpickler.load_refused) for code in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX)),
    *((code, MetadataUnpickler.load_refused) for code in (pickle.EXT1, pickle.EXT2, pickle.EXT4)),
):
    MetadataUnpickler.dispatch[_code[0]] = _method
