"""A request's text side: the request type and its validated form (request.py), prompt building
(prompt.py), stop conditions (stops.py) and incremental detokenisation (text.py)."""
