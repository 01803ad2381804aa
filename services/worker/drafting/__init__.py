"""Where a worker's drafts come from (the engine's DraftSource protocol, engine/tr/source.py):

    embedded.py  per-tenant matrices in an in-process MatrixStore (`trserve serve`)
    split.py     a split worker's sources on the matrix service (`trserve worker`)
    remote.py    one round trip per step to the matrix service
    replica.py   checkout at open, local drafting, rows pushed back in the background
    link.py      what remote and replica share: client config, channel + breaker, fallback counter

Every session is an engine `MatrixSession`: rows are applied to the request's private matrix copy
first, then sent where they belong; a failing store or service only degrades the request to
drafting from its copy ("local-fallback"), never fails it.
"""
