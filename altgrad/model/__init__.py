from altgrad.model.gpt import GPT

__all__ = ["GPT"]
