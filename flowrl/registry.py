"""One small registry per pluggable family (step functions, advantage estimators, losses, rewards,
model adapters, recipes). Configs name entries by short name; an unknown name is an error that lists
the valid ones and suggests the closest."""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "UnknownNameError"]


class UnknownNameError(KeyError):
    """Raised for a name no entry of the family is registered under."""

    def __init__(self, family: str, name: str, valid: list[str]):
        close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        self.message = f"unknown {family} {name!r}{hint}; valid names: {', '.join(sorted(valid)) or '(none)'}"
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.message


class Registry(Generic[T]):
    """A name -> object mapping for one family.

    Entries registered lazily as ``"module.path:attribute"`` strings are imported on first use, so that
    listing a family never imports heavy libraries.
    """

    def __init__(self, family: str):
        self.family = family
        self._entries: dict[str, T | str] = {}

    def register(self, name: str, obj: T | str | None = None) -> Callable[[T], T] | T | str:
        """Register ``obj`` under ``name``; without ``obj`` this is a decorator."""
        if obj is not None:
            self._add(name, obj)
            return obj

        def decorator(target: T) -> T:
            self._add(name, target)
            return target

        return decorator

    def _add(self, name: str, obj: T | str) -> None:
        existing = self._entries.get(name)
        if existing is not None and existing is not obj and not isinstance(existing, str):
            raise ValueError(f"{self.family} {name!r} is already registered")
        self._entries[name] = obj

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise UnknownNameError(self.family, name, list(self._entries))
        entry = self._entries[name]
        if isinstance(entry, str):  # lazy "module:attr"
            import importlib

            module_name, _, attr = entry.partition(":")
            entry = importlib.import_module(module_name)
            for part in attr.split("."):  # "module:Class.from_pretrained"
                entry = getattr(entry, part)
            self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.family!r}, {self.names()})"
