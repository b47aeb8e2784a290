"""The router program (`actorserve router`): one HTTP address in front of many `actorserve
serve` workers. The compiled data plane (`csrc/`, loaded by `native.py`) relays requests; the
Python plane (`relay.py`) serves where no C compiler is; `routing.py` picks the worker (shared
with the frontend's data-parallel replicas)."""
