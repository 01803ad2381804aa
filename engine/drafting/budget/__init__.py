"""How much each running sequence verifies this step: the tree budget (tree.py) prices each
proposer's options with the forward's cost model corrected online (step_costs.py) and the tenant's
measured acceptance (tenant_rates.py), and picks one per sequence for the whole batch (choose.py)."""
