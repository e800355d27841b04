"""Tokenizers and chat templates in the style of each supported architecture, built at test time
(no hub access): byte-level BPE with header tokens (Llama 3), ChatML (Qwen2, Qwen3 with thinking),
SentencePiece-style metaspace BPE with [INST] (Mistral), and a normalizer-based BPE with turns
(Gemma 3). The templates are written for these tests in each family's format; they exercise what
real ones use: bos_token, raise_exception, namespaces, loop state, strftime_now, trim."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris is.",
    "You are a helpful assistant. Answer briefly and politely.", "def add(a, b):\n    return a + b\n",
    "naïve café, 2024-05-06, 3.14159; emojis 🦀🚀 and 你好世界", "Tell me a joke about numbers 12345.",
] * 4

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% set date = strftime_now('%d %b %Y') %}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date }}\n\n{{ system }}<|eot_id|>"
    "{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_TEMPLATE = (
    "{% set ns = namespace(last_user=0) %}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\\n\\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}{{ bos_token }}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}[INST] {{ (system if loop.first else '') + message['content'] }} [/INST]"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}"
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ (first if loop.first else '') + message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass(frozen=True)
class ChatStyle:
    name: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    template: str
    kind: str  # "byte_level", "metaspace" or "normalized"


STYLES = {
    "llama3": ChatStyle("llama3", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                   "<|end_header_id|>", "<|eot_id|>"), "<|begin_of_text|>", "<|eot_id|>",
                        LLAMA3_TEMPLATE, "byte_level"),
    "qwen2": ChatStyle("qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
                       CHATML_TEMPLATE, "byte_level"),
    "qwen3": ChatStyle("qwen3", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"), None,
                       "<|im_end|>", QWEN3_TEMPLATE, "byte_level"),
    "mistral": ChatStyle("mistral", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>",
                         MISTRAL_TEMPLATE, "metaspace"),
    "gemma3": ChatStyle("gemma3", ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>",
                        GEMMA3_TEMPLATE, "normalized"),
}


def build_tokenizer(style: ChatStyle, vocab_size: int = 600) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>" if style.kind == "metaspace" else None))
    alphabet: list[str] = []
    if style.kind == "byte_level":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif style.kind == "metaspace":
        # "first": only the very start of the text gets the prefix space, which segment caching must respect.
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(style.specials),
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    if style.bos is not None:
        bos_id = tokenizer.token_to_id(style.bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{style.bos} $A", pair=f"{style.bos} $A $B", special_tokens=[(style.bos, bos_id)])
    return tokenizer


def write_hf_tokenizer(directory: str, style: ChatStyle) -> None:
    """tokenizer.json and tokenizer_config.json as a Hugging Face checkpoint ships them."""
    os.makedirs(directory, exist_ok=True)
    build_tokenizer(style).save(os.path.join(directory, "tokenizer.json"))
    config = {"bos_token": style.bos, "eos_token": {"content": style.eos}, "chat_template": style.template}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
