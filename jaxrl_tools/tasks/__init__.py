"""Generated tasks (`data.task`), each with its records, SFT traces and a tiny tokenizer's texts:
tool arithmetic (`tool_arithmetic`), function calling (`function_calling`), the real-model task
(`when_to_call`); the grid games' SFT traces (`grid_games`); the small Qwen-style tokenizer
builder of tiny runs and tests (`tokenizer`)."""
