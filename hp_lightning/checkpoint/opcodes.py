"""A pickle's instructions, checked before any of them runs: what it calls, on what, with which sizes.

Restricting what a pickle may *name* (``find_class``) does not restrict what it does with a name:
``GLOBAL pathlib.PurePath`` then ``BUILD`` sets attributes on the class itself, for the whole process,
and a constructor a loader allows (``bytearray``, ``torch.FloatTensor``) reserves any size it is given.

:func:`check_pickle` walks the instructions :mod:`pickletools` decodes (nothing imported, called or
allocated) and tracks what each stack slot and memo entry holds; every call and ``BUILD`` is put to a
:class:`Policy` before the real unpickler reads the bytes. The trade-off: a second pass in Python
(about a microsecond per instruction), for a decision made on the instructions, not their effects.
Instructions no checkpoint writes that reach code by other routes (``INST``, ``OBJ``, ``EXT*``,
out-of-band buffers) are refused outright.
"""

from __future__ import annotations

import math
import pickletools
from typing import Any, Optional, Union


class PickleRefused(Exception):
    """The pickle asks for something its :class:`Policy` does not allow (``str(exc)`` says what)."""


class PickleDamaged(Exception):
    """The instruction stream is not one any unpickler would finish (truncated, unbalanced, unknown)."""


class _Named:
    """A value known by a name alone (shown as that name)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class Global(_Named):
    """A name a ``GLOBAL`` / ``STACK_GLOBAL`` looked up: ``"module.qualname"``."""

    __slots__ = ()


class _Kind(_Named):
    """A container or literal, known by its kind only (each kind one object, compared by identity)."""

    __slots__ = ()


class Made:
    """What a call of global ``name`` returned; ``detail`` is what the policy kept about it (a size, a count)."""

    __slots__ = ("detail", "name")

    def __init__(self, name: str, detail: Any = None) -> None:
        self.name, self.detail = name, detail

    def __repr__(self) -> str:
        return f"{self.name}(...)"


LIST, DICT, SET, BYTES, OTHER = _Kind("list"), _Kind("dict"), _Kind("set"), _Kind("bytes"), _Kind("a literal")
#: What a stack slot holds: a literal int or str as itself (sizes and names are read from them), a tuple of
#: values, a container kind, a :class:`Global` or a :class:`Made`.
Value = Union[int, str, tuple, _Kind, Global, Made]


class Policy:
    """What a pickle may do; the default allows nothing but literals and containers.

    Each hook returns what the slot then holds, or raises :class:`PickleRefused`.
    """

    #: Besides plain dicts, what ``SETITEM(S)`` may fill: objects these globals made (by name).
    mappings: frozenset[str] = frozenset({"collections.OrderedDict"})

    def named(self, module: str, name: str) -> Value:
        raise PickleRefused(f"global {module}.{name}")

    def call(self, func: Value, args: tuple, opcode: str) -> Value:
        raise PickleRefused(f"{opcode} of {func!r}")

    def build(self, inst: Value, state: Value) -> None:
        raise PickleRefused(f"BUILD on {inst!r}")

    def persistent(self, pid: Value) -> Value:
        raise PickleRefused("a persistent id (PERSID)")


#: Each instruction's handling, by name (the walk looks it up once per instruction).
_CATEGORY: dict[str, int] = {
    **dict.fromkeys(("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"), 0),
    **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), 1),
    **dict.fromkeys(("STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"), 2),
    "MARK": 3,
    **dict.fromkeys(("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"), 4),
    **dict.fromkeys(("EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"), 5),
    **dict.fromkeys(("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "LIST", "DICT", "FROZENSET"), 6),
    **dict.fromkeys(("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"), 7),
    **dict.fromkeys(("NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT"), 8),
    **dict.fromkeys(("BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8"), 9),
    **dict.fromkeys(("GLOBAL", "STACK_GLOBAL"), 10),
    **dict.fromkeys(("REDUCE", "NEWOBJ", "NEWOBJ_EX"), 11),
    "BUILD": 12,
    **dict.fromkeys(("POP", "POP_MARK", "DUP"), 13),
    **dict.fromkeys(("PERSID", "BINPERSID"), 14),
    **dict.fromkeys(("PROTO", "FRAME"), 15),
    "STOP": 16,
    **dict.fromkeys(("INST", "OBJ", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"), 17),
}
_EMPTY: dict[str, Value] = {"EMPTY_LIST": LIST, "EMPTY_DICT": DICT, "EMPTY_SET": SET, "LIST": LIST, "DICT": DICT, "FROZENSET": OTHER}


class _Machine:
    """The unpickler's stack, marks and memo, holding :data:`Value` s; as in CPython, nothing below the last MARK may be taken."""

    def __init__(self) -> None:
        self.stack: list[Value] = []
        self.marks: list[int] = []
        self.memo: dict[int, Value] = {}
        self.fence = 0

    def pop(self) -> Value:
        if len(self.stack) <= self.fence:
            raise PickleDamaged("a value is taken from an empty stack")
        return self.stack.pop()

    def top(self) -> Value:
        if len(self.stack) <= self.fence:
            raise PickleDamaged("an instruction needs a value the stack does not hold")
        return self.stack[-1]

    def pop_mark(self) -> list[Value]:
        if not self.marks:
            raise PickleDamaged("an instruction needs a MARK that was never set")
        start = self.marks.pop()
        self.fence = self.marks[-1] if self.marks else 0
        items = self.stack[start:]
        del self.stack[start:]
        return items


