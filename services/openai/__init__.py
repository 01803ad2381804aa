"""The OpenAI-compatible HTTP API of a worker (`/v1/chat/completions`, `/v1/completions`, `/v1/models`)."""
