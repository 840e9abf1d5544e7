"""An optimizer prints as the factory calls that built it (arguments at their defaults left
out), never a function address, in text and as notebook HTML."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import jax.numpy as jnp

import cairn.optim as optim


def _balanced(text: str) -> bool:
    stack: list[str] = []
    bad: list[str] = []

    class P(HTMLParser):
        def handle_starttag(self, tag, attrs):
            stack.append(tag)

        def handle_endtag(self, tag):
            if not stack or stack.pop() != tag:
                bad.append(tag)

    P().feed(text)
    return not bad and not stack


def _many():
    return [
        optim.adam(1e-3), optim.adamw(1e-3, weight_decay=0.1), optim.sgd(0.1, momentum=0.9),
        optim.chain(optim.clip_by_global_norm(1.0), optim.adam(optim.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100))),
        optim.masked(optim.adam(1e-3), {"w": True}), optim.lion(1e-3), optim.adafactor(1e-3), optim.lbfgs(),
        optim.inject_hyperparams(optim.adam)(learning_rate=1e-3), optim.MultiSteps(optim.adam(1e-3), 4),
        optim.contrib.muon(1e-3), optim.apply_if_finite(optim.sgd(0.1), 3),
        optim.named_chain(("clip", optim.clip(1.0)), ("sgd", optim.sgd(0.1))),
    ]


def test_adamw_reads_as_its_parts():
    assert repr(optim.adamw(1e-3)) == (
        "GradientTransformation(chain(scale_by_adam(), add_decayed_weights(weight_decay=0.0001), "
        "scale_by_learning_rate(learning_rate=0.001)))"
    )


def test_non_default_arguments_are_shown_and_defaults_left_out():
    r = repr(optim.adam(1e-2, b1=0.8, mu_dtype=jnp.bfloat16))
    assert "scale_by_adam(b1=0.8, mu_dtype=bfloat16)" in r and "b2=" not in r
    assert "trace(decay=0.9, nesterov=True)" in repr(optim.sgd(0.1, momentum=0.9, nesterov=True))
    assert repr(optim.clip_by_global_norm(2.5)) == "GradientTransformation(clip_by_global_norm(max_norm=2.5))"


def test_schedules_and_wrapped_transformations_are_described():
    r = repr(optim.adam(optim.exponential_decay(1e-3, 100, 0.5)))
    assert "learning_rate=exponential_decay(init_value=0.001, transition_steps=100" in r
    assert repr(optim.MultiSteps(optim.sgd(0.1), 4, use_grad_mean=False)) == (
        "MultiSteps(chain(identity(), scale_by_learning_rate(learning_rate=0.1)), every_k_schedule=4, "
        "use_grad_mean=False)"
    )
    assert repr(optim.masked(optim.sgd(0.1), {"w": True})).startswith(
        "GradientTransformation(masked(chain(identity(), scale_by_learning_rate(learning_rate=0.1)), mask="
    )


def test_inject_hyperparams_shows_the_inner_factory_and_what_it_was_given():
    tx = optim.inject_hyperparams(optim.adamw)(learning_rate=1e-3, weight_decay=0.1)
    assert repr(tx) == "GradientTransformation(inject_hyperparams(adamw)(learning_rate=0.001, weight_decay=0.1))"
    assert repr(optim.inject_hyperparams(optim.adam)(1e-3)) == (
        "GradientTransformation(inject_hyperparams(adam)(learning_rate=0.001))"  # b1, b2, ... at defaults
    )


def test_no_function_addresses_anywhere():
    for tx in _many():
        for text in (repr(tx), tx._repr_html_()):
            assert not re.search(r"0x[0-9a-f]{6,}", text), text
            assert "<function" not in text and "object at" not in text, text


def test_a_users_own_transformation_names_its_functions():
    def my_transform():
        def init(params):
            return ()

        def update(updates, state, params=None):
            return updates, state

        return optim.GradientTransformation(init, update)

    assert repr(my_transform()) == (
        "GradientTransformation(init=test_a_users_own_transformation_names_its_functions.my_transform.init, "
        "update=test_a_users_own_transformation_names_its_functions.my_transform.update)"
    )


def test_repr_leaves_the_transformation_working():
    tx = optim.adamw(1e-3)
    repr(tx)
    init, update = tx  # still the (init, update) pair
    params = {"w": jnp.ones(2)}
    u, _ = update(params, init(params), params)
    assert u["w"].shape == (2,)


def test_html_repr_is_a_balanced_escaped_tree():
    for tx in _many():
        assert _balanced(tx._repr_html_())
    h = optim.adamw(1e-3)._repr_html_()
    assert "<details open><summary><code>chain</code></summary>" in h
    assert "<code>weight_decay</code> = <code>0.0001</code>" in h
    h = optim.masked(optim.sgd(0.1), lambda p: p)._repr_html_()
    assert "&lt;lambda&gt;" in h and "<lambda>" not in h
