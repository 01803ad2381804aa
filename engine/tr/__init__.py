"""The Token Recycling algorithm, as pure tensor functions and small objects:
tree templates (template.py, trees/*.json; no torch) and their compiled form (tree.py), drafting
(draft.py; the torch-free numpy gather the matrix service drafts with: gather.py), greedy
acceptance (accept.py), recycling (recycle.py), lossless sampling (sampling.py), the adjacency
matrix (matrix.py), prompt lookup (lookup.py), suffix histories and n-gram tables, grammars, and the
draft-source boundary between the verifier and wherever the matrix lives (source.py). What drafts
with them is engine/drafting/."""
