"""Chat template rendering rules (what transformers' renderer does, checked on small
templates): whitespace control, tojson, raise_exception, strftime_now, the sandbox, message
normalization, continue_final_message, and errors that name the template's file."""

from __future__ import annotations

import datetime
import json

import pytest

from cairn.serving import ChatTemplateError
from cairn.serving._chat_template import render_chat

USER = [{"role": "user", "content": "hi"}]


def test_trim_and_lstrip_blocks_are_on():
    template = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    # trim_blocks eats the newline after a block tag, lstrip_blocks the indentation before one
    assert render_chat(template, USER + USER) == "hi\nhi\n"


def test_tojson_writes_plain_json_in_insertion_order():
    value = {"z": "<b>&'</b>", "a": "Zürich 🚀", "n": [1, 2.5, None, True]}
    out = render_chat("{{ tools[0] | tojson }}", USER, tools=[value])
    assert out == json.dumps(value, ensure_ascii=False)
    assert render_chat("{{ tools[0] | tojson(indent=2) }}", USER, tools=[value]) == json.dumps(
        value, ensure_ascii=False, indent=2)
    assert render_chat("{{ tools[0] | tojson(ensure_ascii=True, sort_keys=True) }}", USER, tools=[value]) == (
        json.dumps(value, sort_keys=True))


def test_raise_exception_is_our_error_with_the_templates_message():
    with pytest.raises(ChatTemplateError) as err:
        render_chat("{{ raise_exception('Only user and assistant roles') }}", USER)
    assert str(err.value) == "Only user and assistant roles"


def test_strftime_now_is_todays_date():
    before = datetime.datetime.now().strftime("%Y-%m-%d")
    out = render_chat("{{ strftime_now('%Y-%m-%d') }}", USER)
    after = datetime.datetime.now().strftime("%Y-%m-%d")
    assert out in (before, after)


def test_generation_tag_and_loop_controls():
    template = ("{% for m in messages %}{% if loop.index0 == 2 %}{% break %}{% endif %}"
                "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert render_chat(template, [{"role": "user", "content": str(i)} for i in range(5)]) == "[0][1]"


def test_namespace_and_dict_helpers_work_but_stay_in_the_sandbox():
    template = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson }}"
    assert render_chat(template, USER + USER) == '2{"a": 1}'
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render_chat("{% set ns = namespace(_x=1) %}", USER)
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", USER)
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render_chat("{{ messages.append(1) }}", USER)  # the environment is immutable


def test_none_keys_are_dropped_and_reasoning_is_aliased():
    messages = [{"role": "assistant", "content": None, "reasoning": "think"}]
    template = "{{ messages[0].content is defined }} {{ messages[0].reasoning_content }} {{ messages[0].thinking }}"
    assert render_chat(template, messages) == "False think think"
    assert messages == [{"role": "assistant", "content": None, "reasoning": "think"}]  # caller's list untouched


def test_variables_reach_the_template_and_objects_become_plain_data():
    class Weird:
        pass

    out = render_chat("{{ bos_token }}|{{ flag }}|{{ obj }}", USER, variables={"bos_token": "<s>", "flag": True,
                                                                              "obj": Weird()})
    assert out == "<s>|True|<Weird>"


def test_continue_final_message_ends_inside_it():
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    assert render_chat(template, messages, continue_final_message=True) == "<user>q</user>\n<assistant>The answer is"
    with pytest.raises(ValueError, match="exclude each other"):
        render_chat(template, messages, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ValueError, match="dropped part of the final message"):
        render_chat("{{ messages[0].content }}", messages, continue_final_message=True)


def test_errors_name_the_template_file():
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json is not a valid jinja2 template \(line 1\)"):
        render_chat("{% for m in messages %}", USER, origin="/x/tokenizer_config.json")
    with pytest.raises(ChatTemplateError, match=r"/x/chat_template.jinja failed to render: UndefinedError"):
        render_chat("{{ messages[0].content.missing.deeper }}", USER, origin="/x/chat_template.jinja")
    with pytest.raises(TypeError, match="JSON-schema dict"):
        render_chat("{{ tools }}", USER, tools=[len])
    with pytest.raises(TypeError, match="message 0 is a str"):
        render_chat("{{ messages }}", ["hello"])
