"""Llama-family forward pass, checkpoint loaders, tokenizer. No ray."""