def check_pickle(data: bytes, policy: Policy) -> None:
    """Walk ``data``'s instructions to ``STOP``, putting every global, call and ``BUILD`` to ``policy``.

    Raises PickleRefused (naming what was refused) or PickleDamaged (a stream no unpickler would finish).
    """
    m = _Machine()
    stack, memo, category = m.stack, m.memo, _CATEGORY
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            kind = category.get(name, -1)
            if kind == 0:  # MEMOIZE, PUT
                if len(stack) <= m.fence:
                    raise PickleDamaged("a memo entry is written from an empty stack")
                memo[len(memo) if name == "MEMOIZE" else int(arg or 0)] = stack[-1]
            elif kind == 1:  # GET
                if arg not in memo:
                    raise PickleDamaged(f"memo entry {arg!r} is read before it is written")
                stack.append(memo[arg])
            elif kind == 2:
                stack.append(arg if isinstance(arg, str) else OTHER)
            elif kind == 3:  # MARK
                m.fence = len(stack)
                m.marks.append(m.fence)
            elif kind == 4:
                stack.append(arg if type(arg) is int else OTHER)
            elif kind == 5:  # tuples
                if name == "TUPLE":
                    stack.append(tuple(m.pop_mark()))
                elif name == "EMPTY_TUPLE":
                    stack.append(())
                else:
                    items = [m.pop() for _ in range(int(name[-1]))]
                    stack.append(tuple(items[::-1]))
            elif kind == 6:  # containers: empty, or built from the items since the last MARK
                if name in ("LIST", "DICT", "FROZENSET"):
                    items = m.pop_mark()
                    if name == "DICT" and len(items) % 2:
                        raise PickleDamaged("DICT with an odd number of items")
                stack.append(_EMPTY[name])
            elif kind == 7:
                _fill(m, name, policy)
            elif kind == 8:
                stack.append(OTHER)
            elif kind == 9:
                stack.append(BYTES)
            elif kind == 10:
                if name == "GLOBAL":
                    module, _, qualname = str(arg).partition(" ")
                else:
                    qualname_value, module_value = m.pop(), m.pop()
                    if not isinstance(module_value, str) or not isinstance(qualname_value, str):
                        raise PickleDamaged("STACK_GLOBAL of values that are not strings")
                    module, qualname = module_value, qualname_value
                stack.append(policy.named(module, qualname))
            elif kind == 11:  # REDUCE(func, args), NEWOBJ(cls, args), NEWOBJ_EX(cls, args, kwargs)
                if name == "NEWOBJ_EX":
                    m.pop()  # keyword arguments: a dict, held as its kind only
                args = m.pop()
                func = m.pop()
                stack.append(policy.call(func, _args(args, name), name))
            elif kind == 12:  # BUILD
                state = m.pop()
                policy.build(m.top(), state)
            elif kind == 13:
                if name == "POP_MARK":
                    m.pop_mark()
                elif name == "DUP":
                    stack.append(m.top())
                elif m.marks and m.marks[-1] == len(stack):  # as CPython's unpickler does: POP right after MARK drops the mark
                    m.marks.pop()
                    m.fence = m.marks[-1] if m.marks else 0
                else:
                    m.pop()
            elif kind == 14:
                stack.append(policy.persistent(str(arg) if name == "PERSID" else m.pop()))
            elif kind == 16:  # STOP
                if len(stack) != 1 or m.marks:
                    raise PickleDamaged("STOP with a stack that does not hold exactly one object")
                return
            elif kind == 17:
                raise PickleRefused(f"the {name} instruction (no checkpoint writes it; it reaches code by other routes)")
            elif kind != 15:
                raise PickleDamaged(f"instruction {name} is not understood")
    except (ValueError, EOFError, KeyError) as exc:  # pickletools' own account of bytes it cannot decode
        raise PickleDamaged(f"{type(exc).__name__}: {exc}") from None
    raise PickleDamaged("the pickle ends before its STOP")


def _args(value: Value, opcode: str) -> tuple:
    if not isinstance(value, tuple):
        raise PickleDamaged(f"{opcode} with arguments that are not a tuple")
    return value


def _fill(m: _Machine, name: str, policy: Policy) -> None:
    """APPEND(S), SETITEM(S), ADDITEMS: the target must be a container of that kind (CPython's unpickler would
    otherwise call the target's own ``append`` / ``extend`` / ``add`` / ``__setitem__``, whatever it is)."""
    if name in ("APPENDS", "SETITEMS", "ADDITEMS"):
        items = m.pop_mark()
        if name == "SETITEMS" and len(items) % 2:
            raise PickleDamaged("SETITEMS with an odd number of items")
    else:
        m.pop()
        if name == "SETITEM":
            m.pop()
    target = m.top()
    wanted = {"APPEND": LIST, "APPENDS": LIST, "ADDITEMS": SET}.get(name, DICT)
    if target is wanted or (wanted is DICT and isinstance(target, Made) and target.name in policy.mappings):
        return
    raise PickleRefused(f"{name} on {target!r} (only a {wanted!r} may be filled that way)")


def size_of(value: Value) -> Optional[int]:
    """The element count a literal shape (a tuple of ints, or ``torch.Size`` of one) declares; None if not literal."""
    if isinstance(value, Made) and value.name == "torch.Size":
        value = value.detail
    if not isinstance(value, tuple) or not all(type(n) is int and n >= 0 for n in value):
        return None
    return math.prod(value)
