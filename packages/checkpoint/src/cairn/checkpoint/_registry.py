"""Which handler stores an item, by item name and args class (Orbax's handler registries).

cairn's storage does not depend on the handler (every item is a pytree or JSON in its own
format), so a registry here does two jobs: it refuses an item saved or restored with args
its registered handler does not take (``ValueError`` naming the item and the args), and it
supplies the restore args of an item restored without any (``handler.restore_args(None)``).
"""

from __future__ import annotations

from typing import Any

from cairn.checkpoint import _args


class CheckpointHandlerRegistry:
    """Base of handler registries (Orbax's ``CheckpointHandlerRegistry``): entries map
    ``(item name or None, args class)`` to a handler instance."""

    def add(self, item: str | None, args: type, handler: Any = None, **kwargs: Any) -> None:
        """Register ``handler`` for ``item`` saved or restored with ``args``.

        Args:
          item: the item name, or ``None`` for every item.
          args: the args class.
          handler: the handler (or ``None``: the one registered with ``args``).
          **kwargs: options of the registry.
        """
        raise NotImplementedError

    def get(self, item: str | None, args: type) -> Any:
        """The handler registered for ``item`` and ``args`` (or a base class of them).

        Args:
          item: the item name.
          args: the args class.
        """
        raise NotImplementedError

    def has(self, item: str | None, args: type) -> bool:
        """Whether :meth:`get` finds a handler.

        Args:
          item: the item name.
          args: the args class.
        """
        raise NotImplementedError

    def get_all_entries(self) -> dict[tuple[str | None, type], Any]:
        """Every ``(item, args class) -> handler`` entry."""
        raise NotImplementedError


class DefaultCheckpointHandlerRegistry(CheckpointHandlerRegistry):
    """A dict of ``(item name or None, args class) -> handler``; an entry for item ``None``
    serves every item without one of its own.

    Args:
      other_registry: a registry whose entries this one starts with.

    >>> class Handler:
    ...     pass
    >>> r = DefaultCheckpointHandlerRegistry()
    >>> r.add("meta", _args.JsonSave, Handler)
    >>> type(r.get("meta", _args.JsonSave)).__name__, r.has("meta", _args.StandardSave)
    ('Handler', False)
    """

    def __init__(self, other_registry: CheckpointHandlerRegistry | None = None) -> None:
        self._entries: dict[tuple[str | None, type], Any] = {}
        if other_registry is not None:
            self._entries.update(other_registry.get_all_entries())

    def add(self, item: str | None, args: type, handler: Any = None, **kwargs: Any) -> None:
        """Register ``handler`` (an instance, or a class made with no arguments) for ``item``
        (``None``: any item) saved or restored with ``args``.

        Args:
          item: the item name, or ``None`` for every item.
          args: a ``CheckpointArgs`` subclass (or an instance of one).
          handler: a checkpoint handler or handler class; ``None``: the handler class
            ``args`` is registered with (``register_with_handler``; cairn's own args are).
          **kwargs: ignored (Orbax's options).

        Raises:
          TypeError: ``args`` is not a ``CheckpointArgs`` subclass.
          ValueError: ``(item, args)`` already has a handler, or ``handler`` is ``None``
            and no handler class is registered with ``args``.
        """
        if isinstance(args, _args.CheckpointArgs):
            args = type(args)
        if not (isinstance(args, type) and issubclass(args, _args.CheckpointArgs)):
            raise TypeError(f"args must be a CheckpointArgs subclass, got {args!r}")
        if handler is None:
            handler = _args.get_registered_handler_cls(args)
            if handler is None:
                raise ValueError(f"no handler given for item {item!r} and none is registered with {args.__name__}")
        if isinstance(handler, type):
            handler = handler()
        if (item, args) in self._entries:
            raise ValueError(f"item {item!r} with args {args.__name__} already has a handler in this registry")
        self._entries[(item, args)] = handler

    def _find(self, item: str | None, args: type) -> Any:
        for key in (item, None) if item is not None else (None,):
            for cls in args.__mro__:
                if (key, cls) in self._entries:
                    return self._entries[(key, cls)]
        return None

    def get(self, item: str | None, args: type) -> Any:
        """The handler for ``item`` and ``args`` (or a base class of ``args``); an entry
        for ``item`` wins over one for every item.

        Args:
          item: the item name.
          args: the args class.

        Raises:
          ValueError: no entry matches.
        """
        found = self._find(item, args)
        if found is None:
            raise ValueError(f"no handler registered for item {item!r} with args {args.__name__}")
        return found

    def has(self, item: str | None, args: type) -> bool:
        """Whether :meth:`get` finds a handler.

        Args:
          item: the item name.
          args: the args class.
        """
        return self._find(item, args) is not None

    def get_all_entries(self) -> dict[tuple[str | None, type], Any]:
        """A copy of every ``(item, args class) -> handler`` entry."""
        return dict(self._entries)

    def handlers_of(self, item: str) -> list[Any]:
        """The handlers registered for ``item`` itself (not the catch-all ones).

        Args:
          item: the item name.
        """
        return list(dict.fromkeys(h for (i, _), h in self._entries.items() if i == item))


def mismatch(item: str, args: Any, handler: Any) -> ValueError:
    """The error for ``args`` given for ``item`` whose handler does not take them."""
    return ValueError(
        f"item {item!r}: args {type(args).__name__} does not match with any registered handler "
        f"(the item's handler is {type(handler).__name__})"
    )
