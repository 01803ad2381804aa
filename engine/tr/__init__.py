"""The Token Recycling algorithm, as pure tensor functions and small objects:
tree templates and their compiled form (tree.py, trees/*.json), drafting (draft.py), greedy
acceptance (accept.py), recycling (recycle.py), lossless sampling (sampling.py), prompt-lookup
chains grafted into the tree (lookup.py, hybrid.py), the adjacency matrix (matrix.py) and the
draft-source boundary between the verifier and wherever the matrix lives (source.py)."""
