"""The demo: the generated tool-arithmetic task and its SFT traces (`task`), the generated
function-calling task, its traces and report (`function_calling`), a small Qwen-style tokenizer
builder (`tokenizer`), the held-out report (`report`), and the `demo` command that runs them
(`runner`)."""
