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
- APPEND, SETITEM and ADDITEMS fill only lists, dicts and sets;
- the opcodes DCP's metadata never holds (INST, OBJ, NEWOBJ_EX, the extension
  registry, persistent ids) are refused.

Allowed values are None, bools, numbers, strings, bytes, torch dtypes, layouts and
memory formats, and lists, tuples, dicts and sets of them and of instances of the
allowed classes. Any refusal raises `CheckpointUnsafe` naming the file and what it
asked for, before that opcode did anything.
"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import torch

from disttrain.checkpoint.checkpoint_errors import CheckpointUnsafe
from disttrain.runtime import torch_compat

_BASE: dict[int, Any] = dict(pickle._Unpickler.dispatch)  # pickle's own opcodes, called after a check

MAX_DEPTH = 32
"""How deeply a value in DCP's metadata may nest (it nests three or four levels)."""

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


def _own_setstate(cls: type):
    """`cls.__setstate__` when a class of its own defines one (not `object`), else None."""
    for base in cls.__mro__[:-1]:
        if "__setstate__" in vars(base):
            return vars(base)["__setstate__"]
    return None


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP's metadata from `file` (the module docstring says what it
    allows); any other global, call or state raises `CheckpointUnsafe` naming
    `path`, before anything of it ran."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # pickle's own, declared for the type checker
    metastack: list[list[Any]]

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path, self.allowed = path, allowed_globals()
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
        self.refuse(f"holds a persistent id ({str(pid)[:60]!r})")

    def check_value(self, value: Any) -> None:
        """Refuse `value` unless it is an allowed value (the module docstring), nested
        at most `MAX_DEPTH` deep; checked without recursion."""
        todo = [(value, 0)]
        while todo:
            item, depth = todo.pop()
            if depth > MAX_DEPTH:
                self.refuse(f"nests a value more than {MAX_DEPTH} levels deep")
            kind = type(item)
            if kind in (list, tuple, set, frozenset, torch.Size):
                todo += [(v, depth + 1) for v in item]
            elif kind is dict:
                todo += [(v, depth + 1) for pair in item.items() for v in pair]
            elif kind in self.classes:
                if dataclasses.is_dataclass(item):
                    todo += [(v, depth + 1) for v in vars(item).values()]
            elif kind not in _LEAVES:
                self.refuse(f"builds from a {kind.__name__} ({str(item)[:60]!r})")

    def load_reduce(self) -> None:
        args, func = self.stack[-1], self.stack[-2]
        if not any(func is c for c in self.callables) or type(args) is not tuple:
            self.refuse(f"calls {str(func)[:60]}")
        self.check_value(args)
        _BASE[pickle.REDUCE[0]](self)

    def load_newobj(self) -> None:
        args, cls = self.stack[-1], self.stack[-2]
        if not any(cls is c for c in self.classes) or type(args) is not tuple:
            self.refuse(f"makes an object of {str(cls)[:60]}")
        self.check_value(args)
        _BASE[pickle.NEWOBJ[0]](self)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        cls = type(inst)
        if isinstance(inst, type) or cls not in self.classes:
            self.refuse(f"sets state on {str(inst)[:60]}")
        setstate = _own_setstate(cls)
        if setstate is not None and type(state) is tuple:
            self.check_value(state)
            self.stack.pop()
            setstate(inst, state)
            return
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        if type(state) is not dict or not set(state) <= fields:
            self.refuse(f"sets {str(state)[:60]} on a {cls.__name__}, not the fields it declares")
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
        _BASE[pickle.SETITEM[0]](self)

    def load_setitems(self) -> None:
        self._fill(self.metastack[-1][-1], dict)
        _BASE[pickle.SETITEMS[0]](self)

    def load_additems(self) -> None:
        self._fill(self.metastack[-1][-1], set)
        _BASE[pickle.ADDITEMS[0]](self)

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
    *((code, MetadataUnpickler.load_refused) for code in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX)),
    *((code, MetadataUnpickler.load_refused) for code in (pickle.EXT1, pickle.EXT2, pickle.EXT4)),
):
    MetadataUnpickler.dispatch[_code[0]] = _method
