"""Clients of the Generate API: `TRServeClient` for Python callers, `trserve generate` on the command line."""
