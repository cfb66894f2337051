"""Forward hooks for the length of a `with` block: registered on one object, every one removed in finally.

A measurement that reads (or changes) what a module computes registers PyTorch forward hooks and must
remove them whatever happens (an exception, a Stop, a cancelled run), or the shared model keeps them.
`attached()` yields a `Hooks` to register them on and removes each of them when the block ends, so
no caller keeps a list of handles. Shaped like `head_gates.head_mask`, which uses it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from torch import nn


class Hooks:
    """The hooks of one `attached()` block."""

    def __init__(self):
        self._handles = []

    def before(self, module: nn.Module, hook: Callable, *, with_kwargs: bool = False) -> None:
        """A forward pre-hook: hook(module, args) (with_kwargs: hook(module, args, kwargs)), before `module` runs."""
        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=with_kwargs))

    def after(self, module: nn.Module, hook: Callable, *, with_kwargs: bool = False) -> None:
        """A forward hook: hook(module, args, output) (with_kwargs: hook(module, args, kwargs, output))."""
        self._handles.append(module.register_forward_hook(hook, with_kwargs=with_kwargs))

    def remove(self) -> None:
        """Remove every hook registered so far (the last first)."""
        while self._handles:
            self._handles.pop().remove()


@contextmanager
def attached() -> Iterator[Hooks]:
    """Yields a `Hooks`; every hook registered on it is removed when the block ends, even if it raises."""
    hooks = Hooks()
    try:
        yield hooks
    finally:
        hooks.remove()
