"""``pdlab``'s commands: one module each, with ``add_arguments`` / ``check`` / ``run``; ``experiments.cli`` is the only place that knows them."""
