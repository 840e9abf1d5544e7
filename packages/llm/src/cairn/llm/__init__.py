"""cairn.llm: open-weight model families, Hugging Face checkpoints in and out, tokenizers and
chat templates, generation (this file lists the public API and nothing else)."""

from cairn.llm._chat_template import ChatTemplateError
from cairn.llm._tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDecoder", "Tokenizer"]
