"""The demo: the generated tool-arithmetic task and its SFT traces (`task`), a small Qwen-style
tokenizer builder (`tokenizer`), and the held-out report (`report`)."""
