"""The prompts `trserve load` cycles through: short chat questions of different kinds, so tenants'
matrices see varied text and replies are cheap to check (each prompt always gives the same reply)."""

PROMPTS: tuple[str, ...] = (
    "Write a short poem about the sea.",
    "Count from one to twenty, in words.",
    "Explain what a hash table is in two sentences.",
    "List five fruits and their colors.",
    "Translate 'good morning, how are you?' into French.",
    "Write a Python function that returns the square of a number.",
    "What is the capital of Japan, and what is it known for?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
)
