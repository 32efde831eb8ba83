"""A pickle's opcodes read into inert values: nothing is imported, called or hashed, and the cost is linear.

torch keeps its rendezvous state as a pickle, and any holder of the cluster token can write the key it lives at, so
an agent must not hand torch bytes it did not check (``ifrt/torchrun/state.py``). ``read`` is the first half of that
check: it follows the unpickler's stack machine for the opcodes of protocols 4 and 5 that a pickle of plain objects
uses, but builds only the records below. A class is resolved from an allow-list and never called (an object is a
``Call`` record); a dict is a list of pairs and a set a list of items, so no key is ever hashed; every integer's
length is read before the integer is (at most ``MAX_INT_BYTES``); the objects built of each class are counted as
they appear (``limits``); tuples nest at most ``MAX_TUPLE_DEPTH`` deep; memo entries are written in order. Each opcode
does work bounded by what it pops, so the whole read is linear in the bytes, whatever they hold.
"""

from __future__ import annotations

import pickletools
from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_INT_BYTES = 8
"""The longest integer a state may hold, in bytes (19 decimal digits): a round, a pid, a rank, a timedelta's part."""
MAX_TUPLE_DEPTH = 4
"""Tuples in a state are constructor arguments, one level deep; deeper ones are refused as they are read."""
PROTOCOLS = range(4, 6)
"""The pickle protocols read here: torch's state holder writes ``pickle.DEFAULT_PROTOCOL`` (4; 5 from Python 3.14);
protocols 2 and 3 name classes with the opcode GLOBAL, which is not read."""

_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}


class Refused(ValueError):
    """What a state's bytes hold instead of torch's rendezvous state (the reason, for the operator).

    ``other_torch``: the bytes look like a state of a torch whose layout this check does not know."""

    def __init__(self, reason: str, other_torch: bool = False) -> None:
        super().__init__(reason)
        self.other_torch = other_torch


@dataclass(eq=False)
class Class:
    """A class the pickle names (STACK_GLOBAL), resolved from the allow-list; never called here."""

    cls: type


@dataclass(eq=False)
class Call:
    """An object the pickle would build: ``cls`` called (REDUCE) or created (NEWOBJ) with ``args``, then given
    ``state`` (BUILD's dict, as pairs). ``built`` is for the checker: the object it made of this record, once."""

    cls: type
    args: tuple
    how: str
    state: Pairs | None = None
    built: object = None


@dataclass(eq=False)
class Pairs:
    """A dict, as its (key, value) pairs in the order the pickle adds them (duplicates kept: nothing is hashed)."""

    items: list = field(default_factory=list)


@dataclass(eq=False)
class Items:
    """A set (``kind`` "set") or a list (``kind`` "list"), as its items in order (nothing is hashed)."""

    kind: str
    items: list = field(default_factory=list)


@dataclass(eq=False)
class Tuple:
    """A tuple and how deep tuples nest in it (1 for a tuple of no tuples)."""

    items: tuple
    depth: int


def shown(text: str) -> str:
    """A name read from the bytes, fit for a log line: as it is when short and printable, else quoted and escaped."""
    return text if text.isprintable() and len(text) <= 200 else repr(text[:200])


