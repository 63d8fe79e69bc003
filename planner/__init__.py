"""``pdlab plan``: fitted latency models (``latency``), a discrete-event simulator that drives the
real scheduler and router policy (``simulate``), the placement search (``search``) and its
validation against real runs (``validate``); ``command`` is the CLI. Everything here but
``validate`` and ``command`` imports no torch."""
