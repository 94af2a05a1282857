"""Reading a registered submodule or parameter without ``nn.Module.__getattr__``.

``nn.Module`` keeps submodules and parameters in its registries (``_modules``, ``_parameters``),
not in the instance's ``__dict__``, so reading ``self.qkv_proj`` first fails the ordinary lookup
and then runs ``__getattr__`` in Python: ~1 us, and a decode step of SmolLM2 read ~300 of them
on its hot path. A ``Registered`` attribute declared on the class reads the same registry entry
straight away (~0.2 us). It only reads: assignment stays ``nn.Module``'s, which registers the
value without consulting class attributes, so the registry remains the one source of truth and a
replaced submodule or parameter (a loader's, a subclass's) is seen at once.
"""

from __future__ import annotations

from typing import Generic, TypeVar, overload

from torch import nn

T = TypeVar("T")


class Registered(Generic[T]):
    """A class attribute for the instance's entry ``name`` in ``registry`` (``_modules`` for a
    submodule, ``_parameters`` for a parameter)."""

    def __init__(self, registry: str = "_modules") -> None:
        self.registry = registry
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Registered[T]: ...

    @overload
    def __get__(self, obj: nn.Module, owner: type | None = None) -> T: ...

    def __get__(self, obj: nn.Module | None, owner: type | None = None) -> Registered[T] | T:
        if obj is None:
            return self
        try:
            value: T = obj.__dict__[self.registry][self.name]
        except KeyError:  # not registered (yet): what nn.Module says of a missing attribute
            raise AttributeError(f"{type(obj).__name__!r} has no {self.name!r}") from None
        return value

    def __set__(self, obj: nn.Module, value: T) -> None:
        # Not reached for a module or parameter (nn.Module.__setattr__ registers those itself);
        # declared so that type checkers accept the assignments in __init__.
        raise TypeError(f"{self.name} takes what {self.registry} holds, not {type(value)}")
