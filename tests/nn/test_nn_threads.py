"""Module calls traced in two threads at once (a serving engine compiling on its thread
while the main thread exports): each thread has its own call depth and named-scope stack."""

import threading

import jax
import jax.numpy as jnp

from cairn import nn


class _Gate(nn.Module):
    """Calls ``hook`` (a blocking rendezvous) inside its own traced call."""

    def __init__(self, hook):
        self.w = nn.Param(jnp.full((3,), 2.0))
        self.hook = hook

    def __call__(self, x):
        self.hook()
        return x * self.w


class _Outer(nn.Module):
    def __init__(self, hook):
        self.block = _Gate(hook)

    def __call__(self, x):
        return self.block(x) + 1.0


def _lowered_text(model, x):
    """The lowered program with its source locations and named scopes."""
    return jax.jit(lambda m, v: m(v)).lower(model, x).as_text(debug_info=True)


def test_a_call_finishing_on_one_thread_leaves_another_threads_traced_call_intact():
    inside_b = threading.Event()
    a_blocked = threading.Event()
    release_a = threading.Event()
    errors, texts = [], {}

    def hook_a():
        a_blocked.set()
        assert release_a.wait(30)

    def hook_b():
        inside_b.set()
        assert a_blocked.wait(30)  # thread A is now inside its own submodule call

    def run_a():
        assert inside_b.wait(30)  # start while the main thread is inside its call
        try:
            texts["a"] = _lowered_text(_Outer(hook_a), jnp.ones(3))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=run_a)
    t.start()
    texts["b"] = _lowered_text(_Outer(hook_b), jnp.ones(3))
    release_a.set()  # the main thread's call has ended: thread A goes on
    t.join(60)
    assert not t.is_alive()
    assert errors == []
    # each program names its own submodule's ops, with no path taken from the other thread
    for name in ("a", "b"):
        assert "block" in texts[name]
        assert "block/block" not in texts[name]
    x = jnp.ones(3)
    assert jnp.allclose(_Outer(lambda: None)(x), x * 2.0 + 1.0)
