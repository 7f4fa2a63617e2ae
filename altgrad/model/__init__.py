from altgrad.model.gpt import GPT, GPTConfig, batch_loss

__all__ = ["GPT", "GPTConfig", "batch_loss"]
