"""Higgs Audio v2's prompt rows are the reference's chat template rendered and tokenized: the
template of transformers' Higgs Audio v2 processor (convert_higgs_audio_v2_to_hf.py's CHAT_TEMPLATE,
below as it is there), rendered with jinja2 for a system message, a scene and the user's text, each
special token its id and the text between them tokenized as text, equals `preprocess`'s column 0,
with the default system message and scene, given ones (trimmed as the template trims them), and
the prompt's size bounds (`prompt_overhead`, `option_rows`) hold."""

from __future__ import annotations

import re

import jinja2
import pytest

from programs import get_spec, load_program_class
from programs.higgs_tts import spec as h

CHAT_TEMPLATE = r"""{{- bos_token }}
{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set system_message = messages[0]['content']|trim %}
    {%- elif messages[0]['content'] is iterable and messages[0]['content'][0]['type'] == 'text' %}
        {%- set system_message = messages[0]['content'][0]['text']|trim %}
    {%- else %}
        {{- raise_exception("System message content must be a string or contain text type!") }}
    {%- endif %}
    {%- set messages = messages[1:] %}
{%- else %}
    {{- raise_exception("A system message is required but not provided!") }}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- system_message }}

{#- Check for scene message and handle it specially #}
{%- if messages and messages[0]['role'] == 'scene' %}
    {{- "\n\n<|scene_desc_start|>\n" }}
    {%- if messages[0]['content'] is string %}
        {{- messages[0]['content'] | trim }}
    {%- elif messages[0]['content'] is iterable %}
        {%- for content_item in messages[0]['content'] %}
            {%- if content_item['type'] == 'text' %}
                {%- set text_content = content_item['text'] | trim %}
                {{- text_content }}
                {%- if loop.first and not loop.last %}
                    {{- "\n\n" }}
                {%- endif %}
                {%- if not loop.first and not loop.last and messages[0]['content'][loop.index]['type'] != 'audio' %}
                    {{- "\n" }}
                {%- endif %}
            {%- elif content_item['type'] == 'audio' %}
                {{- ' <|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}
                {%- if not loop.last %}
                    {{- "\n" }}
                {%- endif %}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- "\n<|scene_desc_end|>" }}
    {%- set messages = messages[1:] %}
{%- endif %}

{{- "<|eot_id|>" }}

{#- Loop through all messages #}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- if message['content'] is not iterable or message['content'][0]['type'] != 'audio' %}
            {{- raise_exception("Assistant messages must contain audio content only!") }}
        {%- endif %}
        {{- '<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}
    {%- else %}
        {%- if message['content'] is string %}
            {{- message['content'] | trim }}
        {%- elif message['content'] is iterable %}
            {%- for content_item in message['content'] %}
                {%- if content_item['type'] == 'text' %}
                    {{- content_item['text'] | trim }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}

{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n<|audio_out_bos|>' }}
{%- endif %}"""
SPECIAL = {
    "<|begin_of_text|>": h.BEGIN_OF_TEXT,
    "<|start_header_id|>": h.START_HEADER,
    "<|end_header_id|>": h.END_HEADER,
    "<|eot_id|>": h.EOT,
    "<|audio_out_bos|>": h.AUDIO_OUT_BOS,
}


@pytest.fixture(scope="module")
def program():
    p = load_program_class("higgs-tts-tiny")(get_spec("higgs-tts-tiny"), load_format="dummy")
    p.load_prompts()
    return p


def reference_ids(program, text: str, system: str, scene: str) -> list[int]:
    messages = [
        {"role": "system", "content": system},
        {"role": "scene", "content": scene},
        {"role": "user", "content": text},
    ]
    rendered = (
        jinja2.Environment()
        .from_string(CHAT_TEMPLATE)
        .render(messages=messages, bos_token="<|begin_of_text|>", add_generation_prompt=True)
    )
    special = {
        **SPECIAL,
        h.SCENE_START: program._marker(h.SCENE_START),
        h.SCENE_END: program._marker(h.SCENE_END),
    }
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, special)) + ")", rendered):
        ids += [special[piece]] if piece in special else program._tokenizer.text_ids(piece) if piece else []
    return ids


@pytest.mark.parametrize(
    "text, options",
    [
        ("Hello there, how are you today?", {}),
        ("  The sun was low over the harbor.  ", {"scene": " SPEAKER0: feminine, warm\n"}),
        ("Thank you so much.", {"system": "Generate audio.  ", "scene": "A large hall."}),
    ],
)
def test_prompt_rows_are_the_rendered_chat_template(program, text, options):
    rows = program.preprocess(text, options).rows
    system = options.get("system", h.SYSTEM_MESSAGE)
    scene = options.get("scene", h.DEFAULT_SCENE)
    assert rows[:, 0].tolist() == reference_ids(program, text, system, scene)
    assert (rows[:, 1:] == 0).all() and program.check_prompt(rows, {}) == ""
    overhead = program.prompt_overhead() + program.option_rows(options)
    assert len(rows) <= overhead + len(text.strip().encode())
