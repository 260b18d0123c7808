"""Chat templates render in the same jinja environment as transformers' ``apply_chat_template``: its
``tojson`` takes ``ensure_ascii``/``separators``/``sort_keys`` (GLM-4.5's template writes each tool as
``tool | tojson(ensure_ascii=False)``, Kimi-K2's ``tools | tojson(separators=(',', ':'))``), and a
``{% generation %}...{% endgeneration %}`` block (TRL's assistant-mask marker, in fine-tunes' templates)
renders as its body."""

from __future__ import annotations

import shutil

import pytest

from gateway.hf_tokenizer import HFTokenizer

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Météo à Zürich",
                                           "parameters": PARAMETERS}}]
MESSAGES = [{"role": "user", "content": "Wetter?"}, {"role": "assistant", "content": "Sonnig."}]
TEMPLATES = {
    "glm_tojson_ensure_ascii": (
        "{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}\n{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"),
    "kimi_tojson_separators": (
        "{{ tools | tojson(separators=(',', ':')) }}\n"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"),
    "tojson_sort_keys": (
        "{{ tools | tojson(sort_keys=True, indent=2) }}\n"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"),
    "generation_block": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
        "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_renders_as_transformers(tiny_tokenizer_dir, tmp_path, name: str) -> None:
    transformers = pytest.importorskip("transformers")
    shutil.copytree(tiny_tokenizer_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATES[name])
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = HFTokenizer.from_dir(str(tmp_path))
    tools = TOOLS if "tools" in TEMPLATES[name] else None
    expected = ref.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
    assert tok.render_chat(MESSAGES, True, tools) == expected
