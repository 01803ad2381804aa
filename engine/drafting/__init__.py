"""Drafting, in one wing: what each running sequence verifies, and what it commits.

    drafter.py      the drafter: each TR request's draft from the proposer that takes it, sized for the
                    batch by the budget, shaped by the request's grammar (constrained.py)
    step.py         one sequence's TR step around the forward (draft_step -> forward -> accept_step)
    handover.py     recycled rows handed to the request's draft session
    proposers/      the draft methods (static tree + lookup chain, tuned plan, trees grown by confidence)
    budget/         how much each sequence verifies: the tree budget, step costs, tenant rates, the
                    option choosers
    dynamic.py      trees grown by confidence     hybrid.py  prompt-lookup chains grafted into the tree
    constrained.py  grammar-aware drafting
The pure algorithm these build on (trees, gather, acceptance, recycling, the matrix, prompt lookup)
and the draft-source boundary (where a request's trees come from, where its rows go) are engine/tr/.
"""
