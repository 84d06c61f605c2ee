"""One registry for every pluggable thing (eviction policy, queue policy, cost model, workload, router...).

A ``Registry[T]`` maps a short name to a factory. The CLI lists choices from it, and unknown names fail with
an error that lists the known ones. Factories that need heavy imports should import inside the factory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of factories producing ``T``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self._docs: dict[str, str] = {}

    def register(self, name: str, doc: str = "") -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: ``@registry.register("name")`` on a class or factory function."""

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            self.add(name, factory, doc)
            return factory

        return deco

    def add(self, name: str, factory: Callable[..., T], doc: str = "") -> None:
        if name in self._factories:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._factories[name] = factory
        self._docs[name] = doc or (factory.__doc__ or "").strip().split("\n")[0]

    def create(self, name: str, *args: Any, **kwargs: Any) -> T:
        return self.get(name)(*args, **kwargs)

    def get(self, name: str) -> Callable[..., T]:
        try:
            return self._factories[name]
        except KeyError:
            known = ", ".join(sorted(self._factories)) or "(none)"
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._factories)

    def describe(self) -> dict[str, str]:
        return {n: self._docs[n] for n in self.names()}

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
