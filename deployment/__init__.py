"""The deployment: the serving system's lifecycle plane, beside the router and the workers.
``placement.Deployment`` turns a placement and a device set into workers, the router and the
hub of their channels; ``ray_actors`` places, starts, watches and kills Ray actors (the only
pdlab module that imports Ray at module level, ``kv_transfer.ray_store`` aside);
``restarts`` restarts dead workers under a budget.
"""
