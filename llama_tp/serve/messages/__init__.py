"""Anthropic's Messages API: a second door onto the chat completions pipeline (docs/serving.md)."""