def read(data: bytes, classes: Mapping[tuple[str, str], type], limits: Mapping[type, int]) -> object:
    """The value ``data`` pickles, as the records above; Refused (naming the opcode and its byte) for anything the
    pickle of a plain object would not hold, a class outside ``classes`` (by module and qualified name), more objects
    of a class than ``limits`` allows, or bytes that are no well-formed pickle."""
    stack: list = []
    metastack: list[list] = []
    memo: list = []
    made = dict.fromkeys(limits, 0)  # keyed by the allowed classes only: constants, not the caller's values
    pos, end = 0, len(data)

    def take(n: int) -> bytes:
        nonlocal pos
        if n > end - pos:
            raise Refused(f"it is no well-formed pickle (its {name} at byte {at} needs {n} bytes, "
                          f"{end - pos} are left)")
        pos += n
        return data[pos - n:pos]

    def length(size: int) -> int:
        return int.from_bytes(take(size), "little")

    def pop() -> object:
        if not stack:
            raise Refused(f"its {name} at byte {at} takes more than the stack holds")
        return stack.pop()

    def pop_mark() -> list:
        nonlocal stack
        if not metastack:
            raise Refused(f"its {name} at byte {at} has no mark")
        items, stack = stack, metastack.pop()
        return items

    def top(kind: type, what: str) -> object:
        if not stack or type(stack[-1]) is not kind or (kind is Items and stack[-1].kind != what):
            raise Refused(f"its {name} at byte {at} adds to something that is no {what}")
        return stack[-1]

    def text(raw: bytes) -> str:
        try:
            return raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise Refused(f"it is no well-formed pickle (its {name} at byte {at}: {e})") from None

    def integer(size: int) -> int:
        if size > MAX_INT_BYTES:
            raise Refused(f"its {name} at byte {at} is an integer of {size} bytes: a state holds none longer than "
                          f"{MAX_INT_BYTES} (a round, a pid, a rank)")
        return int.from_bytes(take(size), "little", signed=True)

    while True:
        if pos >= end:
            raise Refused("it is no well-formed pickle (it ends before its STOP opcode)")
        at, code = pos, data[pos]
        name = _NAMES.get(code, f"opcode {code:#04x}")
        pos += 1
        if code == 0x8C:  # SHORT_BINUNICODE
            stack.append(text(take(length(1))))
        elif code == 0x94:  # MEMOIZE
            if not stack:
                raise Refused(f"its MEMOIZE at byte {at} memoizes an empty stack")
            memo.append(stack[-1])
        elif code in (0x71, 0x72):  # BINPUT, LONG_BINPUT
            index = length(1 if code == 0x71 else 4)
            if not stack:
                raise Refused(f"its {name} at byte {at} memoizes an empty stack")
            if index > len(memo):  # the unpickler would size its memo table to the index
                raise Refused(f"its {name} at byte {at} skips to memo {index} (a pickler writes them in order)")
            memo[index:index + 1] = [stack[-1]]
        elif code in (0x68, 0x6A):  # BINGET, LONG_BINGET
            index = length(1 if code == 0x68 else 4)
            if index >= len(memo):
                raise Refused(f"its {name} at byte {at} reads memo {index}, never written")
            stack.append(memo[index])
        elif code in (0x4B, 0x4D):  # BININT1, BININT2
            stack.append(length(1 if code == 0x4B else 2))
        elif code == 0x4A:  # BININT
            stack.append(int.from_bytes(take(4), "little", signed=True))
        elif code in (0x8A, 0x8B):  # LONG1, LONG4: the length first, so no long integer is ever built
            size = length(1) if code == 0x8A else int.from_bytes(take(4), "little", signed=True)
            if size < 0:
                raise Refused(f"it is no well-formed pickle (its {name} at byte {at} has a negative length)")
            stack.append(integer(size))
        elif code in (0x58, 0x8D):  # BINUNICODE, BINUNICODE8
            stack.append(text(take(length(4 if code == 0x58 else 8))))
        elif code in (0x43, 0x42, 0x8E):  # SHORT_BINBYTES, BINBYTES, BINBYTES8
            stack.append(take(length({0x43: 1, 0x42: 4, 0x8E: 8}[code])))
        elif code in (0x4E, 0x88, 0x89):  # NONE, NEWTRUE, NEWFALSE
            stack.append({0x4E: None, 0x88: True, 0x89: False}[code])
        elif code == 0x7D:  # EMPTY_DICT
            stack.append(Pairs())
        elif code in (0x8F, 0x5D):  # EMPTY_SET, EMPTY_LIST
            stack.append(Items("set" if code == 0x8F else "list"))
        elif code == 0x29:  # EMPTY_TUPLE
            stack.append(Tuple((), 1))
        elif code == 0x28:  # MARK
            metastack.append(stack)
            stack = []
        elif code in (0x85, 0x86, 0x87, 0x74):  # TUPLE1, TUPLE2, TUPLE3, TUPLE
            items = pop_mark() if code == 0x74 else [pop() for _ in range(code - 0x84)][::-1]
            depth = 1 + max((i.depth for i in items if type(i) is Tuple), default=0)
            if depth > MAX_TUPLE_DEPTH:
                raise Refused(f"it nests tuples more than {MAX_TUPLE_DEPTH} deep (at byte {at})")
            stack.append(Tuple(tuple(items), depth))
        elif code == 0x73:  # SETITEM
            value, key = pop(), pop()
            top(Pairs, "dict").items.append((key, value))
        elif code == 0x75:  # SETITEMS
            items = pop_mark()
            if len(items) % 2:
                raise Refused(f"its SETITEMS at byte {at} has a key without a value")
            top(Pairs, "dict").items.extend(zip(items[::2], items[1::2], strict=True))
        elif code in (0x61, 0x65, 0x90):  # APPEND, APPENDS, ADDITEMS
            items = [pop()] if code == 0x61 else pop_mark()
            top(Items, "set" if code == 0x90 else "list").items.extend(items)
        elif code == 0x93:  # STACK_GLOBAL
            qualname, module = pop(), pop()
            if type(module) is not str or type(qualname) is not str:
                raise Refused(f"its STACK_GLOBAL at byte {at} names a class by something other than strings")
            cls = classes.get((module, qualname))
            if cls is None:
                allowed = ", ".join(f"{m}.{n}" for m, n in classes)
                raise Refused(f"it names {shown(module)}.{shown(qualname)}, which is no class of torch's rendezvous "
                              f"state ({allowed})")
            stack.append(Class(cls))
        elif code in (0x52, 0x81):  # REDUCE, NEWOBJ
            args, called = pop(), pop()
            if type(called) is not Class or type(args) is not Tuple:
                raise Refused(f"its {name} at byte {at} calls something other than a class it names")
            if called.cls in made:
                made[called.cls] += 1
                if made[called.cls] > limits[called.cls]:
                    raise Refused(f"it holds more than {limits[called.cls]} {called.cls.__name__} (at byte {at}), "
                                  f"the most a state may hold")
            stack.append(Call(called.cls, args.items, name))
        elif code == 0x62:  # BUILD
            state = pop()
            if type(state) is not Pairs or not stack or type(stack[-1]) is not Call or stack[-1].state is not None:
                raise Refused(f"its BUILD at byte {at} sets something other than a dict on an object, once")
            stack[-1].state = state
        elif code == 0x32:  # DUP
            stack.append(stack[-1] if stack else pop())
        elif code == 0x30:  # POP: the top item, or (the stack empty) the last mark
            if stack:
                stack.pop()
            else:
                pop_mark()
        elif code == 0x31:  # POP_MARK
            pop_mark()
        elif code == 0x80:  # PROTO
            protocol = length(1)
            if protocol not in PROTOCOLS:
                raise Refused(f"it is a pickle of protocol {protocol}; ifrt reads protocols {PROTOCOLS[0]} and "
                              f"{PROTOCOLS[-1]}, those torch's state holder writes", other_torch=True)
        elif code == 0x95:  # FRAME: a hint for buffering, its opcodes follow inline
            take(8)
        elif code == 0x2E:  # STOP
            if len(stack) != 1 or metastack:
                raise Refused(f"its STOP at byte {at} leaves {len(stack)} values and {len(metastack)} marks, "
                              f"not one value")
            if pos != end:
                raise Refused(f"it goes on for {end - pos} bytes after its STOP at byte {at}")
            return stack[0]
        elif code in _NAMES:
            raise Refused(f"it uses the opcode {name} (at byte {at}), which no pickle of torch's rendezvous state "
                          f"does")
        else:
            raise Refused(f"it is no well-formed pickle (unknown {name} at byte {at})")


__all__ = ["MAX_INT_BYTES", "MAX_TUPLE_DEPTH", "PROTOCOLS", "Call", "Class", "Items", "Pairs", "Refused", "Tuple",
           "read", "shown"]
